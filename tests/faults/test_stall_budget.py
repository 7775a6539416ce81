"""The stall budget's mechanism (``cachestore.budget``, ``cachestore.redis_budget``): what each
wait of a Redis call is given and charged, on a real redis-server stopped with SIGSTOP, and one
pass of the waits' thread spending one budget. ``test_store_stall.py`` holds the bound a request
meets end to end.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
from redis.connection import Connection
from test_store_stall import OP_TIMEOUT_MS, redis, timed_out_waits  # noqa: F401 - fixtures

from cachestore import budget, redis_budget
from cachestore.budget import StallBudget, spending
from cachestore.factory import REQUEST_OP_TIMEOUTS, StoreOptions, open_store
from cachestore.stats import CacheStats
from services.engine.run_waits import RunWait, RunWaits, WaitEnd


def test_a_redis_store_gives_each_request_the_documented_budget(redis):  # noqa: F811 - the fixture
    store = open_store(redis.url, StoreOptions(op_timeout_ms=OP_TIMEOUT_MS), CacheStats())
    assert store.stall_budget().seconds == pytest.approx(REQUEST_OP_TIMEOUTS * OP_TIMEOUT_MS / 1e3)
    assert open_store("memory://", StoreOptions(), CacheStats()).stall_budget() is None


def test_each_wait_gets_what_the_budget_has_left_and_none_starts_after(redis, timed_out_waits):  # noqa: F811
    """A budget of 1.5 op timeouts: the lookup's read waits one op timeout, its retry's handshake
    the half left; the lease claim and the next read never reach the socket."""
    stats = CacheStats()
    store = open_store(redis.url, StoreOptions(op_timeout_ms=OP_TIMEOUT_MS), stats)
    store.ping(2)
    store.put("k", b"v")
    allowed = StallBudget(1.5 * OP_TIMEOUT_MS / 1e3)
    redis.pause()
    try:
        timed_out_waits.clear()
        results = []

        def fetch():  # on a thread named like a read thread, so that its waits are recorded
            with spending(allowed):
                results.append((list(store.iter_many(["k"])), store.claim("lease", b"t", 1000), store.get("k")))

        thread = threading.Thread(target=fetch, name="kv-read_test")
        thread.start()
        thread.join()
    finally:
        redis.resume()
    assert results == [([], None, None)]
    assert timed_out_waits == pytest.approx([OP_TIMEOUT_MS / 1e3, OP_TIMEOUT_MS / 2e3])
    assert allowed.spent and allowed.timeouts == 2
    assert stats.budget_skipped == 2 and stats.store_errors == {"timeout": 1}
    with spending(store.stall_budget()):  # a fresh budget on an answering store: nothing cut
        assert store.get("k") == b"v"
    store.close()


def test_waiting_for_a_pooled_connection_is_a_wait_within_the_budget(redis):  # noqa: F811
    stats = CacheStats()
    store = open_store(redis.url, StoreOptions(op_timeout_ms=OP_TIMEOUT_MS, max_connections=1), stats)
    store.ping()
    pool = store.inner._client.connection_pool
    held = pool.get_connection()  # the only connection: every call waits for it to come free
    try:
        allowed = StallBudget(OP_TIMEOUT_MS / 2e3)
        with spending(allowed):
            assert store.get("k") is None
            assert store.get("k") is None
    finally:
        pool.release(held)
    assert allowed.charged == pytest.approx(OP_TIMEOUT_MS / 2e3) and allowed.timeouts == 1
    assert stats.store_errors == {"connection": 1} and stats.budget_skipped == 1
    store.close()


def test_one_pass_of_the_waits_thread_spends_one_budget_in_all():
    """Rows stepped one after another on the waits' thread: once one row's polls waited the pass's
    budget, the others' skip the store in that pass (their own budgets untouched)."""
    seen: dict[str, bool] = {}
    ended: dict[str, WaitEnd] = {}
    done = threading.Event()

    def wait(name: str, stall_s: float) -> RunWait:
        def fetch_more() -> int:
            seen.setdefault(name, budget.spent())
            if stall_s:
                budget.charge(stall_s)  # what a poll that timed out charges (the socket waits stand in here)
            return 0

        def end(outcome: WaitEnd) -> None:
            ended[name] = outcome
            if len(ended) == 2:
                done.set()

        return RunWait(fetch_more=fetch_more, missing=lambda: 1, held=lambda: False, cancelled=lambda: False,
                       compute_s=lambda blocks: 60.0, stall_s=60.0, first_stall_s=60.0, pace_blocks=1, on_end=end)

    waits = RunWaits(10.0, pass_budget=lambda: StallBudget(0.2))
    try:
        with waits._cond:  # both due in the same pass
            waits.add(wait("first", 0.2))
            waits.add(wait("second", 0.0))
        assert done.wait(30)
    finally:
        waits.close()
    assert seen == {"first": False, "second": True}
    assert ended == {"first": WaitEnd.RELEASED, "second": WaitEnd.RELEASED}


def test_the_budgeted_connections_use_only_redis_pys_public_api():
    """A private name of redis-py (an underscored attribute or method) may change in any release:
    ``redis_budget`` overrides none, and every underscored name it touches is one it defines."""
    tree = ast.parse(Path(redis_budget.__file__).read_text())
    own = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    own |= {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}
    own |= {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)}  # attributes it sets
    touched = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and node.attr.startswith("_") and not node.attr.startswith("__")}
    assert touched <= own, f"redis-py private names used: {sorted(touched - own)}"
    overridden = [name for name in vars(redis_budget._Budgeted) if hasattr(Connection, name)
                  and not name.startswith("__")]
    assert overridden and not [name for name in overridden if name.startswith("_")], overridden
