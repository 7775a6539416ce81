"""Reads a GGUF file (llama.cpp's format) into what the folder writer needs: the decoder's shape,
float32 weights under the builder's names and in its orientation (``[in, out]`` for matmuls), and
the tokenizer's fields (vocabulary, scores or merges, token types, special ids, chat template).

The reader, the dequantization and the tokenizer fields are shared; each architecture
(services/modelbuild/gguf_architectures.py) reads its shape from its own keys and maps its tensors.
Anything the ONNX graph cannot represent is refused with a ``GGUFError`` naming it, never
approximated: another architecture, rope scaling, attention biases, a tokenizer other than
byte-level BPE with a known pre-tokenizer or SentencePiece, a rotary dimension other than the head
size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.modelbuild.gguf_architectures import ARCHITECTURES
from services.modelbuild.gguf_blocks import QuantBlocks, blocks_of
from services.modelbuild.gguf_fields import Fields, GGUFError
from services.modelbuild.presets import DecoderShape

# llama.cpp's pre-tokenizers, as the regular expressions it applies in order (llama-vocab.cpp).
# Only the ones whose byte-level BPE split the tokenizer writer can reproduce are listed.
PRE_TOKENIZERS = {
    "smollm": ("digits", "gpt2"),
    "gpt2": ("gpt2",),
}
TOKENIZER_MODELS = ("gpt2", "llama")
"""``tokenizer.ggml.model`` values converted: byte-level BPE with merges, SentencePiece with scores."""


@dataclass(slots=True)
class GGUFModel:
    name: str
    architecture: str
    """``general.architecture``: ``llama`` or ``gemma3``; says which graph builder takes ``shape``."""
    shape: DecoderShape
    weights: dict[str, np.ndarray]
    """float32, builder names (``model.layers.0.attn.q_proj.weight``), matmul weights ``[in, out]``."""
    blocks: dict[str, QuantBlocks]
    """The matmul weights (and the embedding, which a tied head multiplies by) whose GGUF block
    type maps exactly onto MatMulNBits, under their builder names; empty unless asked for."""
    tied_head: bool
    """No ``output.weight``: the output head is the token embedding, transposed."""
    tokenizer_model: str
    """``tokenizer.ggml.model``, one of TOKENIZER_MODELS."""
    tokens: list[str]
    token_types: list[int]
    """llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte."""
    scores: list[float] | None
    """SentencePiece's piece scores (``llama`` tokenizers); None where the file has none."""
    merges: list[str]
    """Byte-level BPE merges (``gpt2`` tokenizers); empty for SentencePiece."""
    pre_tokenizer: str
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    unknown_token_id: int | None
    add_bos_token: bool
    """Whether llama.cpp puts BOS before an encoded text (``tokenizer.ggml.add_bos_token``)."""
    add_space_prefix: bool
    """Whether SentencePiece prefixes the text with a space (``tokenizer.ggml.add_space_prefix``)."""
    chat_template: str | None


def read_gguf(path: Path, keep_blocks: bool = False) -> GGUFModel:
    """The model in ``path``; GGUFError (never another exception) for anything unreadable or
    refused. ``keep_blocks``: also keep the quantized matmul weights as blocks (``blocks``)."""
    try:
        return _read(path, keep_blocks)
    except GGUFError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError, OverflowError, OSError) as exc:
        raise GGUFError(f"not a readable GGUF model ({type(exc).__name__}: {exc})") from exc


def _read(path: Path, keep_blocks: bool) -> GGUFModel:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    arch = reader.fields.get("general.architecture")
    arch = arch.contents() if arch is not None else None
    if arch not in ARCHITECTURES:
        raise GGUFError(f"architecture {arch!r}: only {', '.join(map(repr, ARCHITECTURES))} can be converted")
    mapping = ARCHITECTURES[arch]
    fields = Fields(reader, arch)
    for key in mapping.refused_keys:
        if fields.has(key):
            raise GGUFError(f"{arch}.{key} is set: the graph has no way to represent it")
    tokens = list(fields.get("tokenizer.ggml.tokens"))
    shape = mapping.shape(fields, len(tokens))
    rotary = int(fields.arch_get("rope.dimension_count", shape.head_size))
    if rotary != shape.head_size:
        raise GGUFError(f"rotary dimension {rotary} is not the head size {shape.head_size}")
    tokenizer_model = fields.get("tokenizer.ggml.model")
    if tokenizer_model not in TOKENIZER_MODELS:
        raise GGUFError(f"tokenizer model {tokenizer_model!r}: only byte-level BPE ('gpt2') and SentencePiece ('llama') "
                        "are converted")
    pre = str(fields.get("tokenizer.ggml.pre", "gpt2" if tokenizer_model == "gpt2" else "default"))
    if tokenizer_model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise GGUFError(f"pre-tokenizer {pre!r} is not one of {sorted(PRE_TOKENIZERS)}")

    weights: dict[str, np.ndarray] = {}
    blocks: dict[str, QuantBlocks] = {}
    expected = reader.data_offset
    for tensor in reader.tensors:
        # llama.cpp's loader refuses data that is not packed in order, each tensor padded to the
        # alignment: a header whose offsets overlap or leave gaps lies about a tensor.
        if tensor.data_offset != expected:
            raise GGUFError(f"tensor {tensor.name} has its data at offset {tensor.data_offset}, expected {expected} "
                            "(overlapping or misplaced tensor data)")
        expected += -(-int(tensor.n_bytes) // reader.alignment) * reader.alignment
        with np.errstate(all="ignore"):
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if not np.isfinite(values).all():
            raise GGUFError(f"tensor {tensor.name} holds NaN or infinite values")
        quantized = blocks_of(tensor.tensor_type.name, tensor.data, *values.shape) if keep_blocks and values.ndim == 2 else None
        if quantized is not None:
            builder, quantized = mapping.blocks(tensor.name, quantized, shape)
            blocks[builder] = quantized
        name, values = mapping.tensor(tensor.name, values, shape)
        weights[name] = values
    template = fields.get("tokenizer.chat_template")
    scores = fields.get("tokenizer.ggml.scores")
    eos = int(fields.get("tokenizer.ggml.eos_token_id"))
    unknown = fields.get("tokenizer.ggml.unknown_token_id")
    return GGUFModel(
        name=str(fields.get("general.name", path.stem)), architecture=arch, shape=shape, weights=weights, blocks=blocks,
        tied_head="lm_head.weight" not in weights, tokenizer_model=tokenizer_model, tokens=tokens,
        token_types=[int(t) for t in fields.get("tokenizer.ggml.token_type")],
        scores=[float(s) for s in scores] if scores is not None else None,
        merges=list(fields.get("tokenizer.ggml.merges", [])), pre_tokenizer=pre,
        bos_token_id=int(fields.get("tokenizer.ggml.bos_token_id")), eos_token_id=eos,
        pad_token_id=int(fields.get("tokenizer.ggml.padding_token_id", eos)),
        unknown_token_id=int(unknown) if unknown is not None else None,
        # llama.cpp's default where the file says nothing: SentencePiece vocabularies put BOS first.
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", tokenizer_model == "llama")),
        add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", True)),
        chat_template=str(template) if template is not None else None,
    )
