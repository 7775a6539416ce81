"""Client-side traffic for the benchmarks and the fault lab (``store_faults``, also run by the
tests): Generate streams over grpc.aio, each
recorded with its status, token arrival times and tokens, and a workload of greedy requests sharing
one system prompt whose every answer is checked against the same prompt computed cold.

``Traffic`` keeps a number of clients busy (each sends its next request when the last one ends)
on an event loop of its own, so that the caller can break things meanwhile and wait on *progress*
(``wait_completed``) instead of on the clock: a fault is applied after so many requests ended,
whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete

FIRST_TOKEN_ID = 3
"""Random prompts draw ids from here up: the ids below are the seeded tokenizer's special tokens."""


@dataclass(slots=True)
class StreamResult:
    sent: float
    """perf_counter() when the call was made."""
    arrivals: list[float] = field(default_factory=list)
    """perf_counter() of each token's arrival (tokens of one message share its time)."""
    tokens: list[int] = field(default_factory=list)
    status: grpc.StatusCode = grpc.StatusCode.OK
    ended: float = 0.0
    question: int = -1
    """Index of the workload question asked, -1 outside a workload."""
    wrong: bool = False
    """Ended OK with tokens other than the cold reference's."""

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent


async def stream(stub: pb_grpc.GeneratorStub, request: pb.GenerateRequest, timeout_s: float,
                 result: StreamResult | None = None) -> StreamResult:
    """Runs one Generate call to its end; an RPC error is recorded as the result's status."""
    result = result or StreamResult(time.perf_counter())
    try:
        async for message in stub.Generate(request, timeout=timeout_s):
            now = time.perf_counter()
            result.arrivals.extend([now] * len(message.token_ids))
            result.tokens.extend(message.token_ids)
    except grpc.aio.AioRpcError as exc:
        result.status = exc.code()
    result.ended = time.perf_counter()
    return result


@dataclass(slots=True)
class Summary:
    """What a set of streams did: counts, latency percentiles (ms) and throughput."""

    sent: int
    failed: Counter
    """Non-OK streams by status name."""
    wrong: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float

    @classmethod
    def of(cls, streams: Sequence[StreamResult]) -> Summary:
        ok = [s for s in streams if s.status == grpc.StatusCode.OK and s.tokens]
        ttft = [s.ttft for s in ok] or [float("nan")]
        span = (max(s.ended for s in streams) - min(s.sent for s in streams)) if streams else 0.0
        return cls(
            sent=len(streams),
            failed=Counter(s.status.name for s in streams if s.status != grpc.StatusCode.OK),
            wrong=sum(s.wrong for s in streams),
            ttft_p50_ms=float(np.percentile(ttft, 50) * 1e3),
            ttft_p99_ms=float(np.percentile(ttft, 99) * 1e3),
            tokens_per_s=sum(len(s.tokens) for s in ok) / span if span else 0.0,
        )

    @property
    def failed_text(self) -> str:
        return ", ".join(f"{name} {n}" for name, n in sorted(self.failed.items())) or "0"


@dataclass(frozen=True, slots=True)
class Workload:
    """Greedy requests of ``system`` + one of ``questions``, ``new_tokens`` each, EOS ignored."""

    system: list[int]
    questions: list[list[int]]
    new_tokens: int

    @classmethod
    def random(cls, rng: np.random.Generator, vocab: tuple[int, int], system_tokens: int, questions: int,
               question_tokens: int, new_tokens: int) -> Workload:
        ids = lambda n: rng.integers(*vocab, size=n).tolist()  # noqa: E731
        return cls(ids(system_tokens), [ids(question_tokens) for _ in range(questions)], new_tokens)

    def request(self, question: int, cold: bool = False) -> pb.GenerateRequest:
        return pb.GenerateRequest(prompt_token_ids=self.system + self.questions[question],
                                  max_new_tokens=self.new_tokens, ignore_eos=True,
                                  cache=pb.CacheOptions(skip_read=cold, skip_write=cold))

    def references(self, stub: pb_grpc.GeneratorStub, timeout_s: float = 300.0) -> list[list[int]]:
        """Every question's answer computed cold (the cache neither read nor written)."""
        return [complete(stub, self.request(q, cold=True), timeout_s).token_ids for q in range(len(self.questions))]


def judge(result: StreamResult, references: list[list[int]]) -> None:
    """Marks ``result`` wrong if it ended OK with other tokens than its question's cold answer."""
    result.wrong = result.status == grpc.StatusCode.OK and result.tokens != references[result.question]


class Traffic:
    """``clients`` concurrent callers, round-robin over ``targets``, each asking the workload's
    questions in turn until ``stop()``; every answer is compared with ``references``. Use as a
    context manager (stops and joins on exit)."""

    def __init__(self, targets: Sequence[str], workload: Workload, references: list[list[int]], clients: int,
                 timeout_s: float = 120.0) -> None:
        self.workload, self.references, self.timeout_s = workload, references, timeout_s
        self.results: list[StreamResult] = []
        self._targets, self._clients = list(targets), clients
        self._next = itertools.count()
        self._done = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        channels = [grpc.aio.insecure_channel(t) for t in self._targets]
        try:
            stubs = [pb_grpc.GeneratorStub(c) for c in channels]
            await asyncio.gather(*(self._client(stubs[k % len(stubs)]) for k in range(self._clients)))
        finally:
            for channel in channels:
                await channel.close()

    async def _client(self, stub: pb_grpc.GeneratorStub) -> None:
        while not self._stopping.is_set():
            question = next(self._next) % len(self.workload.questions)
            result = StreamResult(time.perf_counter(), question=question)
            await stream(stub, self.workload.request(question), self.timeout_s, result)
            judge(result, self.references)
            with self._done:
                self.results.append(result)
                self._done.notify_all()

    def completed(self) -> int:
        with self._done:
            return len(self.results)

    def wait_completed(self, more: int, timeout_s: float = 300.0) -> None:
        """Blocks until ``more`` further requests have ended (in any status)."""
        target = self.completed() + more
        with self._done:
            if not self._done.wait_for(lambda: len(self.results) >= target or not self._thread.is_alive(), timeout_s):
                raise TimeoutError(f"{target - len(self.results)} of {more} requests still running after {timeout_s} s")

    def stop(self) -> Summary:
        """Lets every client finish its request in flight; returns the summary of all of them."""
        self._stopping.set()
        self._thread.join()
        return Summary.of(self.results)

    def __enter__(self) -> Traffic:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Periodic:
    """Calls ``step`` every ``interval_s`` on a thread of its own while the ``with`` block runs;
    ``count`` adds up what the calls returned (True counts 1: a fault made, a sample taken)."""

    def __init__(self, step: Callable[[], bool | int], interval_s: float = 0.005) -> None:
        self.count = 0
        self._step, self._interval = step, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.count += self._step()

    def __enter__(self) -> Periodic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def burst(target: str, workload: Workload, references: list[list[int]], count: int,
          timeout_s: float) -> list[StreamResult]:
    """Sends ``count`` of the workload's requests at once over one channel, waits for all of them
    to end, and judges each answer."""

    async def run() -> list[StreamResult]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            sent = time.perf_counter()
            questions = [i % len(workload.questions) for i in range(count)]
            return list(await asyncio.gather(*(
                stream(stub, workload.request(q), timeout_s, StreamResult(sent, question=q)) for q in questions)))

    results = asyncio.run(run())
    for result in results:
        judge(result, references)
    return results
