"""Attacks on the sliding-window store (``tiny-window``: layers 0 and 1 see the last 40 positions,
layer 2 all of them; blocks of 16): an attacker who writes anything to Redis, and clients sending
any request. Each answer is compared with a full recompute (greedy, EOS ignored) or, for samples
and beams, with the same request computed cold; what a worker published is judged by the answers
of the prompts that read it."""

import asyncio

import numpy as np
import pytest
import redis
from conftest import store_options
from test_batching import make_engine as batching_engine
from test_sliding_window import TOLERANCE, B, make_engine, prompt, recomputed, run

from cachestore.codec import Expected, ValueKind, decode, encode
from cachestore.factory import open_store
from cachestore.keys import block_key, lease_key, window_block_key
from cachestore.stats import CacheStats
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import BeamSearch, CacheControl, GenerationRequest
from services.engine.run_waits import LeaseOptions
from services.engine.sampling import SamplingConfig
from services.engine.scheduler import SchedulerOptions
from services.runtime.kv_layout import KVLayout


@pytest.fixture(scope="module")
def window_model(model_dirs):
    return model_dirs["tiny-window", KVLayout.SEPARATE]


def pausing_engine(folder, redis_url) -> Engine:
    """An engine whose streams pause after 2 unread tokens: a request nobody reads holds its slot."""
    return Engine.load(folder, EngineOptions(block_size=B, cache_dtype="float32",
                                             scheduler=SchedulerOptions(max_unread_tokens=2)),
                       open_store(redis_url, store_options(), CacheStats()), CacheStats(), "cpu", 2)


async def collect(engine: Engine, request: GenerationRequest):
    ids, last = [], None
    async for chunk in engine.generate(request):
        ids += chunk.token_ids
        last = chunk
    return ids, last


@pytest.fixture()
def replicas(window_model, redis_url):
    engines = [make_engine(window_model, redis_url) for _ in range(2)]
    yield engines
    for e in engines:
        e.close()


def assert_recomputed(folder, ids, got_ids, got_logits):
    want_ids, want_logits = recomputed(folder, ids, len(got_ids))
    assert got_ids == want_ids
    assert max(np.max(np.abs(a - b)) for a, b in zip(got_logits, want_logits)) <= TOLERANCE


def test_a_row_copied_from_a_skip_write_row_never_publishes_the_windows_that_row_never_filled(window_model,
                                                                                               redis_url):
    """Row A reads 9 cached blocks but writes nothing (``cache.skip_write``): its windowed layers
    hold K/V only from block 6 on. The store loses the blocks (evicted, or deleted by whoever
    writes to Redis); row B, with A's first 9 blocks and more, finds nothing and copies A's 144
    tokens (past A's window floor, so B's own answer is right). B then publishes its prompt's
    blocks from its slot: the windowed layers of blocks 0-5 are whatever A's row held there, not
    this prompt's K/V, and a third prompt sharing 5 blocks read them and answered wrongly (from its
    15th token on; its logits were off by up to 2). B now publishes none of what it copied."""
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
        third_ids, third_logits, _ = run(reader, third, n=16)
        assert_recomputed(window_model, third, third_ids, third_logits)
    finally:
        for e in (publisher, engine, reader):
            e.close()



def test_prompts_ending_around_block_and_window_boundaries_answer_as_a_full_recompute(replicas, window_model):
    """One replica publishes a long prompt; the other answers each of its prefixes that end just
    before, at and after a block's end (16k) and the window's (40), decoding across the window."""
    cold, warm = replicas
    long = prompt(12 * B, seed=30)
    run(cold, long, n=1)
    for n in (17, 32, 33, 39, 40, 41, 47, 48, 49, 55, 56, 57, 64, 80, 81):
        got_ids, got_logits, last = run(warm, long[:n], n=6)
        assert last.usage.cached_prompt_tokens == min(n // B * B, n - 1), n
        assert_recomputed(window_model, long[:n], got_ids, got_logits)


def expected_run(prompt_tokens: int, lost_full: set[int], lost_windows: set[int], window: int = 40) -> int:
    """Cached prompt tokens of a prompt whose blocks' values in ``lost_*`` are gone: the run of full
    values, shortened until every windowed value a continuation after it reads is there."""
    n = next((i for i in range(prompt_tokens // B) if i in lost_full), prompt_tokens // B)
    while n:
        c = min(n * B, prompt_tokens - 1)
        absent = [i for i in range(max(0, (c - window + 1) // B), -(-c // B)) if i in lost_windows]
        if not absent:
            return c
        n = max(absent)
    return 0


def test_any_values_lost_shorten_the_run_to_the_longest_one_whose_last_window_is_there(replicas, window_model,
                                                                                      redis_url):
    """Seeded patterns of deleted values (either group, any block) under prompts of any length:
    the run found is the longest whose full values are all there and whose last window's values
    are, and the answer is the recompute's."""
    cold, warm = replicas
    client = redis.Redis.from_url(redis_url)
    long = prompt(10 * B + 3, seed=31)
    rng = np.random.default_rng(31)
    for _ in range(10):
        client.flushall()
        run(cold, long, n=1)
        hashes = cold.prefix.hashes(cold.namespace(""), long)
        lost_windows = {i for i in range(len(hashes)) if rng.random() < 0.3}
        lost_full = {i for i in range(len(hashes)) if rng.random() < 0.08}
        lost = [window_block_key(hashes[i]) for i in lost_windows] + [block_key(hashes[i]) for i in lost_full]
        if lost:
            client.delete(*lost)
        n = int(rng.integers(2, len(long) + 1))
        got_ids, got_logits, last = run(warm, long[:n], n=4)
        assert last.usage.cached_prompt_tokens == expected_run(n, lost_full, lost_windows), (n, lost_full, lost_windows)
        assert_recomputed(window_model, long[:n], got_ids, got_logits)


def forgeries(client, engine, ids, hashes, block):
    """Values an attacker may put under block ``block``'s window key, and the reason each is refused."""
    g = engine.prefix.geometry
    shape = g.block_shape(B, g.windowed)
    genuine = client.get(window_block_key(hashes[block]))
    tensor = np.array(decode(genuine, Expected(ValueKind.WINDOW_BLOCK, hashes[block], g.dtype, shape)))
    salted = engine.prefix.hashes(engine.namespace("another-salt"), ids)
    header = genuine[: len(genuine) - tensor.nbytes]
    nan = tensor.copy()
    nan[1, 0, 0, 3, 2] = np.nan
    return {
        "another salt's value of the same block": (client.get(window_block_key(salted[block])), "owner"),
        "the previous block's value": (client.get(window_block_key(hashes[block - 1])), "owner"),
        "a full-group value of the window's shape": (encode(ValueKind.PREFIX_BLOCK, hashes[block], tensor), "format"),
        "the block's own full-group value": (client.get(block_key(hashes[block])), "format"),
        "a float16 copy": (encode(ValueKind.WINDOW_BLOCK, hashes[block], tensor.astype(np.float16)), "format"),
        "cut short": (genuine[:-4], "format"),
        "its windowed layers swapped": (header + np.ascontiguousarray(tensor[::-1]).tobytes(), "checksum"),
        "NaN inside, checksum redone": (encode(ValueKind.WINDOW_BLOCK, hashes[block], nan), "non_finite"),
    }


FORGERIES = ["another salt's value of the same block", "the previous block's value",
             "a full-group value of the window's shape", "the block's own full-group value", "a float16 copy",
             "cut short", "its windowed layers swapped", "NaN inside, checksum redone"]


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_window_value_ends_the_run_before_its_block(replicas, window_model, redis_url, forgery):
    """Each value is refused for what it is, deleted, and the run ends before its block (block 7
    of a 9-block prompt: the run is 7 blocks); the answer is the recompute's and the publish that
    follows puts the genuine value back."""
    cold, warm = replicas
    client = redis.Redis.from_url(redis_url)
    # A prompt of each forgery's own: the session's Redis still holds what the other forgeries' runs
    # published and deleted, in whatever order they ran.
    ids = prompt(9 * B + 6, seed=40 + FORGERIES.index(forgery))
    run(cold, ids, n=1)
    stream_salted = GenerationRequest(prompt_token_ids=ids, max_new_tokens=1, cache=CacheControl(salt="another-salt"))
    asyncio.run(collect(cold, stream_salted))
    asyncio.run(cold.wait_for_publishes())
    hashes = cold.prefix.hashes(cold.namespace(""), ids)
    value, reason = forgeries(client, cold, ids, hashes, 7)[forgery]
    genuine = client.get(window_block_key(hashes[7]))
    client.set(window_block_key(hashes[7]), value)
    got_ids, got_logits, last = run(warm, ids, n=6)
    assert warm.cache_stats.rejected_values == {reason: 1} and warm.cache_stats.window_misses == 1
    assert last.usage.cached_prompt_tokens == 7 * B
    assert_recomputed(window_model, ids, got_ids, got_logits)
    assert client.get(window_block_key(hashes[7])) == genuine


async def outputs(engine: Engine, request: GenerationRequest) -> tuple[dict, set[int]]:
    """Each sample's or hypothesis' tokens (and the prompt log-probabilities) by index, and the
    cached prompt tokens the rows reported."""
    out, cached = {}, set()
    async for chunk in engine.generate(request):
        out.setdefault(chunk.index, []).extend(chunk.token_ids)
        out.setdefault("prompt", []).extend((t.token_id, round(t.logprob, 4)) for t in chunk.prompt_logprobs)
        if chunk.usage is not None:
            cached.add(chunk.usage.cached_prompt_tokens)
    await engine.wait_for_publishes()
    return out, cached


@pytest.mark.parametrize("kind", ["samples", "beams", "prompt_logprobs"])
def test_samples_beams_and_prompt_log_probabilities_over_a_windowed_cached_prefix_answer_as_cold(
        replicas, redis_url, kind):
    """n samples fork the fetched row (windowed layers filled over the last window only), beams
    reorder rows over it, and prompt log-probabilities read nothing: each, on prompts ending at a
    block's end, the window's, or past both, answers as the same request computed cold, decoding
    30 tokens across the window."""
    cold, warm = replicas
    client = redis.Redis.from_url(redis_url)
    long = prompt(10 * B, seed=33)
    make = {
        "samples": lambda ids: GenerationRequest(prompt_token_ids=ids, max_new_tokens=30, ignore_eos=True, n=3,
                                                 sampling=SamplingConfig(temperature=1.0, seed=5)),
        "beams": lambda ids: GenerationRequest(prompt_token_ids=ids, max_new_tokens=30, ignore_eos=True, n=2,
                                               beams=BeamSearch(num_beams=3)),
        "prompt_logprobs": lambda ids: GenerationRequest(prompt_token_ids=ids, max_new_tokens=4, ignore_eos=True,
                                                         prompt_logprobs=True),
    }[kind]
    for n in (41, 64, 145):
        ids = long[:n]
        client.flushall()
        want, _ = asyncio.run(outputs(cold, make(ids)))
        got, cached = asyncio.run(outputs(warm, make(ids)))
        assert got == want, n
        assert cached == ({0} if kind == "prompt_logprobs" else {min(n // B * B, n - 1)})


def test_blocks_taken_on_a_trail_fill_the_windows_they_bring_and_no_row_copies_the_rest(window_model, redis_url):
    """A worker that gave up waiting on a holder (block 0 never comes) computes its first chunk
    and then takes the holder's later blocks: their full layers all, their windowed layers over
    the last window only (blocks 22-24 of 25), so positions 32-351 of its windowed layers are
    never filled. Its answer is the recompute's; a later prompt sharing its first 23 blocks,
    finding nothing in the store, computes them rather than copy those positions."""
    client = redis.Redis.from_url(redis_url)
    engine = batching_engine(window_model, open_store(redis_url, store_options(), CacheStats()), cache_dtype="float32",
                             max_prefill_tokens_per_step=32, max_unread_tokens=2,
                             # A look for the holder's blocks is given up after 4 x poll_ms: at the
                             # default 10 ms a loaded machine gave it up, computed a second chunk
                             # and adopted a block less (CI); a second is no machine's pace.
                             leases=LeaseOptions(wait_factor=1, first_ms_per_token=1, poll_ms=1000))
    ids = prompt(24 * B + 8, seed=34)
    other = ids[: 23 * B] + prompt(5, seed=35)
    try:
        run(engine, ids, n=1)
        hashes = engine.prefix.hashes(engine.namespace(""), ids)
        client.delete(block_key(hashes[0]))
        client.set(lease_key(hashes[0]), b"a-worker-not-there-yet", px=60_000)

        async def scenario():
            trailing = engine.generate(GenerationRequest(prompt_token_ids=ids, max_new_tokens=300, ignore_eos=True,
                                                         return_logits=True))
            first = await trailing.__anext__()  # its prompt done; paused (nobody reads), its slot held
            await engine.wait_for_publishes()
            client.flushall()
            second = await collect(engine, GenerationRequest(prompt_token_ids=other, max_new_tokens=8,
                                                             ignore_eos=True))
            await trailing.aclose()
            return first, second

        first, (other_ids, other_last) = asyncio.run(scenario())
        assert engine.scheduler.stats.adopted_tokens == 24 * B - 32
        assert_recomputed(window_model, ids, first.token_ids, first.logits)
        assert other_last.usage.cached_prompt_tokens == 0
        assert other_ids == recomputed(window_model, other, 8)[0]
    finally:
        engine.close()
