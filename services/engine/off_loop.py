"""Work that must not run on the event loop (rendering, tokenizing, detokenizing thousands of
log-probabilities), on a few threads of its own: the Rust tokenizer releases the GIL, so a
megabyte-sized prompt blocks neither the loop nor the scheduler. Audio (decoding, resampling,
log-mel: up to ~1.4 s of CPU for a 30-s file) and Tokenize calls have pools of their own, so that
no request's tokenizing ever waits behind them; ``services.engine.door`` bounds the calls they
hold.

Each pool serves its clients in turn (``fair_share.client_of``), not in arrival order: a call
waits for the calls running and at most one more of each other client, where a first-come queue
made it wait behind all of another client's (an audio flood held another tenant's clip 6 s).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_Item = tuple[Callable[[Any], Any], Any, asyncio.AbstractEventLoop, asyncio.Future]


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # its caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class OffLoop:
    """``threads`` threads taking calls client by client. Invariant: the clients with calls
    waiting are served round robin, each client's calls in their order; a call whose caller was
    cancelled before a thread took it is skipped."""

    def __init__(self, threads: int, name: str = "tokenize") -> None:
        self._cond = threading.Condition()
        self._waiting: OrderedDict[str, deque[_Item]] = OrderedDict()
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    async def run(self, work: Callable[[T], R], arg: T, client: str = "") -> R:
        """``work(arg)`` on one of the threads, in ``client``'s turn, awaited on the caller's loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if self._closed:
                raise RuntimeError("this pool is closed")
            self._waiting.setdefault(client, deque()).append((work, arg, loop, future))
            self._cond.notify()
        return await future

    def _next(self) -> _Item | None:
        """The next call, its client's turn moved to the end (None: closed and nothing waits)."""
        with self._cond:
            while not self._waiting:
                if self._closed:
                    return None
                self._cond.wait()
            client, calls = self._waiting.popitem(last=False)
            item = calls.popleft()
            if calls:
                self._waiting[client] = calls
            return item

    def _serve(self) -> None:
        while (item := self._next()) is not None:
            work, arg, loop, future = item
            if future.cancelled():
                continue
            try:
                result, error = work(arg), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, as an executor would
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the caller's loop is closed: nobody waits for it
                pass

    def close(self) -> None:
        """Runs what is waiting, then ends the threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
