"""Something that is not Redis answers on the cache port: replies of the wrong type or length are
store failures (counted as ``protocol``), never passed on, and every answer equals the cold one.
The server here is a deliberately hostile stand-in speaking RESP, not a model of Redis."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import pytest
from conftest import collect

from cachestore.factory import StoreOptions, open_store
from cachestore.stats import CacheStats
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationRequest

# A worker reads with one pipeline of GETRANGEs (RedisStore.iter_many; a tiered store's L2 too, and
# the lease claim): each gets the reply of the kind named, and the store error the worker counts.
GET_REPLIES = {
    "integer": (b":5\r\n", "protocol"),
    "nested arrays": (b"*1\r\n$1\r\nx\r\n", "protocol"),
    "errors inside": (b"-ERR no\r\n", "response"),
    "integers inside": (b":1\r\n", "protocol"),
    "too short": (b"", "timeout"),  # no reply at all
    "too long": (b"$-1\r\n$1\r\nx\r\n", "protocol"),  # a nil, then a reply nobody asked for
}


class HostileServer:
    """Greets redis-py's ``HELLO 3`` as a RESP3 server would, answers +OK to every other command
    but GET and GETRANGE, answered ``get``."""

    def __init__(self, get: bytes) -> None:
        self._get = get
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while line := reader.readline():
                args = []
                for _ in range(int(line[1:])):
                    size = int(reader.readline()[1:])
                    args.append(reader.read(size + 2)[:-2])
                command = args[0].upper()
                if command == b"HELLO":
                    reply = b"%1\r\n+proto\r\n:3\r\n"
                else:
                    reply = self._get if command in (b"GET", b"GETRANGE") else b"+OK\r\n"
                conn.sendall(reply)
        except (OSError, ValueError, IndexError):
            pass
        conn.close()

    def close(self) -> None:
        self._listener.close()


@pytest.mark.parametrize("tiered", [False, True], ids=["redis", "tiered"])
@pytest.mark.parametrize("reply", list(GET_REPLIES))
def test_malformed_replies_are_store_failures_never_answers(tiny_model, reply, tiered):
    server = HostileServer(GET_REPLIES[reply][0])
    stats = CacheStats()
    url = f"{'tiered+' if tiered else ''}redis://127.0.0.1:{server.port}"
    # The replies are malformed, not slow: only the one that never comes waits out the op timeout.
    # The others get a hang guard for one, so that a busy machine's slow reply is never counted as
    # "timeout" in place of the error the reply is (seen with 4 test processes on 2 CPUs).
    expects_timeout = GET_REPLIES[reply][1] == "timeout"
    store = open_store(url, StoreOptions(op_timeout_ms=250.0 if expects_timeout else 10_000.0), stats)
    engine = Engine.load(tiny_model, EngineOptions(block_size=16), store, stats, "cpu", 2)
    try:
        ids = np.random.default_rng(3).integers(3, 512, size=50).tolist()
        cold = collect(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True,
                                                 cache=CacheControl(skip_read=True, skip_write=True)))[0]
        for _ in range(2):  # a tiered store's L1 may serve the first request's own blocks to the second
            tokens, last = collect(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True))
            assert tokens == cold
            assert tiered or last.usage.cached_prompt_tokens == 0
        errors = set(stats.snapshot()["store_errors"])
        # Extra replies still on their way when the pipeline's last one is read are seen by a
        # later command instead (timing): one way or the other, only checked values are used.
        assert errors == {GET_REPLIES[reply][1]} or (reply == "too long" and errors <= {"protocol"})
    finally:
        engine.close()
        server.close()
        asyncio.set_event_loop(None)
