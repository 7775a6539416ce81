"""A big request does not stop the streams already running: what makes it so, each proved by the
order of events, never by how long anything took. In-process engines over real ONNX Runtime
sessions, real gRPC on loopback.

- a prompt (or Tokenize text) over the size limit is refused before any tokenizing;
- under a raised limit it is tokenized on a tokenizer thread: a running stream goes on making
  tokens while that thread is held, and the Tokenize answer is serialized there too;
- the Rust tokenizer releases the GIL while it encodes, so that thread never stops the
  scheduler's;
- a long prompt is prefilled in chunks of the per-step token budget, with a decode step of the
  running stream between every two of them.

How long a running stream's longest gap is while such a call is answered (against its median gap)
is a speed figure, not a test: ``python -m bench.stalls`` measures it on the real model.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import wait_until
from tokenizers import Tokenizer

from cachestore.memory import MemoryStore
from cachestore.stats import CacheStats
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.api import servicer as servicer_module
from services.api.method_handlers import add_generator_to_server
from services.api.servicer import GeneratorServicer
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationRequest
from services.engine.scheduler import SchedulerOptions
from services.engine.sequence import Phase
from services.runtime.tokenizer import TextTokenizer

HUNG_S = 60.0
"""How long a wait that only a hung test outlasts may take: no case here waits for a duration."""
CORPUS = Path(__file__).resolve().parent.parent / "services" / "modelbuild" / "corpus.txt"
RAISED_PROMPT_BYTES = 16 << 20


def big_text(nbytes: int, seed: int = 5) -> str:
    """Seeded text of at least ``nbytes`` UTF-8 bytes: sentences of the seeded tokenizer's corpus
    words with some accented and CJK words and line breaks (as bench/stalls.py's ``big_text``)."""
    rng = np.random.default_rng(seed)
    words = CORPUS.read_text().split() + ["café", "naïve", "Zürich", "日本語", "données", "—", "1984", "3.14"]
    out: list[str] = []
    size = 0
    while size < nbytes:
        sentence = " ".join(words[i] for i in rng.integers(0, len(words), size=int(rng.integers(4, 30))))
        out.append(sentence + (".\n" if rng.random() < 0.2 else ". "))
        size += len(out[-1].encode())
    return "".join(out)


def load(folder: Path, max_prompt_bytes: int = 0, **scheduler) -> Engine:
    options = EngineOptions(scheduler=SchedulerOptions(**scheduler), max_prompt_bytes=max_prompt_bytes)
    return Engine.load(folder, options, MemoryStore(64 << 20), CacheStats(), "cpu", 2)


@pytest.fixture(scope="module")
def engines(tiny_model):
    """The default prompt limit (derived from the context) and one raised so that a big prompt is
    really tokenized. At most 8 unread tokens, and no patience limit: a stream the test is not
    reading pauses, for as long as the test takes, instead of running to its end."""
    made = {"default": load(tiny_model, max_unread_tokens=8, max_paused_s=86400.0),
            "raised": load(tiny_model, RAISED_PROMPT_BYTES, max_unread_tokens=8, max_paused_s=86400.0)}
    yield made
    for engine in made.values():
        engine.close()


@pytest.fixture(scope="module")
def text(engines) -> str:
    """Four times the default limit: refused by default, tokenized (and beyond the context) when raised."""
    return big_text(4 * engines["default"].limits.prompt_bytes)


class HeldEncodes:
    """Wraps ``TextTokenizer.encode``: an encode of more than ``threshold`` characters says so
    (``entered``, with the thread it runs on) and waits until the test opens ``gate``."""

    def __init__(self, monkeypatch, threshold: int) -> None:
        self.threshold = threshold
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.threads: list[str] = []
        real = TextTokenizer.encode

        def encode(tokenizer, text, max_tokens=None):
            if len(text) > self.threshold:
                self.threads.append(threading.current_thread().name)
                self.entered.set()
                assert self.gate.wait(HUNG_S), "the tokenizer gate never opened"
            return real(tokenizer, text, max_tokens)

        monkeypatch.setattr(TextTokenizer, "encode", encode)


async def read_tokens(call, count: int) -> int:
    """Reads messages of a running Generate call until ``count`` more tokens came; returns how many did."""
    got = 0
    async with asyncio.timeout(HUNG_S):
        while got < count:
            message = await call.read()
            assert message is not grpc.aio.EOF, "the running stream ended"
            got += len(message.token_ids)
    return got


@pytest.mark.parametrize(("limit", "method", "expected"), [
    ("default", "Generate", grpc.StatusCode.INVALID_ARGUMENT),
    ("raised", "Generate", grpc.StatusCode.OUT_OF_RANGE),
    ("default", "Tokenize", grpc.StatusCode.INVALID_ARGUMENT),
    ("raised", "Tokenize", grpc.StatusCode.OK),
])
def test_a_big_call_does_not_stop_a_running_stream(engines, tiny_model, text, monkeypatch, limit, method, expected):
    """A greedy stream runs; the big call arrives. Over the limit: refused, its text never reaching
    the tokenizer. Under a raised limit: its tokenizing is held on a tokenizer thread while the
    running stream makes 16 more tokens (had the tokenizing held the event loop or the scheduler,
    none would come), then let go; the call then gets its answer."""
    engine = engines[limit]
    held = HeldEncodes(monkeypatch, threshold=len(text) // 2)
    answer_threads: list[str] = []
    real_response = servicer_module.tokenize_response

    def tokenize_response(result):
        answer_threads.append(threading.current_thread().name)
        return real_response(result)

    monkeypatch.setattr(servicer_module, "tokenize_response", tokenize_response)

    async def scenario():
        server = grpc.aio.server()
        add_generator_to_server(GeneratorServicer(engine), server)  # as the worker: Tokenize answers bytes
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GeneratorStub(channel)
                running = stub.Generate(pb.GenerateRequest(
                    prompt="The system prompt tells the assistant who it is.", max_new_tokens=900, ignore_eos=True,
                    cache=pb.CacheOptions(skip_read=True, skip_write=True)))
                await read_tokens(running, 1)
                async def big_call():
                    if method == "Generate":
                        return [m async for m in stub.Generate(pb.GenerateRequest(prompt=text, max_new_tokens=16))]
                    return await stub.Tokenize(pb.TokenizeRequest(text=text))

                big = asyncio.ensure_future(big_call())
                if limit == "raised":
                    assert await asyncio.to_thread(held.entered.wait, HUNG_S), "the big text reached no tokenizer"
                    assert await read_tokens(running, 16) >= 16, "the stream went on while the big text was held"
                    assert not big.done()
                    held.gate.set()
                try:
                    answer, status = await big, grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    answer, status = exc.details(), exc.code()
                assert await read_tokens(running, 4) >= 4, "the stream goes on after the call"
                running.cancel()
                return status, answer
        finally:
            held.gate.set()
            await server.stop(None)

    status, answer = asyncio.run(scenario())
    assert status == expected, str(answer)[:300]
    if status == grpc.StatusCode.INVALID_ARGUMENT:
        assert "--max-prompt-bytes" in answer
        assert held.threads == [], "refused before any tokenizing"
    else:
        assert held.threads and all(name.startswith("tokenize") for name in held.threads), held.threads
    if status == grpc.StatusCode.OUT_OF_RANGE:
        assert f"context length of {engine.spec.context_length} tokens" in answer
    if status == grpc.StatusCode.OK:  # the ids the GIL-free path made are the library's plain encode's
        reference = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).encode(text).ids
        assert list(answer.token_ids) == reference
        assert answer_threads and all(name.startswith("tokenize") for name in answer_threads), \
            "the answer is serialized on a tokenizer thread, not on the event loop"


def test_the_tokenizer_lets_other_threads_run_while_it_encodes(tiny_model, text):
    """With the interpreter never taking the GIL from a thread that holds it (a switch interval of
    an hour), a thread waiting on an event the encoding thread sets just before the Rust encode
    can only run before that encode returns if the encode released the GIL."""
    tokenizer = TextTokenizer(tiny_model / "tokenizer.json")
    library = tokenizer._tokenizer
    inside = threading.Event()
    entered = threading.Event()
    result: list[list[int]] = []

    class Probe:
        """The library's tokenizer, flagging the native encode's span."""

        @staticmethod
        def encode_batch_fast(texts):
            inside.set()
            entered.set()
            try:
                return library.encode_batch_fast(texts)
            finally:
                inside.clear()

    tokenizer._tokenizer = Probe()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(3600.0)
    try:
        thread = threading.Thread(target=lambda: result.append(tokenizer.encode(text)), name="encoding")
        thread.start()
        assert entered.wait(HUNG_S)
        ran_during_encode = inside.is_set()
        thread.join(HUNG_S)
    finally:
        sys.setswitchinterval(interval)
    assert ran_during_encode, "this thread ran only after the encode returned: the encode held the GIL"
    assert result and list(result[0]) == library.encode(text).ids


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(tiny_model):
    """A stream decodes; a 600-token prompt arrives with a budget of 32 prompt tokens a step: it is
    prefilled in 19 chunks, and the decoding stream makes a token between every two of them. The
    slot bank is wrapped to record the runs in order; its decode runs wait (the test's gate) until
    the new request is submitted and then until its lookup is done, so the decoding stream is
    still decoding when the prefill starts, whatever the threads' speeds."""
    budget, long_prompt = 32, 600
    engine = load(tiny_model, max_prefill_tokens_per_step=budget, max_unread_tokens=1024)
    runs: list[tuple[str, object, int]] = []
    submitted = threading.Event()
    """Set once the long prompt's request is submitted: until then the decoding stream's decode waits."""
    real_prefill, real_decode = engine.slots.prefill, engine.slots.decode

    def prefill(slot, tokens, *args, **kwargs):
        runs.append(("prefill", slot, len(tokens)))
        return real_prefill(slot, tokens, *args, **kwargs)

    def decode(slots, tokens):
        assert submitted.wait(HUNG_S), "the long prompt was never submitted"
        # Its lookup runs on a read thread: the decoding stream waits for it here.
        wait_until(lambda: not any(s.phase is Phase.FETCHING for s in engine.scheduler.active),
                   timeout_s=HUNG_S, what="the long prompt's lookup")
        runs.append(("decode", list(slots), len(slots)))
        return real_decode(slots, tokens)

    engine.slots.prefill, engine.slots.decode = prefill, decode

    def request(ids, n):
        return GenerationRequest(prompt_token_ids=ids, max_new_tokens=n, ignore_eos=True,
                                 cache=CacheControl(skip_read=True, skip_write=True))

    async def collect(stream):
        return [t async for chunk in stream for t in chunk.token_ids]

    async def scenario():
        decoding = engine.generate(request(list(range(3, 15)), 200))
        first = (await asyncio.wait_for(decoding.__anext__(), HUNG_S)).token_ids
        rest = asyncio.ensure_future(collect(decoding))
        long = asyncio.ensure_future(collect(engine.generate(request(
            np.random.default_rng(3).integers(3, 512, size=long_prompt).tolist(), 4))))
        await asyncio.to_thread(wait_until, lambda: engine.scheduler.stats.admitted == 2, HUNG_S,
                                "the long prompt to be submitted")
        submitted.set()
        return first + await asyncio.wait_for(rest, HUNG_S), await asyncio.wait_for(long, HUNG_S)

    try:
        streamed, long_tokens = asyncio.run(scenario())
    finally:
        submitted.set()
        engine.close()
    assert len(streamed) == 200 and len(long_tokens) == 4
    decoding_slot = runs[0][1]
    chunks = [i for i, (kind, slot, _) in enumerate(runs) if kind == "prefill" and slot is not decoding_slot]
    assert [runs[i][2] for i in chunks] == [budget] * (long_prompt // budget) + [long_prompt % budget]
    for a, b in itertools.pairwise(chunks):
        assert any(kind == "decode" and decoding_slot in slots for kind, slots, _ in runs[a + 1 : b]), \
            f"prefill runs {a} and {b} of the long prompt with no decode step of the running stream between"
