"""The pools off the event loop serve clients in turn: a client with many calls waiting delays
another client's call by one of its calls, not all of them. Gated by events, never timed."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.engine.off_loop import OffLoop


def test_clients_are_served_in_turn_each_in_its_own_order():
    pool = OffLoop(1, "test")
    gate, order = threading.Event(), []

    def work(name: str) -> str:
        if name == "a1":
            assert gate.wait(60)
        order.append(name)
        return name.upper()

    async def scenario() -> list[str]:
        calls = [asyncio.ensure_future(pool.run(work, f"a{i}", "a")) for i in range(1, 6)]
        await asyncio.sleep(0)
        calls.append(asyncio.ensure_future(pool.run(work, "b1", "b")))
        await asyncio.sleep(0)
        gate.set()
        return await asyncio.gather(*calls)

    try:
        answers = asyncio.run(scenario())
    finally:
        gate.set()
        pool.close()
    assert answers == ["A1", "A2", "A3", "A4", "A5", "B1"]
    assert order.index("b1") <= 2, f"b's call waited behind at most a1 (running) and one more of a's: {order}"
    assert [n for n in order if n.startswith("a")] == ["a1", "a2", "a3", "a4", "a5"]


def test_an_error_reaches_its_caller_and_the_pool_goes_on():
    pool = OffLoop(2, "test")

    def work(x: int) -> int:
        if x < 0:
            raise ValueError("negative")
        return x * 2

    async def scenario():
        with pytest.raises(ValueError, match="negative"):
            await pool.run(work, -1)
        return await asyncio.gather(*(pool.run(work, i, f"c{i % 3}") for i in range(10)))

    try:
        assert asyncio.run(scenario()) == [i * 2 for i in range(10)]
    finally:
        pool.close()
