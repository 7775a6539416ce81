"""Faults in the shared store under live traffic: every request must still succeed, with the same
tokens as the same prompt computed cold. ``bench/faults.py`` runs the cases and prints a table;
``tests/faults/`` runs them as regression tests.

Two workers share one real redis-server, reached through a TCP proxy that can cut a connection in
the middle of a reply. Eight clients keep both busy with greedy requests that share a system prompt
(so every request reads the same cached blocks) and differ by question; each answer is compared
with the question's cold answer. A case lets ``settle`` requests end on a healthy store, applies
its fault, lets ``settle`` more end under it (and, where the fault is undone, ``settle`` after),
then stops the clients. Steps wait on finished requests, never on the clock, except the pause's
hold time. What the workers saw is the change in their own metrics (store errors by kind, values
rejected by reason): proof that the fault reached them.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.request import urlopen

import grpc
import numpy as np
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.local.redis_process import RedisServer, free_port, stored_values
from services.local.tcp_proxy import TcpProxy
from services.local.traffic import FIRST_TOKEN_ID, Periodic, Summary, Traffic, Workload
from services.local.worker_process import WorkerProcess

CLIENTS = 8
BLOCK_SIZE = 16
WORKER_THREADS = 2
"""Intra-op threads of each worker unless told otherwise (the benchmarks' own setting)."""
_EVENT_METRICS = {"kvshare_cache_store_errors_total": "kind", "kvshare_cache_values_rejected_total": "reason"}


@dataclass(slots=True)
class CaseResult:
    name: str
    summary: Summary
    injected: str
    """What the case did, in numbers (flips made, cuts made, seconds paused)."""
    seen: Counter
    """Change in the workers' store errors by kind and rejected values by reason."""

    @property
    def held(self) -> bool:
        """Every request succeeded with the cold answer, and the fault did reach the workers."""
        return not self.summary.failed and not self.summary.wrong and self.seen[CASES[self.name].sign] > 0

    @property
    def seen_text(self) -> str:
        return ", ".join(f"{k} {n}" for k, n in sorted(self.seen.items()) if n) or "nothing"


def worker_samples(metrics_ports: list[int]) -> Iterator:
    """Every sample of every worker's /metrics."""
    for port in metrics_ports:
        text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            yield from family.samples


def worker_events(metrics_ports: list[int]) -> Counter:
    """Store errors by kind and rejected values by reason, summed over the workers."""
    events: Counter = Counter()
    for sample in worker_samples(metrics_ports):
        if (label := _EVENT_METRICS.get(sample.name)) is not None:
            events[sample.labels[label]] += int(sample.value)
    return events


class Lab:
    """The redis-server, the proxy, two workers and the cold references, shared by every case."""

    def __init__(self, stack: ExitStack, folder: Path, workload: Workload, intra_op_threads: int) -> None:
        self.redis = stack.enter_context(RedisServer())
        self.client: redis.Redis = stack.enter_context(self.redis.client())
        self.proxy = stack.enter_context(TcpProxy(self.redis.port))
        self.metrics_ports = [free_port(), free_port()]
        self.workers = [
            stack.enter_context(WorkerProcess(
                folder, "--cache", self.proxy.url, "--block-size", str(BLOCK_SIZE),
                "--intra-op-threads", str(intra_op_threads), "--metrics-port", str(port)))
            for port in self.metrics_ports
        ]
        self.workload = workload
        with grpc.insecure_channel(self.workers[0].target) as channel:
            self.references = workload.references(pb_grpc.GeneratorStub(channel))
        self.rng = random.Random(0)

    def run(self, name: str, settle: int) -> CaseResult:
        """Runs one case of ``CASES`` on an empty store."""
        self.client.flushall()
        with Traffic([w.target for w in self.workers], self.workload, self.references, CLIENTS) as traffic:
            traffic.wait_completed(settle)
            self._until_cached(traffic)
            before = worker_events(self.metrics_ports)
            injected = CASES[name].inject(self, traffic, settle)
        summary = traffic.stop()
        seen = worker_events(self.metrics_ports)
        seen.subtract(before)
        return CaseResult(name, summary, injected, seen)

    def _until_cached(self, traffic: Traffic, timeout_s: float = 120.0) -> None:
        """Waits (on finished requests) until no breaker of any worker keeps calls away (a previous
        fault may have left them backing off) and the system prompt's blocks are stored."""
        blocks = len(self.workload.system) // BLOCK_SIZE
        deadline = time.monotonic() + timeout_s
        while True:
            samples = list(worker_samples(self.metrics_ports))
            open_breakers = [s.labels for s in samples if s.name == "kvshare_cache_breaker_open" and s.value]
            stored = stored_values(self.client)
            if not open_breakers and stored >= blocks:
                return
            if time.monotonic() > deadline:
                # What was still wrong, so that a rare failure can be told apart from the next one.
                counts = [(s.name, s.value) for s in samples if s.name in (
                    "kvshare_cache_blocks_written_total", "kvshare_cache_publishes_dropped_total",
                    "kvshare_cache_short_circuited_total")]
                raise TimeoutError(f"the store was not healthy again after {timeout_s} s: breakers open {open_breakers}, "
                                   f"{stored} of {blocks} blocks stored, worker counters {counts}, "
                                   f"events {dict(worker_events(self.metrics_ports))}")
            traffic.wait_completed(1)

    def until_counted(self, kind: str, before: int, traffic: Traffic, timeout_s: float = 120.0) -> None:
        """Waits (on finished requests) until the workers have counted more store events of ``kind``
        (an error kind or reject reason) than ``before``; the timeout is a hang guard."""
        deadline = time.monotonic() + timeout_s
        while worker_events(self.metrics_ports)[kind] <= before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers counted no store event {kind!r} in {timeout_s} s "
                                   f"(events {dict(worker_events(self.metrics_ports))})")
            traffic.wait_completed(1)

    def random_key(self) -> bytes | None:
        return self.client.randomkey()

    def flip_bit(self, key: bytes | None) -> bool:
        """Flips one random bit of ``key``'s value in place (TTL kept); False if there is none."""
        value = self.client.get(key) if key else None
        if not value:
            return False
        damaged = bytearray(value)
        bit = self.rng.randrange(len(damaged) * 8)
        damaged[bit // 8] ^= 1 << (bit % 8)
        return bool(self.client.set(key, bytes(damaged), xx=True, keepttl=True))

    def swap(self, a: bytes | None, b: bytes | None) -> bool:
        """Stores ``a``'s value under ``b`` and ``b``'s under ``a``: valid values under wrong keys."""
        if not a or not b or a == b:
            return False
        va, vb = self.client.mget([a, b])
        if not va or not vb:
            return False
        self.client.set(a, vb, xx=True, keepttl=True)
        self.client.set(b, va, xx=True, keepttl=True)
        return True


def redis_killed(lab: Lab, traffic: Traffic, settle: int) -> str:
    lab.redis.kill()
    traffic.wait_completed(settle)
    lab.redis.start()
    traffic.wait_completed(settle)
    return "killed (SIGKILL), restarted empty"


def redis_paused(lab: Lab, traffic: Traffic, settle: int) -> str:
    # Held until the workers have met it (counted a store timeout) and ``settle`` requests ended
    # meanwhile, rather than for a fixed time: on a slow machine a fixed pause could end before any
    # request reached the store, on a fast one it only waited.
    timeouts = worker_events(lab.metrics_ports)["timeout"]
    lab.redis.pause()
    paused = time.monotonic()
    try:
        traffic.wait_completed(settle)
        lab.until_counted("timeout", timeouts, traffic)
    finally:
        lab.redis.resume()
    held = time.monotonic() - paused
    traffic.wait_completed(settle)
    return f"SIGSTOP for {held:.1f} s"


def redis_full(lab: Lab, traffic: Traffic, settle: int) -> str:
    # Below what the server itself uses: every write is refused with OOM, reads still answer. (A
    # limit of "used + a little" depends on the allocator's accounting, and did not always bite.)
    lab.client.flushall()
    lab.client.config_set("maxmemory-policy", "noeviction")
    lab.client.config_set("maxmemory", "1")
    try:
        traffic.wait_completed(settle)
    finally:
        lab.client.config_set("maxmemory", "0")
    return "emptied, maxmemory below its own use, noeviction"


def bit_flips(lab: Lab, traffic: Traffic, settle: int) -> str:
    # Every stored value once (so the next requests must meet damage), then random ones meanwhile.
    flipped = sum(lab.flip_bit(key) for key in lab.client.scan_iter(count=1000))
    with Periodic(lambda: lab.flip_bit(lab.random_key())) as periodic:
        traffic.wait_completed(settle)
    return f"{flipped + periodic.count} bit flips"


def value_swaps(lab: Lab, traffic: Traffic, settle: int) -> str:
    keys = list(lab.client.scan_iter(count=1000))
    swapped = sum(lab.swap(a, b) for a, b in zip(keys[::2], keys[1::2], strict=False))
    with Periodic(lambda: lab.swap(lab.random_key(), lab.random_key())) as periodic:
        traffic.wait_completed(settle)
    return f"{swapped + periodic.count} value swaps"


def cut_fetches(lab: Lab, traffic: Traffic, settle: int) -> str:
    # Half of the shared prompt's blocks: the cut falls inside the MGET reply that carries them.
    half = sum(lab.client.strlen(k) for k in lab.client.scan_iter(count=1000)) // 2
    cuts = lab.proxy.cuts
    with lab.proxy.cutting(half):
        traffic.wait_completed(settle)
    return f"{lab.proxy.cuts - cuts} connections cut {half >> 10} KiB into a reply"


@dataclass(frozen=True, slots=True)
class Case:
    inject: Callable[[Lab, Traffic, int], str]
    """Applies the fault while the clients run (and undoes it); says what it did."""
    sign: str
    """The store error kind or reject reason the workers must count: the fault reached them."""


CASES: dict[str, Case] = {
    "Redis killed and restarted": Case(redis_killed, "connection"),
    "Redis paused (SIGSTOP)": Case(redis_paused, "timeout"),
    "Redis full (noeviction)": Case(redis_full, "out_of_memory"),
    "bit flips in stored values": Case(bit_flips, "checksum"),
    "values swapped between keys": Case(value_swaps, "owner"),
    "connection cut during a fetch": Case(cut_fetches, "connection"),
}


def settle_for(smoke: bool) -> int:
    """Requests to let end per step: 2 per client for the smoke run and the tests, 8 for the record."""
    return (2 if smoke else 8) * CLIENTS


def workload_for(vocab_size: int, smoke: bool) -> Workload:
    """The shared-system-prompt workload over a vocabulary of ``vocab_size`` ids: 8 questions of
    16 tokens, 16 new tokens each."""
    return Workload.random(np.random.default_rng(7), (FIRST_TOKEN_ID, vocab_size),
                           system_tokens=128 if smoke else 512, questions=8, question_tokens=16, new_tokens=16)


@contextmanager
def lab(folder: Path, workload: Workload, intra_op_threads: int = WORKER_THREADS) -> Iterator[Lab]:
    """The lab of the model in ``folder``: started on entry, everything stopped on exit."""
    with ExitStack() as stack:
        yield Lab(stack, folder, workload, intra_op_threads)
