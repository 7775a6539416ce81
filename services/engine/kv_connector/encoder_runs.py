"""The worker's encoder runs on a cross K/V miss, on a thread of their own: never on the scheduler
thread, so the streams already decoding keep making tokens while a new encoder input is encoded,
and never on a read thread, which would hold the other rows' lookups back for as long."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from services.engine.sequence import Sequence

Encode = Callable[[], np.ndarray]
"""Runs the encoder on one sequence's input: its cross K/V in the model's K/V dtype, canonical
``[layers, 2, heads, encoder_tokens, head]`` (the runner's, which holds the session; any thread)."""


class EncoderRuns:
    """One encoder run at a time, in the order they were asked for. One thread: on a few cores
    (two, in the reference deployment) runs side by side would only share them, each ending later,
    and the decode steps would get less still; in order, so none waits behind later ones."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-encoder")

    def start(self, seq: Sequence, encode: Encode) -> Future:
        """Queues the run of ``encode`` for ``seq`` and returns it (also ``seq.kv.encoding``): its
        cross K/V, or its error, which ``KVConnectorWorker.load`` raises on the scheduler thread
        so that this request alone fails. The run never touches a slot. A request that ended
        before its run's turn is not encoded (the run holds None): its slot is free already, and
        its row is never assembled."""

        def run() -> np.ndarray | None:
            return None if seq.aborted or seq.done else encode()

        seq.kv.encoding = future = self._pool.submit(run)
        return future

    def close(self) -> None:
        """Drops the runs that have not begun (their requests have ended: the scheduler has
        stopped) and waits for the one in progress."""
        self._pool.shutdown(wait=True, cancel_futures=True)
