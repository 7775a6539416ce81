"""Writes a model folder in ONNX Runtime GenAI's layout: genai_config.json, model.onnx, tokenizer.

Everything is derived from (preset, layout, seed, dtype), so two runs write the same bytes. Graphs
are built in float32 and converted at the end to ``dtype`` (services/modelbuild/graph_dtype.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from services.modelbuild import encdec_graph
from services.modelbuild.decoder_graph import (
    build_decoder_graph,
    past_names,
    present_names,
)
from services.modelbuild.graph_dtype import convert_model
from services.modelbuild.nbits_graph import use_blocks
from services.modelbuild.presets import (
    DECODER_PRESETS,
    ENCODER_DECODER_PRESETS,
    GGUF_WEIGHTS,
    DecoderShape,
    EncoderDecoderShape,
)
from services.modelbuild.tokenizer_build import build_tokenizer
from services.runtime.kv_layout import KVLayout

MODEL_FILE = "model.onnx"
ENCODER_FILE, DECODER_FILE = "encoder.onnx", "decoder.onnx"


def genai_config(shape: DecoderShape, layout: KVLayout, bos: int, eos: int, pad: int) -> dict:
    """The genai_config.json document: what ONNX Runtime GenAI and kvshare read to run the model."""
    if layout is KVLayout.SEPARATE:
        kv_inputs = {"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
        kv_outputs = {"present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
    else:
        kv_inputs, kv_outputs = {"past_names": "past_%d"}, {"present_names": "present_%d"}
    assert past_names(layout, 0)[0] == next(iter(kv_inputs.values())) % 0
    assert present_names(layout, 0)[0] == next(iter(kv_outputs.values())) % 0
    return {
        "model": {
            "bos_token_id": bos,
            "context_length": shape.context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE,
                "head_size": shape.head_size,
                "hidden_size": shape.hidden_size,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", **kv_inputs},
                "outputs": {"logits": "logits", **kv_outputs},
                "num_attention_heads": shape.num_heads,
                "num_hidden_layers": shape.num_layers,
                "num_key_value_heads": shape.num_kv_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": "llama" if layout is KVLayout.SEPARATE else "gpt2",
            "vocab_size": shape.vocab_size,
        },
        "search": search_options(shape.context_length, share_buffer=layout is KVLayout.SEPARATE),
    }


def search_options(context_length: int, share_buffer: bool) -> dict:
    return {
        "diversity_penalty": 0.0,
        "do_sample": False,
        "early_stopping": True,
        "length_penalty": 1.0,
        "max_length": context_length,
        "min_length": 0,
        "no_repeat_ngram_size": 0,
        "num_beams": 1,
        "num_return_sequences": 1,
        "past_present_share_buffer": share_buffer,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_k": 1,
        "top_p": 1.0,
    }


def encoder_decoder_config(shape: EncoderDecoderShape, bos: int, eos: int, pad: int) -> dict:
    """genai_config.json of the T5-like model, with ONNX Runtime GenAI's Whisper key names."""
    g = encdec_graph
    heads = {"head_size": shape.head_size, "hidden_size": shape.hidden_size,
             "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_heads}
    return {
        "model": {
            "bos_token_id": bos,
            "context_length": shape.context_length,
            "decoder_start_token_id": pad,
            "encoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": ENCODER_FILE,
                **heads,
                "num_hidden_layers": shape.encoder_layers,
                "context_length": shape.encoder_context_length,
                "inputs": {"input_ids": "input_ids"},
                "outputs": {"cross_present_key_names": g.CROSS_KEY, "cross_present_value_names": g.CROSS_VALUE},
            },
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": DECODER_FILE,
                **heads,
                "num_hidden_layers": shape.decoder_layers,
                "inputs": {
                    "input_ids": "input_ids",
                    "past_key_names": g.PAST_SELF_KEY,
                    "past_value_names": g.PAST_SELF_VALUE,
                    "cross_past_key_names": g.PAST_CROSS_KEY,
                    "cross_past_value_names": g.PAST_CROSS_VALUE,
                },
                "outputs": {"logits": "logits", "present_key_names": g.PRESENT_SELF_KEY,
                            "present_value_names": g.PRESENT_SELF_VALUE},
            },
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": "t5",
            "vocab_size": shape.vocab_size,
        },
        "search": search_options(shape.context_length, share_buffer=False),
    }


def write_encoder_decoder_folder(out_dir: Path, preset: str, seed: int = 0, dtype: str = "float32") -> Path:
    """Builds the seeded T5-like encoder-decoder ``preset`` into ``out_dir`` (created), its float
    tensors in ``dtype`` (graph_dtype.MODEL_DTYPES)."""
    shape = ENCODER_DECODER_PRESETS[preset]
    tok = build_tokenizer(shape.vocab_size, seed=seed)
    encoder, decoder = encdec_graph.build_encoder_decoder(shape, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ENCODER_FILE).write_bytes(convert_model(encoder, dtype).SerializeToString())
    (out_dir / DECODER_FILE).write_bytes(convert_model(decoder, dtype).SerializeToString())
    config = encoder_decoder_config(shape, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    _write_common(out_dir, config, tok)
    return out_dir


def _write_common(out_dir: Path, config: dict, tok) -> None:
    (out_dir / "genai_config.json").write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    (out_dir / "tokenizer.json").write_text(tok.tokenizer_json, encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(tok.tokenizer_config_json, encoding="utf-8")


def write_decoder_folder(out_dir: Path, preset: str, layout: KVLayout, seed: int = 0, dtype: str = "float32") -> Path:
    """Builds the seeded decoder ``preset`` into ``out_dir`` (created), its float tensors in
    ``dtype`` (graph_dtype.MODEL_DTYPES), and returns the folder."""
    shape = DECODER_PRESETS[preset]
    tok = build_tokenizer(shape.vocab_size, seed=seed)
    model = convert_model(build_decoder_graph(shape, layout, seed=seed), dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MODEL_FILE).write_bytes(model.SerializeToString())
    _write_common(out_dir, genai_config(shape, layout, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id), tok)
    return out_dir


def write_gguf_folder(gguf_path: Path, out_dir: Path, weights: str = "fp32", dtype: str = "float32") -> Path:
    """Converts a Llama or Gemma 3 GGUF into a folder kvshare and ONNX Runtime GenAI both load:
    model.onnx with its weights beside it in model.onnx.data (ONNX external data: the protobuf
    stays small, and no 2 GiB limit). ``weights`` (GGUF_WEIGHTS): ``gguf`` (the file's own
    Q4_0/Q4_1/Q8_0 blocks as MatMulNBits, exactly: services/modelbuild/gguf_blocks.py; other block
    types dequantized; the embedding's float copy stays for its Gather), ``fp32`` (the dequantized
    weights), or ``int8`` (MatMulNBits, 8 bits, blocks of 32, accuracy level 4: re-quantized by ONNX
    Runtime's own quantizer; the embedding and Llama's tied head stay float). ``dtype``: the
    element type of everything else (activations, K/V, logits, norm weights, and with MatMulNBits
    the scales), as GenAI's int4/int8 CUDA models pair MatMulNBits with float16. int8 changed
    SmolLM2's answers (the capital of France under the template's default system message); gguf
    keeps llama.cpp's (tests/test_real_model.py)."""
    from services.modelbuild.gemma_graph import build_gemma_graph
    from services.modelbuild.gguf_architectures import ARCHITECTURES
    from services.modelbuild.gguf_model import GGUFError, read_gguf
    from services.modelbuild.gguf_tokenizer import stop_token_ids, tokenizer_from_gguf

    if weights not in GGUF_WEIGHTS:
        raise ValueError(f"weights {weights!r} is not one of {', '.join(GGUF_WEIGHTS)}")
    source = read_gguf(gguf_path, keep_blocks=weights == "gguf")
    try:
        tok = tokenizer_from_gguf(source)
        if source.architecture == "gemma3":
            model = build_gemma_graph(source.shape, seed=0, weights=source.weights)
        else:
            model = build_decoder_graph(source.shape, KVLayout.SEPARATE, seed=0, weights=source.weights,
                                        tied_head=source.tied_head)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own types
        raise GGUFError(f"its tensors or vocabulary do not fit a {source.architecture} decoder "
                        f"({type(exc).__name__}: {exc})") from exc
    if weights == "int8":
        model = quantize_int8(model)
    elif weights == "gguf":
        use_blocks(model, source.blocks)
    model = convert_model(model, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, out_dir / MODEL_FILE, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{MODEL_FILE}.data", size_threshold=1024)
    # onnx creates the data file owner-only; readable as model.onnx is (an image's server runs as another user).
    (out_dir / f"{MODEL_FILE}.data").chmod((out_dir / MODEL_FILE).stat().st_mode & 0o777)
    config = genai_config(source.shape, KVLayout.SEPARATE, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    config["model"]["type"] = ARCHITECTURES[source.architecture].genai_type
    stops = stop_token_ids(source)
    if len(stops) > 1:  # llama.cpp ends at each of them; GenAI and kvshare take the list too
        config["model"]["eos_token_id"] = stops
    _write_common(out_dir, config, tok)
    return out_dir


def quantize_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every MatMul with a weight initializer becomes MatMulNBits (8 bits, symmetric, blocks of 32,
    accuracy level 4: int8 activations on CPU), and so does a Gemm head on the tied embedding
    (Gemma 3: its own 8-bit copy, 168 MB beside the float embedding the Gather reads; decode after
    1,000 tokens 45 tok/s against 28 with a float head, 2 threads). Llama's tied head, a Transpose
    of the embedding, stays float."""
    # Through services.runtime.ort first: without ONNX Runtime, its error names the extras to install.
    from services.runtime.ort import onnxruntime  # noqa: F401
    # isort: split
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer_log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quantizer_log.level
    quantizer_log.setLevel(logging.WARNING)  # it logs three INFO lines per matmul
    _gemm_heads_as_matmuls(model)
    try:
        quantizer = MatMulNBitsQuantizer(model, bits=8, block_size=32, is_symmetric=True, accuracy_level=4)
        quantizer.process()
    finally:
        quantizer_log.setLevel(level)
    return quantizer.model.model


def _gemm_heads_as_matmuls(model: onnx.ModelProto) -> None:
    """Each two-input Gemm with ``transB`` on a weight initializer becomes a MatMul on the
    weight's transpose, which the quantizer takes (MatMulNBits keeps B as ``[N, K]``, so no
    transposed float copy survives quantization)."""
    weights = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm" and len(node.input) == 2 and node.input[1] in weights and attrs == {"transB": 1}:
            transposed = f"{node.input[1]}_transposed"
            values = numpy_helper.to_array(weights[node.input[1]]).T
            model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(values), transposed))
            node.op_type, node.input[1] = "MatMul", transposed
            del node.attribute[:]
