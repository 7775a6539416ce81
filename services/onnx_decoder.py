"""One ONNX Runtime session of a decoder model, run one step at a time with a KV cache.

The session is shared by every stream on a worker (``InferenceSession.run*`` is thread-safe); the
cache of each stream lives in its own ``KVCache``. Presents are bound as device outputs and fed
back as the next step's past without a host round trip, so K/V stays on the GPU under CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from services.errors import ModelLoadError
from services.model_spec import ModelSpec
from services.modelbuild.presets import KVLayout

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}


@dataclass(slots=True)
class KVCache:
    """Past self-attention K/V of one sequence, in the model's past-input order.

    ``values`` are OrtValues on the session's device; ``length`` is how many tokens they hold.
    """

    values: list[ort.OrtValue]
    length: int


def choose_providers(requested: str) -> list[str]:
    """Execution providers for ``requested`` ("auto", "cpu" or "cuda"), best first."""
    available = ort.get_available_providers()
    if requested == "cpu":
        return [CPU]
    if requested == "cuda" and CUDA not in available:
        raise ModelLoadError("execution provider 'cuda' requested but onnxruntime-gpu with CUDA is not installed")
    return [CUDA, CPU] if CUDA in available else [CPU]


class DecoderSession:
    """Runs a decoder on token ids after a cached past; knows nothing of requests or the network."""

    def __init__(self, spec: ModelSpec, execution_provider: str = "auto", intra_op_threads: int = 0) -> None:
        self.spec = spec
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(
                str(spec.onnx_path), sess_options=options, providers=choose_providers(execution_provider)
            )
        except (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidGraph,
                ort.capi.onnxruntime_pybind11_state.NoSuchFile, ort.capi.onnxruntime_pybind11_state.InvalidProtobuf) as exc:
            raise ModelLoadError(f"{spec.onnx_path}: ONNX Runtime cannot load it: {exc}") from exc
        # ONNX Runtime silently falls back to CPU when CUDA is listed but no GPU can be used.
        self.execution_provider = self._session.get_providers()[0]
        self._device = ("cuda", 0) if self.execution_provider == CUDA else ("cpu", 0)
        types = {i.name: i.type for i in self._session.get_inputs()}
        self._check_names(types)
        self._ids_dtype = _ORT_TYPES[types[spec.input_ids_name]]
        self._mask_dtype = _ORT_TYPES[types[spec.attention_mask_name]] if spec.attention_mask_name in types else None
        self._pos_dtype = _ORT_TYPES[types[spec.position_ids_name]] if spec.position_ids_name in types else None
        self.kv_dtype = np.dtype(_ORT_TYPES[types[spec.kv.flat_past[0]]])
        log.info("model %s on %s (kv %s, layout %s)", spec.name, self.execution_provider, self.kv_dtype, spec.kv.layout)

    def _check_names(self, input_types: dict[str, str]) -> None:
        outputs = {o.name for o in self._session.get_outputs()}
        missing = [n for n in [self.spec.input_ids_name, *self.spec.kv.flat_past] if n not in input_types]
        missing += [n for n in [self.spec.logits_name, *self.spec.kv.flat_present] if n not in outputs]
        if missing:
            raise ModelLoadError(f"{self.spec.onnx_path}: genai_config.json names tensors the graph lacks: {missing}")

    def empty_cache(self) -> KVCache:
        """A cache holding no tokens, in the model's own layout."""
        shape = [1, self.spec.num_kv_heads, 0, self.spec.head_size]
        if self.spec.kv.layout is KVLayout.COMBINED:
            shape = [2, *shape]
        empty = np.zeros(shape, dtype=self.kv_dtype)
        return KVCache(
            values=[ort.OrtValue.ortvalue_from_numpy(empty, *self._device) for _ in self.spec.kv.flat_past],
            length=0,
        )

    def to_canonical(self, cache: KVCache, tokens: int) -> np.ndarray:
        """The first ``tokens`` of ``cache`` as one host array ``[layers, 2, kv_heads, tokens, head]``."""
        arrays = [value.numpy() for value in cache.values]
        if self.spec.kv.layout is KVLayout.SEPARATE:
            layers = [np.stack([arrays[2 * i][0], arrays[2 * i + 1][0]]) for i in range(self.spec.num_layers)]
        else:
            layers = [a[:, 0] for a in arrays]
        return np.stack([layer[:, :, :tokens] for layer in layers])

    def from_canonical(self, kv: np.ndarray) -> KVCache:
        """A cache holding ``kv`` (``[layers, 2, kv_heads, tokens, head]``) in the model's layout."""
        kv = kv.astype(self.kv_dtype, copy=False)
        if self.spec.kv.layout is KVLayout.SEPARATE:
            arrays = [np.ascontiguousarray(kv[i, j][None]) for i in range(self.spec.num_layers) for j in (0, 1)]
        else:
            arrays = [np.ascontiguousarray(kv[i][:, None]) for i in range(self.spec.num_layers)]
        return KVCache(
            values=[ort.OrtValue.ortvalue_from_numpy(a, *self._device) for a in arrays], length=kv.shape[3]
        )

    def run(self, token_ids: Sequence[int], cache: KVCache, run_options: ort.RunOptions | None = None) -> tuple[np.ndarray, KVCache]:
        """Runs ``token_ids`` after ``cache``; returns the last position's logits ``[vocab]`` (float32)
        and the cache extended by those tokens. ``cache`` itself is left as it was."""
        n = len(token_ids)
        total = cache.length + n
        binding = self._session.io_binding()
        binding.bind_cpu_input(self.spec.input_ids_name, np.asarray([token_ids], dtype=self._ids_dtype))
        if self._mask_dtype is not None:
            binding.bind_cpu_input(self.spec.attention_mask_name, np.ones((1, total), dtype=self._mask_dtype))
        if self._pos_dtype is not None:
            positions = np.arange(cache.length, total, dtype=self._pos_dtype)[None, :]
            binding.bind_cpu_input(self.spec.position_ids_name, positions)
        for name, value in zip(self.spec.kv.flat_past, cache.values, strict=True):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(self.spec.logits_name, "cpu")
        for name in self.spec.kv.flat_present:
            binding.bind_output(name, *self._device)
        self._session.run_with_iobinding(binding, run_options)
        outputs = binding.get_outputs()
        logits = outputs[0].numpy()
        # Some graphs emit logits for every position, others only for the last one.
        last = logits.reshape(-1, logits.shape[-1])[-1].astype(np.float32, copy=False)
        return last, KVCache(values=list(outputs[1:]), length=total)
