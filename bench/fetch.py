"""Bytes per second of the worker's fetch path against plain redis-py GETs of the same values.

The fetch path is what a warm request pays before running its suffix: one batched read of the
prefix's block keys, every value's header and checksum checked, and the model's past assembled
from them (``PrefixStore.lookup`` + ``DecoderSession.cache_from_blocks``). The baseline is an
``MGET`` of the same keys over the same kind of connection, doing nothing with the bytes (the
strict baseline), and the same values read with one ``GET`` per key. Also measured: the tiered
store with its memory L1 already holding the blocks.

    .venv/bin/python -m bench.fetch [--smoke]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import redis

from bench.fleet import bench_model, median, parse_args, print_table
from cachestore.factory import StoreOptions, open_store
from cachestore.keys import block_key
from cachestore.prefix import KVGeometry, PrefixStore
from cachestore.stats import CacheStats
from services.engine.engine import Engine, EngineOptions
from services.local.redis_process import RedisServer


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def main() -> int:
    args = parse_args(__doc__.splitlines()[0])
    model = bench_model(args)
    tokens, runs = (256, 3) if args.smoke else (2048, 15)
    ids = model.random_ids(np.random.default_rng(2), tokens)
    with RedisServer() as server:
        stats = CacheStats()
        engine = Engine.load(model.folder, EngineOptions(), open_store(server.url, StoreOptions(), stats), stats,
                             "cpu", 2)
        session, namespace = engine.session, engine.namespace("")
        geometry = KVGeometry(engine.spec.num_layers, engine.spec.num_kv_heads, engine.spec.head_size, session.kv_dtype)
        hashes = engine.prefix.hashes(namespace, ids)
        kv = np.random.default_rng(3).standard_normal(geometry.block_shape(tokens), dtype=np.float32)
        engine.prefix.publish(hashes, kv, 0, namespace.block_size)
        keys = [block_key(h) for h in hashes]
        plain = redis.Redis.from_url(server.url)
        tiered = PrefixStore(open_store("tiered+" + server.url, StoreOptions(), CacheStats()), geometry, CacheStats())

        def fetch_path(prefix: PrefixStore):
            lookup = prefix.lookup(namespace, ids)
            assert lookup.hit_blocks == len(hashes)
            return session.cache_from_blocks(lookup.blocks, tokens, tokens + 1)

        payload = sum(len(v) for v in plain.mget(keys))
        fetch_path(tiered)  # fills the L1
        times: dict[str, list[float]] = {
            "plain MGET": [], "plain GETs, one per key": [], "kvshare fetch path": [], "tiered, warm L1": []}
        for _ in range(runs):
            times["plain MGET"].append(timed(lambda: plain.mget(keys))[0])
            times["plain GETs, one per key"].append(timed(lambda: [plain.get(k) for k in keys])[0])
            times["kvshare fetch path"].append(timed(lambda: fetch_path(engine.prefix))[0])
            times["tiered, warm L1"].append(timed(lambda: fetch_path(tiered))[0])
        engine.close()
        plain.close()
    base = payload / median(times["plain MGET"])
    rows = [(name, f"{payload / 2**20:.1f}", median(t) * 1e3, payload / median(t) / 1e9, payload / median(t) / base)
            for name, t in times.items()]
    print_table(f"{model.name} model, {tokens}-token prefix in {len(keys)} blocks, loopback Redis; medians of {runs} runs",
                ("path", "MiB", "ms", "GB/s", "× plain MGET"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
