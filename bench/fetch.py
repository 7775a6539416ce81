"""Bytes per second of the worker's fetch path against plain redis-py reads of the same stored
values, for each storage dtype (--cache-dtype).

The fetch path is what a warm request pays before running its suffix: one batched read of the
prefix's block keys, every value's header, checksum and range checked, and the blocks widened
into the request's slot as they arrive (``PrefixStore.lookup`` with the slot's receiver, then
``SlotBank.begin``: the engine's own calls).
The baselines read the same stored bytes and do nothing with them: one ``MGET`` (the target's
baseline), and one pipeline of ``GET``s whose replies are read and dropped one by one (the
cheapest way redis-py can move them). Also measured: the tiered store with its memory L1 already
holding the blocks.

The second table is the CPU budget of the target (the fetch path at >= 0.9 of ``MGET``'s
throughput, i.e. within ``MGET``'s time / 0.9): the CPU time the cheaper of the two plain reads
(``MGET``, the ``GET`` pipeline) costs the client thread and ``redis-server`` (its INFO counters),
and the CPU time of everything the path does once the bytes are in (read through a memory store
holding the same values: header, checksum and range checks, widening, copying into the slot).
However that work is overlapped with the transfer, the target needs at least their sum / that
time cores.

    .venv/bin/python -m bench.fetch [--smoke] [--model DIR]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import redis

from bench.fleet import bench_model, median, parse_args, print_table
from cachestore.factory import StoreOptions, open_store
from cachestore.keys import block_key
from cachestore.memory import MemoryStore
from cachestore.prefix import PrefixStore
from cachestore.stats import CacheStats
from cachestore.storage_dtype import STORAGE_DTYPES
from services.engine.engine import Engine, EngineOptions
from services.local.redis_process import RedisServer


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def pipelined_gets(client: redis.Redis, keys: list[str]) -> None:
    """Every GET sent at once, each reply read and dropped before the next (one value held)."""
    connection = client.connection_pool.get_connection()
    try:
        connection.send_packed_command(connection.pack_commands([("GET", k) for k in keys]))
        for _ in keys:
            connection.read_response()
    finally:
        client.connection_pool.release(connection)


def redis_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def cpu_ms(fn, server: redis.Redis, runs: int) -> tuple[float, float]:
    """Medians over ``runs`` of this thread's CPU ms and redis-server's CPU ms while ``fn`` runs."""
    mine, theirs = [], []
    for _ in range(runs):
        r0, c0 = redis_cpu_s(server), time.thread_time()
        fn()
        mine.append((time.thread_time() - c0) * 1e3)
        theirs.append((redis_cpu_s(server) - r0) * 1e3)
    return median(mine), median(theirs)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    model = bench_model(args)
    tokens, runs = (256, 3) if args.smoke else (2048, 15)
    ids = model.random_ids(np.random.default_rng(2), tokens)
    rows, bytes_per_token, budget = [], [], []
    with RedisServer() as server:
        plain = redis.Redis.from_url(server.url)
        for name in STORAGE_DTYPES:
            stats = CacheStats()
            engine = Engine.load(model.folder, EngineOptions(cache_dtype=name),
                                 open_store(server.url, StoreOptions(), stats), stats, "cpu", 2)
            namespace, geometry = engine.namespace(""), engine.prefix.geometry
            hashes = engine.prefix.hashes(namespace, ids)
            kv = np.random.default_rng(3).standard_normal(geometry.block_shape(tokens), dtype=np.float32)
            engine.prefix.publish(hashes, kv, 0, namespace.block_size)
            keys = [block_key(h) for h in hashes]
            tiered = PrefixStore(open_store("tiered+" + server.url, StoreOptions(), CacheStats()), geometry, CacheStats())
            slot = engine.slots.acquire(tokens + 1)

            def fetch_path(prefix: PrefixStore):
                lookup = prefix.lookup(namespace, ids, engine.slots.receiver(slot))
                assert lookup.hit_blocks == len(hashes)
                engine.slots.begin(slot, lookup.blocks, tokens)

            payload = sum(len(v) for v in plain.mget(keys))
            bytes_per_token.append((name, engine.spec.kv_bytes_per_token(engine.storage_dtype.itemsize),
                                    f"{payload / tokens:.0f}"))
            fetch_path(tiered)  # fills the L1
            times: dict[str, list[float]] = {"plain MGET": [], "plain GET pipeline, replies dropped": [],
                                             "kvshare fetch path": [], "tiered, warm L1": []}
            for _ in range(runs):
                times["plain MGET"].append(timed(lambda: plain.mget(keys)))
                times["plain GET pipeline, replies dropped"].append(timed(lambda: pipelined_gets(plain, keys)))
                times["kvshare fetch path"].append(timed(lambda: fetch_path(engine.prefix)))
                times["tiered, warm L1"].append(timed(lambda: fetch_path(tiered)))
            in_memory = MemoryStore(4 * payload)
            in_memory.put_many(list(zip(keys, plain.mget(keys), strict=True)))
            local = PrefixStore(in_memory, geometry, CacheStats())
            read_cpu, redis_cpu = min(cpu_ms(lambda: plain.mget(keys), plain, runs),
                                      cpu_ms(lambda: pipelined_gets(plain, keys), plain, runs), key=sum)
            work_cpu, _ = cpu_ms(lambda: fetch_path(local), plain, runs)
            mget_ms = median(times["plain MGET"]) * 1e3
            total = read_cpu + redis_cpu + work_cpu
            budget.append((name, mget_ms, mget_ms / 0.9, read_cpu, redis_cpu, work_cpu, total, total / (mget_ms / 0.9)))
            engine.slots.release(slot)
            engine.close()
            base = payload / median(times["plain MGET"])
            rows += [(name, path, f"{payload / 2**20:.2f}", median(t) * 1e3, payload / median(t) / 1e9,
                      payload / median(t) / base) for path, t in times.items()]
        plain.close()
    print_table(f"{model.name} model, {tokens}-token prefix in {tokens // EngineOptions().block_size} blocks, loopback Redis; medians of "
                f"{runs} runs; GB/s of stored bytes", ("storage dtype", "path", "stored MiB", "ms", "GB/s",
                                                     "× plain MGET"), rows)
    print_table("CPU budget of the target: ms of CPU to move and use the values against the wall time the target "
                "allows (plain MGET / 0.9); the last column is the fewest cores that could meet it",
                ("storage dtype", "plain MGET ms", "allowed ms", "read, client CPU ms", "read, redis-server CPU ms",
                 "checks + widen + copy CPU ms", "CPU ms in all", "cores needed"), budget)
    print_table("Redis value bytes per cached token (K/V payload + headers)",
                ("storage dtype", "K/V bytes/token", "stored bytes/token"), bytes_per_token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
