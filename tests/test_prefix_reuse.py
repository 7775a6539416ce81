"""Suffix-only prefill from cached prefix blocks, in-process engines over a real redis-server."""

import asyncio
import threading

import numpy as np
import pytest
from conftest import GENAI_FIXTURES, collect, record_margin, wait_until

from cachestore.codec import Expected, ValueKind, decode, dtype_of, encode
from cachestore.factory import StoreOptions, open_store
from cachestore.keys import block_key
from cachestore.memory import MemoryStore
from cachestore.prefix import KVGeometry, PrefixStore
from cachestore.stats import CacheStats
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import (
    BeamSearch,
    CacheControl,
    FinishReason,
    GenerationRequest,
)
from services.local.redis_process import stored_values
from services.runtime.kv_layout import KVLayout
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import DecoderSession

B = 16
TOLERANCE = 1e-4


def make_engine(folder, store, block_size=B) -> Engine:
    return Engine.load(folder, EngineOptions(block_size=block_size), store, CacheStats(), "cpu", 2)


def generate(engine: Engine, ids, n=12, **cache):
    return collect(engine, GenerationRequest(prompt_token_ids=list(ids), max_new_tokens=n, ignore_eos=True,
                                             cache=CacheControl(**cache)))


def prompt(n, seed=0, vocab=512):
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


@pytest.fixture()
def replicas(tiny_model, redis_url):
    """Two engines (as two replicas would be) sharing one Redis through separate clients."""
    engines = [make_engine(tiny_model, open_store(redis_url, StoreOptions(), CacheStats())) for _ in range(2)]
    yield engines
    for e in engines:
        e.close()


FOLDERS = [("tiny", KVLayout.SEPARATE), ("tiny", KVLayout.COMBINED), ("small", KVLayout.SEPARATE),
           ("small", KVLayout.COMBINED), ("genai-builder", "llama-fp32"), ("genai-builder", "llama-int4")]


@pytest.mark.parametrize("preset, layout", FOLDERS)
def test_cached_prefix_prefill_matches_cold_prefill(model_dirs, redis_url, preset, layout):
    folder = GENAI_FIXTURES / layout if preset == "genai-builder" else model_dirs[preset, layout]
    spec = load_model_spec(folder)
    session = DecoderSession(spec, "cpu", 2)
    engine = make_engine(folder, open_store(redis_url, StoreOptions(), CacheStats()), block_size=B)
    ids = prompt(5 * B + 7, vocab=spec.vocab_size)[: min(5 * B + 7, spec.context_length - 1)]
    ns = engine.namespace("")
    prefix = PrefixStore(engine.store, KVGeometry(spec.num_layers, spec.num_kv_heads, spec.head_size, session.kv_dtype), CacheStats())
    cold_logits, cold_cache = session.run(ids, session.empty_cache(len(ids)))
    hashes = prefix.hashes(ns, ids)
    prefix.publish(hashes, session.to_canonical(cold_cache, len(hashes) * B), 0, B)
    lookup = prefix.lookup(ns, ids)
    assert lookup.hit_blocks == 5
    warm_logits, warm_cache = session.run(ids[5 * B:], session.cache_from_blocks(lookup.blocks, 5 * B, len(ids)))
    record_margin(f"cached vs cold prefill ({preset}, {layout})", cold_logits)
    assert np.max(np.abs(warm_logits - cold_logits)) <= TOLERANCE
    assert int(np.argmax(warm_logits)) == int(np.argmax(cold_logits))
    assert np.max(np.abs(session.to_canonical(warm_cache, len(ids)) - session.to_canonical(cold_cache, len(ids)))) <= TOLERANCE
    engine.close()


@pytest.mark.parametrize("length", [B - 1, B, B + 1, 3 * B - 1, 3 * B, 3 * B + 1])
def test_prompt_lengths_around_block_multiples(replicas, length):
    a, b = replicas
    ids = prompt(length, seed=length)
    cold, _ = generate(b, ids, skip_read=True, skip_write=True)
    first, last_a = generate(a, ids)
    assert last_a.usage.cached_prompt_tokens == 0
    second, last_b = generate(b, ids)
    full_blocks = length // B
    # Fully cached prompts still run their last token (docs/design.md, invariant 3).
    assert last_b.usage.cached_prompt_tokens == min(full_blocks * B, length - 1)
    assert first == second == cold


def test_longer_prompt_reuses_a_shorter_prompts_blocks(replicas):
    a, b = replicas
    system = prompt(4 * B + 5, seed=1)
    generate(a, system + prompt(9, seed=2))
    answer, last = generate(b, system + prompt(11, seed=3))
    assert last.usage.cached_prompt_tokens == 4 * B
    assert answer == generate(b, system + prompt(11, seed=3), skip_read=True)[0]


def _corrupt(client, key, how, owner=b""):
    value = client.get(key)
    if how == "nan":
        # A well-formed value under the right owner, checksum and all: only its numbers are bad.
        tensor = decode(value, Expected(ValueKind.PREFIX_BLOCK, owner, dtype_of(value))).copy()
        tensor[0, 0, 0, 0, :] = np.nan
        client.set(key, encode(ValueKind.PREFIX_BLOCK, owner, tensor))
    elif how == "flip":
        damaged = bytearray(value)
        damaged[len(damaged) // 2] ^= 0x01
        client.set(key, bytes(damaged))
    elif how == "truncate":
        client.set(key, value[: len(value) - 100])
    elif how == "delete":
        client.delete(key)


@pytest.mark.parametrize(("how", "reason"), [("delete", None), ("flip", "checksum"), ("truncate", "format"),
                                             ("foreign", "owner"), ("nan", "non_finite")])
def test_gap_or_bad_block_in_the_middle_stops_reuse_there(replicas, redis_server, how, reason):
    a, b = replicas
    ids = prompt(6 * B + 3, seed=9)
    cold, _ = generate(b, ids, skip_read=True, skip_write=True)
    generate(a, ids)
    hashes = a.prefix.hashes(a.namespace(""), ids)
    keys = [block_key(h) for h in hashes]
    with redis_server.client() as client:
        if how == "foreign":
            # A well-formed value from another namespace (salt) copied under this namespace's key.
            generate(a, ids, salt="other-tenant")
            foreign = client.get(block_key(a.prefix.hashes(a.namespace("other-tenant"), ids)[3]))
            client.set(keys[3], foreign)
        else:
            _corrupt(client, keys[3], how, hashes[3])
        answer, last = generate(b, ids, skip_write=True)
        assert last.usage.cached_prompt_tokens == 3 * B
        assert answer == cold
        assert b.cache_stats.rejected_values == ({reason: 1} if reason else {})
        if reason:
            assert client.get(keys[3]) is None, "a bad value is deleted"


def test_salts_never_share_blocks(replicas):
    a, b = replicas
    ids = prompt(5 * B, seed=4)
    generate(a, ids, salt="tenant-x")
    assert generate(b, ids, salt="tenant-y")[1].usage.cached_prompt_tokens == 0
    assert generate(b, ids, salt="tenant-x")[1].usage.cached_prompt_tokens == 5 * B - 1


def test_skip_read_and_skip_write(replicas, redis_server):
    a, b = replicas
    ids = prompt(4 * B + 1, seed=5)
    generate(a, ids, skip_write=True)
    with redis_server.client() as client:
        assert stored_values(client) == 0
    generate(a, ids)
    assert generate(b, ids, skip_read=True)[1].usage.cached_prompt_tokens == 0
    assert generate(b, ids)[1].usage.cached_prompt_tokens == 4 * B


class HeldWrites(MemoryStore):
    """A memory store whose writes wait until the test opens ``gate``: stands for a store too slow
    to answer at all while the test looks. Counts the writes that entered ``put_many`` and those
    that finished."""

    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.gate = threading.Event()
        self._counted = threading.Condition()
        self.writes_started = 0
        self.writes_finished = 0

    def put_many(self, items):
        with self._counted:
            self.writes_started += 1
            self._counted.notify_all()
        assert self.gate.wait(HUNG_S), "the write gate never opened"
        written = super().put_many(items)
        with self._counted:
            self.writes_finished += 1
        return written

    def wait_started(self, count: int) -> None:
        """Returns once ``count`` writes have entered ``put_many`` (fails only a hung test)."""
        with self._counted:
            assert self._counted.wait_for(lambda: self.writes_started >= count, HUNG_S), \
                f"{self.writes_started} writes reached the store, expected {count}"


HUNG_S = 60.0
"""How long a wait that only a hung test outlasts may take: no case here waits for a duration."""


def test_publishing_does_not_delay_the_first_token(tiny_model):
    """Every write is held at the store until the stream has ended: the first token, and the whole
    stream, arrive while the prompt's publish is still waiting in ``put_many``. Had the token path
    waited on the publish, the stream would not end before the gate opens (and the test would fail
    on its bounded wait)."""
    store = HeldWrites()
    engine = make_engine(tiny_model, store)
    ids = prompt(8 * B + 3, seed=6)

    async def scenario():
        stream = engine.generate(GenerationRequest(prompt_token_ids=ids, max_new_tokens=4, ignore_eos=True))
        first = await asyncio.wait_for(stream.__anext__(), HUNG_S)
        assert first.token_ids, "a first token"
        assert store.writes_finished == 0, "the first token came while no write had reached the store"
        tokens, last = list(first.token_ids), first
        async with asyncio.timeout(HUNG_S):
            async for chunk in stream:
                tokens += chunk.token_ids
                last = chunk
        assert len(tokens) == 4 and last.finish_reason is FinishReason.LENGTH
        # The prompt's publish was made (it is waiting in put_many), and it has not finished.
        await asyncio.to_thread(store.wait_started, 1)
        assert store.writes_finished == 0, "the stream ended while the prompt's publish was held at the store"
        store.gate.set()
        await engine.wait_for_publishes()

    try:
        asyncio.run(scenario())
    finally:
        store.gate.set()
    assert store.writes_started == store.writes_finished == 2, "one publish: its run, then its first block"
    assert engine.prefix.lookup(engine.namespace(""), ids).hit_blocks == 8, "the held publish reached the store"
    engine.close()


def test_keys_turned_into_lists_are_replaced_by_the_next_publish(replicas, redis_server):
    # MGET reads a list as nil and SET NX cannot overwrite it: without the check, the prompt would
    # miss until someone deleted the keys (they have no TTL).
    a, b = replicas
    ids = prompt(3 * B + 2, seed=21)
    keys = [block_key(h) for h in a.prefix.hashes(a.namespace(""), ids)]
    with redis_server.client() as client:
        for key in keys:
            client.rpush(key, "planted")
        assert generate(a, ids)[1].usage.cached_prompt_tokens == 0
        assert all(client.type(key) == b"string" for key in keys)
    assert generate(b, ids)[1].usage.cached_prompt_tokens == 3 * B


def test_answers_are_published_for_the_next_turn(replicas, redis_server):
    """A finished stream's prompt + answer blocks reach the store, whatever ended it (length, a stop
    string), so a next turn that sends the answer back hits them on another replica; the last
    token (never fed) and a beam search's rows are not published."""
    a, b = replicas
    ids = prompt(2 * B + 3, seed=9)
    tokens, last = generate(a, ids, n=2 * B)
    assert last.finish_reason is FinishReason.LENGTH
    with redis_server.client() as client:
        # prompt + answer minus its last token: 4 * B + 2 tokens, 4 full blocks.
        assert stored_values(client) == 4
    turn2 = [*ids, *tokens, *prompt(5, seed=10)]
    assert generate(b, turn2, n=1, skip_write=True)[1].usage.cached_prompt_tokens == 4 * B

    other = [*ids[:-1], *prompt(2 * B + 3, seed=11)]  # 4 * B + 5 tokens: 2 blocks shared with ids, 2 new
    free = generate(a, other, n=3 * B, skip_write=True)[0]
    text = a.tokenizer.decode(free)
    start = len(a.tokenizer.decode(free[: 2 * B]))
    stop = next(text[i : i + 3] for i in range(start, len(text)) if text.find(text[i : i + 3]) == i)
    stopped = collect(a, GenerationRequest(prompt_token_ids=other, max_new_tokens=3 * B, ignore_eos=True, stop=[stop]))
    assert stopped[1].finish_reason is FinishReason.STOP and stopped[1].matched_stop == stop
    assert len(stopped[0]) > 2 * B
    # The consumer ended it at the stop string; the scheduler publishes as it frees the slot.
    wait_until(lambda: a.scheduler.running == 0, what="the stopped sequence to be freed")
    asyncio.run(a.wait_for_publishes())
    with redis_server.client() as client:
        # At least 4 * B + 5 + 2 * B tokens held: 6 blocks, 2 of them shared with ids.
        assert stored_values(client) >= 4 + 4, "the answer ended by a stop string was published"

    with redis_server.client() as client:
        client.flushall()
    collect(a, GenerationRequest(prompt_token_ids=ids, max_new_tokens=2 * B, ignore_eos=True, beams=BeamSearch(2)))
    with redis_server.client() as client:
        assert stored_values(client) == 2, "only the prompt's blocks"
