"""Warnings that cannot flood a log: the first of a kind is written, repeats within an interval are
counted and reported with the next one written."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """At most one record per ``interval_s`` seconds; the next one written says how many were held
    back. Thread-safe (store threads share one)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._held = 0

    def warning(self, message: str, *args: object) -> None:
        with self._lock:
            now = self._clock()
            if now - self._last < self._interval_s:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        if held:
            message += f" (and {held} more like it in the last {self._interval_s:g} s)"
        self._logger.warning(message, *args)
