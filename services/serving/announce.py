"""The one line a server prints on standard output when it listens (``kvshare listening on
HOST:PORT``), which parents such as ``services.local.worker_process`` read to find its port."""

from __future__ import annotations

import sys


def announce(line: str) -> None:
    """Writes ``line`` and its newline in one write, then flushes. ``print`` writes the newline
    apart, and with unbuffered output (``PYTHONUNBUFFERED``) a log line from another thread (the
    engine's warm-up) landed between the two on the shared pipe: the port read ``456332026-12-02``."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
