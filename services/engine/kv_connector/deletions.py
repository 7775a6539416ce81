"""Deletions of distrusted values (``KVConnectorWorker.distrust``): never dropped, and bounded.

A request whose first logits over cached K/V were not finite deletes the values it read and the
blocks it published over them, so that the next request publishes afresh. Those deletes used to
go through the publish queue's bounded path, which drops a write when the queue is full: under
a flood of poisoned prompts (when deleting matters most) the forged values stayed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

from cachestore.store import KVStore
from services.engine.kv_connector.publish_queue import PublishQueue

MAX_GATHERED_KEYS = 16_384
"""Keys gathered and not yet deleted, at most (about 100 bytes each): at this many, the thread
adding more deletes them itself."""


class Deletions:
    """Keys to delete, gathered into one set (a key distrusted twice is deleted once) and deleted
    by one write job at a time, all of them in one ``DEL``.

    None is ever dropped: ``add`` never refuses keys and never waits for room. A key joins the set
    once the publishes it must follow are done (a done callback of the last one: a publish
    completed over forged K/V must not land after its delete); whenever the set gains keys and no
    job is waiting to start, one is started with ``PublishQueue.always``, which never drops, and
    it takes every key gathered by the time it runs. A job never waits on another write, so it
    cannot hold a write thread that a publish it follows needs.

    Memory is bounded: keys waiting for their publishes belong to publishes in the queue (which
    the queue bounds), and at ``max_keys`` gathered the thread adding keys (a write thread, or the
    scheduler's under a flood) deletes the whole set itself, synchronously. Once the write threads
    are shut down (the engine closing), the thread adding keys deletes them at once."""

    def __init__(self, store: KVStore, writes: PublishQueue, max_keys: int = MAX_GATHERED_KEYS) -> None:
        self._store = store
        self._writes = writes
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._keys: dict[str, None] = {}
        """Gathered, in the order they came (a dict: a set that keeps order)."""
        self._job_waiting = False
        """A job was started and has not taken the keys yet: keys gathered now are its too."""

    def add(self, keys: Sequence[str], after: Future | None) -> None:
        """Deletes ``keys`` once ``after`` (the sequence's last publish in flight, which follows its
        earlier ones) is done, failed or not; at once when None."""
        if after is None:
            self._gather(keys)
        else:
            after.add_done_callback(lambda _done: self._gather(keys))

    def _gather(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._keys.update(dict.fromkeys(keys))
            if len(self._keys) >= self._max_keys:
                overflow, self._keys = list(self._keys), {}
            else:
                overflow = None
                start, self._job_waiting = not self._job_waiting, True
        if overflow is not None:
            self._store.delete(overflow)
            return
        if start:
            try:
                self._writes.always(0, self._delete_gathered)
            except RuntimeError:  # the write threads were shut down: nobody else will delete them
                self._delete_gathered()

    def _delete_gathered(self) -> None:
        with self._lock:
            keys, self._keys = list(self._keys), {}
            self._job_waiting = False
        if keys:
            self._store.delete(keys)
