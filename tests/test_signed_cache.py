"""Signed cache values and secret key namespaces, attacked through a real redis-server: whatever an
attacker writes there, a worker with a signing key serves only values its fleet signed, and its
answer equals a cold recompute."""

import numpy as np
import pytest
from conftest import collect

from cachestore.codec import Expected, ValueKind, decode, dtype_of, encode, owner_of
from cachestore.factory import StoreOptions, open_store
from cachestore.keys import block_key
from cachestore.signing import MAGIC, Keyring
from cachestore.stats import CacheStats
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationRequest

B = 16
FLEET = Keyring.from_secrets([("k1", "fleet-secret-" + "a" * 40)])
ATTACKER = Keyring.from_secrets([("k1", "attacker-guess-" + "b" * 40)])


def engine(folder, url, keyring=FLEET, secret=b"") -> Engine:
    stats = CacheStats()  # one per worker, shared by its store and engine as in `kvshare serve`
    return Engine.load(folder, EngineOptions(block_size=B, namespace_secret=secret),
                       open_store(url, StoreOptions(keyring=keyring), stats), stats, "cpu", 2)


def generate(e: Engine, ids, **cache):
    return collect(e, GenerationRequest(prompt_token_ids=list(ids), max_new_tokens=10, ignore_eos=True,
                                        cache=CacheControl(**cache)))


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 500, size=n).tolist()


@pytest.fixture()
def fleet(tiny_model, redis_url):
    engines = {}

    def make(name, **kwargs):
        engines[name] = engine(tiny_model, kwargs.pop("url", redis_url), **kwargs)
        return engines[name]

    yield make
    for e in engines.values():
        e.close()


def keys_of(e: Engine, ids, salt=""):
    hashes = e.prefix.hashes(e.namespace(salt), ids)
    return hashes, [block_key(h) for h in hashes]


def test_workers_with_the_same_key_share_signed_blocks(fleet, redis_server):
    a, b = fleet("a"), fleet("b")
    ids = prompt(4 * B + 3, seed=1)
    first, _ = generate(a, ids)
    second, last = generate(b, ids)
    assert last.usage.cached_prompt_tokens == 4 * B and second == first
    with redis_server.client() as client:
        assert all(client.get(k).startswith(MAGIC) for k in keys_of(a, ids)[1])
    assert b.cache_stats.rejected_values == {}


def _forge(client, how, e: Engine, ids, hashes, keys, i):
    """Writes a forged value under ``keys[i]``: the codec and its checksum are always valid."""
    legit = FLEET.verify(keys[i], client.get(keys[i])) if client.get(keys[i]) else None
    if how == "copied":
        # A genuine signed value of another prompt (another salt), copied under this key.
        generate(e, ids, salt="other")
        _, other_keys = keys_of(e, ids, salt="other")
        client.set(keys[i], client.get(other_keys[i]))
        return
    tensor = decode(legit, Expected(ValueKind.PREFIX_BLOCK, hashes[i], dtype_of(legit))) * 3.0
    value = encode(ValueKind.PREFIX_BLOCK, hashes[i], tensor)  # checksum recomputed by the forger
    if how == "unsigned":
        client.set(keys[i], value)
    elif how == "attacker_key":
        client.set(keys[i], ATTACKER.sign(keys[i], value))
    elif how == "altered":
        # The fleet's own envelope, its payload scaled in place (codec checksum fixed up), MAC kept.
        envelope = bytearray(client.get(keys[i]))
        envelope[len(envelope) - len(value):] = value
        client.set(keys[i], bytes(envelope))


@pytest.mark.parametrize(("how", "reason"), [("unsigned", "unsigned"), ("attacker_key", "signature"),
                                             ("altered", "signature"), ("copied", "signature")])
def test_a_forged_value_is_a_miss_and_the_answer_equals_cold(fleet, redis_server, how, reason):
    a, b = fleet("a"), fleet("b")
    ids = prompt(5 * B + 2, seed=2)
    cold, _ = generate(b, ids, skip_read=True, skip_write=True)
    generate(a, ids)
    hashes, keys = keys_of(a, ids)
    with redis_server.client() as client:
        _forge(client, how, a, ids, hashes, keys, 2)
        answer, last = generate(b, ids)
        assert answer == cold
        assert last.usage.cached_prompt_tokens == 2 * B, "the run of verified blocks stops at the forged one"
        assert b.cache_stats.rejected_values == {reason: 1}
        # Deleted, and the worker's publish put a signed value back in its place.
        assert FLEET.verify(keys[2], client.get(keys[2])) is not None
    assert generate(b, ids)[1].usage.cached_prompt_tokens == 5 * B


def test_values_planted_before_the_first_request_are_never_served(fleet, redis_server, tiny_model):
    # The attacker knows the model and tokenizer (GetModelInfo, Tokenize), so without a namespace
    # secret it can compute every key of a prompt before anyone sends it, and fill them.
    victim = fleet("victim")
    ids = prompt(4 * B + 1, seed=3)
    cold, _ = generate(victim, ids, skip_read=True, skip_write=True)
    hashes, keys = keys_of(victim, ids)
    rng = np.random.default_rng(0)
    geometry = victim.prefix.geometry  # blocks of the real size: a longer one is refused unread (test_store_bounds)
    with redis_server.client() as client:
        for h, key in zip(hashes, keys, strict=True):
            forged = encode(ValueKind.PREFIX_BLOCK, h, rng.standard_normal(geometry.block_shape(B)).astype(geometry.dtype))
            client.set(key, ATTACKER.sign(key, forged))
        answer, last = generate(victim, ids)
    assert answer == cold and last.usage.cached_prompt_tokens == 0
    assert victim.cache_stats.rejected_values == {"signature": len(keys)}


def test_a_worker_with_another_key_gets_misses_only(fleet):
    a = fleet("a")
    stranger = fleet("stranger", keyring=Keyring.from_secrets([("k1", "another-fleet-" + "c" * 40)]))
    ids = prompt(3 * B + 4, seed=4)
    first, _ = generate(a, ids)
    answer, last = generate(stranger, ids, skip_write=True)
    assert answer == first and last.usage.cached_prompt_tokens == 0
    assert stranger.cache_stats.rejected_values == {"signature": 3}


def test_rotation_keeps_old_values_hits_while_signing_with_the_new_key(fleet, redis_server):
    old = fleet("old")
    rotated = Keyring.from_secrets([("k2", "next-fleet-secret-" + "d" * 40), ("k1", "fleet-secret-" + "a" * 40)])
    new = fleet("new", keyring=rotated)
    system = prompt(3 * B, seed=5)
    generate(old, system + prompt(5, seed=6))
    answer, last = generate(new, system + prompt(B + 5, seed=7))
    assert last.usage.cached_prompt_tokens == 3 * B, "values signed with the old key still verify"
    _, keys = keys_of(new, system + prompt(B + 5, seed=7))
    with redis_server.client() as client:
        assert b"k2" in client.get(keys[3])[:8], "new blocks are signed with the new current key"
    assert answer == generate(new, system + prompt(B + 5, seed=7), skip_read=True, skip_write=True)[0]
    assert new.cache_stats.rejected_values == {}


def test_a_tiered_worker_never_copies_unverified_values_into_its_l1(fleet, redis_server, redis_url):
    victim = fleet("victim", url="tiered+" + redis_url)
    ids = prompt(3 * B + 2, seed=8)
    cold, _ = generate(victim, ids, skip_read=True, skip_write=True)
    hashes, keys = keys_of(victim, ids)
    with redis_server.client() as client:
        for h, key in zip(hashes, keys, strict=True):
            client.set(key, encode(ValueKind.PREFIX_BLOCK, h, np.ones((2, 2, 2, B, 16), np.float32)))
        answer, last = generate(victim, ids, skip_write=True)
        assert answer == cold and last.usage.cached_prompt_tokens == 0
        assert all(victim.store.l1.get(k) is None for k in keys)
        # Once the worker publishes its own (verified) blocks, both tiers serve them.
        generate(victim, ids)
        assert all(victim.store.l1.get(k) is not None for k in keys)
        client.flushall()
    assert generate(victim, ids)[1].usage.cached_prompt_tokens == 3 * B


def test_a_namespace_secret_makes_keys_unpredictable_and_is_shared_by_the_fleet(fleet, redis_server):
    secret = b"namespace-secret-" + b"e" * 40
    a, b = fleet("a", secret=secret), fleet("b", secret=secret)
    public = fleet("public")  # what anyone computes from the public model fingerprint and token ids
    ids = prompt(3 * B + 1, seed=9)
    generate(a, ids)
    assert not set(keys_of(public, ids)[1]) & set(keys_of(a, ids)[1])
    with redis_server.client() as client:
        assert set(keys_of(a, ids)[1]) <= {k.decode() for k in client.keys("*")}
    assert generate(b, ids)[1].usage.cached_prompt_tokens == 3 * B
    other = fleet("other", secret=b"another-secret-" + b"f" * 40)
    assert generate(other, ids, skip_write=True)[1].usage.cached_prompt_tokens == 0


@pytest.mark.subprocess
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_non_finite_values_signed_with_the_real_key_still_give_the_cold_answer(tiny_model, redis_server, redis_url,
                                                                                tmp_path, poison):
    """A buggy signer in the fleet: the MAC verifies, the K/V is NaN or infinite. The answer, greedy
    or sampled, is the cold one and the status OK (the issue measured INTERNAL for every sampled
    request before the range check)."""
    import grpc

    from kvshare.v1 import generator_pb2 as pb
    from kvshare.v1 import generator_pb2_grpc as pb_grpc
    from services.local.worker_process import WorkerProcess

    keys = tmp_path / "signing-keys"
    keys.write_text("k1 " + "n" * 64 + "\n")
    keyring = Keyring.load(keys)
    ids = prompt(3 * 64 + 7, seed=10)
    with (WorkerProcess(tiny_model, "--cache", redis_url, "--cache-signing-key-file", str(keys)) as worker,
          grpc.insecure_channel(worker.target) as channel):
        stub = pb_grpc.GeneratorStub(channel)

        def run(skip_read=False, **sampling):
            request = pb.GenerateRequest(prompt_token_ids=ids, max_new_tokens=12, ignore_eos=True,
                                         sampling=pb.SamplingParams(**sampling), cache=pb.CacheOptions(skip_read=skip_read))
            out = [m for m in stub.Generate(request, timeout=60)]
            return [t for m in out for t in m.token_ids], out[-1].usage.cached_prompt_tokens

        greedy, _ = run()
        sampled = dict(temperature=0.8, top_k=50, seed=7)
        cold_sampled, _ = run(skip_read=True, **sampled)
        with redis_server.client() as client:
            stored = {key.decode(): keyring.verify(key.decode(), client.get(key)) for key in client.keys("kvshare:v1:blk:*")}
            assert len(stored) == 3

            def poison_every_block():
                for key, value in stored.items():
                    owner = owner_of(value)
                    tensor = decode(value, Expected(ValueKind.PREFIX_BLOCK, owner, dtype_of(value))).copy()
                    tensor[..., 0] = poison
                    client.set(key, keyring.sign(key, encode(ValueKind.PREFIX_BLOCK, owner, tensor)))

            poison_every_block()
            assert run() == (greedy, 0)
            poison_every_block()
            assert run(**sampled) == (cold_sampled, 0)
