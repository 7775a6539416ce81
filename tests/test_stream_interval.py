"""``--stream-interval N``: a stream's consumer is woken every N tokens instead of each one (the
first token and the end at once), as vLLM's flag of that name. Fewer, larger messages, the same
tokens. Chunk sizes are what is checked, never how long anything took."""

import asyncio

import pytest
from conftest import stream

from cachestore.memory import MemoryStore
from cachestore.stats import CacheStats
from services.api.config import Settings
from services.api.server import load_engine
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import GenerationRequest
from services.engine.scheduler import SchedulerOptions

NEW = 23


def engine_with(folder, interval: int, unread: int = 256) -> Engine:
    return Engine.load(folder, EngineOptions(scheduler=SchedulerOptions(stream_interval=interval,
                                                                        max_unread_tokens=unread)),
                       MemoryStore(64 << 20), CacheStats(), "cpu", 2)


def chunks_of(engine: Engine, prompt: list[int]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        request = GenerationRequest(prompt_token_ids=prompt, max_new_tokens=NEW, ignore_eos=True)
        return [list(chunk.token_ids) async for chunk in engine.generate(request)]

    return asyncio.run(run())


@pytest.mark.parametrize("interval", [4, 7])
def test_tokens_come_in_chunks_of_the_interval_and_are_the_same_tokens(tiny_model, interval):
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


def test_an_interval_past_the_unread_limit_still_wakes_the_reader(tiny_model):
    """A row pauses once its consumer has ``max_unread_tokens`` unread: it must have been woken by
    then, or nobody would read on (the interval is capped at that limit)."""
    engine = engine_with(tiny_model, 8, unread=3)
    try:
        chunks = chunks_of(engine, list(range(5, 30)))
    finally:
        engine.close()
    assert sum(map(len, chunks)) == NEW


def test_the_setting_reaches_the_engine(tiny_model):
    engine = load_engine(Settings(model=tiny_model, stream_interval=5, device="cpu"))
    try:
        assert engine.scheduler.options.stream_interval == 5
        assert engine.inputs.stream_interval == 5
    finally:
        engine.close()
