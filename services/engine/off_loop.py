"""Work that must not run on the event loop (rendering, tokenizing, detokenizing thousands of
log-probabilities), on a few threads of its own: the Rust tokenizer releases the GIL, so a
megabyte-sized prompt blocks neither the loop nor the scheduler. Audio (decoding, resampling,
log-mel: up to ~1.4 s of CPU for a 30-s file) and Tokenize calls have pools of their own, so that
no request's tokenizing ever waits behind them; ``services.engine.door`` bounds the calls they
hold."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

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
