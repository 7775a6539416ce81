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
    writing its first positions faults no page."""
    spec = load_model_spec(tiny_model)
    slots = open_slots(DecoderSession(spec, "cpu", 1), 24, 8192)
    assert isinstance(slots, SharedSlots)
    tokens = 256
    row0 = slots._kv[:, :, 0, :, :tokens]
    row0[0, 0, 0, 5, 3] = 7.0
    assert slots.prefault(tokens) == row0.nbytes
    assert row0[0, 0, 0, 5, 3] == 7.0 and np.count_nonzero(row0) == 1
    assert slots.acquire(tokens).index == 0
    assert _faults_writing(row0, 1.0) == 0


def test_populate_faults_in_fresh_memory_that_writing_would_fault():
    """The counter's control, on memory known to be fresh and of small pages (an anonymous map,
    no huge pages asked for; numpy's large arrays ask for them, and a huge page may hold what a
    test thought untouched): writing half of it faults a page at a time; after ``populate``, the
    other half faults none."""
    import mmap

    pages = 256
    with mmap.mmap(-1, pages * mmap.PAGESIZE) as memory:
        array = np.frombuffer(memory, np.float32).reshape(2, pages // 2, mmap.PAGESIZE // 4)
        assert _faults_writing(array[0], 1.0) >= pages // 2
        assert populate(array[1:]) == array[1].nbytes
        assert _faults_writing(array[1], 1.0) == 0
        del array


def test_populate_refuses_nothing_it_cannot_do():
    """An empty view populates nothing; a view populates exactly its runs' bytes."""
    array = np.zeros((3, 5, 1024, 16), np.float32)
    assert populate(array[:, :, :0]) == 0
    assert populate(array[:, 1:3, :100]) == 3 * 2 * 100 * 16 * 4


def test_the_store_opens_the_connections_it_is_asked_for(redis_server, redis_url):
    store = open_store(redis_url, StoreOptions(), CacheStats())
    try:
        with redis_server.client() as client:
            # New connections by id: the session's Redis may still be closing connections of
            # earlier tests meanwhile, so a difference of counts could be short.
            before = {c["id"] for c in client.client_list()}
            store.ping(5)
            opened = {c["id"] for c in client.client_list()} - before
            assert len(opened) == 5
            store.ping(5)  # open ones are reused
            assert {c["id"] for c in client.client_list()} - before == opened
    finally:
        store.close()
