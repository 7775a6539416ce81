"""The bounded queue of writes to the store: publishes of K/V copied out of slots, cross K/V,
lease releases and deletions, run on the write threads, never on the token path."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from cachestore.stats import CacheStats


def after(publish: Future | None) -> None:
    """Blocks until ``publish`` (an earlier write of the same sequence) is done."""
    if publish is not None:
        wait_futures([publish])


class PublishQueue:
    """Writes on ``threads`` write threads, at most ``max_pending`` of them (and
    ``max_pending_bytes`` of the K/V they hold) waiting at once: a slow store, or answers of
    thousands of tokens finishing together, cannot make copies pile up in memory."""

    def __init__(self, threads: int, max_pending: int, max_pending_bytes: int, cache_stats: CacheStats) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-write")
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._cache_stats = cache_stats
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._pending_bytes = 0
        """Bytes the waiting publishes hold (K/V copies, cross K/V)."""

    def bounded(self, nbytes: int, prepare: Callable[[], Callable[[], object]]) -> Future | None:
        """Runs a publish holding ``nbytes`` on the write threads if there is room for it: fewer
        than ``max_pending`` wait, and their bytes stay within ``max_pending_bytes`` (one publish
        larger than that still goes when none waits, or a long prompt would never be shared).
        ``prepare`` (the copy out of a slot) runs here and returns the publish; without room the
        publish is dropped, counted, before anything is copied. Called on the scheduler thread
        only, so no other publish joins between the check and the submit. Returns the publish's
        future, or None when it was dropped."""
        with self._lock:
            full = len(self._pending) >= self._max_pending or (
                self._pending_bytes > 0 and self._pending_bytes + nbytes > self._max_pending_bytes)
            if full:
                self._cache_stats.add(publishes_dropped=1)
                return None
        return self.always(nbytes, prepare())

    def always(self, nbytes: int, job: Callable[[], object]) -> Future:
        """Runs ``job`` on the write threads whatever waits (a lease release: one left behind holds
        waiters back), counted among the pending writes (``drained``)."""
        with self._lock:
            self._pending_bytes += nbytes
            future = self._pool.submit(job)
            self._pending.add(future)
        future.add_done_callback(lambda done: self._done(done, nbytes))
        return future

    def _done(self, future: Future, nbytes: int) -> None:
        with self._lock:
            self._pending.discard(future)
            self._pending_bytes -= nbytes

    async def drained(self) -> None:
        """Returns once every write scheduled so far has reached the store (or failed), with the
        writes scheduled as those ended (``Deletions`` starts its job when a publish ends)."""
        awaited: set[Future] = set()
        while True:
            with self._lock:
                pending = [f for f in self._pending if f not in awaited]
            if not pending:
                return
            awaited.update(pending)
            await asyncio.gather(*(asyncio.wrap_future(f) for f in pending), return_exceptions=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
