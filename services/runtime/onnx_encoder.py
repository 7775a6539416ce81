"""The encoder session of an encoder-decoder model: one input in, every decoder layer's
cross-attention K/V out, in the canonical layout ``[layers, 2 (k, v), heads, encoder_tokens, head]``."""

from __future__ import annotations

import threading

import numpy as np

from services.errors import InvalidRequest, ModelLoadError, StartupError
from services.runtime.device_arrays import ArrayDevice
from services.runtime.model_spec import ModelSpec
from services.runtime.onnx_decoder import input_dtypes, model_graphs, open_session


class EncoderSession:
    def __init__(self, spec: ModelSpec, device: ArrayDevice, intra_op_threads: int = 0,
                 intra_op_spinning: str | None = None) -> None:
        """``device``: the decoder's (``DecoderSession.device``), so both share one stream and budget."""
        assert spec.encoder is not None, "an encoder-decoder model"
        self.spec = spec.encoder
        self._session = open_session(self.spec.onnx_path, device, intra_op_threads, intra_op_spinning,
                                     model_graphs(spec))
        dtypes = input_dtypes(self._session, self.spec.onnx_path)
        if self.spec.input_name not in dtypes:
            raise ModelLoadError(f"{self.spec.onnx_path}: no input named {self.spec.input_name!r}")
        self.input_dtype = dtypes[self.spec.input_name]
        shape = next(i.shape for i in self._session.get_inputs() if i.name == self.spec.input_name)
        self.input_shape: list[int | None] = [d if isinstance(d, int) else None for d in shape]
        """Fixed dimensions of the input; None where the model accepts any size."""
        self._outputs = [n for layer in self.spec.cross_outputs for n in layer]
        missing = sorted(set(self._outputs) - {o.name for o in self._session.get_outputs()})
        if missing:
            raise ModelLoadError(f"{self.spec.onnx_path}: genai_config.json names outputs the encoder lacks: {missing}")
        self._lock = threading.Lock()
        self.runs = 0

    @property
    def takes_token_ids(self) -> bool:
        return self.input_dtype.kind in "iu"

    def check_input(self, array: np.ndarray, field: str) -> None:
        """Raises InvalidRequest unless ``array`` fits the encoder's input (dtype, rank, fixed dims)."""
        if array.ndim == 0 or array.shape[0] != 1:
            raise InvalidRequest(field, f"one encoder input per request: the batch dimension must be 1, got shape {list(array.shape)}")
        if array.dtype != self.input_dtype:
            raise InvalidRequest(field, f"dtype {array.dtype} given, the encoder takes {self.input_dtype}")
        if array.ndim != len(self.input_shape) or any(
                want is not None and want != got for want, got in zip(self.input_shape, array.shape, strict=True)):
            wanted = ", ".join("*" if d is None else str(d) for d in self.input_shape)
            raise InvalidRequest(field, f"shape {list(array.shape)} given, the encoder takes [{wanted}]")

    def warm_up(self) -> None:
        """Runs the encoder once on zeros (not counted in ``runs``): on CUDA its first convolution
        opens cuDNN and picks its algorithms, so a machine without cuDNN stops the worker at start
        (StartupError, with the reason) instead of failing the first request with audio."""
        zeros = np.zeros([d or 1 for d in self.input_shape], dtype=self.input_dtype)
        try:
            self._session.run(self._outputs, {self.spec.input_name: zeros})
        except Exception as exc:  # noqa: BLE001 - whatever failed, the worker cannot serve: say why, at start
            raise StartupError(f"{self.spec.onnx_path}: a first run of the encoder failed ({type(exc).__name__}: "
                               f"{exc}); on CUDA its convolutions need cuDNN 9 (libcudnn.so.9: the CUDA image has it, "
                               "else install onnxruntime-gpu's cudnn extra)") from exc

    def run(self, array: np.ndarray) -> np.ndarray:
        """The cross K/V for ``array`` (already checked), canonical and on the host."""
        outputs = self._session.run(self._outputs, {self.spec.input_name: array})
        with self._lock:
            self.runs += 1
        layers = [np.stack([outputs[2 * i][0], outputs[2 * i + 1][0]]) for i in range(len(self.spec.cross_outputs))]
        return np.stack(layers)
