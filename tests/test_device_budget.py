"""The arithmetic of a CUDA device's memory budget (``device_budget``), checked without a GPU: the
shares add up to the free memory and no more, an encoder-decoder model's two sessions split the
arenas by their weights, and the slots derived from the bank fit it."""

from __future__ import annotations

import pytest

from services.engine.engine import derived_max_batch
from services.modelbuild.folder import write_decoder_folder, write_encoder_decoder_folder
from services.runtime.device_budget import DeviceBudget
from services.runtime.kv_layout import KVLayout
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import model_graphs, weight_bytes

GIB = 1 << 30


@pytest.mark.parametrize("free", [1, 7, GIB + 3, 79 * GIB + 12345])
def test_the_shares_add_up_to_the_free_memory(free):
    budget = DeviceBudget.split(free)
    assert budget.reserve + budget.arenas + budget.bank == free
    assert min(budget.reserve, budget.arenas, budget.bank) >= 0
    assert budget.slot_default <= budget.bank


def test_the_split_of_an_80_gib_device():
    budget = DeviceBudget.split(80 * GIB)
    assert (budget.reserve, budget.arenas, budget.bank) == (8 * GIB, 32 * GIB, 40 * GIB)
    assert budget.slot_default == 36 * GIB, "--kv-cache-bytes 0: 45 per cent of the free memory"
    line = budget.describe()
    assert "80.00 GiB free" in line and "32.00 GiB for ONNX Runtime's arenas" in line and "36.00 GiB of slots" in line


def test_a_decoder_only_models_one_session_gets_every_arena_byte(tmp_path):
    spec = load_model_spec(write_decoder_folder(tmp_path / "tiny", "tiny", KVLayout.SEPARATE))
    budget = DeviceBudget.split(10 * GIB)
    graphs = model_graphs(spec)
    assert graphs == [spec.onnx_path]
    assert budget.arena(weight_bytes(spec.onnx_path), sum(map(weight_bytes, graphs))) == budget.arenas


def test_an_encoder_decoder_models_sessions_split_the_arenas_by_their_weights(tmp_path):
    spec = load_model_spec(write_encoder_decoder_folder(tmp_path / "encdec", "tiny"))
    budget = DeviceBudget.split(10 * GIB)
    decoder, encoder = (weight_bytes(path) for path in model_graphs(spec))
    assert decoder > 0 and encoder > 0
    arenas = [budget.arena(decoder, decoder + encoder), budget.arena(encoder, decoder + encoder)]
    assert sum(arenas) <= budget.arenas
    assert sum(arenas) >= budget.arenas - 1, "the split rounds down, losing at most a byte"
    assert arenas[0] / arenas[1] == pytest.approx(decoder / encoder, rel=1e-6)


def test_weight_bytes_counts_external_data(tmp_path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(np.ones((256, 256), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])], [weights])
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)
    assert weight_bytes(path) == path.stat().st_size + (tmp_path / "model.onnx.data").stat().st_size
    assert weight_bytes(path) >= 256 * 256 * 4


def test_slots_derived_from_the_bank_fit_in_it():
    budget = DeviceBudget.split(24 * GIB)
    per_token, context = 2 * 30 * 3 * 64 * 2, 8192  # SmolLM2-135M in float16
    slots = derived_max_batch(per_token, context, budget.slot_default)
    assert slots >= 1 and slots * per_token * context <= budget.bank
