"""Measures, on this machine's CPU and ONNX Runtime, which run lengths compute their last row
apart (``split_rule``), before a worker serves: the rule the runner keeps and the fingerprint
under which its K/V are shared come from what this CPU does, not from what a reading of the
sources predicts. Invariant: the rule returned covers every lone length the probe saw, or the
probe says the runtime cannot be made split-invariant (``Numerics.exact`` False).

Two one-node graphs of random data, the model's head size and the worker's thread count:
GroupQueryAttention (no rotary: rotary is per row and exact) and MatMulNBits at accuracy level 4
(int8 activations). For every run length n up to ``4 x head_size + 2`` (past the largest ``Br``
the kernel can choose) the last row of an n-row run over a past is compared bitwise with the same
row inside one long run. About 0.1-0.5 s at start.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from services.runtime.layer_windows import MS_DOMAIN
from services.runtime.ort import cpu_session
from services.runtime.ort import onnxruntime as ort
from services.runtime.split_rule import EVERY_RUN, MATMUL_ROW_BLOCK, SplitRule

_OPSETS = {"": 17, MS_DOMAIN: 1}
_PAST = 3
"""Positions held before each probed run (any past > 0 will do; a decode step needs one)."""
_SEED = 20261207


@dataclass(frozen=True, slots=True)
class Numerics:
    """What the probe found. ``fingerprint`` names everything a computed row depends on besides
    the model and its input (ONNX Runtime's version, the CPU's instruction set, the lone lengths
    measured, the head size, the threads): K/V are shared only between equal fingerprints."""

    rule: SplitRule
    """The prompt runs to avoid."""
    decode_rule: SplitRule
    """The decode batch sizes to avoid: a lone row of the int8 matmul (MatMulNBits' own lone
    lengths; nothing where it has none)."""
    exact: bool
    """Every lone length the probe saw fits the rule: runs planned by it are split-invariant."""
    attention_lone: tuple[int, ...]
    matmul_lone: tuple[int, ...]
    fingerprint: str

    def describe(self) -> str:
        if not self.exact:
            return (f"not split-invariant: run lengths {self.attention_lone[:6]} (attention) and "
                    f"{self.matmul_lone[:6]} (int8 matmul) compute their last row apart in no pattern the "
                    "planner can avoid")
        return "split-invariant: no prefill run of n tokens with " + " or ".join(
            f"n mod {m} = 1" for m in self.rule.moduli)


def _lone(last_row, longest: int, reference: np.ndarray) -> tuple[int, ...]:
    """The lengths n in 1..longest whose run's last row differs bitwise from ``reference``'s
    row, scanned up to twice the first lone length past 1 (and 2 more): one period of the
    pattern seen twice is what the rule needs, and the scan's cost grows with its square."""
    lone: list[int] = []
    n, end = 1, longest
    while n <= end:
        if not np.array_equal(last_row(n), reference[_PAST + n - 1]):
            if n > 1 and len(lone) == 1 and lone[0] == 1:
                end = min(longest, 2 * (n - 1) + 2)
            lone.append(n)
        n += 1
    return tuple(lone)


def attention_lone(head_size: int, threads: int, longest: int) -> tuple[int, ...]:
    """Lone run lengths of GroupQueryAttention (one head, float32, flash path as the models run it)."""
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"],
                          ["out", "present_k", "present_v"], domain=MS_DOMAIN, num_heads=1, kv_num_heads=1)],
        "probe_attention",
        [helper.make_tensor_value_info(name, f, [1, "s", head_size]) for name in ("q", "k", "v")]
        + [helper.make_tensor_value_info(name, f, [1, 1, "p", head_size]) for name in ("past_k", "past_v")]
        + [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
           helper.make_tensor_value_info("total", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("out", f, [1, "s", head_size]),
         helper.make_tensor_value_info("present_k", f, [1, 1, "t", head_size]),
         helper.make_tensor_value_info("present_v", f, [1, 1, "t", head_size])])
    session = cpu_session(graph, _OPSETS, threads)
    total = _PAST + longest + 2
    q, k, v = np.random.default_rng(_SEED).standard_normal((3, 1, total, head_size), dtype=np.float32)

    def run(start: int, end: int) -> np.ndarray:
        past = [x[:, :start][:, None] for x in (k, v)]
        feeds = {"q": q[:, start:end], "k": k[:, start:end], "v": v[:, start:end], "past_k": past[0],
                 "past_v": past[1], "seqlens_k": np.array([end - 1], np.int32), "total": np.array(end, np.int32)}
        return session.run(["out"], feeds)[0][0]

    return _lone(lambda n: run(_PAST, _PAST + n)[-1], longest, run(0, total))


def matmul_lone(threads: int, longest: int, inner: int = 128, outer: int = 64) -> tuple[int, ...]:
    """Lone run lengths of a 4-bit MatMulNBits at accuracy level 4 (block 32, symmetric)."""
    rng = np.random.default_rng(_SEED + 1)
    blocks = inner // 32
    weights = rng.integers(0, 256, (outer, blocks, 16), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, outer * blocks).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMulNBits", ["a", "w", "scales"], ["y"], domain=MS_DOMAIN, K=inner, N=outer, bits=4,
                          block_size=32, accuracy_level=4)],
        "probe_matmul", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", inner])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", outer])],
        [onnx.numpy_helper.from_array(weights, "w"), onnx.numpy_helper.from_array(scales, "scales")])
    session = cpu_session(graph, _OPSETS, threads)
    a = rng.standard_normal((_PAST + longest + 2, inner), dtype=np.float32)
    reference = session.run(["y"], {"a": a})[0]
    return _lone(lambda n: session.run(["y"], {"a": a[_PAST : _PAST + n]})[0][-1], longest, reference)


def fitting_rule(lone: tuple[int, ...]) -> SplitRule | None:
    """The rule whose lone lengths are a superset of ``lone``, from moduli
    ``Br`` (the smallest lone length past 1, less one) and MLAS' 128-row block; None when even
    that rule leaves one of ``lone`` out."""
    moduli = {MATMUL_ROW_BLOCK}
    above_one = [n for n in lone if n > 1]
    if above_one and above_one[0] - 1 >= 2:
        moduli.add(above_one[0] - 1)
    rule = SplitRule(tuple(sorted(moduli)))
    return rule if all(rule.lone(n) for n in lone) else None


@functools.cache
def probe(head_size: int, threads: int) -> Numerics:
    """Measures the lone lengths for this head size and ``threads`` (``intra_op_num_threads``;
    0: ONNX Runtime's choice), once per process (``Numerics``)."""
    longest = 4 * head_size + 2
    attention = attention_lone(head_size, threads, longest)
    matmul = matmul_lone(threads, min(longest, 2 * MATMUL_ROW_BLOCK + 2))
    rule = fitting_rule(tuple(sorted(set(attention) | set(matmul))))
    exact = rule is not None
    text = "|".join([ort.__version__, platform.machine(), _isa(), f"h{head_size}", f"t{threads or os.cpu_count()}",
                     "a" + ",".join(map(str, attention)), "m" + ",".join(map(str, matmul))])
    decode = SplitRule((MATMUL_ROW_BLOCK,)) if matmul else EVERY_RUN
    return Numerics(rule or SplitRule((MATMUL_ROW_BLOCK,)), decode, exact, attention, matmul,
                    hashlib.sha256(text.encode()).hexdigest()[:16])


def _isa() -> str:
    """The CPU features that choose MLAS' kernels (AVX-512 VNNI, AVX-512, AVX2, ...): two CPUs
    whose probes agree may still round a row differently when their kernels differ."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    wanted = ("avx512_vnni", "avx512vnni", "avx_vnni", "avx512bw", "avx512f", "avx2", "fma", "amx_int8", "asimd",
              "sve", "i8mm")
    return ",".join(flag for flag in wanted if flag in flags) or "baseline"
