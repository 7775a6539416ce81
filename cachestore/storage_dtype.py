"""The element type cached K/V is stored in, apart from the model's own K/V dtype.

A worker narrows its K/V to the storage dtype when it publishes and widens stored values into a
slot block by block when it fetches, so no request-sized intermediate is made.
The storage dtype is part of every key's namespace: workers storing different dtypes never read
each other's values, and the codec refuses a value whose dtype code is not the one expected.

Choices (``--cache-dtype``), measured in docs/benchmarks.md ("Storage dtype"):

- ``auto`` (default): a 16-bit model's own K/V dtype (its values, unchanged); for a float32
  model, ``float32`` where its matmuls round their activations to 8 bits, else ``float16``. The
  model decides, so the engine resolves it (``resolve``); the store only ever sees one of the
  three below.
- ``float16``: an 11-bit significand (relative rounding error at most 2^-11) over a
  range up to 65504, which the codec enforces for every dtype anyway; 2 bytes. Greedy answers
  over it equalled computing on every measured prompt of the bench model and SmolLM2.
- ``bfloat16``: float32's exponent range with an 8-bit significand (relative error at most 2^-8);
  2 bytes. Faster to convert, but on the bench model 0.2% of greedy positions changed.
- ``float32``: bit-identical to computing (float32 models); 4 bytes per element.

Conversions to and from float16 run in ONNX Runtime (``services.runtime.kv_cast``); this module
only names the dtypes, so that the store knows nothing of ONNX.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
STORAGE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": BFLOAT16,
}
AUTO = "auto"
DEFAULT = AUTO
CHOICES = (AUTO, *STORAGE_DTYPES)
"""``--cache-dtype``'s values."""


def resolve(name: str, model_dtype: np.dtype, quantized_activations: bool) -> str:
    """``--cache-dtype`` ``name`` for a model whose own K/V is ``model_dtype`` and whose matmuls
    do (or do not) round activations to 8 bits. ``auto`` becomes a 16-bit model's own dtype
    (exact), float32 for a float32 model that quantizes activations (its next activations turn
    float16's rounding of K/V into whole quantization steps: warm answers would drift from cold
    ones), float16 for the others; any other name stays."""
    if name != AUTO:
        return name
    own = np.dtype(model_dtype)
    if own.itemsize == 2 and own in STORAGE_DTYPES.values():
        return next(k for k, v in STORAGE_DTYPES.items() if v == own)
    return "float32" if quantized_activations else "float16"


def storage_dtype(name: str) -> np.dtype:
    """The dtype named by ``--cache-dtype`` (resolved: not ``auto``)."""
    try:
        return STORAGE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown cache dtype {name!r}; one of {', '.join(STORAGE_DTYPES)}") from None
