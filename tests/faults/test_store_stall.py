"""A Redis that stops answering (SIGSTOP: it keeps its connections and answers nothing) holds a
request up at most twice ``--cache-op-timeout-ms`` in all, then the request computes (issue 33,
5b: it was four times: the lookup and its retry, then the lease claim's reconnect and its retry;
six with an encoder input's cross K/V).

No clock: every socket wait on a request's path that times out is recorded with the timeout it
was given (what it waited); those add up to the bound, whatever the machine's speed. The waits
are real (a real redis-server, stopped), only counted.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from conftest import collect

from cachestore.factory import StoreOptions, open_store
from cachestore.stats import CacheStats
from services.engine.encoder_input import EncoderRequest
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationRequest
from services.local.redis_process import RedisServer

OP_TIMEOUT_MS = 100.0
BOUND_OP_TIMEOUTS = 2
"""The documented bound (``--cache-op-timeout-ms``'s help, README, docs/security.md), in op
timeouts: ``cachestore.factory.REQUEST_OP_TIMEOUTS``."""
REQUEST_PATH_THREADS = ("kv-read", "kv-run-waits")
"""A request's fetch runs on a read thread, its waits for another worker's blocks on the waits'
thread; publishes (write threads) and announcements (their own thread) are off its path."""


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


@pytest.fixture()
def timed_out_waits(monkeypatch) -> list[float]:
    """The timeout of every socket wait that timed out on a request-path thread, in order."""
    waits: list[float] = []

    def recording(method):
        def wrapper(sock, *args, **kwargs):
            timeout = sock.gettimeout()
            try:
                return method(sock, *args, **kwargs)
            except TimeoutError:
                if threading.current_thread().name.startswith(REQUEST_PATH_THREADS):
                    waits.append(timeout)
                raise

        return wrapper

    for name in ("connect", "sendall", "recv", "recv_into"):
        monkeypatch.setattr(socket.socket, name, recording(getattr(socket.socket, name)))
    return waits


@pytest.fixture()
def request_fixtures(request):
    """The model folder by kind (a fixture of its own, built once per session)."""
    return lambda model: request.getfixturevalue("encdec_model" if model == "encdec" else "tiny_model")


def generation(model: str, prompt: list[int], cold: bool = False) -> GenerationRequest:
    encoder = {"encoder": EncoderRequest(token_ids=list(range(10, 70)))} if model == "encdec" else {}
    return GenerationRequest(prompt_token_ids=prompt, max_new_tokens=6, ignore_eos=True,
                             cache=CacheControl(skip_read=cold, skip_write=cold), **encoder)


@pytest.mark.parametrize(("model", "scheme"), [("decoder", "redis"), ("decoder", "tiered+redis"), ("encdec", "redis")])
def test_a_stopped_redis_holds_a_request_up_twice_the_op_timeout_in_all(request_fixtures, redis, timed_out_waits,
                                                                         model, scheme):
    folder = request_fixtures(model)
    stats = CacheStats()
    store = open_store(scheme + redis.url.removeprefix("redis"), StoreOptions(op_timeout_ms=OP_TIMEOUT_MS), stats)
    engine = Engine.load(folder, EngineOptions(block_size=16), store, stats, "cpu", 2)
    rng = np.random.default_rng(11)
    try:
        collect(engine, generation(model, rng.integers(3, 512, size=40).tolist()))  # the pool's connections open
        prompt = rng.integers(3, 512, size=50).tolist()  # new blocks: looked up, then their lease claimed
        cold = collect(engine, generation(model, prompt, cold=True))[0]
        redis.pause()
        try:
            timed_out_waits.clear()
            tokens, last = collect(engine, generation(model, prompt))
            waited = list(timed_out_waits)
        finally:
            redis.resume()
        assert tokens == cold
        assert last.usage.cached_prompt_tokens == 0
        assert waited, "the stopped Redis never held the request up"
        assert sum(waited) <= BOUND_OP_TIMEOUTS * OP_TIMEOUT_MS / 1e3 + 1e-9, (
            f"the request waited {len(waited)} times {waited} s on the stopped Redis")
        assert stats.snapshot().get("budget_skipped", 0) > 0  # the calls after its budget was spent were not made
    finally:
        engine.close()
