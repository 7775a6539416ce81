"""``--stream-interval N``: a stream's consumer is woken every N tokens instead of each one (the
first token, the end and a token held ``MAX_HOLD_S`` at once; every token for a request with stop
strings, which the consumer matches), as vLLM's flag of that name. Fewer, larger messages, the same
tokens. Chunk sizes and wake-up counts are what is checked, never how long anything took: the hold
bound is set out of reach, or to zero, where it matters."""

import asyncio

import pytest
from conftest import stream

from cachestore.memory import MemoryStore
from cachestore.stats import CacheStats
from services.api.config import Settings
from services.api.server import load_engine
from services.engine import lifecycle
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import GenerationRequest
from services.engine.scheduler import SchedulerOptions

NEW = 23


def engine_with(folder, interval: int, unread: int = 256) -> Engine:
    return Engine.load(folder, EngineOptions(scheduler=SchedulerOptions(stream_interval=interval,
                                                                        max_unread_tokens=unread)),
                       MemoryStore(64 << 20), CacheStats(), "cpu", 2)


def chunks_of(engine: Engine, prompt: list[int], stop: list[str] | None = None) -> list[list[int]]:
    async def run() -> list[list[int]]:
        request = GenerationRequest(prompt_token_ids=prompt, max_new_tokens=NEW, ignore_eos=True, stop=stop or [])
        return [list(chunk.token_ids) async for chunk in engine.generate(request)]

    return asyncio.run(run())


def counting_wakes(engine: Engine) -> dict[str, int]:
    """Counts the scheduler's ``touch`` calls: each marks a row's consumer to be woken."""
    runs = engine.runner.lifecycle
    counts = {"touch": 0}
    touch = runs.touch

    def counted(seq) -> None:
        counts["touch"] += 1
        touch(seq)

    runs.touch = counted
    return counts


@pytest.fixture
def no_hold_bound(monkeypatch):
    monkeypatch.setattr(lifecycle, "MAX_HOLD_S", 3600.0)


@pytest.mark.parametrize("interval", [4, 7])
def test_tokens_come_in_chunks_of_the_interval_and_are_the_same_tokens(tiny_model, interval, no_hold_bound):
    """Every chunk between the first and the last holds at least ``interval`` tokens (a consumer
    that lags gets more, never fewer); the first token is not held back, and the tokens are those
    of a stream that hands each over."""
    prompt = list(range(5, 30))
    each = engine_with(tiny_model, 1)
    try:
        want, _, _ = stream(each, GenerationRequest(prompt_token_ids=prompt, max_new_tokens=NEW, ignore_eos=True))
    finally:
        each.close()
    engine = engine_with(tiny_model, interval)
    try:
        chunks = chunks_of(engine, prompt)
    finally:
        engine.close()
    assert [t for c in chunks for t in c] == want
    assert all(len(c) >= interval for c in chunks[1:-1]), [len(c) for c in chunks]
    assert len(chunks) <= 2 + (NEW - 1) // interval


def test_an_interval_past_the_unread_limit_still_wakes_the_reader(tiny_model, no_hold_bound):
    """A row pauses once its consumer has ``max_unread_tokens`` unread: it must have been woken by
    then, or nobody would read on (the interval is capped at half that limit)."""
    engine = engine_with(tiny_model, 8, unread=3)
    try:
        chunks = chunks_of(engine, list(range(5, 30)))
    finally:
        engine.close()
    assert sum(map(len, chunks)) == NEW


def test_a_request_with_stop_strings_wakes_its_reader_at_every_token(tiny_model, no_hold_bound):
    """Stop strings are matched by the consumer: tokens held back would be decoded past a stop."""
    engine = engine_with(tiny_model, 7)
    wakes = counting_wakes(engine)
    try:
        chunks = chunks_of(engine, list(range(5, 30)), stop=["never in this text \x00"])
    finally:
        engine.close()
    assert sum(map(len, chunks)) == NEW and wakes["touch"] == NEW


def test_a_token_held_past_the_bound_wakes_the_reader(tiny_model, monkeypatch):
    """However large the interval, a token held ``MAX_HOLD_S`` goes out with the next: at 0 every
    token wakes the reader (a router takes a long-silent stream for a frozen worker's)."""
    monkeypatch.setattr(lifecycle, "MAX_HOLD_S", 0.0)
    engine = engine_with(tiny_model, 7)
    wakes = counting_wakes(engine)
    try:
        chunks = chunks_of(engine, list(range(5, 30)))
    finally:
        engine.close()
    assert sum(map(len, chunks)) == NEW and wakes["touch"] == NEW


def test_the_setting_reaches_the_engine(tiny_model):
    engine = load_engine(Settings(model=tiny_model, stream_interval=5, device="cpu"))
    try:
        assert engine.scheduler.options.stream_interval == 5
        assert engine.inputs.stream_interval == 5
    finally:
        engine.close()
