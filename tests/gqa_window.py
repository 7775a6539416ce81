"""Which keys ONNX Runtime's GroupQueryAttention lets a query see under ``local_window_size``:
the op alone (one K/V head, no rotary) on random tensors, against a numpy window, run as the
engine runs it. Shared by the CPU test (tests/test_gemma_graph.py) and the CUDA one
(tests/gpu/test_cuda_window.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from services.modelbuild.graph_writer import MS_DOMAIN, OPSET

HEADS = 2
_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


@dataclass(frozen=True, slots=True)
class Probe:
    head: int
    provider: str = "CPUExecutionProvider"
    dtype: np.dtype = np.dtype(np.float32)

    @property
    def device(self) -> str:
        return "cuda" if self.provider == "CUDAExecutionProvider" else "cpu"

    def session(self, window_attribute: int):
        import onnxruntime as ort

        d, t = self.head, _TYPES[np.dtype(self.dtype)]
        dims = {"q": ["b", "s", HEADS * d], "k": ["b", "s", d], "v": ["b", "s", d],
                "past_k": ["b", 1, "p", d], "past_v": ["b", 1, "p", d]}
        inputs = [helper.make_tensor_value_info(n, t, s) for n, s in dims.items()]
        inputs += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["b"]),
                   helper.make_tensor_value_info("total", TensorProto.INT32, [])]
        outputs = [helper.make_tensor_value_info(n, t, None) for n in ("out", "present_k", "present_v")]
        node = helper.make_node("GroupQueryAttention", [*dims, "seqlens_k", "total"], ["out", "present_k", "present_v"],
                                domain=MS_DOMAIN, num_heads=HEADS, kv_num_heads=1, local_window_size=window_attribute)
        model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                                  opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
        model.ir_version = 8
        session = ort.InferenceSession(model.SerializeToString(), providers=[self.provider])
        assert session.get_providers()[0] == self.provider, session.get_providers()
        return session

    def run(self, session, q: np.ndarray, k: np.ndarray, v: np.ndarray, past: int, shared: bool) -> np.ndarray:
        """Attention of positions ``past ..`` after the first ``past`` K/V (float32 out).
        ``shared``: as the engine runs it, one buffer longer than all the tokens bound as both past
        and present; else a past of exactly ``past`` positions."""
        import onnxruntime as ort

        total, new, d = k.shape[0], k.shape[0] - past, self.head
        capacity = total + 5 if shared else past
        kv = np.zeros((2, 1, 1, capacity, d), self.dtype)
        kv[0, 0, 0, :past], kv[1, 0, 0, :past] = k[:past], v[:past]
        binding = session.io_binding()
        for name, values in {"q": q[past:].reshape(1, new, -1), "k": k[past:].reshape(1, new, -1),
                             "v": v[past:].reshape(1, new, -1)}.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(values, self.dtype))
        binding.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
        binding.bind_cpu_input("total", np.array(total, np.int32))
        binding.bind_output("out", "cpu")  # first: outputs come back in the order bound
        caches = [ort.OrtValue.ortvalue_from_numpy(kv[j], self.device, 0) for j in (0, 1)]
        for j, (past_name, present_name) in enumerate((("past_k", "present_k"), ("past_v", "present_v"))):
            binding.bind_ortvalue_input(past_name, caches[j])
            if shared:
                binding.bind_ortvalue_output(present_name, caches[j])
            else:
                binding.bind_output(present_name, self.device)
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy().astype(np.float32).reshape(new, HEADS, d)

    def matches(self, window_attribute: int, window: int, atol: float) -> bool:
        """Whether ``local_window_size=window_attribute`` gives a query at p exactly the keys
        p - window + 1 .. p: in a prefill longer than the window, in a several-token chunk over
        a past longer than it and in a one-token decode, each over a past of exactly its tokens
        and over the engine's shared past/present buffer."""
        rng = np.random.default_rng(window)
        total = 2 * window + 6
        q = (rng.standard_normal((total, HEADS, self.head)) * 2).astype(self.dtype).astype(np.float32)
        k, v = (rng.standard_normal((2, total, self.head)) * 2).astype(self.dtype).astype(np.float32)
        session = self.session(window_attribute)
        return all(np.allclose(self.run(session, q, k, v, past, shared), windowed_attention(q[past:], k, v, past, window),
                               atol=atol)
                   for past in (0, window + 3, total - 1) for shared in (False, True))


def windowed_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, past: int, window: int) -> np.ndarray:
    """Query i (at position past + i) over keys p - window + 1 .. p: llama.cpp masks p - p0 >= window."""
    out = np.empty_like(q)
    for i in range(q.shape[0]):
        p = past + i
        keys = slice(max(0, p - window + 1), p + 1)
        for h in range(HEADS):
            scores = k[keys] @ q[i, h] / np.sqrt(q.shape[-1])
            probs = np.exp(scores - scores.max())
            out[i, h] = probs / probs.sum() @ v[keys]
    return out
