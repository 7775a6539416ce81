"""Work that must not run on the event loop (rendering, tokenizing, detokenizing thousands of
log-probabilities), on a few threads of its own: the Rust tokenizer releases the GIL, so a
megabyte-sized prompt blocks neither the loop nor the scheduler. Audio (decoding, resampling,
log-mel: up to ~1.4 s of CPU for a 30-s file) has a pool of its own with a bound on the requests
it holds, so that no text request ever waits behind it and a flood of audio is refused at once
rather than held in memory."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.errors import Overloaded

T = TypeVar("T")
R = TypeVar("R")


class OffLoop:
    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    async def run(self, work: Callable[[T], R], arg: T) -> R:
        """``work(arg)`` on one of the threads, awaited on the caller's loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, work, arg)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class BoundedOffLoop(OffLoop):
    """An ``OffLoop`` that holds at most ``capacity`` calls (running or waiting for a thread);
    one more raises ``Overloaded`` at once. ``what`` names the work and the flag in the message.
    Counted on the event loop, the only caller: no lock. A cancelled call stops counting at once,
    though its work, once begun, runs on: at most ``capacity`` + ``threads`` are in memory."""

    def __init__(self, threads: int, capacity: int, what: str) -> None:
        super().__init__(threads)
        self.capacity, self._what = capacity, what
        self.holding = 0

    async def run(self, work: Callable[[T], R], arg: T) -> R:
        if self.holding >= self.capacity:
            raise Overloaded(f"{self.holding} {self._what} already being prepared or waiting; retry later or on "
                             "another replica")
        self.holding += 1
        try:
            return await super().run(work, arg)
        finally:
            self.holding -= 1
