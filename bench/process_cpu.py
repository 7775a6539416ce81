"""CPU time that a set of processes has used, to tell a slow schedule from a machine with no core
to spare: work measured in CPU seconds, divided by the cores, is the shortest wall time that work
could have taken on this machine."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its finished threads so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


class ProcessCpu:
    """CPU seconds used by ``pids`` together since it was made, to one clock tick per process
    (``1 / SC_CLK_TCK`` s, 10 ms on Linux). A process that exits meanwhile counts what it had used
    when last read."""

    def __init__(self, pids: Sequence[int]) -> None:
        self._last = dict.fromkeys(pids, 0.0)
        self._start = self._total()

    def _total(self) -> float:
        for pid in self._last:
            try:
                self._last[pid] = cpu_seconds(pid)
            except (FileNotFoundError, ProcessLookupError):
                pass
        return sum(self._last.values())

    def used(self) -> float:
        return self._total() - self._start


def cores() -> int:
    """The cores this process may run on (its affinity mask, not the host's count)."""
    return len(os.sched_getaffinity(0))
