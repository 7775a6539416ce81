"""How the CUDA slot bank orders its copies, memory and sessions, shown without a GPU.

``CudaArrays`` runs here over the counting device (tests/counting_cuda.py: CuPy's calls on host
memory, each stream operation logged with its stream and thread) beside a CPU session of the tiny
model. What a CPU can show: a read thread's copies into a fetching slot go on the fetch stream,
after the slot's mark, and nobody waits for the compute stream on the host; the compute stream
waits for them on the device when the row begins (or is released); pinned staging is made with
the device current and held until its transfer has passed; a session that ONNX Runtime would put
on the CPU instead of CUDA is refused in one line that names the missing libraries; the bank's
start-up run leaves it as it was. tests/gpu runs the same code on a GPU.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from counting_cuda import CountingCupy

from services.errors import StartupError
from services.modelbuild.folder import write_decoder_folder
from services.runtime.device_arrays import CudaArrays, missing_cuda_libraries
from services.runtime.device_budget import DeviceBudget
from services.runtime.kv_layout import KVLayout
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import DecoderSession, open_session
from services.runtime.ort import onnxruntime as ort
from services.runtime.slots import SharedSlots

B = 8
BUDGET = DeviceBudget.split(8 << 30)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_decoder_folder(tmp_path_factory.mktemp("ordering") / "tiny", "tiny", KVLayout.SEPARATE)


@pytest.fixture
def cupy():
    return CountingCupy()


@pytest.fixture
def bank(tiny, cupy):
    """A bank of 2 rows whose arrays are on the counting device (its session runs on the CPU, so
    the bank's model runs cannot be used: only its copies)."""
    session = DecoderSession(load_model_spec(tiny), "cpu")
    session.device = CudaArrays(0, BUDGET, cupy_module=cupy)
    return SharedSlots(session, 2, 64)


def _blocks(bank: SharedSlots, count: int, seed: int = 0) -> list[np.ndarray]:
    spec = bank.session.spec
    rng = np.random.default_rng(seed)
    shape = (spec.num_layers, 2, spec.num_kv_heads, B, spec.head_size)
    return [rng.standard_normal(shape).astype(bank.session.kv_dtype) for _ in range(count)]


def _fetch_on_a_read_thread(bank: SharedSlots, slot, blocks) -> None:
    receive = bank.receiver(slot)
    thread = threading.Thread(target=lambda: [receive(i, b, slice(None)) for i, b in enumerate(blocks)],
                              name="kv-read-test")
    thread.start()
    thread.join()


def test_fetched_blocks_are_copied_on_the_fetch_stream_after_the_slots_mark_and_joined_on_the_device(bank, cupy):
    device, log = bank.device, cupy.log
    compute, fetch = device.stream.name, device.fetch_stream.name
    slot = bank.acquire(40)
    ready = slot.ready.id
    blocks = _blocks(bank, 3)
    _fetch_on_a_read_thread(bank, slot, blocks)
    read = [op for op in log.ops if op.thread == "kv-read-test" and op.stream is not None]
    assert read[0].what == "wait" and read[0].stream == fetch and read[0].event == ready, read[:2]
    assert {op.stream for op in read} == {fetch}, "a read thread enqueues only on the fetch stream"
    assert not [op for op in log.ops if op.thread == "kv-read-test" and op.what == "synchronize"], \
        "a read thread never waits on the host"
    assert [op.what for op in read].count("h2d") == 2, "block 0 is left to begin"

    before = len(log.ops)
    bank.begin(slot, blocks[:1], 3 * B)
    joined = log.ops[before:]
    assert joined[0].what == "record" and joined[0].stream == fetch
    assert joined[1].what == "wait" and joined[1].stream == compute and joined[1].event == joined[0].event
    assert all(op.stream == compute for op in joined[2:] if op.stream), "begin copies block 0 on the compute stream"
    assert not [op for op in log.ops if op.what == "synchronize"], "no one waits for a stream on the host"
    np.testing.assert_array_equal(bank._kv[:, :, slot.index, :, : 3 * B], np.concatenate(blocks, axis=3))


def test_a_fetch_released_before_it_began_is_joined_before_the_row_is_used_again(bank, cupy):
    device, log = bank.device, cupy.log
    slot = bank.acquire(40)
    _fetch_on_a_read_thread(bank, slot, _blocks(bank, 2))
    before = len(log.ops)
    bank.release(slot)
    released = log.ops[before:]
    assert [(op.what, op.stream) for op in released] == [("record", device.fetch_stream.name),
                                                          ("wait", device.stream.name)]
    again = bank.acquire(40)
    assert again.index == slot.index and again.ready.id > released[0].event, "the next owner's mark comes after"


def test_a_slot_without_fetched_blocks_joins_nothing(bank, cupy):
    slot = bank.acquire(40)
    bank.receiver(slot)
    before = len(cupy.log.ops)
    bank.begin(slot, [], 0)
    bank.release(slot)
    assert not [op for op in cupy.log.ops[before:] if op.what == "wait"]


def test_pinned_staging_is_made_with_its_device_current_on_any_thread(cupy):
    device = CudaArrays(1, BUDGET, cupy_module=cupy)
    target = device.zeros([2, 4], np.float16)
    thread = threading.Thread(target=lambda: device.copy_in(target[:, :2], np.ones((2, 2), np.float32),
                                                            device.fetch(device.mark())), name="kv-read-test")
    thread.start()
    thread.join()
    pinned = [op for op in cupy.log.ops if op.what == "pinned"]
    assert pinned and all(op.device == 1 for op in pinned), "a context on device 0 would be made otherwise"
    assert all(op.device == 1 for op in cupy.log.ops if op.thread == "kv-read-test"), "nor made current after"
    np.testing.assert_array_equal(np.asarray(target), [[1, 1, 0, 0], [1, 1, 0, 0]])


def test_pinned_staging_is_held_until_its_transfer_has_passed(cupy):
    device = CudaArrays(0, BUDGET, cupy_module=cupy)
    target = device.zeros([4, 4], np.float32)
    device.copy_in(target[0], np.ones(4, np.float32))
    (first_event, first), = device._staged
    device.copy_in(target[1], np.ones(4, np.float32))
    assert [held for _, held in device._staged] == [first, device._staged[1][1]], "not passed: both held"
    first_event.done = True
    device.copy_in(target[2], np.ones(4, np.float32))
    assert first_event not in [event for event, _ in device._staged]
    assert len(device._staged) == 2


def test_each_session_gets_its_arena_share_and_the_heuristic_convolution_search(cupy):
    device = CudaArrays(0, BUDGET, cupy_module=cupy)
    assert cupy.pool.limit == BUDGET.bank, "CuPy's pool is capped at the bank"
    assert device.default_kv_cache_bytes == BUDGET.slot_default
    (name, options), = device.session_providers(123456)
    assert name == "CUDAExecutionProvider"
    assert options["gpu_mem_limit"] == "123456"
    assert options["user_compute_stream"] == str(device.stream.ptr)
    assert options["cudnn_conv_algo_search"] == "HEURISTIC", "EXHAUSTIVE benchmarks on a request's path"


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                    reason="this ONNX Runtime has a CUDA provider, which would be handed the stand-in's stream")
def test_a_cuda_session_that_onnx_runtime_would_put_on_the_cpu_is_refused_in_one_line(tiny, cupy):
    device = CudaArrays(0, BUDGET, cupy_module=cupy)
    with pytest.raises(StartupError) as refused:
        open_session(tiny / "model.onnx", device, 1)
    message = str(refused.value)
    assert "\n" not in message
    assert "could not create its CUDA provider on cuda:0 and would run on CPUExecutionProvider" in message
    missing = missing_cuda_libraries()
    if missing:
        assert ", ".join(missing) + " cannot be loaded" in message, "names the libraries that do not load here"
    else:
        assert "ONNX Runtime's own log line above names the cause" in message
    assert "--dtype" not in message, "not the placement check's advice: the graph is not the problem"


def test_the_banks_first_run_leaves_it_as_it_was(tiny):
    session = DecoderSession(load_model_spec(tiny), "cpu")
    bank = SharedSlots(session, 2, 64)
    counted = dict(bank.device.copied.bytes)
    bank.warm_up()
    assert bank.free == 2 and not bank._lengths.any()
    assert bank.device.copied.bytes == counted
    slot = bank.acquire(8)
    assert slot.index == 0 and slot.length == 0


def test_a_bank_whose_device_operations_fail_stops_the_start_with_the_reason(bank):
    # On the counting device the bank's model runs fail (a CPU session cannot read device pointers),
    # as a run on a machine without CUDA headers fails compiling: either way, at start, in one message.
    with pytest.raises(StartupError, match="nvidia-cuda-runtime"):
        bank.warm_up()
    assert bank.free == 2


def test_a_copy_out_is_waited_for_on_a_write_thread_with_its_device_current_and_a_blocking_event(cupy):
    device = CudaArrays(1, BUDGET, cupy_module=cupy)
    source = device.zeros([2, 3, 4], np.float16)
    copy = device.copy_out(source, (slice(None), 1))
    thread = threading.Thread(target=copy.result, name="kv-write-test")
    thread.start()
    thread.join()
    waited, = [op for op in cupy.log.ops if op.thread == "kv-write-test"]
    assert waited.what == "synchronize" and waited.device == 1 and waited.stream == device.stream.name
    assert copy._wait is None and copy.result().shape == (2, 4)


def test_a_block_that_arrives_after_begin_is_not_copied(bank, cupy):
    slot = bank.acquire(40)
    receive = bank.receiver(slot)
    blocks = _blocks(bank, 2)
    bank.begin(slot, blocks[:1], B)
    before = len(cupy.log.ops)
    assert receive(1, blocks[1], slice(None)) is False
    assert not [op for op in cupy.log.ops[before:] if op.what == "h2d"], "the row is the runs' once it began"


def test_the_encoders_first_run_at_start_is_not_counted(tmp_path):
    from services.modelbuild.folder import write_encoder_decoder_folder
    from services.runtime.onnx_encoder import EncoderSession

    spec = load_model_spec(write_encoder_decoder_folder(tmp_path / "encdec", "tiny"))
    decoder = DecoderSession(spec, "cpu")
    encoder = EncoderSession(spec, decoder.device)
    encoder.warm_up()
    assert encoder.runs == 0
