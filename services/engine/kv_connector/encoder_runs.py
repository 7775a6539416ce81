"""The worker's encoder runs on a cross K/V miss, on a thread of their own: never on the scheduler
thread, so the streams already decoding keep making tokens while a new encoder input is encoded,
and never on a read thread, which would hold the other rows' lookups back for as long. Requests
for the same encoder input (the same hash) while its run is queued or running share that run:
the same audio sent by several clients at once is encoded once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from cachestore.keys import BlockHash
from services.engine.sequence import Sequence

Encode = Callable[[], np.ndarray]
"""Runs the encoder on one sequence's input: its cross K/V in the model's K/V dtype, canonical
``[layers, 2, heads, encoder_tokens, head]`` (the runner's, which holds the session; any thread)."""


@dataclass(slots=True)
class _Run:
    """One queued or running encoder run and the sequences waiting for its cross K/V."""

    seqs: list[Sequence]
    future: Future | None = None


class EncoderRuns:
    """One encoder run at a time, in the order they were asked for. One thread: on a few cores
    (two, in the reference deployment) runs side by side would only share them, each ending later,
    and the decode steps would get less still; in order, so none waits behind later ones."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-encoder")
        self._lock = threading.Lock()
        self._pending: dict[BlockHash, _Run] = {}
        """Runs not yet ended, by encoder input hash (under ``_lock``)."""

    def start(self, seq: Sequence, encode: Encode) -> Future:
        """Queues the run of ``encode`` for ``seq``, or joins the pending run of the same encoder
        input, and returns it (also ``seq.kv.encoding``): its cross K/V, or its error, which
        ``KVConnectorWorker.load`` raises on the scheduler thread so that these requests alone
        fail. The run never touches a slot. A run whose every request ended before its turn does
        not encode (it holds None): their slots are free already, their rows never assembled."""
        key = seq.kv.encoder_hash
        with self._lock:
            run = self._pending.get(key)
            if run is not None:
                run.seqs.append(seq)
            else:
                run = self._pending[key] = _Run([seq])
                # Submitted under the lock, so a joiner always finds the run's future; the run
                # itself takes the lock only once it begins.
                run.future = self._pool.submit(self._work, key, run, encode)
        seq.kv.encoding = run.future
        return run.future

    def _work(self, key: BlockHash, run: _Run, encode: Encode) -> np.ndarray | None:
        with self._lock:  # decided with no one joining meanwhile: a later joiner starts a run of its own
            if all(s.aborted or s.done for s in run.seqs):
                del self._pending[key]
                return None
        try:
            return encode()
        finally:
            with self._lock:
                del self._pending[key]

    def close(self) -> None:
        """Drops the runs that have not begun (their requests have ended: the scheduler has
        stopped) and waits for the one in progress."""
        self._pool.shutdown(wait=True, cancel_futures=True)
