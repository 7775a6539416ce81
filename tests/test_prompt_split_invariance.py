"""An answer does not depend on how its prompt was split between the cache and computing, nor on
how a cold prompt was chunked, nor on how many rows decode beside it: bit for bit, on the fast
folders of SmolLM2 (fetch-model's default) and Gemma 3 (``--weights gguf``: the GGUF's own blocks
in MatMulNBits with int8 activations, which turns a float rounding of one row into whole
quantization steps, so nothing less than bitwise equality holds). Gemma's reference crosses its
sliding window of 512 positions, so runs that begin a held position early read windowed layers
too.

The reference is one cold run of the whole prompt. Suffix lengths: every length within two of a
multiple of each modulus of the rule (where a run's last row can fall alone in a tile), a few
between, all up to 260. Every length 1..260 was run once when the rule was made (bitwise equal
throughout); that sweep computes 34k prompt tokens, about 5 minutes here, so CI runs the lengths
where a tile's edge falls. Every case loads the reference's own K/V for
its cached prefix (as a fetch would) and computes the rest through ``ModelRunner.run_prompt``,
the code the scheduler's prefill chunks run, under the rule this CPU's probe chose
(``split_rule``, ``numerics_probe``); logits and K/V must equal the reference's bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import stream

from cachestore.memory import MemoryStore
from cachestore.stats import CacheStats
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationRequest
from services.engine.scheduler import SchedulerOptions

SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: shelf {i * 7 % 31} holds {i * 13 % 17} jars of {('plum', 'fig', 'pear', 'lime')[i % 4]} jam." for i in range(40))
QUESTION = "What should I name my cat? Give one name only."
LONGEST = 520
"""Reference prompt length: past 2 x 128 + 260, and not itself a lone length."""
CACHED = 256


@pytest.fixture(scope="module", params=["smollm2_gguf", "gemma3"])
def engine(request):
    folder = request.getfixturevalue(request.param)
    engine = Engine.load(folder, EngineOptions(cache_dtype="float32", scheduler=SchedulerOptions(max_batch=16)),
                         MemoryStore(512 << 20), CacheStats(), "cpu", 2)
    assert engine.session.numerics.exact, engine.session.numerics
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    ids = engine.tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    assert len(ids) >= LONGEST
    return ids[-LONGEST:]


@pytest.fixture(scope="module")
def reference(engine, prompt):
    """Every position's logits (None where the graph emits the last position's only, as Gemma's
    does: there every position's K/V, which every later logit reads, is what is compared) and the
    K/V of one cold run of the whole prompt."""
    slot = engine.slots.acquire(LONGEST + 16)
    try:
        engine.slots.begin(slot, [], 0)
        every = engine.session.logits_per_position
        logits = engine.runner.run_prompt(slot, prompt, 0, LONGEST, every) if every else None
        if not every:
            engine.runner.run_prompt(slot, prompt, 0, LONGEST, False)
        kv = engine.slots.canonical(slot, 0, LONGEST).result().copy()
    finally:
        engine.slots.release(slot)
    return logits, kv


def _continue(engine, prompt, kv, cached: int, chunks: list[int]):
    """Loads ``cached`` positions of ``kv`` into a slot and computes ``chunks`` after them: the
    last chunk's logits and the slot's K/V."""
    slot = engine.slots.acquire(LONGEST + 16)
    try:
        engine.slots.begin(slot, [kv[:, :, :, :cached]] if cached else [], cached)
        start = cached
        for n in chunks:
            logits = engine.runner.run_prompt(slot, prompt, start, n, False)
            start += n
        return logits, engine.slots.canonical(slot, 0, start).result().copy()
    finally:
        engine.slots.release(slot)


def _equal(got, reference, end: int) -> list[str]:
    logits, kv = got
    wrong = []
    if reference[0] is not None and not np.array_equal(logits, reference[0][end - 1]):
        wrong.append(f"logits {np.abs(logits - reference[0][end - 1]).max():.3g} apart")
    if not np.array_equal(kv, reference[1][:, :, :, :end]):
        wrong.append(f"K/V {np.abs(kv - reference[1][:, :, :, :end]).max():.3g} apart")
    return wrong


def test_the_probe_finds_a_rule_that_covers_every_lone_run_length(engine):
    numerics = engine.session.numerics
    for n in (*numerics.attention_lone, *numerics.matmul_lone):
        assert numerics.rule.lone(n), (n, numerics)
    assert 1 in numerics.attention_lone  # a decode step's row is its own kernel's (so answers are not published)


def _suffixes(moduli: tuple[int, ...], longest: int = 260) -> list[int]:
    """Lengths 1..longest within two of a multiple of a modulus, and a few between."""
    near = {m * j + d for m in moduli for j in range(longest // m + 1) for d in (-2, -1, 0, 1, 2)}
    return sorted(k for k in near | {1, 2, 3, 4, 37, 100, 161, 222} if 1 <= k <= longest)


def test_suffixes_where_a_tile_edge_falls_after_a_cached_prefix_equal_the_cold_run(engine, prompt, reference):
    wrong = {}
    for k in _suffixes(engine.session.numerics.rule.moduli):
        found = _equal(_continue(engine, prompt, reference[1], CACHED, [k]), reference, CACHED + k)
        if found:
            wrong[k] = found
    assert not wrong, wrong


def test_every_cached_block_boundary_equals_the_cold_run(engine, prompt, reference):
    size = engine.options.block_size
    wrong = {}
    length = 300  # past two tiles of 128, with every block of a 16-token store before it
    for cached in range(0, length, size):
        found = _equal(_continue(engine, prompt, reference[1], cached, [length - cached]), reference, length)
        if found:
            wrong[cached] = found
    assert not wrong, wrong


@pytest.mark.parametrize("chunk", [32, 64, 256])
def test_a_cold_prompt_chunked_equals_the_whole_run(engine, prompt, reference, chunk):
    for length in (LONGEST, 257, 129):
        chunks = [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])
        assert not _equal(_continue(engine, prompt, reference[1], 0, chunks), reference, length), (chunk, length)


@pytest.mark.parametrize("beside", [0, 3, 15])
def test_a_decoded_row_does_not_depend_on_the_rows_decoding_beside_it(engine, prompt, reference, beside):
    slots, kv = engine.slots, reference[1]
    taken = [slots.acquire(LONGEST + 16) for _ in range(beside + 1)]
    try:
        for i, slot in enumerate(taken):
            length = LONGEST - 8 * i
            slots.begin(slot, [kv[:, :, :, :length]], length)
        tokens = [prompt[8 * i] for i in range(len(taken))]  # any tokens will do: the rows are compared
        rows = []
        for _ in range(6):
            logits = slots.decode(taken, tokens)
            rows.append(logits[0].copy())
            tokens = [int(t) for t in np.argmax(logits, axis=1)]
    finally:
        for slot in taken:
            slots.release(slot)
    alone = _decoded_alone(engine, reference, prompt[0])
    assert all(np.array_equal(a, b) for a, b in zip(rows, alone, strict=True)), beside


def _decoded_alone(engine, reference, token: int) -> list[np.ndarray]:
    slot = engine.slots.acquire(LONGEST + 16)
    try:
        engine.slots.begin(slot, [reference[1]], LONGEST)
        rows = []
        for _ in range(6):
            logits = engine.slots.decode([slot], [token])
            rows.append(logits[0].copy())
            token = int(np.argmax(logits[0]))
        return rows
    finally:
        engine.slots.release(slot)


def _request(ids, **cache):
    return GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, return_logits=True, ignore_eos=True,
                             cache=CacheControl(**cache))


@pytest.mark.parametrize("tokens", [128, 129, 130, 257])
def test_a_warm_repeat_through_the_engine_answers_as_cold(engine, prompt, tokens):
    ids = prompt[-tokens:]
    cold = stream(engine, _request(ids, skip_read=True))  # publishes its blocks
    warm = stream(engine, _request(ids))
    assert warm[2].usage.cached_prompt_tokens >= 64
    assert warm[0] == cold[0]
    assert all(np.array_equal(a, b) for a, b in zip(warm[1], cold[1], strict=True))


def test_a_second_turn_over_a_decoded_answer_answers_as_cold(engine, prompt):
    first = stream(engine, _request(prompt[:300]))
    follow = engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd a second name?<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    ids = prompt[:300] + first[0] + follow
    warm = stream(engine, _request(ids))
    cold = stream(engine, _request(ids, skip_read=True, skip_write=True))
    assert warm[2].usage.cached_prompt_tokens >= 256
    assert warm[0] == cold[0]
    assert all(np.array_equal(a, b) for a, b in zip(warm[1], cold[1], strict=True))
