"""The cache attacks of docs/security.md, run against two configurations side by side: the default
(no signing key, no namespace secret, no API keys) and the hardened one (all three).

The attacker uses only the public gRPC API and write access to Redis:
- plant: computes a prompt's block keys from GetModelInfo and Tokenize before the victim sends it,
  and fills them with forged K/V (valid codec, checksum and shape).
- overwrite: after the victim's first request, rewrites every block it published (read from
  Redis) with the same K/V scaled by -4, checksum recomputed.
- probe: another caller recovers a 3-digit code inside a prompt the victim sent, by trying every
  code and reading ``cached_prompt_tokens``.

For each it prints how many prompt tokens the victim took from forged values, whether its answer
still equals a cold recompute, and how many probes found the code.

Then the attacks on a live fleet (issue 33), each a module of its own, run in turn (``--cache-only``
skips them):
- ``bench.attack_door``: a 4M-id Tokenize flood, 24 streams of one tenant that are never read, and a
  burst of 500 refused requests with the gRPC floor beside it;
- ``bench.attack_router``: a worker frozen (SIGSTOP) behind ``kvshare route`` with calls in flight;
- ``bench.attack_leases``: forged (unsigned) and replayed (signed) leases against a victim's prompts;
- ``bench.attack_stall``: Redis frozen (SIGSTOP) under load, against the documented store-wait bound;
- ``bench.attack_bodies``: request messages that never end, on a text and an audio worker;
- ``bench.attack_floods``: Tokenize, audio and HTTP body floods, a two-tenant burst and the door's
  refusal cost, each beside a victim measured idle and under attack.

    .venv/bin/python -m bench.attacks [--smoke] [--cache-only]
"""

from __future__ import annotations

import importlib
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from bench.fleet import INTRA_OP_THREADS, parse_args, print_table
from cachestore.codec import Expected, ValueKind, decode, dtype_of, encode, owner_of
from cachestore.keys import Namespace, block_hashes, block_key
from cachestore.prefix import CANONICAL_LAYOUT
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.api.api_keys import key_line
from services.local.model_cache import cache_dir, ensure_model
from services.local.redis_process import RedisServer, stored_values
from services.local.worker_process import WorkerProcess

BLOCK = 16
VICTIM_KEY, ATTACKER_KEY = "victim-key-" + "1" * 32, "attacker-key-" + "2" * 32
TEMPLATE = "Account notes for the support agent. The caller's access code is {code}. Verify it before any change."


@dataclass(slots=True)
class Target:
    name: str
    stub: pb_grpc.GeneratorStub
    victim: tuple[tuple[str, str], ...]
    attacker: tuple[tuple[str, str], ...]
    redis: object


def generate(t: Target, ids: list[int], metadata, skip_cache: bool = False) -> tuple[list[int], int]:
    """(greedy ids, cached prompt tokens) of ``ids``; waits until its new blocks are in Redis."""
    request = pb.GenerateRequest(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True,
                                 cache=pb.CacheOptions(skip_read=skip_cache, skip_write=skip_cache))
    done = t.stub.Generate(request, metadata=metadata, timeout=60)
    tokens, last = [], None
    for last in done:
        tokens.extend(last.token_ids)
    if not skip_cache:
        settle(t.redis)
    return tokens, last.usage.cached_prompt_tokens


def settle(redis_client, quiet_s: float = 0.1) -> None:
    """Returns once Redis has held the same number of keys for ``quiet_s`` (publishes landed)."""
    count, since = stored_values(redis_client), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.01)
        now = stored_values(redis_client)
        if now != count:
            count, since = now, time.monotonic()


def public_keys(t: Target, ids: list[int]) -> tuple[list[bytes], list[str], tuple[int, ...]]:
    """What anyone who can call GetModelInfo computes: the block hashes and keys of ``ids``."""
    info = t.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=t.attacker)
    itemsize = info.kv_bytes_per_token // (2 * info.num_layers * info.num_kv_heads * info.head_size)
    namespace = Namespace(info.fingerprint, info.block_size, {4: "float32", 2: "float16"}[itemsize], CANONICAL_LAYOUT)
    hashes = block_hashes(namespace, ids)
    shape = (info.num_layers, 2, info.num_kv_heads, info.block_size, info.head_size)
    return hashes, [block_key(h) for h in hashes], shape


def plant(t: Target, redis_client, rng) -> tuple[int, bool]:
    ids = rng.integers(3, 500, size=6 * BLOCK + 5).tolist()
    hashes, keys, shape = public_keys(t, ids)
    for h, key in zip(hashes, keys, strict=True):
        redis_client.set(key, encode(ValueKind.PREFIX_BLOCK, h, rng.standard_normal(shape).astype(np.float32)))
    answer, cached = generate(t, ids, t.victim)
    return cached, answer == generate(t, ids, t.victim, skip_cache=True)[0]


def overwrite(t: Target, redis_client, rng) -> tuple[int, bool]:
    ids = rng.integers(3, 500, size=6 * BLOCK + 5).tolist()
    before = set(redis_client.keys("kvshare:v1:blk:*"))
    generate(t, ids, t.victim)
    for key in set(redis_client.keys("kvshare:v1:blk:*")) - before:
        value = redis_client.get(key)
        start = value.find(b"KVSH")  # the codec value, inside a signature envelope or not
        owner = owner_of(value[start:])
        tensor = decode(value[start:], Expected(ValueKind.PREFIX_BLOCK, owner, dtype_of(value[start:]))) * -4.0
        redis_client.set(key, value[:start] + encode(ValueKind.PREFIX_BLOCK, owner, tensor))
    answer, cached = generate(t, ids, t.victim)
    return cached, answer == generate(t, ids, t.victim, skip_cache=True)[0]


def probe(t: Target, codes: int) -> int | None:
    """How many probes found the victim's code (None: not found in ``codes`` probes)."""
    secret = 417 % codes

    def ids(code: int) -> list[int]:
        text = TEMPLATE.format(code=f"{code:03d}")
        return list(t.stub.Tokenize(pb.TokenizeRequest(text=text), metadata=t.attacker).token_ids)

    victim_ids = ids(secret)
    generate(t, victim_ids, t.victim)
    full = len(victim_ids) // BLOCK * BLOCK
    for n, code in enumerate(range(codes), 1):
        _, cached = generate(t, ids(code), t.attacker)
        if cached >= min(full, len(victim_ids) - 1):
            return n
    return None


FLEET_ATTACKS = ("bench.attack_door", "bench.attack_router", "bench.attack_leases", "bench.attack_stall",
                 "bench.attack_floods", "bench.attack_bodies")


def main() -> int:
    def extra(parser) -> None:
        parser.add_argument("--cache-only", action="store_true", help="the cache attacks only, not the fleet's")

    args = parse_args(__doc__.splitlines()[0], extra)
    code = cache_attacks(args)
    if args.cache_only:
        return code
    # Each fleet attack reads the same flags (--smoke, --model) from the command line itself.
    sys.argv = [sys.argv[0], *(["--smoke"] if args.smoke else []),
                *(["--model", str(args.model)] if args.model is not None else [])]
    for name in FLEET_ATTACKS:
        print(f"\n## {name}", flush=True)
        code = max(code, importlib.import_module(name).main())
    return code


def cache_attacks(args) -> int:
    """The three cache attacks on both configurations; 0 when the hardened one stops them all."""
    model = ensure_model(cache_dir() / "decoder-tiny", "tiny")
    codes = 20 if args.smoke else 1000
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = Path(tmp)
        (folder / "signing").write_text(f"k1 {rng.bytes(32).hex()}\n")
        (folder / "namespace").write_text(rng.bytes(32).hex())
        (folder / "api-keys").write_text(key_line("victim", VICTIM_KEY) + key_line("attacker", ATTACKER_KEY))
        redis_server = stack.enter_context(RedisServer())
        redis_client = stack.enter_context(redis_server.client())
        common = ("--cache", redis_server.url, "--block-size", str(BLOCK), "--intra-op-threads", str(INTRA_OP_THREADS))
        hardened = ("--cache-signing-key-file", str(folder / "signing"), "--cache-namespace-secret-file",
                    str(folder / "namespace"), "--api-keys-file", str(folder / "api-keys"))
        targets = []
        for name, extra, victim, attacker in (("default", (), (), ()),
                                              ("hardened", hardened, (("authorization", f"Bearer {VICTIM_KEY}"),),
                                               (("authorization", f"Bearer {ATTACKER_KEY}"),))):
            worker = stack.enter_context(WorkerProcess(model, *common, *extra))
            channel = stack.enter_context(grpc.insecure_channel(worker.target))
            targets.append(Target(name, pb_grpc.GeneratorStub(channel), victim, attacker, redis_client))
        for t in targets:
            planted, planted_ok = plant(t, redis_client, rng)
            overwritten, overwritten_ok = overwrite(t, redis_client, rng)
            found = probe(t, codes)
            rows.append((t.name, planted, "yes" if planted_ok else "NO", overwritten, "yes" if overwritten_ok else "NO",
                         f"found after {found}" if found else f"not found in {codes}"))
            print(f"{t.name}: done", flush=True)
    print_table("cache attacks through the public API and Redis writes (tiny model, block 16; a prompt of 101 tokens)",
                ("configuration", "plant: tokens from forged K/V", "plant: answer = cold",
                 "overwrite: tokens from forged K/V", "overwrite: answer = cold", f"probe {codes} codes"), rows)
    hardened_row = rows[-1]
    held = hardened_row[1] == 0 and hardened_row[3] == 0 and hardened_row[2] == hardened_row[4] == "yes" \
        and hardened_row[5].startswith("not found")
    print(f"\nhardened configuration stops every attack: {'held' if held else 'NOT held'}")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
