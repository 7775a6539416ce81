"""ONNX Runtime's intra-op threads: how many a session gets, and when idle ones spin.

Here, not in onnx_decoder.py, so that the worker's settings can name the choices without importing
ONNX Runtime.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

SPINNING = ("in-run", "always", "never")
"""``--intra-op-spinning``: when idle intra-op threads spin-wait for the next parallel section
instead of sleeping.

- ``in-run`` (the worker's default): within a model run only. Spinning is allowed and stopped as
  soon as the last run in flight returns (``session.force_spinning_stop``), so the hundreds of
  parallel sections of one decode step cost no wake-up each, and between steps (sampling, gRPC,
  other replicas, Redis) the threads sleep. Measured on SmolLM2, 2 threads: decode as fast as
  ``always``, 16% faster than ``never`` (docs/benchmarks.md).
- ``always``: ONNX Runtime's own default; threads also spin for a while after a run returns, on
  cores another process or the worker's own event loop may need.
- ``never``: threads sleep between parallel sections.
"""
_SPIN_CONFIG = {"in-run": ("1", "1"), "always": ("1", "0"), "never": ("0", "0")}
SPINNING_VARIABLE = "KVSHARE_INTRA_OP_SPINNING"


def default_spinning() -> str:
    """The policy of a session opened without one (an in-process engine: benchmarks, tests, a
    program that embeds kvshare): ``KVSHARE_INTRA_OP_SPINNING``, the variable the worker's
    ``--intra-op-spinning`` reads, else ``in-run``. The test suite sets ``never``: it runs several
    test processes on few CPUs, where a thread spinning within a run holds a core its peers need."""
    policy = os.environ.get(SPINNING_VARIABLE, "in-run")
    if policy not in _SPIN_CONFIG:
        raise ValueError(f"{SPINNING_VARIABLE}={policy!r}: expected one of {', '.join(SPINNING)}")
    return policy


def spin_config(policy: str | None = None) -> dict[str, str]:
    """The session config entries of spinning ``policy`` (one of SPINNING; None: ``default_spinning``)."""
    allow, stop = _SPIN_CONFIG[policy or default_spinning()]
    return {"session.intra_op.allow_spinning": allow, "session.force_spinning_stop": stop}


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (``cpu.max`` of cgroup v2, else
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` of v1); None when unlimited or unreadable. A
    Kubernetes CPU limit is such a quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def intra_op_threads(configured: int, limit: float | None = None) -> int:
    """The thread count to give ONNX Runtime for ``--intra-op-threads`` ``configured``. A
    configured count is kept. 0 stays 0 (ONNX Runtime's choice: one per physical core of the
    machine) unless the CPUs this process may use, by affinity or by its cgroup quota ``limit``
    (default: read), are fewer than the machine's: ONNX Runtime counts the node's cores, so a
    pod limited to 2 CPUs on a 64-core node would run 64 threads time-sliced onto 2."""
    if configured:
        return configured
    limit = cgroup_cpu_limit() if limit is None else limit
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if limit is not None:
        usable = min(usable, max(1, math.ceil(limit)))
    return usable if usable < (os.cpu_count() or usable) else 0
