"""Requests that could stall a worker: what a running stream sees while they arrive.

A greedy stream decodes (EOS ignored) on a worker while one call arrives: a 3.6 MB prompt or a
3.6 MB Tokenize call (to a worker with the default prompt limit, and to one with
``KVSHARE_MAX_PROMPT_BYTES`` raised so that they are really tokenized), a request with 64 stop
strings or one with 50,000. For each: its answer, how long it took, and the stream's longest gap
between tokens while it was answered against the stream's median gap just before (and whether that
stays under ``GAP_BAR``, 10x). Then: tokens/s of N concurrent streams while one more stream runs with no stops, 64 or 50,000 stop strings (that
never match), and the RSS of a fresh worker before and after one 3.6 MB prompt is tokenized.

The limits are given by environment variables, which a worker without them ignores, so the same
file measures a commit from before they existed. Big calls are sent and answered as raw bytes, so
the client's own parsing of megabytes never delays the stream it measures.

    .venv/bin/python -m bench.stalls [--smoke] [--model DIR] [--streams N] [--prompt-mb MB]
"""

from __future__ import annotations

import gc
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from bench.fleet import (
    BenchModel,
    bench_model,
    parse_args,
    print_table,
)
from bench.load import rss_mib
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import raw_call
from services.local.worker_process import WorkerProcess

CORPUS = Path(__file__).resolve().parent.parent / "services" / "modelbuild" / "corpus.txt"

INTRA_OP_THREADS_HERE = 1
"""Leaves a core of the 2-vCPU bench machine to tokenizing: what the stream then sees is what the
worker does to it, not two runtimes sharing one core."""
MAX_STOPS = 64
"""The default --max-stop-strings."""
MANY_STOPS = 50_000
MESSAGE_BYTES = 16 << 20
"""--max-message-bytes of the measured workers: admits the big calls and the Tokenize answers."""
GAP_BAR = 10.0
"""The bar for a big call: the stream's longest gap while it is answered stays under this many
times its median gap (once asserted by tests/test_stalls.py on real workers; a speed figure, so
measured here, while the tests prove the mechanisms by the order of events)."""


def big_text(megabytes: float, seed: int = 5) -> str:
    """Seeded text of about ``megabytes`` MB in UTF-8: sentences of the seeded tokenizer's own
    corpus words (as efficiently tokenized as English is by a real model's tokenizer, about 4
    bytes per token) with some accented and CJK words and line breaks."""
    rng = np.random.default_rng(seed)
    words = CORPUS.read_text().split() + ["café", "naïve", "Zürich", "日本語", "données", "—", "1984", "3.14"]
    out: list[str] = []
    size = 0
    while size < megabytes * 1e6:
        sentence = " ".join(words[i] for i in rng.integers(0, len(words), size=int(rng.integers(4, 30))))
        out.append(sentence + (".\n" if rng.random() < 0.2 else ". "))
        size += len(out[-1].encode())
    return "".join(out)


def never_matching_stops(count: int, seed: int = 9) -> list[str]:
    """``count`` distinct stop strings of 12 characters that generated text will not contain."""
    rng = np.random.default_rng(seed)
    return [f"\u2603{i:07d}{s}" for i, s in enumerate(rng.integers(1000, 9999, size=count))]


class RunningStream:
    """A greedy stream read on a thread of its own, recording when each message arrives; stopped
    by ``cancel``."""

    def __init__(self, target: str, request: pb.GenerateRequest) -> None:
        self.arrivals: list[float] = []
        """perf_counter() of each message's arrival."""
        self.status: grpc.StatusCode | None = None
        self._channel = grpc.insecure_channel(target)
        self._call = pb_grpc.GeneratorStub(self._channel).Generate(request, timeout=600)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for _ in self._call:
                self.arrivals.append(time.perf_counter())
            self.status = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.status = exc.code()

    def wait_for_tokens(self, count: int, timeout_s: float = 120.0, or_end: bool = False) -> None:
        """Until ``count`` more messages arrived (or, with ``or_end``, the stream finished)."""
        deadline = time.monotonic() + timeout_s
        start = len(self.arrivals)
        while len(self.arrivals) < start + count:
            if or_end and self.status == grpc.StatusCode.OK:
                return
            if self.status is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the running stream ended ({self.status}) or stalled")
            time.sleep(0.005)

    def gaps_ms(self, start: float, end: float) -> np.ndarray:
        """Gaps between arrivals that overlap [start, end] (ms)."""
        t = np.asarray(self.arrivals)
        keep = (t[1:] >= start) & (t[:-1] <= end)
        return np.diff(t)[keep] * 1e3

    def wait(self, timeout_s: float = 600.0) -> None:
        self._thread.join(timeout_s)

    def cancel(self) -> None:
        self._call.cancel()
        self._thread.join(10)
        self._channel.close()


def stream_request(max_new_tokens: int, stop: list[str] | None = None) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="The system prompt tells the assistant who it is.", max_new_tokens=max_new_tokens,
                              ignore_eos=True, stop=stop or [], cache=pb.CacheOptions(skip_read=True, skip_write=True))


@dataclass(frozen=True, slots=True)
class Arrival:
    """One call made while a stream runs, and what the stream saw meanwhile."""

    status: grpc.StatusCode
    answer: bytes
    """The response bytes, or the status details."""
    answered_ms: float
    median_gap_ms: float
    """The stream's median gap over its 100 gaps before the call."""
    longest_gap_ms: float
    """The stream's longest gap while the call was answered."""

    @property
    def ratio(self) -> float:
        return self.longest_gap_ms / self.median_gap_ms


def call_during_stream(target: str, method: str, request: bytes, stream_tokens: int = 3000) -> Arrival:
    """Starts a greedy stream, lets it make 150 tokens, makes the call, and returns what the
    stream saw (the gap that is open when the answer comes is waited for)."""
    stream = RunningStream(target, stream_request(stream_tokens))
    # The stream's arrivals are stamped in this process: a collection of a big test process's
    # garbage while they are would be the client's pause, not the worker's.
    gc.collect()
    gc.disable()
    try:
        stream.wait_for_tokens(150)
        median = statistics.median(np.diff(stream.arrivals[-101:])) * 1e3
        with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", MESSAGE_BYTES)]) as channel:
            start = time.perf_counter()
            status, answer = raw_call(channel, method, request, timeout_s=300)
            end = time.perf_counter()
        stream.wait_for_tokens(5, or_end=True)  # the gap still open at the answer
        # A stream that ended during the call (a machine slow enough to make all its tokens first)
        # saw only the gaps before its end; none at all reads as NaN, never as a figure.
        gaps = stream.gaps_ms(start, end)
        return Arrival(status, answer, (end - start) * 1e3, median, float(gaps.max()) if gaps.size else float("nan"))
    finally:
        gc.enable()
        stream.cancel()


def throughput(target: str, streams: int, new_tokens: int, stop: list[str] | None) -> float:
    """Tokens/s of ``streams`` greedy streams while one more runs with ``stop``."""
    extra = RunningStream(target, stream_request(new_tokens, stop))
    runners = [RunningStream(target, stream_request(new_tokens)) for _ in range(streams)]
    try:
        for r in runners:
            r.wait()
        start = min(r.arrivals[0] for r in runners)
        end = max(r.arrivals[-1] for r in runners)
        # A message may carry several tokens; the streams all end at new_tokens.
        return streams * new_tokens / (end - start)
    finally:
        extra.cancel()


def worker_rss_after(worker: WorkerProcess, request: bytes) -> tuple[float, float, float]:
    """RSS (MiB) after a few small requests, right after the call, and 2 s later."""
    with grpc.insecure_channel(worker.target) as ch:
        for _ in range(3):
            raw_call(ch, "Generate", stream_request(16).SerializeToString(), timeout_s=300)
        before = rss_mib(worker.pid)
        raw_call(ch, "Generate", request, timeout_s=300)
    after = rss_mib(worker.pid)
    time.sleep(2)
    return before, after, rss_mib(worker.pid)


def main() -> int:
    def extra(parser) -> None:
        parser.add_argument("--streams", type=int, default=None, help="concurrent streams for tokens/s (default 8; smoke 2)")
        parser.add_argument("--prompt-mb", type=float, default=None, help="size of the big prompt (default 3.6; smoke 0.01)")

    args = parse_args(__doc__.splitlines()[0], extra)
    model: BenchModel = bench_model(args)
    streams = args.streams or (2 if args.smoke else 8)
    megabytes = args.prompt_mb or (0.01 if args.smoke else 3.6)
    new_tokens = 64 if args.smoke else 256
    text = big_text(megabytes)
    size = f"{len(text.encode()) / 1e6:.3g} MB"
    prompt = pb.GenerateRequest(prompt=text, max_new_tokens=16).SerializeToString()
    tokenize = pb.TokenizeRequest(text=text).SerializeToString()
    common = ("--intra-op-threads", str(INTRA_OP_THREADS_HERE), "--max-message-bytes", str(MESSAGE_BYTES),
              "--max-new-tokens-cap", "4096")
    raised = {"KVSHARE_MAX_PROMPT_BYTES": str(MESSAGE_BYTES)}
    stops = {n: pb.GenerateRequest(prompt="Hello", max_new_tokens=16, stop=never_matching_stops(n)).SerializeToString()
             for n in (MAX_STOPS, MANY_STOPS)}
    # The tiny model's context holds 900 new tokens after the prompt; a stream that ends during a
    # call on a slow machine reports the gaps it saw (call_during_stream).
    stream_tokens = 900 if args.smoke else 3000
    with WorkerProcess(model.folder, *common) as default, WorkerProcess(model.folder, *common, env=raised) as tokenizing:
        cases = [
            (f"{size} prompt, default limit", default, "Generate", prompt),
            (f"{size} Tokenize, default limit", default, "Tokenize", tokenize),
            (f"{size} prompt, limit raised (tokenized)", tokenizing, "Generate", prompt),
            (f"{size} Tokenize, limit raised (tokenized)", tokenizing, "Tokenize", tokenize),
            (f"{MAX_STOPS} stop strings", default, "Generate", stops[MAX_STOPS]),
            (f"{MANY_STOPS:,} stop strings", default, "Generate", stops[MANY_STOPS]),
        ]
        seen = [(label, call_during_stream(w.target, method, request, stream_tokens))
                for label, w, method, request in cases]
        rates = {label: throughput(default.target, streams, new_tokens, stop) for label, stop in (
            ("no stops", None), (f"{MAX_STOPS} stops", never_matching_stops(MAX_STOPS)),
            (f"{MANY_STOPS:,} stops", never_matching_stops(MANY_STOPS)))}
    with WorkerProcess(model.folder, *common, env=raised) as fresh:
        rss = worker_rss_after(fresh, prompt)

    print_table(f"model {model.name}, {INTRA_OP_THREADS_HERE} intra-op thread: a greedy stream decoding while each call "
                "arrives", ("call", "answer", "answered in ms", "stream's median gap ms", "longest gap meanwhile ms",
                            "longest ÷ median", f"under {GAP_BAR:g}x"),
                [(label, a.status.name, f"{a.answered_ms:.0f}", f"{a.median_gap_ms:.1f}", f"{a.longest_gap_ms:.1f}",
                  f"{a.ratio:.1f}x", "yes" if a.ratio < GAP_BAR else "NO") for label, a in seen])
    base = rates["no stops"]
    print_table(f"tokens/s of {streams} greedy streams of {new_tokens} tokens while one more stream runs, and the "
                f"worker's RSS around one {size} prompt tokenized", ("figure", "value"),
                [(f"tokens/s, the extra stream with {label}", f"{rate:.0f} ({rate / base:.2f}x)")
                 for label, rate in rates.items()]
                + [("RSS MiB before / right after / 2 s after", " / ".join(f"{v:.0f}" for v in rss))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
