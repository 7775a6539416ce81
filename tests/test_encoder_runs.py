"""An encoder run never stops the streams already decoding: on a cross K/V miss the encoder runs
on the KV connector's encoder thread, one run at a time, and the row is planned once its cross K/V
is there. Each case is proved by the order of events (a gate the test holds inside a real
EncoderSession's run), never by how long anything took; real ONNX Runtime sessions, a real
redis-server.

- a stream decoding makes tokens while another request's encoder run is held, and the held
  request's tokens equal a cold run's once it is let go;
- a request cancelled while its encoder run is held frees its slot at once; the next request
  takes that slot, and the held run, once let go, writes into nobody's;
- an encoder that fails fails that request alone, with the error (and so the status) it raised;
- runs never overlap and go in the order they were asked for;
- NaN logits over a cached cross K/V drop it, and the encoder runs again off the scheduler thread;
- requests for the same encoder input while its run is held share that run, published once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from conftest import collect, wait_until

from cachestore.factory import StoreOptions, open_store
from cachestore.keys import cross_key
from cachestore.stats import CacheStats
from services.api.servicer import status_for
from services.engine.encoder_input import EncoderRequest
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationChunk, GenerationRequest
from services.engine.scheduler import SchedulerOptions
from services.engine.sequence import Phase, Sequence

B = 16
HUNG_S = 60.0
"""How long a wait that only a hung test outlasts may take: no case here waits for a duration."""
UNREAD = 8
"""Tokens a stream makes ahead of its reader before it pauses: a stream the test is not reading
waits, however fast the machine, instead of running to its end."""
SHARED_INPUT = list(range(10, 70))
"""The encoder input of the streams already decoding (encoded before the held runs)."""
HELD_INPUT = list(range(11, 71))
"""The encoder input whose run the test holds."""
THIRD_INPUT = list(range(12, 72))
DECODER_IDS = list(range(100, 120))


def load(folder, url, **scheduler) -> Engine:
    options = EngineOptions(block_size=B, scheduler=SchedulerOptions(
        max_unread_tokens=UNREAD, max_paused_s=86400.0, **scheduler))
    return Engine.load(folder, options, open_store(url, StoreOptions(), CacheStats()), CacheStats(), "cpu", 2)


def request(encoder_ids: list[int], n: int, decoder_ids: list[int] = DECODER_IDS, **cache) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=decoder_ids, max_new_tokens=n, ignore_eos=True,
                             encoder=EncoderRequest(token_ids=encoder_ids), cache=CacheControl(**cache))


def cold(engine: Engine, encoder_ids: list[int], n: int, decoder_ids: list[int] = DECODER_IDS) -> list[int]:
    """The tokens of a run that reads and writes nothing: the encoder runs, nothing is shared."""
    return collect(engine, request(encoder_ids, n, decoder_ids, skip_read=True, skip_write=True))[0]


class HeldEncoder:
    """Wraps a real EncoderSession's ``run`` (an instance attribute): every run notes its input's
    first id and its thread and counts how many run at once; a run on ``held`` says so
    (``entered``, with ``watch``'s generated tokens at that moment) and waits until the test
    opens ``gate``; a run on ``failing`` raises ``error``."""

    def __init__(self, engine: Engine, held: list[int], failing: list[int] | None = None) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()
        self.watch: Sequence | None = None
        self.generated_at_entry = 0
        self.inputs: list[int] = []
        self.threads: list[str] = []
        self.error = RuntimeError("the encoder broke")
        self._lock = threading.Lock()
        self._inside = 0
        self.most_at_once = 0
        real = engine.encoder.run

        def run(array: np.ndarray) -> np.ndarray:
            with self._lock:
                self._inside += 1
                self.most_at_once = max(self.most_at_once, self._inside)
                self.inputs.append(int(array[0, 0]))
                self.threads.append(threading.current_thread().name)
            try:
                if np.array_equal(array[0], held):
                    self.generated_at_entry = self.watch.generated if self.watch is not None else 0
                    self.entered.set()
                    assert self.gate.wait(HUNG_S), "the encoder gate never opened"
                if failing is not None and np.array_equal(array[0], failing):
                    raise self.error
                return real(array)
            finally:
                with self._lock:
                    self._inside -= 1

        engine.encoder.run = run


async def next_chunk(stream: AsyncIterator[GenerationChunk]) -> GenerationChunk:
    async with asyncio.timeout(HUNG_S):
        return await anext(stream)


async def rest(stream: AsyncIterator[GenerationChunk]) -> tuple[list[int], GenerationChunk]:
    """The stream's remaining tokens and its last chunk."""
    tokens, last = [], None
    async with asyncio.timeout(HUNG_S):
        async for chunk in stream:
            tokens += chunk.token_ids
            last = chunk
    return tokens, last


async def entered(held: HeldEncoder) -> None:
    assert await asyncio.to_thread(held.entered.wait, HUNG_S), "the held encoder input was never encoded"


async def until(predicate, what: str) -> None:
    await asyncio.to_thread(wait_until, predicate, HUNG_S, what)


def the_row(engine: Engine, phase: Phase) -> Sequence:
    [row] = [s for s in engine.scheduler.active if s.phase is phase]
    return row


@pytest.fixture()
def engine(encdec_model, redis_url):
    made = load(encdec_model, redis_url, max_batch=2)
    yield made
    made.close()


def test_a_stream_decodes_while_another_requests_encoder_runs(engine):
    """A stream decodes; a request with a new encoder input arrives and its encoder run is held.
    The stream makes 16 tokens after that run began (counted by the stream's own counter, so
    none of them was made before): had the run held the scheduler thread, none would come. Let
    go, the held request's tokens are a cold run's, and its run is counted."""
    held = HeldEncoder(engine, HELD_INPUT)

    async def scenario():
        running = engine.generate(request(SHARED_INPUT, 400))
        await next_chunk(running)
        held.watch = the_row(engine, Phase.DECODING)
        arriving = asyncio.ensure_future(rest(engine.generate(request(HELD_INPUT, 12))))
        try:
            await entered(held)
            while held.watch.generated < held.generated_at_entry + 16:
                await next_chunk(running)  # reading keeps the stream from pausing
            assert not arriving.done(), "the held request waits for its encoder"
        finally:
            held.gate.set()
        tokens, last = await arriving
        await running.aclose()
        return tokens, last

    tokens, last = asyncio.run(scenario())
    assert not last.usage.encoder_cache_hit
    assert held.inputs == [SHARED_INPUT[0], HELD_INPUT[0]] and engine.encoder.runs == 2, "each run counted once"
    assert all(name.startswith("kv-encoder") for name in held.threads), held.threads
    assert tokens == cold(engine, HELD_INPUT, 12)


def test_a_request_cancelled_while_its_encoder_runs_frees_its_slot(engine):
    """Two slots: one stream decodes, a request with a new encoder input holds the other while its
    encoder run is held. Cancelled, its slot is free at once, and a third request (its cross K/V
    a store hit: no encoder run to queue behind the held one) takes it and decodes while the run
    is still held. Let go, the run ends without writing anywhere: the third request's tokens and
    the first stream's are cold runs', and the worker serves on with both slots."""
    warm_tokens = collect(engine, request(SHARED_INPUT, 1))[0]  # publishes the shared cross K/V
    assert len(warm_tokens) == 1 and engine.encoder.runs == 1
    held = HeldEncoder(engine, HELD_INPUT)
    third_ids = list(range(130, 150))

    async def scenario():
        running = engine.generate(request(SHARED_INPUT, 60))
        first = (await next_chunk(running)).token_ids
        cancelled = asyncio.ensure_future(rest(engine.generate(request(HELD_INPUT, 12))))
        try:
            await entered(held)
            row = the_row(engine, Phase.FETCHING)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            await until(lambda: row.done and engine.slots.free == 1, "the cancelled request's slot to be freed")
            third = engine.generate(request(SHARED_INPUT, 40, third_ids))
            third_first = await next_chunk(third)
            assert not held.gate.is_set() and third_first.token_ids, "the third request decodes in the freed slot"
        finally:
            held.gate.set()
        await until(lambda: engine.encoder.runs == 2, "the held run to end")
        third_rest, third_last = await rest(third)
        running_rest, _ = await rest(running)
        return first + running_rest, third_first.token_ids + third_rest, third_last

    running_tokens, third_tokens, third_last = asyncio.run(scenario())
    assert third_last.usage.encoder_cache_hit
    assert held.inputs == [HELD_INPUT[0]], "the cancelled request's run, and no other"
    wait_until(lambda: engine.scheduler.running == 0 and engine.slots.free == 2, what="every slot to be free")
    assert engine.scheduler.stats.aborted == 1
    assert third_tokens == cold(engine, SHARED_INPUT, 40, third_ids)
    assert running_tokens == cold(engine, SHARED_INPUT, 60)
    assert collect(engine, request(HELD_INPUT, 12))[0] == cold(engine, HELD_INPUT, 12)


def test_an_encoder_that_fails_fails_that_request_alone(engine):
    """A stream decodes; another request's encoder run raises. That request ends with the very
    error the encoder raised (INTERNAL over gRPC, as when the encoder ran on the scheduler
    thread), the stream goes on to its end, and the worker serves the next request."""
    held = HeldEncoder(engine, HELD_INPUT, failing=HELD_INPUT)

    async def scenario():
        running = engine.generate(request(SHARED_INPUT, 40))
        first = (await next_chunk(running)).token_ids
        failing = asyncio.ensure_future(rest(engine.generate(request(HELD_INPUT, 12))))
        held.gate.set()
        with pytest.raises(RuntimeError) as info:
            await failing
        running_rest, _ = await rest(running)
        return info.value, first + running_rest

    error, running_tokens = asyncio.run(scenario())
    assert error is held.error and status_for(error) is grpc.StatusCode.INTERNAL
    assert engine.scheduler.stats.failed == 1
    assert running_tokens == cold(engine, SHARED_INPUT, 40)
    assert collect(engine, request(THIRD_INPUT, 12))[0] == cold(engine, THIRD_INPUT, 12)
    wait_until(lambda: engine.slots.free == 2, what="every slot to be free")


def test_encoder_runs_go_one_at_a_time_in_arrival_order(engine):
    """Two requests with new encoder inputs: while the first one's run is held, the second's is
    queued, not running; let go, they ran in arrival order, never both at once, and each
    request's tokens are a cold run's."""
    held = HeldEncoder(engine, HELD_INPUT)

    async def scenario():
        first = asyncio.ensure_future(rest(engine.generate(request(HELD_INPUT, 12))))
        try:
            await entered(held)
            second = asyncio.ensure_future(rest(engine.generate(request(THIRD_INPUT, 12))))
            await until(lambda: len(engine.scheduler.active) == 2
                        and engine.scheduler.active[1].kv.encoding is not None, "the second request's run to be queued")
            assert not engine.scheduler.active[1].kv.encoding.running(), "it waits for the held run"
        finally:
            held.gate.set()
        return (await first)[0], (await second)[0]

    first_tokens, second_tokens = asyncio.run(scenario())
    assert held.inputs == [HELD_INPUT[0], THIRD_INPUT[0]] and held.most_at_once == 1
    assert first_tokens == cold(engine, HELD_INPUT, 12)
    assert second_tokens == cold(engine, THIRD_INPUT, 12)


def test_nan_logits_over_cached_cross_kv_encode_again_off_the_scheduler_thread(encdec_model, redis_url,
                                                                                redis_server):
    """Replica A publishes an encoder input's cross K/V and the decoder prompt's block; replica B
    reads both and its first logits are NaN (made by the runtime here: the test cannot forge a
    value that passes the codec and yields NaN). B drops both, deletes them from the store,
    encodes the input again on its encoder thread, and computes the prompt: a cold run's tokens."""
    a, b = load(encdec_model, redis_url), load(encdec_model, redis_url)
    try:
        expected = cold(a, SHARED_INPUT, 12)
        collect(a, request(SHARED_INPUT, 12))
        held = HeldEncoder(b, HELD_INPUT)
        real_prefill, poisoned = b.slots.prefill, []

        def prefill(slot, tokens, all_positions=False):
            logits = real_prefill(slot, tokens, all_positions)
            if not poisoned:
                poisoned.append(len(tokens))
                logits = np.full_like(logits, np.nan)
            return logits

        b.slots.prefill = prefill
        tokens, last = collect(b, request(SHARED_INPUT, 12))
        assert poisoned == [len(DECODER_IDS) - B]
        assert tokens == expected
        assert not last.usage.encoder_cache_hit and last.usage.cached_prompt_tokens == 0
        assert b.cache_stats.rejected_values == {"bad_output": 1}
        assert held.inputs == [SHARED_INPUT[0]] and held.threads[0].startswith("kv-encoder")
        with redis_server.client() as client:
            assert client.get(cross_key(b.encoder_input_hash("", np.asarray([SHARED_INPUT], np.int64)))) is None
    finally:
        a.close()
        b.close()


def test_requests_for_the_same_encoder_input_share_one_run_and_one_publish(engine):
    """Two requests (other decoder prompts) for the same new encoder input, the second arriving
    while the first's run is held: one run serves both, its cross K/V is published once, and each
    gets a cold run's tokens."""
    held = HeldEncoder(engine, HELD_INPUT)
    other_ids = list(range(130, 150))

    async def scenario():
        first = asyncio.ensure_future(rest(engine.generate(request(HELD_INPUT, 8))))
        try:
            await entered(held)
            second = asyncio.ensure_future(rest(engine.generate(request(HELD_INPUT, 8, other_ids))))
            await until(lambda: sum(s.kv.encoding is not None for s in engine.scheduler.active) == 2,
                        "the second request to join the held run")
        finally:
            held.gate.set()
        return await first, await second

    sent_before = engine.cache_stats.snapshot()["bytes_sent"]
    (first, first_last), (second, second_last) = asyncio.run(scenario())
    assert held.inputs == [HELD_INPUT[0]] and engine.encoder.runs == 1, "one run for both"
    assert not first_last.usage.encoder_cache_hit and not second_last.usage.encoder_cache_hit
    asyncio.run(engine.wait_for_publishes())
    value = len(engine.store.get(cross_key(engine.encoder_input_hash("", np.asarray([HELD_INPUT], np.int64)))))
    assert engine.cache_stats.snapshot()["bytes_sent"] - sent_before < 2 * value, "published once"
    assert first == cold(engine, HELD_INPUT, 8) and second == cold(engine, HELD_INPUT, 8, other_ids)
