"""Prefill runs whose rows come out as they would inside one long run: the rule that makes an
answer independent of how its prompt was split between the cache and computing.

ONNX Runtime's CPU kernels compute a row of a run the same whatever the run's length, with one
exception each (ONNX Runtime 1.32, read in its sources and measured by ``numerics_probe``):

- GroupQueryAttention's flash prefill cuts a run into query tiles of ``Br`` rows from the run's
  first row; a tile of one row (the run's last row when ``n mod Br == 1``, and every decode step)
  takes MLAS's one-row SGEMM kernel, which rounds ``P.V`` differently (separate mul and add
  where longer tiles fuse them). ``Br = min(L2 / (32 x head_size), 2 x head_size)``, so it depends
  on the CPU's L2 size and the model's head size: ``numerics_probe`` measures it.
- MatMulNBits, on CPUs without AVX-512 VNNI, cuts the rows into blocks of 128 with a thread pool
  and gives a one-row block a kernel of its own (``n mod 128 == 1``).

Such a row is a float rounding away (about 1e-7) from the row computed inside a longer run, but
a model whose matmuls round activations to int8 turns that into whole quantization steps, and
then into other tokens. Invariant kept here: no prefill run ever has a length ``n`` with
``n mod m == 1`` for a modulus ``m`` of the rule, except the one-token prompt (which nothing
can split and nothing reuses: blocks hold many tokens). A run is extended back over tokens
already held (computing them again writes the same K/V in place), or, at a prompt's start, cut
in two. A decode step's row is not canonical: decoded answers' K/V are reused only by computing
them again (see ``docs/design.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

MATMUL_ROW_BLOCK = 128
"""MLAS' row block for MatMulNBits with a thread pool (``qnbitgemm.cpp``)."""


@dataclass(frozen=True, slots=True)
class SplitRule:
    """Run lengths to avoid: ``n`` with ``n mod m == 1`` for any ``m`` of ``moduli`` (each >= 2)."""

    moduli: tuple[int, ...]

    def lone(self, n: int) -> bool:
        """Whether a run of ``n`` rows leaves its last row alone in a tile (n = 1 always does)."""
        return any(n % m == 1 for m in self.moduli)

    def runs(self, start: int, n: int) -> list[tuple[int, int]]:
        """Runs ``(begin, end)`` (prompt positions, end exclusive) that compute positions
        ``start .. start + n - 1`` when ``start`` positions are held: the one run, or the one run
        begun a position early (that position is computed again), or two runs. Never earlier than
        one position: a windowed layer's slot holds the ``window`` positions before ``start``
        (``KVGeometry.window_blocks``), enough to compute one more, not two."""
        if not self.lone(n):
            return [(start, start + n)]
        if start > 0 and not self.lone(n + 1):
            return [(start - 1, start + n)]
        for first in range(n - 2, 1, -1):
            if not self.lone(first) and not self.lone(n - first):
                return [(start, start + first), (start + first, start + n)]
        return [(start, start + n)]  # one token at a prompt's start: nothing else computes it


EVERY_RUN = SplitRule(())
"""The rule of a runtime whose rows never depend on the run (nothing to avoid)."""
