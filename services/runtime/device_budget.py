"""How a worker splits a CUDA device's memory: one budget for every allocator it starts.

Three allocators take device memory, and each would otherwise size itself from the same free
memory: ONNX Runtime's arena per session (weights and activations; ``gpu_mem_limit`` caps each
session's own), CuPy's pool (the K/V slot bank of ``SharedSlots`` and its temporaries), and ONNX
Runtime's default allocator (the per-sequence K/V of ``SequenceSlots``, which no option caps, so
``max_batch`` is derived from the bank's share and bounds it instead). The budget gives each a
share of the memory free when the device was first opened, and the shares add up to that memory:

- ``reserve``: what neither allocator sees (the CUDA context, cuBLAS and cuDNN workspaces, NVRTC);
- ``arenas``: every session's arena together, split between the sessions in proportion to their
  weights (a decoder-only model's one session gets all of it);
- ``bank``: the K/V slots; ``--kv-cache-bytes`` 0 means ``slot_default`` of it (the rest is for
  gathers and temporaries in the same pool).

All figures are bytes. Nothing here touches a device: the arithmetic is tested on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

RESERVE_SHARE = 0.10
ARENA_SHARE = 0.40
SLOT_SHARE_OF_BANK = 0.90


@dataclass(frozen=True, slots=True)
class DeviceBudget:
    """A device's free memory at the worker's first open, split once for the whole process.
    Invariant: ``reserve + arenas + bank == free``."""

    free: int
    reserve: int
    arenas: int
    bank: int

    @classmethod
    def split(cls, free: int) -> DeviceBudget:
        reserve, arenas = int(free * RESERVE_SHARE), int(free * ARENA_SHARE)
        return cls(free, reserve, arenas, free - reserve - arenas)

    @property
    def slot_default(self) -> int:
        """The slots' memory when ``--kv-cache-bytes`` is 0."""
        return int(self.bank * SLOT_SHARE_OF_BANK)

    def arena(self, weight_bytes: int, all_weight_bytes: int) -> int:
        """The arena cap of a session whose graph holds ``weight_bytes`` of the ``all_weight_bytes``
        that every session of the model holds: its share of ``arenas``, at least 1 byte."""
        if all_weight_bytes <= 0:
            return self.arenas
        return max(1, self.arenas * min(weight_bytes, all_weight_bytes) // all_weight_bytes)

    def describe(self) -> str:
        """One line for the start-up log."""
        gib = 1 << 30
        return (f"{self.free / gib:.2f} GiB free at start: {self.reserve / gib:.2f} GiB kept for the CUDA context "
                f"and libraries, {self.arenas / gib:.2f} GiB for ONNX Runtime's arenas (weights, activations), "
                f"{self.bank / gib:.2f} GiB for the K/V slots ({self.slot_default / gib:.2f} GiB of slots when "
                "--kv-cache-bytes is 0)")
