"""What the slot bank copies, and in what order, counted by a numpy-backed device.

``CountingArrays`` is the host device (the same numpy code every CPU test runs) that also writes a
log of each copy (direction, bytes) and each model run. The bytes each operation moves must equal
what it needed: a warm request copies in exactly its cached tokens, a publish copies out exactly
its new blocks, a fork or a beam reorder copies only the rows' used tokens, and no copy is ever a
whole-capacity buffer. Also: where each node of a graph runs on a device is checked
(``placement``), and ``--device`` names a device or the worker does not start.
"""

import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import collect
from onnx import TensorProto, helper

from cachestore.memory import MemoryStore
from cachestore.stats import CacheStats
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import BeamSearch, GenerationRequest
from services.engine.sampling import SamplingConfig
from services.errors import ModelLoadError
from services.runtime.device_arrays import HostArrays
from services.runtime.device_choice import DeviceChoice
from services.runtime.ort import onnxruntime as ort
from services.runtime.placement import check_placement
from services.runtime.slots import SharedSlots

B = 16


class CountingArrays(HostArrays):
    """Host arrays that log every K/V copy as ``(direction, bytes)`` and every run as ``("run", 0)``."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int]] = []

    def copy_in(self, dest, block, fetch=None) -> None:
        super().copy_in(dest, block, fetch)
        self.log.append(("in", dest.nbytes))

    def copy_out(self, array, key):
        copy = super().copy_out(array, key)
        self.log.append(("out", copy.result().nbytes))
        return copy

    def copy_within(self, array, dest, src) -> None:
        before = self.copied.bytes["within"]
        super().copy_within(array, dest, src)
        self.log.append(("within", self.copied.bytes["within"] - before))

    def take(self) -> list[tuple[str, int]]:
        log, self.log = self.log, []
        return log


@pytest.fixture()
def counted(tiny_model):
    device = CountingArrays()
    engine = Engine.load(tiny_model, EngineOptions(block_size=B), MemoryStore(64 << 20), CacheStats(), device, 2)
    run = engine.session.run_binding

    def logged_run(binding, run_options=None):
        run(binding, run_options)
        device.log.append(("run", 0))

    engine.session.run_binding = logged_run
    yield engine, device
    engine.close()


def _bytes(log, direction):
    return sum(n for d, n in log if d == direction)


def test_cold_then_warm_copy_exactly_the_blocks_they_publish_and_fetch(counted):
    engine, device = counted
    assert isinstance(engine.slots, SharedSlots)
    per_token = engine.spec.kv_bytes_per_token(engine.session.kv_dtype.itemsize)
    row_bytes = engine.slots.max_seq * per_token
    ids = np.random.default_rng(1).integers(3, 500, size=3 * B + 5).tolist()
    request = GenerationRequest(prompt_token_ids=ids, max_new_tokens=4, ignore_eos=True)

    cold_tokens, _ = collect(engine, request)
    cold = device.take()
    assert _bytes(cold, "in") == 0 and _bytes(cold, "within") == 0
    assert _bytes(cold, "out") == 3 * B * per_token, "a publish copies out exactly the prompt's full blocks"
    first_out = next(i for i, (d, _) in enumerate(cold) if d == "out")
    assert any(d == "run" for d, _ in cold[:first_out]), "blocks are copied out after the run that computed them"

    warm_tokens, last = collect(engine, request)
    warm = device.take()
    assert warm_tokens == cold_tokens and last.usage.cached_prompt_tokens == 3 * B
    assert _bytes(warm, "in") == 3 * B * per_token, "a warm request copies in exactly its cached tokens"
    assert _bytes(warm, "out") == 0 and _bytes(warm, "within") == 0, "nothing new to publish"
    first_run = next(i for i, (d, _) in enumerate(warm) if d == "run")
    assert all(d != "in" for d, _ in warm[first_run:]), "every cached block is in the slot before the row's first run"
    assert all(n < row_bytes for _, n in cold + warm), "no copy is a whole-capacity buffer"
    assert engine.session.device.copied.bytes == {"in": 3 * B * per_token, "out": 3 * B * per_token, "within": 0}


def test_samples_and_beams_copy_only_the_used_tokens(counted):
    engine, device = counted
    per_token = engine.spec.kv_bytes_per_token(engine.session.kv_dtype.itemsize)
    ids = np.random.default_rng(2).integers(3, 500, size=B // 2).tolist()  # no full block, answers included: nothing published

    collect(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=5, ignore_eos=True, n=3,
                                      sampling=SamplingConfig(temperature=0.9, seed=5)))
    forks = device.take()
    assert [e for e in forks if e[0] != "run"] == [("within", len(ids) * per_token)] * 2, \
        "each of the 2 other samples gets one copy of the prompt's K/V, nothing more"

    beams, steps = 4, 6
    collect(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=steps, ignore_eos=True,
                                      beams=BeamSearch(beams)))
    reorders = [n for d, n in device.take() if d == "within"]
    forks, moves = reorders[: beams - 1], reorders[beams - 1 :]
    assert forks == [len(ids) * per_token] * (beams - 1)
    # A reorder moves the rows whose parent is another row, and only their generated tokens.
    assert moves and all(0 < n <= beams * (steps - 1) * per_token and n % per_token == 0 for n in moves)


def test_the_copy_counter_is_exported(counted):
    from prometheus_client import generate_latest

    from services.api.metrics import WorkerMetrics

    engine, _ = counted
    ids = np.random.default_rng(3).integers(3, 500, size=2 * B).tolist()
    collect(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=2, ignore_eos=True))
    text = generate_latest(WorkerMetrics(engine).registry).decode()
    per_token = engine.spec.kv_bytes_per_token(engine.session.kv_dtype.itemsize)
    assert f'kvshare_slot_copy_bytes_total{{direction="out"}} {float(2 * B * per_token)}' in text
    assert 'kvshare_slot_copy_bytes_total{direction="in"} 0.0' in text


def _shape_then_matmul() -> onnx.ModelProto:
    """``Shape -> Gather -> Cast`` (shape arithmetic) and a float ``MatMul`` (compute)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["d"], axis=0),
             helper.make_node("Cast", ["d"], ["n"], to=TensorProto.INT32),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor_value_info("n", TensorProto.INT32, []),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor("zero", TensorProto.INT64, [], [0]),
                               helper.make_tensor("w", TensorProto.FLOAT, [2, 2], [1, 0, 0, 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _assignment(model: onnx.ModelProto):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.get_provider_graph_assignment_info()


def test_compute_on_the_cpu_beside_a_device_is_refused_but_shape_arithmetic_may_stay(tiny_model, tmp_path):
    """Real assignments from a CPU session, checked as if a device provider had been asked for."""
    check_placement(tmp_path, _assignment(_shape_then_matmul()), "CPUExecutionProvider")
    with pytest.raises(ModelLoadError, match="1 MatMul would run on the CPU beside CUDAExecutionProvider"):
        check_placement(tmp_path, _assignment(_shape_then_matmul()), "CUDAExecutionProvider")
    shape_only = _shape_then_matmul()
    del shape_only.graph.node[3]
    del shape_only.graph.output[1]
    check_placement(tmp_path, _assignment(shape_only), "CUDAExecutionProvider")

    decoder = onnx.load(tiny_model / "model.onnx")
    with pytest.raises(ModelLoadError, match=r"GroupQueryAttention.*--dtype float16"):
        check_placement(tiny_model, _assignment(decoder), "CUDAExecutionProvider")


@pytest.mark.parametrize("text, parsed", [("cpu", DeviceChoice("cpu")), ("auto", DeviceChoice("auto")),
                                          ("cuda", DeviceChoice("cuda", 0)), ("CUDA:3", DeviceChoice("cuda", 3))])
def test_device_choices(text, parsed):
    assert DeviceChoice.parse(text) == parsed


@pytest.mark.parametrize("text", ["gpu", "cpu:", "cpu:0", "cuda:", "cuda:x", "cuda:²", "cuda:٣", "auto:1", ""])
def test_device_texts_that_name_no_device(text):
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
        DeviceChoice.parse(text)


@pytest.mark.parametrize("device, message", [
    ("cuda", "kvshare serve: --device cuda:0: this ONNX Runtime has no CUDA provider"),
    ("cuda:1", "kvshare serve: --device cuda:1: this ONNX Runtime has no CUDA provider"),
    ("tpu", "kvshare serve: --device 'tpu': expected auto, cpu, cuda or cuda:N"),
    ("cuda:²", "kvshare serve: --device 'cuda:²': expected auto, cpu, cuda or cuda:N"),
])
def test_a_device_that_cannot_be_used_stops_the_worker_with_one_line(tiny_model, device, message):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine's ONNX Runtime has a CUDA provider")
    done = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(tiny_model), "--port", "0",
                           "--device", device], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), done.stderr
    assert "kvshare listening" not in done.stdout
