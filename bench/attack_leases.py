"""Lease attacks (docs/security.md): how much a forged or replayed lease on a victim's prompts
costs its first token.

Fleet single-flight makes a worker that finds another worker's lease on a prompt's blocks wait for
them. Whoever can write to Redis can try to make every worker wait:

- forged (default configuration, no signing key): the attacker computes a prompt's block keys from
  GetModelInfo (as ``bench.attacks`` does) before the victim sends it and sets
  ``kvshare:v1:lease:<hash>`` on every block, ``PX 600000``;
- replayed (``--cache-signing-key-file``): the attacker reads a real, signed lease with ``GET``
  while a worker computes a prompt, waits, deletes the prompt's blocks and writes the lease back
  with ``PX 600000``; then the victim, another worker of the fleet, sends a prompt that begins
  like it.

Each row is the victim's server-side time to first token, median over the prompts, attacked and
not (fresh prompts of the same length, sent alternately with the attacked ones, so that both see
the same load), and their ratio.

    .venv/bin/python -m bench.attack_leases [--smoke]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import redis

from bench.fleet import (
    INTRA_OP_THREADS,
    PUBLISH_TIMEOUT_S,
    first_token,
    median,
    parse_args,
    print_table,
    wait_for_keys,
)
from cachestore.keys import BlockHash, Namespace, block_hashes, block_key, lease_key
from cachestore.prefix import CANONICAL_LAYOUT
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.local.model_cache import cache_dir, ensure_model
from services.local.redis_process import RedisServer, stored_values
from services.local.worker_process import WorkerProcess

BLOCK = 16
SHORT, LONG = 6 * BLOCK + 5, 44 * BLOCK + 5
"""A victim's prompt: 6 full blocks and a tail (as ``bench.attacks``: one prefill chunk, which the
tiny model computes in less than one lease poll), or 44 and a tail (three chunks)."""
CAPTURE_TOKENS = 48 * BLOCK
"""The prompt a holder computes while the attacker reads its lease: long enough (several prefill
chunks) that the lease on its first block is there for a few polls."""
REPLAY_AFTER_S = 3.0
"""How long after capturing a lease the attacker writes it back: past the lease's own expiry
(twice the holder's expected compute time plus 0.5 s) and the clock-skew tolerance."""
FORGED_PX_MS = 600_000


@dataclass(slots=True)
class Row:
    name: str
    clean_ms: list[float]
    attacked_ms: list[float]

    def cells(self) -> tuple[object, ...]:
        clean, attacked = median(self.clean_ms), median(self.attacked_ms)
        return self.name, len(self.attacked_ms), clean, attacked, attacked / clean, max(self.attacked_ms) / clean


def public_hashes(stub: pb_grpc.GeneratorStub, ids: list[int]) -> list[BlockHash]:
    """What anyone who can call GetModelInfo computes (no namespace secret): the block hashes of ``ids``."""
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    return block_hashes(Namespace(info.fingerprint, info.block_size, info.cache_dtype, CANONICAL_LAYOUT), ids)


def ttft_ms(stub: pb_grpc.GeneratorStub, ids: list[int]) -> float:
    return first_token(stub, ids).timings.time_to_first_token_ms


def warm_up(stub: pb_grpc.GeneratorStub, rng: np.random.Generator, count: int = 8) -> None:
    """Cold requests, so that the worker has measured its own prefill pace and paid its start-up."""
    for i in range(count):
        first_token(stub, random_ids(rng, (SHORT, LONG)[i % 2]))


def random_ids(rng: np.random.Generator, count: int) -> list[int]:
    return rng.integers(3, 500, size=count).tolist()


def forged(stub: pb_grpc.GeneratorStub, client: redis.Redis, rng: np.random.Generator, prompts: int,
           length: int) -> Row:
    clean, attacked = [], []
    for _ in range(prompts):
        clean.append(ttft_ms(stub, random_ids(rng, length)))
        ids = random_ids(rng, length)
        hashes = public_hashes(stub, ids)
        for h in hashes:
            client.set(lease_key(h), b"attacker.1", px=FORGED_PX_MS)
        attacked.append(ttft_ms(stub, ids))
    return Row(f"default: forged lease on every block, {length}-token prompts", clean, attacked)


def capture(holder: pb_grpc.GeneratorStub, client: redis.Redis, key: str, ids: list[int]) -> bytes | None:
    """The lease under ``key`` as ``GET`` read it while ``holder`` computed ``ids`` (None: missed)."""
    seen: list[bytes] = []
    running = threading.Event()
    running.set()

    def poll() -> None:
        while running.is_set() and not seen:
            value = client.get(key)
            if value is not None:
                seen.append(value)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        first_token(holder, ids)
    finally:
        running.clear()
        thread.join()
    return seen[0] if seen else None


def captured_lease(holder: pb_grpc.GeneratorStub, client: redis.Redis, rng: np.random.Generator
                   ) -> tuple[list[int], str, bytes]:
    """A real lease read while ``holder`` computed a prompt, once the holder has published that
    prompt's blocks and ended its lease, and the blocks deleted: (the victim's prompt, which begins
    like that one, the lease's key, the lease as read)."""
    while True:
        ids = random_ids(rng, CAPTURE_TOKENS)
        hashes = public_hashes(holder, ids)
        keys, key = [block_key(h) for h in hashes], lease_key(hashes[0])
        before = stored_values(client)
        lease = capture(holder, client, key, ids)
        wait_for_keys(client, before + len(keys))
        deadline = time.monotonic() + PUBLISH_TIMEOUT_S
        while client.exists(key) and time.monotonic() < deadline:  # the holder ends its lease after its publishes
            time.sleep(0.001)
        client.delete(*keys)
        if lease is not None:
            return ids[:LONG], key, lease


def replayed(holder: pb_grpc.GeneratorStub, victim: pb_grpc.GeneratorStub, client: redis.Redis,
             rng: np.random.Generator, prompts: int, after_s: float) -> Row:
    """Leases captured from ``holder``, each written back ``after_s`` after its capture (0: at once),
    before ``victim`` sends a prompt that begins like the captured one."""
    clean, attacked = [], []
    if after_s:
        captured = [captured_lease(holder, client, rng) for _ in range(prompts)]
        time.sleep(after_s)
    for i in range(prompts):
        ids, key, lease = captured[i] if after_s else captured_lease(holder, client, rng)
        clean.append(ttft_ms(victim, random_ids(rng, LONG)))
        client.set(key, lease, px=FORGED_PX_MS)
        attacked.append(ttft_ms(victim, ids))
    when = f"{after_s:.0f} s after capture" if after_s else "at once (within its own expiry)"
    return Row(f"signed: lease replayed {when}, {LONG}-token prompts", clean, attacked)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    model = ensure_model(cache_dir() / "decoder-tiny", "tiny")
    prompts = 8 if args.smoke else 60
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        (Path(tmp) / "signing").write_text(f"k1 {rng.bytes(32).hex()}\n")
        redis_server = stack.enter_context(RedisServer())
        client = stack.enter_context(redis_server.client())
        common = ("--cache", redis_server.url, "--block-size", str(BLOCK), "--intra-op-threads", str(INTRA_OP_THREADS))
        signed = ("--cache-signing-key-file", str(Path(tmp) / "signing"))

        def stub(*extra: str) -> pb_grpc.GeneratorStub:
            worker = stack.enter_context(WorkerProcess(model, *common, *extra))
            return pb_grpc.GeneratorStub(stack.enter_context(grpc.insecure_channel(worker.target)))

        plain, holder, victim = stub(), stub(*signed), stub(*signed)
        for s in (plain, holder, victim):
            warm_up(s, rng)
        rows = [forged(plain, client, rng, prompts, length) for length in (SHORT, LONG)]
        print("forged: done", flush=True)
        for after_s in (0.0, REPLAY_AFTER_S):
            rows.append(replayed(holder, victim, client, rng, prompts, after_s))
            print(f"replayed after {after_s:.0f} s: done", flush=True)
    print_table(f"lease attacks: the victim's time to first token (ms, server-side; tiny model, block {BLOCK})",
                ("attack", "prompts", "no attack: median", "attacked: median", "median ratio",
                 "slowest / no-attack median"),
                [row.cells() for row in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
