"""Malformed GGUFs that the converter turns into a model silently different from the file's.

llama.cpp's loader (ggml's ``gguf_init_from_file``) refuses a file whose tensors' data offsets are
not each the previous tensor's end, padded to the alignment ("tensor '%s' has offset %d, expected
%d"): overlapping or gapped data means a header that lies about a tensor's type, shape or place.
The converter reads each tensor at its stated offset, so such a file converts, exit 0, into a
model whose weights are some other tensor's bytes. A block whose float16 scale is NaN or infinite
converts into a folder whose every logit is NaN. Either must be a ``GGUFError`` naming the tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
from gemma_reference import TinyGemma, tiny_tensors, write_tiny_gguf

from services.modelbuild.folder import write_gguf_folder
from services.modelbuild.gguf_model import GGUFError

SHAPE = TinyGemma(hidden=32, ffn=64)
QUANTIZED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _source(tmp_path):
    tensors = tiny_tensors(SHAPE, seed=3)
    types = {name: "Q4_1" for name in tensors if name.split(".")[-2] in QUANTIZED}
    return write_tiny_gguf(tmp_path / "tiny.gguf", SHAPE, tensors, types=types)


def _patched(path, change):
    from gguf import GGUFReader

    reader = GGUFReader(path, "r+")
    change({t.name: t for t in reader.tensors})
    reader.data.flush()
    return path


def _same_offset(tensors):
    """blk.0.attn_q's header points at blk.0.attn_k's bytes (same type and shape)."""
    tensors["blk.0.attn_q.weight"].field.parts[-1][0] = tensors["blk.0.attn_k.weight"].field.parts[-1][0]


def _nan_scale(tensors):
    """Row 3's first Q4_1 block of blk.0.attn_q gets the scale NaN (float16 0x7E00)."""
    tensors["blk.0.attn_q.weight"].data[3, 0:2] = np.array([0x7E00], np.uint16).view(np.uint8)


@pytest.mark.parametrize("weights", ["gguf", "fp32"])
@pytest.mark.parametrize(("change", "says"), [(_same_offset, "offset"), (_nan_scale, "blk.0.attn_q.weight")])
def test_a_gguf_whose_tensors_cannot_be_the_files_model_is_refused(tmp_path, weights, change, says):
    source = _patched(_source(tmp_path), change)
    with pytest.raises(GGUFError, match=says):
        write_gguf_folder(source, tmp_path / "out", weights=weights)
