"""The harness of the flood attacks (``bench.attack_floods``, ``bench.attack_bodies``; the keys also
``bench.attack_door``'s): the tenants' API keys, a victim whose runs are measured idle and under attack, and one table row per attack
judged against the goals (victim worst ≤ 3 x idle + 200 ms; RSS growth ≤ ``RSS_BOUND_MIB`` where
bounded; only the allowed statuses)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from bench.fleet import print_table
from bench.load import RssSampler
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.api.api_keys import key_line

KEYS = {t: f"{t}-key-" + str(i) * 32 for i, t in enumerate(("attacker", "victim", "a", "b", "c", "hoarder"), 1)}
"""The tenants of the attack benches, each with its API key; ``auth`` of any other sends a key no
worker knows."""
IDLE_RUNS = 5
RSS_BOUND_MIB = 64


def auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS.get(tenant, 'not-a-key')}"),)


def keys_file(folder: Path) -> Path:
    path = folder / "api-keys"
    path.write_text("".join(key_line(t, k) for t, k in KEYS.items()))
    return path


def counts(statuses: Iterable[str]) -> str:
    return ", ".join(f"{s} {n}" for s, n in sorted(Counter(statuses).items())) or "-"


def quantiles(ms: list[float]) -> tuple[float, float, float]:
    """p50, p99 and max of ``ms`` (zeros when empty)."""
    return (float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), max(ms)) if ms else (0.0, 0.0, 0.0)


@dataclass(slots=True)
class Victim:
    """One client's request (``request_of(run)``), sent again and again on a channel of its own
    while an attack runs; each run's TTFT and longest gap between messages (ms), or its status."""

    target: str
    request_of: Callable[[int], pb.GenerateRequest]
    idle_ttft: float = 0.0
    idle_gap: float = 0.0
    runs: list[tuple[float, float]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    _count: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def once(self, stub: pb_grpc.GeneratorStub) -> tuple[float, float] | None:
        self._count += 1
        sent, stamps = time.perf_counter(), []
        try:
            for _ in stub.Generate(self.request_of(self._count), metadata=auth("victim"), timeout=120):
                stamps.append(time.perf_counter())
        except grpc.RpcError as err:
            self.failed.append(err.code().name)
            return None
        return (stamps[0] - sent) * 1e3, float(np.diff(stamps).max() * 1e3) if len(stamps) > 1 else 0.0

    def measure_idle(self, runs: int) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            self.once(stub)  # the channel's connection and the request's first run are no part of "idle"
            idle = [r for r in (self.once(stub) for _ in range(runs)) if r]
        if not idle:
            raise RuntimeError(f"the victim's request fails on the idle worker: {counts(self.failed)}")
        self.idle_ttft, self.idle_gap = (float(np.median(v)) for v in zip(*idle, strict=True))

    def _loop(self) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            while True:  # at least one run, begun once the attack is under way
                result = self.once(stub)
                if result:
                    self.runs.append(result)
                if self._stop.is_set():
                    return

    def __enter__(self) -> Victim:
        self.runs, self.failed = [], []
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def figures(self) -> tuple[str, str, list[str]]:
        """(TTFT text, gap text, what missed the goal)."""
        worst = [max(v) for v in zip(*self.runs, strict=True)] if self.runs else [float("inf")] * 2
        texts, misses = [], []
        for name, idle, bad in (("TTFT", self.idle_ttft, worst[0]), ("gap", self.idle_gap, worst[1])):
            texts.append(f"{idle:.0f} → {bad:.0f}")
            if bad > 3 * idle + 200:
                misses.append(f"victim {name}")
        if self.failed:
            misses.append(f"victim got {counts(self.failed)}")
        return texts[0], texts[1], misses


@dataclass(slots=True)
class Row:
    attack: str
    statuses: list[str]
    allowed: set[str]
    figures: str = "-"
    victim: tuple[str, str, list[str]] | None = None
    """``Victim.figures()`` of the victim of this attack."""
    rss: RssSampler | None = None
    rss_bounded: bool = False
    misses: list[str] = field(default_factory=list)

    def cells(self) -> tuple:
        ttft, gap, misses = self.victim or ("-", "-", [])
        misses = misses + self.misses
        rss = "-"
        if self.rss:
            growth = self.rss.peak[0] - self.rss.start[0]
            rss = f"{self.rss.text} (+{growth:.0f})"
            if self.rss_bounded and growth > RSS_BOUND_MIB:
                misses.append(f"RSS +{growth:.0f} MiB")
        if set(self.statuses) - self.allowed:
            misses.append("status " + ", ".join(sorted(set(self.statuses) - self.allowed)))
        return (self.attack, ttft, gap, rss, counts(self.statuses), self.figures,
                "met" if not misses else "missed: " + "; ".join(misses))


def report(title: str, rows: list[Row], what: str) -> bool:
    """Prints ``rows`` as one table under ``title`` and whether every ``what`` held; returns that."""
    print_table(f"{title}, each beside a victim measured idle and under attack in this run",
                ("attack", "victim TTFT idle → worst (ms)", "victim longest gap idle → worst (ms)",
                 "worker RSS start→peak→end (+growth) (MiB)", "attackers' statuses", "figures", "verdict"),
                [row.cells() for row in rows])
    held = all(row.cells()[-1] == "met" for row in rows)
    print(f"\nevery {what} held: {'yes' if held else 'NO'}")
    return held
