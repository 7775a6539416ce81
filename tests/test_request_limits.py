"""Request size limits: refused with INVALID_ARGUMENT naming the field, the limit and its flag,
before any tokenizing; requests at the limits still work. Real workers over gRPC on loopback."""

import math

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.engine.request_limits import (
    MAX_MESSAGES,
    MAX_REQUEST_ID_CHARS,
    MAX_SALT_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_SUPPRESS_TOKEN_IDS,
    RequestLimits,
    derived_prompt_bytes,
    utf8_length,
)
from services.local.worker_process import WorkerProcess
from services.runtime.tokenizer import TextTokenizer, TokenBytes, _shrinker

PROMPT = "The system prompt tells the assistant who it is."


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> TextTokenizer:
    return TextTokenizer(tiny_model / "tokenizer.json")


@pytest.fixture(scope="module")
def limit(tokenizer) -> int:
    """The tiny model's derived prompt limit: context × longest token."""
    return derived_prompt_bytes(1024, tokenizer.token_bytes())


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


@pytest.mark.subprocess
def test_prompts_over_the_derived_limit_are_refused_naming_it(stub, limit):
    over = "a" * (limit + 1)
    for request in (pb.GenerateRequest(prompt=over, max_new_tokens=4),
                    pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="é" * (limit // 2))],
                                       max_new_tokens=4)):
        error = refusal(lambda: list(stub.Generate(request, timeout=30)))
        field = "prompt" if request.prompt else "messages"
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith(f"{field}: ") and f"at most {limit}" in error.details()
        assert "context of 1024 tokens" in error.details() and "--max-prompt-bytes" in error.details()
    for request in (pb.TokenizeRequest(text=over), pb.TokenizeRequest(messages=[pb.ChatMessage(role="u" * (limit + 1))])):
        error = refusal(lambda: stub.Tokenize(request, timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-prompt-bytes" in error.details()
    # At the limit the size check passes: what follows is the context check, after tokenizing.
    error = refusal(lambda: list(stub.Generate(pb.GenerateRequest(prompt="a" * limit, max_new_tokens=4), timeout=30)))
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE, error.details()
    assert len(stub.Tokenize(pb.TokenizeRequest(text="a" * limit), timeout=30).token_ids) > 1024


@pytest.mark.subprocess
def test_a_raised_prompt_limit_is_used_and_said(tiny_model):
    with WorkerProcess(tiny_model, env={"KVSHARE_MAX_PROMPT_BYTES": "100"}) as w, \
            grpc.insecure_channel(w.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        error = refusal(lambda: stub.Tokenize(pb.TokenizeRequest(text="x" * 101), timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "101 bytes of text; at most 100 (set by the operator" in error.details()
        assert stub.Tokenize(pb.TokenizeRequest(text="x" * 100), timeout=30).token_ids


@pytest.mark.subprocess
def test_stop_strings_over_the_limits_are_refused(stub):
    # 65 distinct stops (one over the default --max-stop-strings), and 20,000 one-character stops
    # (the fixture's messages are at most 64 KiB), are refused alike.
    cases = [("stop", [f"\u2603{i:07d}" for i in range(65)]), ("stop", ["x"] * 20_000),
             ("stop[3]", ["a", "b", "c", "é" * 129])]
    for field, stop in cases:
        error = refusal(lambda: list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4, stop=stop),
                                                   timeout=30)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith(f"{field}: ")
        assert ("--max-stop-strings" if field == "stop" else "258 bytes; at most 256") in error.details()


@pytest.mark.subprocess
def test_the_most_stop_strings_still_stop_right(stub):
    free = complete(stub, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=120, ignore_eos=True), timeout_s=30).text
    # The longest stop that fits 256 bytes, taken from the output; the 63 others are its prefixes
    # with a character that never comes after them, so all are held back and released again.
    stop = free[10:]
    while utf8_length(stop) > 256:
        stop = stop[:-1]
    assert utf8_length(stop) > 250
    decoys = [stop[:n] + "\u2603" for n in range(1, 64)]
    request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=120, ignore_eos=True, stop=[*decoys, stop])
    done = complete(stub, request, timeout_s=30)
    assert done.last.finish_reason == pb.FINISH_REASON_STOP
    assert done.text == free[: free.find(stop)]


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(text=st.text(min_size=1, max_size=300))
def test_no_text_over_the_derived_bound_fits_fewer_tokens(tokenizer, text):
    """The derived limit refuses nothing that could fit: B bytes are at least ⌈B / longest⌉ tokens."""
    longest = tokenizer.token_bytes().longest
    assert len(tokenizer.encode(text)) >= math.ceil(utf8_length(text) / longest)


def test_tokenizers_that_can_drop_text_are_named(tokenizer):
    assert tokenizer.token_bytes() == TokenBytes(8, None)
    bpe = {"type": "BPE", "byte_fallback": True}
    keeps = [
        {"normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}, "model": bpe},
        {"normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
         "pre_tokenizer": None, "model": bpe},
        {"normalizer": None, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits"}, {"type": "Split", "behavior": "Isolated"}, {"type": "ByteLevel"}]}, "model": bpe},
    ]
    assert [_shrinker(c) for c in keeps] == [None, None, None]
    drops = {
        "normalizer NFKC": {"normalizer": {"type": "NFKC"}, "pre_tokenizer": None, "model": bpe},
        "normalizer Replace": {"normalizer": {"type": "Replace", "pattern": {"String": "  "}, "content": " "},
                               "pre_tokenizer": None, "model": bpe},
        "pre-tokenizer Whitespace": {"normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "model": bpe},
        "model WordPiece": {"normalizer": None, "pre_tokenizer": None, "model": {"type": "WordPiece"}},
        "model BPE with fuse_unk": {"normalizer": None, "pre_tokenizer": None,
                                    "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True}},
    }
    assert {_shrinker(c): name for name, c in drops.items()} == {name: name for name in drops}


WIDE = "\U0001F600"
"""A character of 4 bytes in UTF-8: a limit counted in characters holds the most bytes with it."""
LARGEST_ID = 2**31 - 1
"""An int32 id of the longest varint a valid id can have (5 bytes)."""


def largest_requests(limits: RequestLimits) -> list[pb.GenerateRequest | pb.TokenizeRequest]:
    """Requests at every size limit at once, each prompt form in turn (a request has one): every
    string of 4-byte characters, every id the longest varint, every number its largest."""
    sampling = pb.SamplingParams(temperature=3.4e38, top_k=2**32 - 1, top_p=1.0, seed=2**64 - 1, min_p=1.0,
                                 repetition_penalty=3.4e38, presence_penalty=-3.4e38, frequency_penalty=-3.4e38)
    rest = dict(
        request_id=WIDE * MAX_REQUEST_ID_CHARS, max_new_tokens=2**32 - 1, sampling=sampling,
        stop=[WIDE * (limits.stop_string_bytes // 4)] * limits.stop_strings, ignore_eos=True,
        cache=pb.CacheOptions(skip_read=True, skip_write=True, salt=WIDE * MAX_SALT_CHARS), min_new_tokens=2**32 - 1,
        stop_token_ids=[LARGEST_ID] * MAX_STOP_TOKEN_IDS, include_stop_str_in_output=True, logprobs=True,
        top_logprobs=2**32 - 1, prompt_logprobs=True, n=2**32 - 1, num_beams=2**32 - 1, length_penalty=-3.4e38,
        early_stopping=True, suppress_token_ids=[LARGEST_ID] * MAX_SUPPRESS_TOKEN_IDS,
        begin_suppress_token_ids=[LARGEST_ID] * MAX_SUPPRESS_TOKEN_IDS)
    text = WIDE * (limits.prompt_bytes // 4)
    # The most messages, their bytes all in the contents (a role counts as its bytes too).
    per_message = limits.prompt_bytes // MAX_MESSAGES
    messages = [pb.ChatMessage(role="", content="a" * per_message) for _ in range(MAX_MESSAGES)]
    ids = [LARGEST_ID] * (limits.context_tokens - 1)
    return [pb.GenerateRequest(prompt=text, **rest), pb.GenerateRequest(messages=messages, **rest),
            pb.GenerateRequest(prompt_token_ids=ids, **rest), pb.TokenizeRequest(text=text),
            pb.TokenizeRequest(messages=messages), pb.TokenizeRequest(token_ids=[LARGEST_ID] * limits.token_ids)]


@pytest.mark.parametrize("limits", [
    RequestLimits(8192, "derived", 16, 1024, context_tokens=1024, token_bytes=8),  # the tiny model's
    RequestLimits(663552, "derived", 16, 1024, context_tokens=8192, token_bytes=81),  # SmolLM2's
    RequestLimits(1572864, "derived", 64, 4096, context_tokens=32768, token_bytes=48),  # Gemma 3's, more stops
    RequestLimits(100, "set by the operator", 1, 1, context_tokens=131072, token_bytes=16),  # ids dominate
], ids=["tiny", "smollm2", "gemma3", "long-context"])
def test_the_largest_valid_requests_fit_the_receive_bound(limits):
    """A worker's gRPC receive bound is ``RequestLimits.message_bytes``: a request at every limit
    at once, in each prompt form, serializes within it, so the bound refuses no valid request."""
    for request in largest_requests(limits):
        assert request.ByteSize() <= limits.message_bytes, (type(request).__name__, request.ByteSize())


def test_models_with_an_encoder_leave_the_bound_to_the_message_limit():
    """Audio and encoder features have no bound in the text limits: the face's --max-message-bytes."""
    assert RequestLimits(8192, "derived", 16, 1024, audio_seconds=30.0, encoder=True).message_bytes is None
