"""suppress_token_ids and begin_suppress_token_ids, and their defaults from a model folder's
generation_config.json: greedy, samples, beams, the encoder-decoder model, and the proto mapping.

Greedy and beam answers are checked against the full-recompute reference of
tests/test_generation_options.py with the ids masked as the proto says; nothing here imports the
engine's own masking code."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import record_margin, stream
from test_generation_options import (
    MIN_MARGIN,
    TOLERANCE,
    VOCAB,
    Reference,
    one,
    prompt,
    reference_beam_search,
    run,
)

from kvshare.v1 import generator_pb2 as pb
from services.api.servicer import engine_request
from services.cli import build_parser
from services.client import generate_request
from services.engine.encoder_input import EncoderRequest
from services.engine.engine import Engine
from services.engine.generation import BeamSearch, FinishReason, GenerationRequest
from services.engine.sampling import SamplingConfig
from services.errors import InvalidRequest, ModelLoadError
from services.runtime.generation_config import GenerationDefaults


@pytest.fixture(scope="module")
def ref(tiny_model) -> Reference:
    return Reference(tiny_model)


@pytest.fixture(scope="module")
def engine(load_engine, tiny_model) -> Engine:
    return load_engine(tiny_model)


def masked_greedy(ref: Reference, ids: list[int], n: int, suppress=(), begin_suppress=(), label="suppress") -> list[int]:
    """Greedy, EOS not ending it, with ``suppress`` at -inf at every step and ``begin_suppress`` at the first."""
    out: list[int] = []
    for step in range(n):
        logits = ref.logits(ids + out).copy()
        logits[[*suppress, *(begin_suppress if step == 0 else ())]] = -np.inf
        assert record_margin(label, logits) > MIN_MARGIN
        out.append(int(np.argmax(logits)))
    return out


def greedy_request(ids: list[int], n: int = 12, **fields) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=ids, max_new_tokens=n, ignore_eos=True, **fields)


def test_a_suppressed_id_is_never_generated(engine, ref):
    ids = prompt(1)
    plain = masked_greedy(ref, ids, 12)
    target = plain[0]
    expected = masked_greedy(ref, ids, 12, suppress=[target])
    assert expected != plain and target not in expected
    assert one(engine, greedy_request(ids)).tokens == plain
    assert one(engine, greedy_request(ids, suppress_token_ids=[target])).tokens == expected


def test_begin_suppress_masks_the_first_token_only(engine, ref):
    ids = prompt(1)
    plain = masked_greedy(ref, ids, 12)
    later = next(t for t in plain[1:] if t != plain[0])
    # An id greedy picks later, masked at the first token only: nothing changes.
    assert one(engine, greedy_request(ids, begin_suppress_token_ids=[later])).tokens == plain
    expected = masked_greedy(ref, ids, 12, begin_suppress=[plain[0]])
    assert expected[0] != plain[0]
    assert one(engine, greedy_request(ids, begin_suppress_token_ids=[plain[0]])).tokens == expected


def test_a_suppressed_eos_never_ends_the_stream(engine, ref):
    ids = prompt(27)  # greedy: one token, then EOS
    eos = sorted(ref.eos)
    s = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=8, suppress_token_ids=eos))
    assert s.tokens == masked_greedy(ref, ids, 8, suppress=eos)
    assert s.last.finish_reason is FinishReason.LENGTH
    # At the first token only, as Whisper's begin_suppress_tokens hold its EOS: it may end the stream later.
    first = one(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=8, begin_suppress_token_ids=eos))
    assert first.tokens[0] not in ref.eos


def test_samples_never_draw_a_suppressed_id(engine):
    ids = prompt(3)
    sampled = dict(n=3, max_new_tokens=16, ignore_eos=True, sampling=SamplingConfig(temperature=1.5, seed=5))
    plain = run(engine, GenerationRequest(prompt_token_ids=ids, **sampled))
    drawn = sorted({t for s in plain.values() for t in s.tokens})
    firsts = sorted({s.tokens[0] for s in plain.values()})
    suppressed = run(engine, GenerationRequest(prompt_token_ids=ids, suppress_token_ids=drawn, **sampled))
    assert sorted(suppressed) == [0, 1, 2]
    assert all(not set(s.tokens) & set(drawn) for s in suppressed.values())
    begun = run(engine, GenerationRequest(prompt_token_ids=ids, begin_suppress_token_ids=firsts, **sampled))
    assert all(s.tokens[0] not in firsts for s in begun.values())
    # Each sample equals a request with n = 1 seeded seed + i under the same masks.
    alone = one(engine, GenerationRequest(prompt_token_ids=ids, suppress_token_ids=drawn, max_new_tokens=16,
                                          ignore_eos=True, sampling=SamplingConfig(temperature=1.5, seed=7)))
    assert alone.tokens == suppressed[2].tokens


@pytest.mark.parametrize("field", ["suppress", "begin_suppress"])
def test_beam_search_masks_the_log_probabilities(engine, ref, field):
    ids = prompt(2)
    stop_ids = (142, 280, 8)
    ends = {*ref.eos, *stop_ids}
    plain, _ = reference_beam_search(ref, ids, 4, 12, 1.0, False, ends)
    target = plain[0].tokens[0]
    masks = {field: frozenset([target])}
    expected, gap = reference_beam_search(ref, ids, 4, 12, 1.0, False, ends, **masks)
    assert [h.tokens for h in expected[:2]] != [h.tokens for h in plain[:2]], "the mask must change the search"
    record_margin(f"beam search: {field}", np.array([0.0, gap]))
    assert gap > MIN_MARGIN, "the reference's choices were near ties"
    streams = run(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, stop_token_ids=list(stop_ids),
                                            n=2, beams=BeamSearch(4), **{f"{field}_token_ids": [target]}))
    for rank in (0, 1):
        assert streams[rank].tokens == expected[rank].tokens, f"hypothesis {rank}"
        assert abs(streams[rank].last.beam_score - expected[rank].score) <= TOLERANCE
        if field == "suppress":
            assert target not in streams[rank].tokens
        else:
            assert streams[rank].tokens[0] != target


def test_encoder_decoder_model_suppresses_too(load_engine, encdec_model):
    engine = load_engine(encdec_model)
    request = dict(max_new_tokens=10, ignore_eos=True, return_logits=True, encoder=EncoderRequest(token_ids=list(range(10, 40))))
    plain, _, _ = stream(engine, GenerationRequest(**request))
    masked = [plain[0], plain[1]]
    tokens, logits, _ = stream(engine, GenerationRequest(suppress_token_ids=[plain[1]], begin_suppress_token_ids=[plain[0]],
                                                         **request))
    assert tokens[0] != plain[0] and plain[1] not in tokens
    # Each token is the arg-max of its position's raw logits with the masks applied.
    for step, (token, row) in enumerate(zip(tokens, logits, strict=True)):
        row = row.astype(np.float64)
        row[masked if step == 0 else masked[1:]] = -np.inf
        assert record_margin("encoder-decoder suppress", row) > MIN_MARGIN
        assert token == int(np.argmax(row))


# ---------------------------------------------------------------------------------------------
# The model folder's defaults


def folder_with_config(tiny_model, tmp_path, config) -> object:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    (folder / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


def test_folder_defaults_apply_unless_the_request_sets_the_field(load_engine, tiny_model, tmp_path, ref):
    ids = prompt(1)
    plain = masked_greedy(ref, ids, 12)
    other = next(t for t in range(3, VOCAB) if t not in plain)
    engine = load_engine(folder_with_config(tiny_model, tmp_path, {
        "suppress_tokens": [plain[0]], "begin_suppress_tokens": [plain[1]], "max_length": 448}))
    assert engine.inputs.generation_defaults == GenerationDefaults((plain[0],), (plain[1],))
    assert one(engine, greedy_request(ids)).tokens == masked_greedy(ref, ids, 12, [plain[0]], [plain[1]])
    # A request's own list replaces the default (it is not added to it); an empty one is none.
    assert one(engine, greedy_request(ids, suppress_token_ids=[other], begin_suppress_token_ids=[other])).tokens == plain
    assert one(engine, greedy_request(ids, suppress_token_ids=[], begin_suppress_token_ids=[])).tokens == plain
    assert one(engine, greedy_request(ids, begin_suppress_token_ids=[])).tokens == masked_greedy(ref, ids, 12, [plain[0]])


def test_a_folder_without_generation_config_has_no_defaults(engine):
    assert engine.inputs.generation_defaults == GenerationDefaults()


@pytest.mark.parametrize(("config", "words"), [
    ({"suppress_tokens": [3, VOCAB]}, "suppress_tokens[1]"),
    ({"begin_suppress_tokens": [-1]}, "begin_suppress_tokens[0]"),
    ({"suppress_tokens": [True]}, "suppress_tokens[0]"),
    ({"suppress_tokens": 5}, "must be a list"),
    ([1, 2], "JSON object"),
    ("{not json", "unreadable"),
])
def test_an_unusable_generation_config_refuses_the_folder(tiny_model, tmp_path, config, words):
    folder = folder_with_config(tiny_model, tmp_path, config)
    with pytest.raises(ModelLoadError) as info:
        GenerationDefaults.from_folder(folder, VOCAB)
    assert words in str(info.value) and "generation_config.json" in str(info.value)


def test_engine_load_refuses_an_unusable_generation_config(tiny_model, tmp_path):
    folder = folder_with_config(tiny_model, tmp_path, {"suppress_tokens": [VOCAB]})
    with pytest.raises(ModelLoadError, match=r"suppress_tokens\[0\]"):
        Engine.load(folder, None, None, None, "cpu", 1)  # refused before anything is built


def test_null_lists_are_no_defaults(tiny_model, tmp_path):
    folder = folder_with_config(tiny_model, tmp_path, {"suppress_tokens": None, "begin_suppress_tokens": [5]})
    assert GenerationDefaults.from_folder(folder, VOCAB) == GenerationDefaults((), (5,))


# ---------------------------------------------------------------------------------------------
# Refusals in the engine and the mapping from the proto


def all_but(keep: int, eos) -> list[int]:
    """Every id except ``keep`` ids that are not EOS."""
    kept = [t for t in range(VOCAB) if t not in eos][:keep]
    return [t for t in range(VOCAB) if t not in kept]


REFUSED = {
    # name: (request fields given the EOS ids, words of the refusal)
    "an id outside the vocabulary": (lambda eos: {"suppress_token_ids": [3, VOCAB]}, "suppress_token_ids[1]"),
    "a negative id": (lambda eos: {"begin_suppress_token_ids": [-1]}, "begin_suppress_token_ids[0]"),
    "1025 ids": (lambda eos: {"suppress_token_ids": list(range(1025))}, "at most 1024"),
    "the whole vocabulary": (lambda eos: {"suppress_token_ids": list(range(VOCAB))}, "0 left, at least 1 needed"),
    "all but EOS, which min_new_tokens masks": (
        lambda eos: {"suppress_token_ids": [t for t in range(VOCAB) if t not in eos], "min_new_tokens": 1},
        "0 left, at least 1 needed"),
    "fewer ids than beams": (lambda eos: {"begin_suppress_token_ids": all_but(3, eos), "beams": BeamSearch(4)},
                             "3 left, at least 4 needed"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_the_engine_refuses_unusable_masks(engine, name):
    fields, words = REFUSED[name]
    with pytest.raises(InvalidRequest) as info:
        engine.prepare(GenerationRequest(prompt_token_ids=prompt(1), max_new_tokens=4,
                                         **fields(set(engine.spec.eos_token_ids))))
    assert words in str(info.value)


def test_masks_that_leave_one_id_are_served(engine):
    # Every id but one at the first token (EOS included, but only at the first token).
    s = one(engine, GenerationRequest(prompt_token_ids=prompt(1), max_new_tokens=3, ignore_eos=True,
                                      begin_suppress_token_ids=[t for t in range(VOCAB) if t != 7]))
    assert s.tokens[0] == 7


def test_the_proto_fields_map_unset_to_the_default_and_minus_one_to_none():
    def mapped(**fields):
        r = engine_request(pb.GenerateRequest(prompt="x", **fields), 64)
        return r.suppress_token_ids, r.begin_suppress_token_ids

    assert mapped() == (None, None)
    assert mapped(suppress_token_ids=[-1], begin_suppress_token_ids=[4, 5]) == ([], [4, 5])
    assert mapped(begin_suppress_token_ids=[-1]) == (None, [])
    assert mapped(suppress_token_ids=[-1, 5]) == ([-1, 5], None)  # the engine refuses it, naming index 0
    assert len(mapped(suppress_token_ids=range(5000))[0]) == 1025  # cut one past the limit


def test_kvshare_generate_flags():
    args = build_parser().parse_args(["generate", "hi", "--suppress-token-id", "-1", "--begin-suppress-token-id", "5",
                                      "--begin-suppress-token-id", "7"])
    request = generate_request(args)
    assert list(request.suppress_token_ids) == [-1] and list(request.begin_suppress_token_ids) == [5, 7]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--suppress-token-id", "-2"])
