"""A fresh worker readies what its first warm request would otherwise pay for (``Engine.warm_up``):
the first slot row's memory faulted in without being written, and the store's connections open.

Counted, never timed: page faults of the writing thread (``getrusage``) and Redis' own client list.
"""

from __future__ import annotations

import resource

import numpy as np
import pytest

from cachestore.factory import StoreOptions, open_store
from cachestore.stats import CacheStats
from services.runtime.memory import populate
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import DecoderSession
from services.runtime.slots import SharedSlots, open_slots

pytestmark = pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="per-thread fault counts are Linux's")


def _faults_writing(view: np.ndarray, value: float) -> int:
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    view[...] = value
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_the_first_row_is_faulted_in_unchanged_and_then_writes_fault_nothing(tiny_model):
    """Row 0 (the row ``acquire`` hands out first) after ``prefault``: its values are what they
    were (a value written before is still there: the kernel populates, it does not zero), and
    writing its first positions faults no page; the same positions of a middle row, never
    touched, do fault. (Not a neighbour of a row 0: numpy asks for transparent huge pages on large
    arrays, and a 2 MiB page around row 0 of one layer may hold row 1, or the previous layer's last
    row; with huge pages one fault may cover several runs, so the count is only known to be
    positive.)"""
    spec = load_model_spec(tiny_model)
    # 24 rows of 8,192 positions: a buffer past the largest mmap threshold glibc adapts to (32
    # MiB), so its pages are fresh (a smaller one may come from the heap, zeroed by writing:
    # already faulted in).
    slots = open_slots(DecoderSession(spec, "cpu", 1), 24, 8192)
    assert isinstance(slots, SharedSlots)
    tokens = 256
    row0, far = slots._kv[:, :, 0, :, :tokens], slots._kv[:, :, 12, :, :tokens]  # 12 MiB from any row 0
    row0[0, 0, 0, 5, 3] = 7.0
    assert slots.prefault(tokens) == row0.nbytes
    assert row0[0, 0, 0, 5, 3] == 7.0 and np.count_nonzero(row0) == 1
    assert slots.acquire(tokens).index == 0
    assert _faults_writing(row0, 1.0) == 0
    assert _faults_writing(far, 1.0) > 0


def test_populate_refuses_nothing_it_cannot_do():
    """An empty view populates nothing; a view populates exactly its runs' bytes."""
    array = np.zeros((3, 5, 1024, 16), np.float32)
    assert populate(array[:, :, :0]) == 0
    assert populate(array[:, 1:3, :100]) == 3 * 2 * 100 * 16 * 4


def test_the_store_opens_the_connections_it_is_asked_for(redis_server, redis_url):
    store = open_store(redis_url, StoreOptions(), CacheStats())
    try:
        with redis_server.client() as client:
            before = len(client.client_list())
            store.ping(5)
            assert len(client.client_list()) - before == 5
            store.ping(5)  # open ones are reused
            assert len(client.client_list()) - before == 5
    finally:
        store.close()
