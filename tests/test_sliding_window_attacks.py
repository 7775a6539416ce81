"""Attacks on the sliding-window store (``tiny-window``: layers 0 and 1 see the last 40 positions,
layer 2 all of them; blocks of 16): an attacker who writes anything to Redis, and clients sending
any request. Each answer is compared with a full recompute (greedy, EOS ignored), and what a
worker publishes with what a cold worker would have published."""

import asyncio

import numpy as np
import pytest
from test_sliding_window import TOLERANCE, B, make_engine, prompt, recomputed, run

from cachestore.factory import StoreOptions, open_store
from cachestore.stats import CacheStats
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationRequest
from services.engine.scheduler import SchedulerOptions
from services.runtime.kv_layout import KVLayout


@pytest.fixture(scope="module")
def window_model(model_dirs):
    return model_dirs["tiny-window", KVLayout.SEPARATE]


def pausing_engine(folder, redis_url) -> Engine:
    """An engine whose streams pause after 2 unread tokens: a request nobody reads holds its slot."""
    return Engine.load(folder, EngineOptions(block_size=B, cache_dtype="float32",
                                             scheduler=SchedulerOptions(max_unread_tokens=2)),
                       open_store(redis_url, StoreOptions(), CacheStats()), CacheStats(), "cpu", 2)


async def collect(engine: Engine, request: GenerationRequest):
    ids, last = [], None
    async for chunk in engine.generate(request):
        ids += chunk.token_ids
        last = chunk
    return ids, last


def test_a_row_copied_from_a_skip_write_row_never_publishes_the_windows_that_row_never_filled(window_model,
                                                                                               redis_url):
    """Row A reads 9 cached blocks but writes nothing (``cache.skip_write``): its windowed layers
    hold K/V only from block 6 on. The store loses the blocks (evicted, or deleted by whoever
    writes to Redis); row B, with A's first 9 blocks and more, finds nothing and copies A's 144
    tokens (past A's window floor, so B's own answer is right). B then publishes its prompt's
    blocks from its slot: the windowed layers of blocks 0-5 are whatever A's row held there, not
    this prompt's K/V. A third prompt that shares 5 blocks reads them and answers wrongly."""
    import redis

    client = redis.Redis.from_url(redis_url)
    publisher, engine, reader = (make_engine(window_model, redis_url), pausing_engine(window_model, redis_url),
                                 make_engine(window_model, redis_url))
    long = prompt(9 * B + 6, seed=20)
    second = long[: 9 * B] + prompt(B + 4, seed=21)
    third = long[: 5 * B] + prompt(7, seed=24)

    async def scenario():
        await collect(publisher, GenerationRequest(prompt_token_ids=long, max_new_tokens=1))
        await publisher.wait_for_publishes()
        holder = engine.generate(GenerationRequest(prompt_token_ids=long, max_new_tokens=500, ignore_eos=True,
                                                   cache=CacheControl(skip_write=True)))
        await holder.__anext__()  # A holds its slot, paused
        client.flushall()
        got = await collect(engine, GenerationRequest(prompt_token_ids=second, max_new_tokens=8, ignore_eos=True))
        await engine.wait_for_publishes()
        await holder.aclose()
        return got

    try:
        (second_ids, second_last) = asyncio.run(scenario())
        assert second_last.usage.cached_prompt_tokens == 9 * B  # copied from A
        assert second_ids == recomputed(window_model, second, 8)[0]
        third_ids, third_logits, third_last = run(reader, third, n=16)
        want_ids, want_logits = recomputed(window_model, third, 16)
        assert third_ids == want_ids, f"served {third_ids}, a full recompute gives {want_ids}"
        assert max(np.max(np.abs(a - b)) for a, b in zip(third_logits, want_logits)) <= TOLERANCE
    finally:
        for e in (publisher, engine, reader):
            e.close()
