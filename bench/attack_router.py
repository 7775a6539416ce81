"""The router against a frozen worker (issue 33, finding 3): two workers behind `kvshare route
--health-interval-s 1`, Generate streams in flight on both, then one worker is SIGSTOPped (a hung
process: its socket stays open, it answers nothing) and new calls keep coming to the prefixes it
served. How long does each call stay frozen, and how does it end?

- in flight: streams that had received messages from each worker when it was stopped;
- sent after: Generate calls for the stopped worker's prefixes, and Tokenize calls (round-robin),
  sent right after the SIGSTOP, before a health check can have noticed it;
- stall s: the longest silence of a call after the SIGSTOP (from it, or from the call's sending if
  later, to a message, between two, or from the last to the end): messages already on their way
  still arrive after the stop; a call that ran on unhindered stalls ~0;
- outcome: ``finished by <worker>`` (from the workers' own log lines) or the status code and details.

Every call has a deadline (``--deadline-s``, 30 s as in the attack; 10 s with ``--smoke``): a call
the router leaves waiting on the frozen worker stalls until it. The run fails (exit 1) when any call
met its deadline or ended with a status that names no worker.

    .venv/bin/python -m bench.attack_router [--smoke] [--model DIR] [--deadline-s S]
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import grpc
import numpy as np

from bench.fleet import (
    INTRA_OP_THREADS,
    BenchModel,
    bench_model,
    parse_args,
    print_table,
)
from bench.verdict import exit_code
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.local.worker_process import RouterProcess, WorkerProcess
from services.route.rendezvous import choose
from services.route.routing_key import routing_key

STREAMS_PER_WORKER = 2
LATE_GENERATES = 2
LATE_TOKENIZES = 2
PROMPT_TOKENS = 48
HEALTH_INTERVAL_S = 1.0
START_TIMEOUT_S = 120.0


@dataclass(slots=True)
class Call:
    """One call and what happened to it; times are time.monotonic()."""

    name: str
    kind: str
    home: str
    """Worker rendezvous hashing (or round-robin, for Tokenize: either) sends it to."""
    request_id: str = ""
    sent_at: float = 0.0
    heard: list[float] = field(default_factory=list)
    """When each message arrived."""
    ended_at: float = 0.0
    status: str = ""
    """'' for OK, else CODE: details."""
    first: threading.Event = field(default_factory=threading.Event)

    def stall_s(self, stopped_at: float) -> float:
        """The longest silence of the call after the SIGSTOP: the greatest gap between consecutive
        signs of life (the stop, or the sending if later; each message; the end)."""
        since = max(self.sent_at, stopped_at)
        times = [since, *(t for t in self.heard if t >= since), self.ended_at]
        return max(b - a for a, b in zip(times, times[1:]))

    def heard_before(self, stopped_at: float) -> int:
        return sum(t < stopped_at for t in self.heard)


@dataclass(frozen=True, slots=True)
class Candidate:
    address: str
    streams: int = 0


def home_of(request: pb.GenerateRequest, targets: list[str]) -> str:
    """The worker the router sends ``request`` to while both are healthy (its documented rule)."""
    return choose(routing_key(request.SerializeToString(), (), 256), [Candidate(t) for t in targets]).address


def prompts_for(target: str, targets: list[str], model: BenchModel, rng: np.random.Generator,
                count: int) -> list[list[int]]:
    """``count`` prompts whose routing key goes to ``target``."""
    found: list[list[int]] = []
    while len(found) < count:
        prompt = model.random_ids(rng, PROMPT_TOKENS)
        if home_of(pb.GenerateRequest(prompt_token_ids=prompt), targets) == target:
            found.append(prompt)
    return found


def generate(stub: pb_grpc.GeneratorStub, call: Call, prompt: list[int], max_new_tokens: int, deadline_s: float) -> None:
    request = pb.GenerateRequest(request_id=call.request_id, prompt_token_ids=prompt, max_new_tokens=max_new_tokens,
                                 ignore_eos=True)
    call.sent_at = time.monotonic()
    try:
        for _ in stub.Generate(request, timeout=deadline_s):
            call.heard.append(time.monotonic())
            call.first.set()
    except grpc.RpcError as err:
        call.status = f"{err.code().name}: {err.details()}"
    finally:
        call.ended_at = time.monotonic()
        call.first.set()


def tokenize(stub: pb_grpc.GeneratorStub, call: Call, deadline_s: float) -> None:
    call.sent_at = time.monotonic()
    try:
        stub.Tokenize(pb.TokenizeRequest(text="a frozen worker"), timeout=deadline_s)
        call.heard.append(time.monotonic())
    except grpc.RpcError as err:
        call.status = f"{err.code().name}: {err.details()}"
    finally:
        call.ended_at = time.monotonic()


def outcome(call: Call, workers: list[WorkerProcess]) -> str:
    if call.status:
        return call.status
    if not call.request_id:
        return "answered"
    finished = [w.target for w in workers
                if any(f"request {call.request_id} finished" in line for line in w.log_lines)]
    return f"finished by {finished[0] if len(finished) == 1 else '?'}"


def wait_logged(workers: list[WorkerProcess], calls: list[Call], timeout_s: float = 10.0) -> None:
    """Waits for the finished calls' log lines (a worker logs a request once its stream ended)."""
    deadline = time.monotonic() + timeout_s
    pending = [c for c in calls if c.request_id and not c.status]
    while pending and time.monotonic() < deadline:
        pending = [c for c in pending
                   if not any(f"request {c.request_id} finished" in line for w in workers for line in w.log_lines)]
        time.sleep(0.05)


def main() -> int:
    def options(parser) -> None:
        parser.add_argument("--deadline-s", type=float, default=None,
                            help="deadline of every call (30 s, as in the attack; 10 s with --smoke)")

    args = parse_args(__doc__.splitlines()[0], options)
    model = bench_model(args)
    deadline_s = args.deadline_s or (10.0 if args.smoke else 30.0)
    # Streams long enough to be running when the worker is stopped, short enough to finish on the
    # other well within the deadline (2 CPUs).
    max_new_tokens = 900 if args.smoke else 500
    rng = np.random.default_rng(0)
    worker_args = ("--max-new-tokens-cap", str(max_new_tokens), "--intra-op-threads", str(INTRA_OP_THREADS),
                   "--max-unread-tokens", "8")
    calls: list[Call] = []
    with ExitStack() as stack:
        workers = [stack.enter_context(WorkerProcess(model.folder, *worker_args, startup_timeout_s=START_TIMEOUT_S))
                   for _ in range(2)]
        targets = [w.target for w in workers]
        victim, survivor = workers
        router = stack.enter_context(RouterProcess(targets, "--health-interval-s", str(HEALTH_INTERVAL_S)))
        stub = pb_grpc.GeneratorStub(stack.enter_context(grpc.insecure_channel(router.target)))
        threads: list[threading.Thread] = []

        def start(call: Call, target, *call_args) -> None:
            calls.append(call)
            thread = threading.Thread(target=target, args=(stub, call, *call_args), daemon=True)
            threads.append(thread)
            thread.start()

        for worker in workers:
            for i, prompt in enumerate(prompts_for(worker.target, targets, model, rng, STREAMS_PER_WORKER)):
                name = f"stream {i + 1} on {'stopped' if worker is victim else 'other'}"
                start(Call(name, "in flight", worker.target, f"attack-{len(calls)}"), generate, prompt,
                      max_new_tokens, deadline_s)
        for call in calls:
            call.first.wait(START_TIMEOUT_S)
        stopped_at = time.monotonic()
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            for i, prompt in enumerate(prompts_for(victim.target, targets, model, rng, LATE_GENERATES)):
                start(Call(f"Generate {i + 1}", "sent after", victim.target, f"attack-{len(calls)}"), generate, prompt,
                      8, deadline_s)
            for i in range(LATE_TOKENIZES):
                start(Call(f"Tokenize {i + 1}", "sent after", "either"), tokenize, deadline_s)
            for thread in threads:
                thread.join(deadline_s + 30)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        wait_logged(workers, calls)
        results = [(c, outcome(c, workers)) for c in calls]
        names = {victim.target: "stopped", survivor.target: "other", "either": "either"}
        rows = [(c.name, c.kind, names[c.home], c.heard_before(stopped_at), c.stall_s(stopped_at), out)
                for c, out in results]
        stalled = [c.stall_s(stopped_at) for c, _ in results if c.home != survivor.target]
        rows.append(("worst stall of a call for the stopped worker", "", "", "", max(stalled), ""))
        print_table(f"{model.name} model, 2 workers behind kvshare route --health-interval-s {HEALTH_INTERVAL_S:g}, "
                    f"one SIGSTOPped with {STREAMS_PER_WORKER} streams in flight on each; every call's deadline "
                    f"{deadline_s:g} s",
                    ("call", "kind", "worker", "messages before the stop", "stall s", "outcome"), rows)
    bad = [c.name for c, out in results
           if out.startswith("DEADLINE_EXCEEDED") or (c.status and victim.target not in c.status)
           or (not c.status and c.request_id and out.endswith("?"))
           or (c.kind == "in flight" and c.ended_at <= stopped_at)]
    if bad:
        print(f"\nFAILED: {', '.join(bad)}: waited out its deadline, ended with a status naming no worker, "
              "was not logged as finished by one worker, or ended before the stop", file=sys.stderr)
    return exit_code(not bad, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
