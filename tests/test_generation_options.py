"""Generation options beyond plain sampling: logprobs of generated and prompt tokens, the
repetition/presence/frequency penalties, min_p, min_new_tokens, stop token ids,
include_stop_str_in_output, n samples and beam search (suppressed token ids: test_suppress_tokens.py,
which shares this file's reference).

Each is checked against a reference written here from the proto's comments
(proto/kvshare/v1/generator.proto), over full recompute: the whole token sequence runs through a
plain session with no cache at every step and the last position's logits are taken. Nothing here
imports the engine's own penalty, logprob or beam search code. The tiny seeded model answers in
milliseconds; nothing depends on the machine's speed."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise

import grpc
import numpy as np
import pytest
from conftest import record_margin

from cachestore.memory import MemoryStore
from cachestore.stats import CacheStats
from kvshare.v1 import generator_pb2 as pb
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import (
    BeamSearch,
    CacheControl,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
)
from services.engine.sampling import SamplingConfig
from services.runtime.kv_layout import KVLayout
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import DecoderSession
from services.runtime.tokenizer import TextTokenizer

TOLERANCE = 1e-4  # fp32 logits; cached decoding differs from recompute by ~2e-5 in log-probabilities
VOCAB = 512
# A reference's choice is trusted only where the choices it made were at least this far apart.
MIN_MARGIN = 1e-3
TEXT_PROMPT = "The system prompt tells the assistant who it is."


def prompt(seed: int, n: int = 10) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


class Reference:
    """Full-recompute logits of the tiny model (memoised by sequence) and its tokenizer."""

    def __init__(self, folder) -> None:
        spec = load_model_spec(folder)
        self.session = DecoderSession(spec, "cpu", intra_op_threads=2)
        self.tokenizer = TextTokenizer(folder / "tokenizer.json")
        self.eos = frozenset(spec.eos_token_ids)
        self._memo: dict[tuple[int, ...], np.ndarray] = {}

    def logits(self, ids) -> np.ndarray:
        key = tuple(int(t) for t in ids)
        if key not in self._memo:
            logits, _ = self.session.run(list(key), self.session.empty_cache(len(key)))
            self._memo[key] = logits.astype(np.float64)
        return self._memo[key]

    def logprobs(self, ids) -> np.ndarray:
        return log_softmax(self.logits(ids))

    def greedy(self, ids: list[int], n: int, label: str) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            logits = self.logits(ids + out)
            record_margin(label, logits)
            out.append(int(np.argmax(logits)))
        return out

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


@dataclass
class Stream:
    """One sample's (or hypothesis') chunks, in order."""

    chunks: list[GenerationChunk] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def logprobs(self) -> list:
        return [lp for c in self.chunks for lp in c.logprobs]

    @property
    def last(self) -> GenerationChunk:
        return self.chunks[-1]


def run_in_order(engine: Engine, request: GenerationRequest) -> list[GenerationChunk]:
    """Every chunk of ``request`` as the engine yields them; waits for its publishes."""

    async def go():
        chunks = [chunk async for chunk in engine.generate(request)]
        await engine.wait_for_publishes()
        return chunks

    return asyncio.run(go())


def run(engine: Engine, request: GenerationRequest) -> dict[int, Stream]:
    """Every chunk of ``request``, by ``chunk.index``."""
    streams: dict[int, Stream] = defaultdict(Stream)
    for chunk in run_in_order(engine, request):
        streams[chunk.index].chunks.append(chunk)
    return dict(streams)


def one(engine: Engine, request: GenerationRequest) -> Stream:
    streams = run(engine, request)
    assert list(streams) == [0]
    return streams[0]


def ended_once(stream: Stream) -> None:
    """Only the last chunk carries the finish reason and usage."""
    assert stream.last.finish_reason is not None and stream.last.usage is not None
    assert all(c.finish_reason is None for c in stream.chunks[:-1])


@pytest.fixture(scope="module")
def ref(tiny_model) -> Reference:
    return Reference(tiny_model)


@pytest.fixture(scope="module")
def engine(load_engine, tiny_model) -> Engine:
    return load_engine(tiny_model)


def fresh_engine(folder, block_size: int = 64) -> Engine:
    return Engine.load(folder, EngineOptions(block_size=block_size), MemoryStore(64 << 20), CacheStats(), "cpu", 2)


# ---------------------------------------------------------------------------------------------
# Logprobs


def check_position(ref: Reference, context: list[int], entry, token: int, top: int) -> None:
    """``entry`` (a TokenLogprob) is ``token``'s raw log-probability after ``context`` and its
    ``top`` most likely alternatives, most likely first (ties aside)."""
    expected = ref.logprobs(context)
    assert entry.token_id == token
    assert abs(entry.logprob - expected[token]) <= TOLERANCE, (entry.logprob, expected[token])
    assert len(entry.top) == top
    best = np.sort(expected)[::-1][:top]
    ids = [alt.token_id for alt in entry.top]
    assert len(set(ids)) == top
    for rank, alt in enumerate(entry.top):
        # Its value is that id's, and it is the rank-th largest: so the list is the top, in order,
        # up to ids whose log-probabilities are within the tolerance of each other.
        assert abs(alt.logprob - expected[alt.token_id]) <= TOLERANCE
        assert abs(alt.logprob - best[rank]) <= TOLERANCE
        assert alt.text == ref.decode([alt.token_id])
    assert all(a.logprob >= b.logprob for a, b in pairwise(entry.top))


def test_greedy_logprobs_are_the_raw_log_softmax_with_the_top_alternatives(engine, ref):
    ids = prompt(1)
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, ignore_eos=True,
                                      logprobs=True, top_logprobs=5))
    expected = ref.greedy(ids, 12, "logprobs: greedy tokens")
    assert s.tokens == expected
    assert [len(c.logprobs) for c in s.chunks] == [len(c.token_ids) for c in s.chunks]
    for i, (token, entry) in enumerate(zip(s.tokens, s.logprobs, strict=True)):
        check_position(ref, ids + s.tokens[:i], entry, token, 5)
        assert entry.top[0].token_id == token  # greedy: the chosen token is the most likely
    assert all(not c.prompt_logprobs for c in s.chunks)


def test_sampled_logprobs_ignore_temperature_and_filters(engine, ref):
    ids = prompt(2)
    sampling = SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, seed=3)
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=16, ignore_eos=True, sampling=sampling,
                                      logprobs=True, top_logprobs=3))
    assert len(s.logprobs) == len(s.tokens) == 16
    for i, (token, entry) in enumerate(zip(s.tokens, s.logprobs, strict=True)):
        check_position(ref, ids + s.tokens[:i], entry, token, 3)
    # The same tokens reported under temperature 0.8 would differ by far more than the tolerance.
    scaled = [log_softmax(ref.logits(ids + s.tokens[:i]) / 0.8)[t] for i, t in enumerate(s.tokens)]
    assert max(abs(a - e.logprob) for a, e in zip(scaled, s.logprobs)) > 100 * TOLERANCE


def test_logprobs_only_when_asked(engine, ref):
    ids = prompt(1)
    plain = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=4, ignore_eos=True))
    assert all(not c.logprobs and not c.prompt_logprobs for c in plain.chunks)
    bare = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=4, ignore_eos=True, logprobs=True))
    assert bare.tokens == plain.tokens
    for i, (token, entry) in enumerate(zip(bare.tokens, bare.logprobs, strict=True)):
        check_position(ref, ids + bare.tokens[:i], entry, token, 0)


def test_prompt_logprobs_compute_the_whole_prompt_even_when_cached(tiny_model, ref):
    ids = prompt(4, n=40)
    engine = fresh_engine(tiny_model, block_size=16)
    try:
        stats = engine.scheduler.stats
        run(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=2, ignore_eos=True))
        warm = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=2, ignore_eos=True))
        assert warm.last.usage.cached_prompt_tokens == 32, "the prompt's two full blocks are in the store"
        before = stats.prefill_tokens
        s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=3, ignore_eos=True,
                                          logprobs=True, top_logprobs=4, prompt_logprobs=True))
        assert s.last.usage.cached_prompt_tokens == 0
        assert s.last.usage.prompt_tokens == 40
        assert stats.prefill_tokens - before == 40
    finally:
        engine.close()
    first, rest = s.chunks[0], s.chunks[1:]
    assert len(first.prompt_logprobs) == len(ids) - 1
    assert all(not c.prompt_logprobs for c in rest)
    for j, entry in enumerate(first.prompt_logprobs):
        check_position(ref, ids[: j + 1], entry, ids[j + 1], 4)
    assert s.tokens == ref.greedy(ids, 3, "prompt logprobs: greedy tokens")
    for i, (token, entry) in enumerate(zip(s.tokens, s.logprobs, strict=True)):
        check_position(ref, ids + s.tokens[:i], entry, token, 4)


def test_long_prompt_logprobs_come_in_pieces_ahead_of_the_first_token(engine, ref):
    """A long prompt's log-probabilities are spread over messages of at most 64 entries (no message
    grows with the prompt); the ones before the first token carry no tokens; across prefill chunks
    (the step budget is 256 tokens) every position is still there, in order."""
    ids = prompt(8, n=300)
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=2, ignore_eos=True,
                                      prompt_logprobs=True, top_logprobs=2))
    pieces = [c.prompt_logprobs for c in s.chunks if c.prompt_logprobs]
    assert [len(p) for p in pieces] == [64, 64, 64, 64, 43]
    assert all(not c.token_ids for c in s.chunks[:4]) and s.chunks[4].token_ids
    entries = [e for p in pieces for e in p]
    for j in (0, 1, 200, 255, 256, 257, 298):
        check_position(ref, ids[: j + 1], entries[j], ids[j + 1], 2)


# ---------------------------------------------------------------------------------------------
# Penalties and min_p


def penalized(logits: np.ndarray, prompt_ids: list[int], generated: list[int], rep: float, presence: float,
              frequency: float) -> np.ndarray:
    """The proto's order: repetition over prompt + generated (l / p if l > 0 else l * p), then
    frequency x count + presence x (count > 0) over the generated tokens only."""
    out = np.array(logits, dtype=np.float64)
    if rep != 1.0:
        seen = np.unique(np.asarray(prompt_ids + generated, dtype=np.int64))
        out[seen] = np.where(out[seen] > 0, out[seen] / rep, out[seen] * rep)
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=out.shape[0]).astype(np.float64)
    return out - frequency * counts - presence * (counts > 0)


def penalized_greedy(ref: Reference, ids: list[int], n: int, rep: float, presence: float, frequency: float,
                     label: str) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = penalized(ref.logits(ids + out), ids, out, rep, presence, frequency)
        assert record_margin(label, logits) > MIN_MARGIN
        out.append(int(np.argmax(logits)))
    return out


PENALTIES = {
    # name: (prompt seed, repetition, presence, frequency)
    "repetition 1.3": (3, 1.3, 0.0, 0.0),
    "repetition 1.3, other prompt": (39, 1.3, 0.0, 0.0),
    "repetition 0.8 (rewards repeats)": (1, 0.8, 0.0, 0.0),
    "presence 0.5 + frequency 0.7": (3, 1.0, 0.5, 0.7),
    "presence 0.5 + frequency 0.7, other prompt": (39, 1.0, 0.5, 0.7),
    "all three": (39, 1.2, 0.3, 0.4),
}


@pytest.mark.parametrize("name", list(PENALTIES))
def test_penalties_equal_the_reference(engine, ref, name):
    seed, rep, presence, frequency = PENALTIES[name]
    ids = prompt(seed)
    expected = penalized_greedy(ref, ids, 16, rep, presence, frequency, f"penalties: {name}")
    assert expected != ref.greedy(ids, 16, "penalties: unpenalized greedy"), "the penalty must change something"
    config = {"repetition_penalty": rep, "presence_penalty": presence, "frequency_penalty": frequency}
    greedy = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=16, ignore_eos=True,
                                           sampling=SamplingConfig(**config), logprobs=True))
    assert greedy.tokens == expected
    # Penalties never change the reported log-probabilities: still the raw distribution's.
    for i, (token, entry) in enumerate(zip(greedy.tokens, greedy.logprobs, strict=True)):
        check_position(ref, ids + greedy.tokens[:i], entry, token, 0)
    # Sampling applies the penalties before its filters: top_k 1 keeps the penalized argmax.
    sampled = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=16, ignore_eos=True,
                                            sampling=SamplingConfig(temperature=0.9, top_k=1, seed=5, **config)))
    assert sampled.tokens == expected


def test_min_p_one_is_greedy_and_a_seeded_min_p_run_repeats(engine, ref):
    ids = prompt(7)
    expected = ref.greedy(ids, 16, "min_p 1: greedy tokens")
    only_top = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=16, ignore_eos=True,
                                             sampling=SamplingConfig(temperature=1.0, min_p=1.0, seed=4)))
    assert only_top.tokens == expected
    config = SamplingConfig(temperature=1.0, min_p=0.1, seed=8)
    first = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=24, ignore_eos=True, sampling=config))
    again = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=24, ignore_eos=True, sampling=config))
    assert first.tokens == again.tokens


def test_min_p_never_samples_a_token_below_its_threshold(engine, ref):
    """Tokens whose probability after temperature is below min_p x the top token's never come out.
    Temperature 0.7 sharpens the distribution: a filter applied to the raw probabilities instead
    would let through tokens this one refuses."""
    min_p, temperature = 0.3, 0.7
    ids = prompt(11)
    worst, chances = np.inf, 0
    for seed in range(6):
        s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=16, ignore_eos=True,
                                          sampling=SamplingConfig(temperature=temperature, min_p=min_p, seed=seed)))
        for i, token in enumerate(s.tokens):
            probs = np.exp(log_softmax(ref.logits(ids + s.tokens[:i]) / temperature))
            ratio = probs / probs.max()
            worst = min(worst, ratio[token])
            chances += int(np.sum((ratio >= 0.05) & (ratio < min_p)))
    assert worst >= min_p * (1 - 1e-3), f"sampled a token at {worst:.4f} x the top token's probability"
    assert chances > 0, "no position had a token the filter had to drop: the test proves nothing"


# ---------------------------------------------------------------------------------------------
# min_new_tokens, stop token ids, include_stop_str_in_output


def masked_greedy(ref: Reference, ids: list[int], max_new: int, min_new: int, ends: set[int],
                  label: str) -> list[int]:
    """Greedy with the ending ids at -inf until ``min_new`` tokens exist; stops after an ending id."""
    out: list[int] = []
    while len(out) < max_new:
        logits = ref.logits(ids + out).copy()
        if len(out) < min_new:
            logits[list(ends)] = -np.inf
        assert record_margin(label, logits) > MIN_MARGIN
        out.append(int(np.argmax(logits)))
        if out[-1] in ends:
            break
    return out


def test_min_new_tokens_masks_the_eos_token_until_reached(engine, ref):
    ids = prompt(27)  # greedy: one token, then EOS
    plain = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12))
    assert plain.tokens == ref.greedy(ids, 2, "min_new_tokens: greedy") and plain.tokens[-1] in ref.eos
    assert plain.last.finish_reason is FinishReason.EOS
    expected = masked_greedy(ref, ids, 12, 4, set(ref.eos), "min_new_tokens: masked greedy")
    assert len(expected) >= 4 and not set(expected[:4]) & ref.eos
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, min_new_tokens=4))
    assert s.tokens == expected
    ended_once(s)
    assert s.last.finish_reason is (FinishReason.EOS if expected[-1] in ref.eos else FinishReason.LENGTH)
    assert s.last.usage.completion_tokens == len(expected)


def test_min_new_tokens_masks_stop_token_ids_until_reached(engine, ref):
    ids = prompt(1)  # no EOS in its first 40 greedy tokens
    greedy = ref.greedy(ids, 12, "min_new_tokens: greedy")
    stop_id = greedy[1]
    assert stop_id not in greedy[:1] + greedy[2:]
    expected = masked_greedy(ref, ids, 12, 5, {stop_id, *ref.eos}, "min_new_tokens: masked stop id")
    assert stop_id not in expected[:5]
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, min_new_tokens=5,
                                      stop_token_ids=[stop_id]))
    assert s.tokens == expected
    if expected[-1] == stop_id:
        assert s.last.finish_reason is FinishReason.STOP and s.last.matched_stop == stop_id
    else:
        assert s.last.finish_reason is FinishReason.LENGTH and len(expected) == 12


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_id_ends_the_stream_with_its_id_returned(engine, ref, include):
    ids = ref.tokenizer.encode(TEXT_PROMPT)
    greedy = ref.greedy(ids, 16, "stop token id: greedy")
    stop_at = 6
    stop_id = greedy[stop_at]
    assert stop_id not in greedy[:stop_at] and 2 not in greedy and ref.decode([stop_id])
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=16, stop_token_ids=[stop_id, 2],
                                      include_stop_str_in_output=include))
    assert s.tokens == greedy[: stop_at + 1]
    ended_once(s)
    assert s.last.finish_reason is FinishReason.STOP
    assert s.last.matched_stop == stop_id and isinstance(s.last.matched_stop, int)
    assert s.last.usage.completion_tokens == stop_at + 1
    assert s.text == ref.decode(greedy[: stop_at + 1] if include else greedy[:stop_at])


def test_stop_token_ids_work_with_ignore_eos(engine, ref):
    ids = prompt(1)
    greedy = ref.greedy(ids, 12, "stop token id: greedy")
    stop_id = greedy[3]
    assert stop_id not in greedy[:3]
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, ignore_eos=True,
                                      stop_token_ids=[stop_id]))
    assert s.tokens == greedy[:4]
    assert s.last.finish_reason is FinishReason.STOP and s.last.matched_stop == stop_id


def test_eos_and_length_name_no_matched_stop(engine, ref):
    ids = prompt(27)
    eos = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12))
    assert eos.last.finish_reason is FinishReason.EOS and eos.last.matched_stop is None
    length = one(engine, GenerationRequest(prompt_token_ids=prompt(1), max_new_tokens=3))
    assert length.last.finish_reason is FinishReason.LENGTH and length.last.matched_stop is None
    # The EOS id named as a stop token id: the request's own stop, reported as such.
    named = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, stop_token_ids=[eos.tokens[-1]]))
    assert named.tokens == eos.tokens
    assert named.last.finish_reason is FinishReason.STOP and named.last.matched_stop == eos.tokens[-1]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_with_and_without_include_stop_str_in_output(engine, ref, include):
    ids = ref.tokenizer.encode(TEXT_PROMPT)
    greedy = ref.greedy(ids, 16, "stop string: greedy")
    full = ref.decode(greedy)
    stop = "ckr"  # spans two tokens ("ck" + "red") in the greedy text
    at = full.find(stop)
    assert at > 0 and full.count(stop) == 1
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=16, ignore_eos=True, stop=[stop],
                                      include_stop_str_in_output=include))
    ended_once(s)
    assert s.last.finish_reason is FinishReason.STOP
    assert s.last.matched_stop == stop
    assert s.text == (full[: at + len(stop)] if include else full[:at])
    assert s.text.endswith(stop) is include
    assert s.tokens == greedy[: len(s.tokens)]


def test_stop_strings_do_not_end_the_stream_before_min_new_tokens(engine, ref):
    ids = ref.tokenizer.encode(TEXT_PROMPT)
    greedy = ref.greedy(ids, 16, "stop string: greedy")
    stop = ref.decode(greedy[4:5])  # " of", in the fifth token's text
    assert stop.strip() and stop in ref.decode(greedy[:5])
    early = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=16, ignore_eos=True, stop=[stop]))
    assert len(early.tokens) == 5 and early.last.finish_reason is FinishReason.STOP
    late = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=16, ignore_eos=True, stop=[stop],
                                         min_new_tokens=9))
    assert len(late.tokens) >= 9
    assert late.tokens == greedy[: len(late.tokens)]


# ---------------------------------------------------------------------------------------------
# n samples


def test_n_samples_equal_single_samples_seeded_seed_plus_index_and_prefill_once(engine, ref):
    ids = prompt(25, n=16)  # greedy ends with EOS after four tokens: some samples end early
    sampling = SamplingConfig(temperature=1.0, seed=11)
    request = GenerationRequest(prompt_token_ids=ids, max_new_tokens=10, sampling=sampling, n=4,
                                cache=CacheControl(skip_read=True))
    stats = engine.scheduler.stats
    before = stats.prefill_tokens
    first = run(engine, request)
    assert stats.prefill_tokens - before == len(ids), "the prompt is prefilled once for all samples"
    assert sorted(first) == [0, 1, 2, 3]
    again = run(engine, request)
    assert {i: s.tokens for i, s in first.items()} == {i: s.tokens for i, s in again.items()}
    singles = {}
    for i in range(4):
        single = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=10,
                                               sampling=SamplingConfig(temperature=1.0, seed=11 + i)))
        singles[i] = single
        s = first[i]
        assert s.tokens == single.tokens, f"sample {i}"
        assert s.text == single.text
        ended_once(s)
        assert s.last.finish_reason is single.last.finish_reason
        assert s.last.usage.prompt_tokens == len(ids)
        assert s.last.usage.completion_tokens == len(s.tokens)
        assert s.last.timings is not None
    assert len({tuple(s.tokens) for s in first.values()}) > 1, "the seeds must give different samples"
    reasons = {s.last.finish_reason for s in first.values()}
    assert reasons == {FinishReason.EOS, FinishReason.LENGTH}, "each sample ends for its own reason"


def test_n_samples_carry_their_own_logprobs(engine, ref):
    ids = prompt(2)
    chunks = run_in_order(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True, n=3,
                                                    sampling=SamplingConfig(temperature=1.0, seed=21), logprobs=True,
                                                    top_logprobs=2, prompt_logprobs=True))
    streams: dict[int, Stream] = defaultdict(Stream)
    for chunk in chunks:
        streams[chunk.index].chunks.append(chunk)
    assert sorted(streams) == [0, 1, 2]
    for s in streams.values():
        assert len(s.tokens) == 8
        for j, (token, entry) in enumerate(zip(s.tokens, s.logprobs, strict=True)):
            check_position(ref, ids + s.tokens[:j], entry, token, 2)
    # The prompt is the samples' common part: its log-probabilities come once, in the stream's
    # first message (GenerateResponse.prompt_logprobs).
    assert len(chunks[0].prompt_logprobs) == len(ids) - 1
    assert all(not c.prompt_logprobs for c in chunks[1:])
    for j, entry in enumerate(chunks[0].prompt_logprobs):
        check_position(ref, ids[: j + 1], entry, ids[j + 1], 2)


# ---------------------------------------------------------------------------------------------
# Beam search


@dataclass
class Hypothesis:
    score: float
    tokens: list[int]
    """Generated tokens, the ending token (if any) included."""
    ending: int | None
    """The EOS or stop token id that ended it; None when max_new_tokens did."""


def reference_beam_search(ref: Reference, ids: list[int], num_beams: int, max_new: int, length_penalty: float,
                          early_stopping: bool, ends: set[int], repetition: float = 1.0, suppress: frozenset[int] = frozenset(),
                          begin_suppress: frozenset[int] = frozenset()) -> tuple[list[Hypothesis], float]:
    """Beam search as the proto's comment says (Hugging Face's BeamSearchScorer): returns the
    finished hypotheses best first and the smallest gap between two scores whose order decided
    the result. ``repetition`` penalises the log-probabilities of the ids in each beam's prompt +
    tokens (all negative, so multiplied), as Hugging Face's processor does inside beam search;
    ``suppress`` ids are -inf at every step, ``begin_suppress`` ids at the first."""
    k = num_beams
    beams: list[tuple[float, list[int]]] = [(0.0, [])]  # (sum of log-probabilities, generated tokens)
    finished: list[Hypothesis] = []
    worst = 1e9
    gaps: list[float] = []

    def add(tokens: list[int], sum_logprobs: float, generated: int, ending: int | None) -> Hypothesis | None:
        nonlocal worst
        score = sum_logprobs / max(generated, 1) ** length_penalty  # the proto: L is at least 1
        if len(finished) < k or score > worst:
            added = Hypothesis(score, tokens, ending)
            finished.append(added)
            if len(finished) > k:
                finished.remove(min(finished, key=lambda h: h.score))
                worst = min(h.score for h in finished)
            else:
                worst = min(worst, score)
            return added
        return None

    width = max(2, 1 + len(ends)) * k  # candidates considered per step
    done = False
    for step in range(max_new):
        candidates = []
        for b, (score, tokens) in enumerate(beams):
            logprobs = ref.logprobs(ids + tokens).copy()
            seen = sorted(set(ids + tokens))
            logprobs[seen] = np.where(logprobs[seen] > 0, logprobs[seen] / repetition, logprobs[seen] * repetition)
            logprobs[[*suppress, *(begin_suppress if step == 0 else ())]] = -np.inf
            candidates += [(score + logprobs[t], b, int(t)) for t in np.argsort(-logprobs)[: width + 1]]
        candidates.sort(key=lambda c: -c[0])
        kept: list[tuple[float, list[int]]] = []
        last, ending_seen, best_finished = 0, False, None
        for rank, (score, b, token) in enumerate(candidates[:width]):
            last = rank
            tokens = beams[b][1]
            if token in ends:
                ending_seen = True
                if rank < k:
                    added = add(tokens + [token], score, len(tokens), token)
                    if rank == 0:
                        best_finished = added
            else:
                kept.append((score, tokens + [token]))
            if len(kept) == k:
                break
        assert len(kept) == k
        gaps.append(candidates[last][0] - candidates[last + 1][0])
        if ending_seen:
            gaps.append(candidates[k - 1][0] - candidates[k][0])
        beams = kept
        if len(finished) >= k:
            if early_stopping:
                done = True
            else:
                # The step's best candidate (kept or finished), over the tokens generated before it.
                bound = candidates[0][0] / max(step, 1) ** length_penalty
                # When that candidate ended a hypothesis, the bound is that hypothesis' own score:
                # the search is done exactly when it is the worst, decided by the others' scores.
                gaps += [abs(h.score - bound) for h in finished if h is not best_finished]
                done = worst >= bound
        if done:
            break
    if not done:
        for score, tokens in beams:
            add(tokens, score, len(tokens), None)
    finished.sort(key=lambda h: -h.score)
    gaps += [a.score - b.score for a, b in pairwise(finished)]
    return finished, min(gaps)


BEAM_CASES = {
    # name: (prompt seed, stop token ids, length_penalty, early_stopping)
    "the best hypothesis ends with EOS": (5, (), 1.0, False),
    "stop token ids end hypotheses": (2, (142, 280, 8), 1.0, False),
    "stop token ids end hypotheses, early stopping": (2, (142, 280, 8), 1.0, True),
    "early stopping picks other hypotheses": (4, (97, 8), 1.0, True),
    "length penalty 0.5": (20, (97, 8, 123, 280), 0.5, False),
    "length penalty -0.5 favours short hypotheses": (2, (97, 8), -0.5, False),
}
# name: (prompt seed, stop token ids, repetition penalty)
PENALISED_BEAM_CASES = {"repetition penalty 1.5 on the log-probabilities": (4, (142, 280, 8), 1.5)}


@pytest.mark.parametrize("name", list(BEAM_CASES))
def test_beam_search_equals_the_reference(engine, ref, name):
    seed, stop_ids, length_penalty, early = BEAM_CASES[name]
    ids = prompt(seed)
    ends = {*ref.eos, *stop_ids}
    expected, gap = reference_beam_search(ref, ids, 4, 12, length_penalty, early, ends)
    record_margin(f"beam search: {name}", np.array([0.0, gap]))
    assert gap > MIN_MARGIN, "the reference's choices were near ties"
    assert any(h.ending is not None for h in expected[:2]), "an ending token must be exercised"
    streams = run(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, stop_token_ids=list(stop_ids),
                                            n=2, beams=BeamSearch(4, length_penalty, early)))
    assert sorted(streams) == [0, 1]
    for rank in (0, 1):
        s, h = streams[rank], expected[rank]
        assert len(s.chunks) == 1, "a hypothesis comes as one message"
        assert s.tokens == h.tokens, f"hypothesis {rank}"
        assert s.last.beam_score is not None and abs(s.last.beam_score - h.score) <= TOLERANCE
        assert s.last.usage.completion_tokens == len(h.tokens)
        assert s.last.usage.prompt_tokens == len(ids)
        if h.ending is None:
            assert s.last.finish_reason is FinishReason.LENGTH and len(h.tokens) == 12
        elif h.ending in ref.eos:
            assert s.last.finish_reason is FinishReason.EOS
        else:
            assert s.last.finish_reason is FinishReason.STOP and s.last.matched_stop == h.ending
        assert s.text == ref.decode(h.tokens[:-1] if h.ending is not None else h.tokens)
    assert streams[0].last.beam_score >= streams[1].last.beam_score


@pytest.mark.parametrize("name", list(PENALISED_BEAM_CASES))
def test_penalised_beam_search_equals_the_reference(engine, ref, name):
    seed, stop_ids, repetition = PENALISED_BEAM_CASES[name]
    ids = prompt(seed)
    ends = {*ref.eos, *stop_ids}
    expected, gap = reference_beam_search(ref, ids, 4, 12, 1.0, False, ends, repetition)
    plain, _ = reference_beam_search(ref, ids, 4, 12, 1.0, False, ends)
    assert [h.tokens for h in expected[:2]] != [h.tokens for h in plain[:2]], "the penalty must change the search"
    record_margin(f"beam search: {name}", np.array([0.0, gap]))
    assert gap > MIN_MARGIN, "the reference's choices were near ties"
    streams = run(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, stop_token_ids=list(stop_ids), n=2,
                                            beams=BeamSearch(4), sampling=SamplingConfig(repetition_penalty=repetition)))
    for rank in (0, 1):
        assert streams[rank].tokens == expected[rank].tokens, f"hypothesis {rank}"
        assert abs(streams[rank].last.beam_score - expected[rank].score) <= TOLERANCE


def test_beam_search_early_stopping_changes_the_answer(ref):
    """The two early-stopping cases above really differ (or the flag would go untested)."""
    ids = prompt(4)
    late, _ = reference_beam_search(ref, ids, 4, 12, 1.0, False, {*ref.eos, 97, 8})
    early, _ = reference_beam_search(ref, ids, 4, 12, 1.0, True, {*ref.eos, 97, 8})
    assert [h.tokens for h in late[:2]] != [h.tokens for h in early[:2]]


def test_beam_search_best_hypothesis_alone(engine, ref):
    ids = prompt(5)
    expected, _ = reference_beam_search(ref, ids, 4, 12, 1.0, False, set(ref.eos))
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, beams=BeamSearch(4)))
    assert s.tokens == expected[0].tokens and expected[0].ending in ref.eos
    assert abs(s.last.beam_score - expected[0].score) <= TOLERANCE


def test_one_beam_is_greedy(engine, ref):
    ids = prompt(7)
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, ignore_eos=True,
                                      beams=BeamSearch(1, 2.0, True)))
    assert s.tokens == ref.greedy(ids, 12, "one beam: greedy")


# ---------------------------------------------------------------------------------------------
# The proto mapping, over gRPC


def messages(stub, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=60))


BAD_OPTIONS = {
    # name: (request fields, words one of which the error names)
    "top_logprobs 21": ({"logprobs": True, "top_logprobs": 21}, ("top_logprobs",)),
    "n above the batch": ({"n": 65, "sampling": pb.SamplingParams(temperature=1.0)}, ("n",)),
    "num_beams with temperature": ({"num_beams": 4, "sampling": pb.SamplingParams(temperature=0.7)},
                                   ("num_beams", "temperature")),
    "num_beams with top_k": ({"num_beams": 4, "sampling": pb.SamplingParams(top_k=5)}, ("num_beams", "top_k")),
    "num_beams with logprobs": ({"num_beams": 4, "logprobs": True}, ("num_beams", "logprobs")),
    "num_beams with stop strings": ({"num_beams": 4, "stop": ["x"]}, ("num_beams", "stop")),
    "n above num_beams": ({"num_beams": 2, "n": 3}, ("n", "num_beams")),
    "min_p above 1": ({"sampling": pb.SamplingParams(temperature=1.0, min_p=1.5)}, ("min_p",)),
    "repetition_penalty 0": ({"sampling": pb.SamplingParams(repetition_penalty=0.0)}, ("repetition_penalty",)),
    "presence_penalty 3": ({"sampling": pb.SamplingParams(presence_penalty=3.0)}, ("presence_penalty",)),
    "frequency_penalty -3": ({"sampling": pb.SamplingParams(frequency_penalty=-3.0)}, ("frequency_penalty",)),
    "min_new_tokens above max_new_tokens": ({"min_new_tokens": 9}, ("min_new_tokens",)),
    "stop token id outside the vocabulary": ({"stop_token_ids": [VOCAB]}, ("stop_token_ids",)),
    "65 stop token ids": ({"stop_token_ids": list(range(3, 68))}, ("stop_token_ids",)),
    "suppress token id outside the vocabulary": ({"suppress_token_ids": [3, VOCAB]}, ("suppress_token_ids[1]",)),
    "-1 among begin suppress ids": ({"begin_suppress_token_ids": [5, -1]}, ("begin_suppress_token_ids[1]",)),
    "1025 suppress token ids": ({"suppress_token_ids": list(range(1025))}, ("suppress_token_ids",)),
    "1025 begin suppress token ids": ({"begin_suppress_token_ids": list(range(1025))}, ("begin_suppress_token_ids",)),
    "every id suppressed": ({"suppress_token_ids": list(range(VOCAB))}, ("suppress_token_ids",)),
}


@pytest.mark.subprocess
def test_generation_options_over_grpc(stub):
    ids = prompt(1)

    def request(**fields) -> pb.GenerateRequest:
        return pb.GenerateRequest(prompt_token_ids=ids, **{"max_new_tokens": 8, **fields})

    greedy = [t for m in messages(stub, request(ignore_eos=True)) for t in m.token_ids]
    stop_id = greedy[3]
    masked = [t for m in messages(stub, request(ignore_eos=True, suppress_token_ids=[greedy[0]])) for t in m.token_ids]
    assert len(masked) == 8 and greedy[0] not in masked
    begun = [t for m in messages(stub, request(ignore_eos=True, begin_suppress_token_ids=[greedy[0]])) for t in m.token_ids]
    assert begun[0] != greedy[0]
    none = messages(stub, request(ignore_eos=True, suppress_token_ids=[-1], begin_suppress_token_ids=[-1]))
    assert [t for m in none for t in m.token_ids] == greedy
    answer = messages(stub, request(ignore_eos=True, logprobs=True, top_logprobs=2, prompt_logprobs=True,
                                    stop_token_ids=[stop_id], n=0))
    assert [t for m in answer for t in m.token_ids] == greedy[:4]
    assert all(m.index == 0 and len(m.logprobs) == len(m.token_ids) for m in answer)
    assert [lp.token_id for m in answer for lp in m.logprobs] == greedy[:4]
    assert all(len(lp.top) == 2 and lp.top[0].token_id == lp.token_id and lp.logprob <= 0
               and lp.text == lp.top[0].text for m in answer for lp in m.logprobs)
    assert len(answer[0].prompt_logprobs) == len(ids) - 1
    assert answer[0].prompt_logprobs[0].token_id == ids[1]
    last = answer[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert last.WhichOneof("matched_stop") == "matched_stop_token_id" and last.matched_stop_token_id == stop_id

    stop = "ckr"  # spans the seventh and eighth greedy tokens of TEXT_PROMPT ("ck" + "red")
    answer = messages(stub, pb.GenerateRequest(prompt=TEXT_PROMPT, max_new_tokens=12, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True))
    assert answer[-1].finish_reason == pb.FINISH_REASON_STOP
    assert "".join(m.text for m in answer).endswith(stop)
    assert answer[-1].WhichOneof("matched_stop") == "matched_stop_str" and answer[-1].matched_stop_str == stop

    samples = messages(stub, request(ignore_eos=True, n=3, sampling=pb.SamplingParams(
        temperature=1.0, seed=9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1)))
    finals = {m.index: m for m in samples if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED}
    assert sorted(finals) == [0, 1, 2]
    assert all(m.usage.completion_tokens == 8 for m in finals.values())
    assert sorted(sum(len(m.token_ids) for m in samples if m.index == i) for i in range(3)) == [8, 8, 8]

    beams = messages(stub, request(num_beams=4, n=2, length_penalty=1.0, early_stopping=True))
    assert [m.index for m in beams] == [0, 1]
    assert all(m.finish_reason != pb.FINISH_REASON_UNSPECIFIED and m.beam_score < 0 for m in beams)
    assert beams[0].beam_score >= beams[1].beam_score

    for name, (fields, words) in BAD_OPTIONS.items():
        with pytest.raises(grpc.RpcError) as info:
            messages(stub, request(**fields))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value.details())
        assert any(w in info.value.details() for w in words), (name, info.value.details())


def test_samples_and_beams_on_a_graph_without_a_shared_buffer(model_dirs, engine):
    """The combined-layout graph runs every row batch 1 with its own cache (SequenceSlots): its
    samples and beams must equal the shared-buffer bank's on the same weights."""
    combined = fresh_engine(model_dirs["tiny", KVLayout.COMBINED])
    try:
        assert not combined.slots.batched
        ids = prompt(4)
        sampled = GenerationRequest(prompt_token_ids=ids, max_new_tokens=10, n=3, ignore_eos=True,
                                    sampling=SamplingConfig(temperature=1.0, seed=11))
        beams = GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, stop_token_ids=[142, 280, 8], n=2,
                                  beams=BeamSearch(4))
        for request in (sampled, beams):
            theirs, ours = run(combined, request), run(engine, request)
            assert {i: s.tokens for i, s in theirs.items()} == {i: s.tokens for i, s in ours.items()}
    finally:
        combined.close()


def test_beam_search_with_more_stop_ids_than_beams_at_the_top(engine, ref):
    """Every one of the best continuations may be a stop token: the search still keeps num_beams
    beams (it considers (1 + stop ids) x num_beams candidates) and equals the reference."""
    ids = prompt(3)
    stop_ids = [int(t) for t in np.argsort(-ref.logprobs(ids))[:6]]
    ends = {*ref.eos, *stop_ids}
    expected, _ = reference_beam_search(ref, ids, 2, 8, 1.0, False, ends)
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=8, stop_token_ids=stop_ids, beams=BeamSearch(2)))
    assert s.tokens == expected[0].tokens and s.last.finish_reason is FinishReason.STOP


def test_a_failing_beam_search_fails_alone(engine, ref, monkeypatch):
    """A beam step that raises ends its own request, never the other rows of the decode step."""
    from services.engine.beam_search import BeamState

    step = BeamState.step

    def failing(self, logprobs):
        if self.tokens.shape[1] == 2:
            raise RuntimeError("a bug in one search")
        return step(self, logprobs)

    monkeypatch.setattr(BeamState, "step", failing)
    ids = prompt(6)

    async def both():
        async def drain(request):
            return [chunk async for chunk in engine.generate(request)]

        plain = asyncio.ensure_future(drain(GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, ignore_eos=True)))
        beams = asyncio.ensure_future(drain(GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, ignore_eos=True,
                                                              beams=BeamSearch(3))))
        return await asyncio.gather(plain, beams, return_exceptions=True)

    plain, beams = asyncio.run(both())
    assert isinstance(beams, RuntimeError)
    assert sum(len(c.token_ids) for c in plain) == 12 and plain[-1].finish_reason is FinishReason.LENGTH
    assert engine.scheduler.running == 0
