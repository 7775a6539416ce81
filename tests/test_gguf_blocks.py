"""``--weights gguf``: a GGUF's own quantized blocks, read into MatMulNBits without re-quantizing.

Each mapped block type must give back exactly the values llama.cpp's dequantization gives (gguf's
own ``dequantize``); a converted tiny Gemma 3 with Q4_1 and Q8_0 tensors must put every matmul on
those blocks (siblings fused, the query/key/value product packed into the attention) and, with
float activations, answer as the fp32 folder of the same file. The real model (SmolLM2, Q4_1 and
Q8_0) is held to llama.cpp's own greedy ids in tests/test_real_model.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gemma_reference import TinyGemma, tiny_tensors, write_tiny_gguf

from services.modelbuild.folder import write_gguf_folder
from services.modelbuild.gguf_blocks import MAPPED_TYPES, QuantBlocks, blocks_of
from services.runtime.ort import onnxruntime as ort

SHAPE = TinyGemma(hidden=32, ffn=64)
"""Every matmul's input width a multiple of the 32-value block."""


K_QUANTS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}
"""Bytes per super-block of 256 values, and where its float16 scales lie (gguf-py cannot quantize these)."""


def _raw_blocks(kind: str, rows: int, columns: int) -> np.ndarray:
    """A tensor of ``kind``'s blocks: gguf's own quantization where it has one; else random bytes
    with finite float16 scales (every byte pattern is a valid K-quant block otherwise)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(5)
    if kind not in K_QUANTS:
        values = rng.standard_normal((rows, columns)).astype(np.float32) * 3
        values[3, :32] = 0.0  # a block of zeros: scale 0
        return quantize(values, GGMLQuantizationType[kind])
    size, scales = K_QUANTS[kind]
    raw = rng.integers(0, 256, (rows, columns // 256, size), dtype=np.uint8)
    for at in scales:
        halves = rng.uniform(1e-3, 0.05, raw.shape[:2]).astype(np.float16)
        raw[..., at : at + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", MAPPED_TYPES)
def test_each_mapped_block_type_gives_back_llama_cpps_values(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, columns = 24, 512
    raw = _raw_blocks(kind, rows, columns)
    blocks = blocks_of(kind, raw, rows, columns)
    assert blocks is not None and blocks.shape == (rows, columns) and blocks.data.dtype == np.uint8
    assert np.array_equal(blocks.dequantize(), dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, columns))
    assert np.array_equal(blocks.rows(np.arange(rows)[::-1]).dequantize(), blocks.dequantize()[::-1])
    assert blocks_of("Q5_K", raw, rows, columns) is None and blocks_of(kind, raw, rows, columns - 16) is None


def test_stacked_blocks_are_the_parts_outputs_in_order():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(6)
    parts = [blocks_of("Q4_1", quantize(rng.standard_normal((n, 64)).astype(np.float32), GGMLQuantizationType.Q4_1), n, 64)
             for n in (8, 4, 4)]
    stacked = QuantBlocks.stacked(parts)
    assert np.array_equal(stacked.dequantize(), np.concatenate([p.dequantize() for p in parts]))


TYPES = {name: ("Q8_0" if name in ("token_embd.weight",) or name.endswith("attn_v.weight") else "Q4_1")
         for name in tiny_tensors(SHAPE, seed=3) if name == "token_embd.weight" or
         name.split(".")[-2] in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(gguf folder, fp32 folder) of one tiny Gemma 3 GGUF with Q4_1 and Q8_0 tensors."""
    root = tmp_path_factory.mktemp("gguf-blocks")
    source = write_tiny_gguf(root / "tiny.gguf", SHAPE, tiny_tensors(SHAPE, seed=3), types=TYPES)
    return (write_gguf_folder(source, root / "gguf", weights="gguf"),
            write_gguf_folder(source, root / "fp32", weights="fp32"))


def _logits(model: onnx.ModelProto | str, ids: list[int]) -> np.ndarray:
    session = ort.InferenceSession(model if isinstance(model, str) else model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    feed = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for i in range(SHAPE.layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = np.zeros((1, SHAPE.kv_heads, 0, SHAPE.head), np.float32)
    return session.run(["logits"], feed)[0].reshape(-1)


def test_every_matmul_reads_the_files_blocks_and_answers_as_the_float_folder(folders):
    """Per layer one MatMulNBits for query and key side by side (Q4_1; then split: Gemma normalizes
    each head before the attention), one for value (Q8_0: other bits, not fused), one for the
    output projection, one for gate and up side by side (then split), one for down; one for the
    tied head; no float matmul weight left but the embedding the Gather reads. (A Llama graph
    hands the packed query/key/value product to the attention whole: SmolLM2 in
    tests/test_real_model.py.) With
    float activations (accuracy level 1) the logits are the fp32 folder's to float rounding; at
    the folder's own level 4 (int8 activations, as llama.cpp) they stay near them."""
    gguf, fp32 = folders
    model = onnx.load(str(gguf / "model.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 5 * SHAPE.layers + 1 and "Gemm" not in ops
    assert ops.count("Split") == 2 * SHAPE.layers
    floats = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2
              and min(t.dims) >= 32}
    assert floats == {"model.embed_tokens.weight"}
    assert {a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
            if a.name == "accuracy_level"} == {4}
    ids = np.random.default_rng(2).integers(4, len(SHAPE.vocab), 19).tolist()
    want = _logits(str(fp32 / "model.onnx"), ids)
    assert np.abs(_logits(model, ids) - want).max() < 0.1 * np.abs(want).max()
    for node in model.graph.node:
        for attribute in node.attribute:
            if node.op_type == "MatMulNBits" and attribute.name == "accuracy_level":
                attribute.i = 1
    assert np.abs(_logits(model, ids) - want).max() < 1e-4 * np.abs(want).max()


def test_fetch_model_defaults_to_the_folder_that_keeps_the_caches_guarantee():
    """gguf is faster and follows llama.cpp, and its answers do not depend on how the prompt was
    split (tests/test_prompt_split_invariance.py, bit for bit): the default."""
    from services.local.model_catalogue import CATALOGUE, default_weights

    assert default_weights("smollm2-135m-instruct") == "gguf"
    assert default_weights("smollm2-135m-instruct", "float16") == "fp32"  # measured on the CPU only
    assert default_weights("gemma-3-270m") == "gguf"  # llama.cpp's ids: tests/test_gemma.py
    assert all(entry.default_weights in entry.weights for entry in CATALOGUE.values())


def test_a_graph_that_quantizes_activations_is_recognised(folders):
    """What ``--cache-dtype auto`` and answer publishing go by: MatMulNBits at accuracy level 4
    (the gguf folder), or a dynamic quantization node (``quantize_dynamic``); not float matmuls."""
    from onnx import helper

    from services.runtime.layer_windows import quantizes_activations
    from services.runtime.model_spec import load_model_spec

    gguf, fp32 = folders
    assert load_model_spec(gguf).quantized_activations and not load_model_spec(fp32).quantized_activations
    dynamic = helper.make_graph([helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "scale", "zero"])], "g", [], [])
    assert quantizes_activations(dynamic)
