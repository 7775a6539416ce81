"""SmolLM2-135M-Instruct in float16 on a GPU: kvshare workers against ONNX Runtime GenAI's og.Engine
(onnxruntime-genai-cuda 0.18) on the same model folder, side by side in one run.

The folder is the one `kvshare fetch-model smollm2-135m-instruct --dtype float16` writes from the
catalogue's GGUF (built once into the user's cache), or ``--model DIR``. Both engines: greedy, EOS
ignored (GenAI: the same number of tokens forced with a per-turn minimum), 2 intra-op threads.

- decode: 1, 16 and 64 streams of 256 prompt + 128 new tokens, sent at once, the shared cache
  skipped; tokens/s of all streams from the first request sent to the last token received (as
  bench/batch.py). Both 64 rows: kvshare ``--max-batch 64``, og.Engine static batching of 64.
- TTFT: a 1k- and an 8k-token prefix (1024 and 8064 tokens: with the 32-token question and the
  token generated they fit the 8192 context) on two workers sharing one Redis, once with
  ``--prefix-fetch always`` and once with ``auto``: cold (worker A computes the prefix and publishes
  it), warm (worker B, another question; ``auto`` may compute what it could fetch, so the tokens it
  took from the cache are reported). Server-side ms. og.Engine's TTFT of the same two prompts, in
  its process (it shares nothing between processes; the second shows what its own cache does).

Needs a GPU that CuPy sees, onnxruntime-gpu and onnxruntime-genai-cuda; without them it stops at
once with one line (exit 2). ``--device cpu`` runs the same comparison on the CPU, to check the
benchmark itself on a machine without a GPU (its numbers are not what it is for). Prints each table
with the ratios against GenAI and writes everything to a JSON file (rewritten after each part, so
a run cut short keeps what it measured). scripts/gpu_check.sh runs it on the GPU machine.

    python -m bench.gpu [--smoke] [--model DIR] [--device cuda|cuda:N|cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.batch import GenAIEngine, kvshare_load, prompts_for
from bench.fleet import (
    INTRA_OP_THREADS,
    QUESTION_TOKENS,
    BenchModel,
    Fleet,
    cold,
    first_token,
    fleet,
    median,
    parse_args,
    print_table,
    warm,
    warm_up,
)
from kvshare.v1 import generator_pb2 as pb
from services.local.model_catalogue import fetch_model
from services.local.worker_process import WorkerProcess
from services.runtime.device_arrays import cuda_problem
from services.runtime.device_choice import DeviceChoice

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "docs" / "gpu.json"
MODEL = "smollm2-135m-instruct"
ROWS = 64
PROMPT_TOKENS = 256
FETCH_MODES = ("always", "auto")


@dataclass(frozen=True, slots=True)
class Plan:
    """How much one run measures (``--smoke``: seconds, to check the benchmark works)."""

    streams: tuple[int, ...]
    new_tokens: int
    rounds: int
    prefixes: tuple[int, ...]
    runs: int
    fetch_warm_ups: int
    """Cold and warm pairs before the TTFT runs: ``--prefix-fetch auto`` decides from running
    estimates (prefill pace, the store's latency and bytes/s) only once each has 8 observations."""


FULL = Plan(streams=(1, 16, ROWS), new_tokens=128, rounds=3, prefixes=(1024, 8064), runs=3, fetch_warm_ups=10)
SMOKE = Plan(streams=(1, 4), new_tokens=8, rounds=1, prefixes=(256,), runs=1, fetch_warm_ups=2)


@dataclass(frozen=True, slots=True)
class DecodeRow:
    streams: int
    kvshare_tokens_per_s: float
    genai_tokens_per_s: float
    kvshare_over_genai: float
    """Median of the rounds' ratios (each round runs both engines back to back)."""
    same_tokens: int
    """Streams whose greedy tokens were GenAI's, of ``streams_compared``."""
    streams_compared: int


@dataclass(frozen=True, slots=True)
class TTFTRow:
    prefix_fetch: str
    prefix_tokens: int
    kvshare_cold_ms: float
    kvshare_warm_ms: float
    warm_cached_tokens: list[int]
    """Prompt tokens each warm run took from the cache (``auto`` may have computed them instead)."""
    genai_cold_ms: float
    genai_same_prefix_ms: float
    """og.Engine's TTFT of the second prompt: the same prefix, another question, in its process."""

    @property
    def ratios(self) -> dict[str, float]:
        return {"kvshare_warm_over_cold": self.kvshare_warm_ms / self.kvshare_cold_ms,
                "genai_cold_over_kvshare_cold": self.genai_cold_ms / self.kvshare_cold_ms,
                "genai_cold_over_kvshare_warm": self.genai_cold_ms / self.kvshare_warm_ms}


def missing_gpu(device: str) -> str | None:
    """Why ``device`` (cuda or cuda:N) cannot run this benchmark here, or None when it can: what
    stops a worker (``cuda_problem``), or a GenAI without CUDA."""
    if problem := cuda_problem(DeviceChoice.parse(device).index):
        return problem
    try:
        import onnxruntime_genai as og
    except ImportError:
        return "onnxruntime-genai is not installed (the peer: onnxruntime-genai-cuda)"
    if not og.is_cuda_available():
        return f"onnxruntime-genai {og.__version__} is not the CUDA build (onnxruntime-genai-cuda)"
    return None


def float16_smollm2() -> BenchModel:
    """The catalogue's SmolLM2 as `kvshare fetch-model smollm2 --dtype float16` writes it (built once
    into the user's model cache)."""
    return BenchModel.of(fetch_model(MODEL, dtype="float16"), "SmolLM2-135M-Instruct float16")


def genai_engine(model: BenchModel, device: str) -> GenAIEngine:
    """og.Engine with ``ROWS`` static-batching rows, on the folder's CPU provider or on CUDA."""
    if device == "cpu":
        return GenAIEngine(model, ROWS)
    return GenAIEngine(model, ROWS, "cuda", {"device_id": str(DeviceChoice.parse(device).index)})


def decode_rows(model: BenchModel, genai: GenAIEngine, device: str, plan: Plan) -> list[DecodeRow]:
    """Rounds of every stream count on both engines, interleaved so that a noisy moment hits both."""
    rng = np.random.default_rng(7)
    runs: dict[int, list[tuple[float, float]]] = {n: [] for n in plan.streams}
    same = dict.fromkeys(plan.streams, 0)
    with WorkerProcess(model.folder, "--device", device, "--intra-op-threads", str(INTRA_OP_THREADS),
                       "--cache", "memory://", "--max-batch", str(ROWS), startup_timeout_s=180) as worker:
        first = prompts_for(model, rng, 2, PROMPT_TOKENS)
        kvshare_load(worker.target, first, [4, 4])
        genai.load(first, [4, 4])
        for _ in range(plan.rounds):
            for n in plan.streams:
                prompts = prompts_for(model, rng, n, PROMPT_TOKENS)
                ours = kvshare_load(worker.target, prompts, [plan.new_tokens] * n)
                theirs = genai.load(prompts, [plan.new_tokens] * n)
                runs[n].append((ours.tokens_per_s, theirs.tokens_per_s))
                same[n] += sum(a.tokens == b.tokens for a, b in zip(ours.streams, theirs.streams, strict=True))
    return [DecodeRow(n, median([r[0] for r in runs[n]]), median([r[1] for r in runs[n]]),
                      median([a / b for a, b in runs[n]]), same[n], n * plan.rounds) for n in plan.streams]


def warm_start(f: Fleet, prompt: list[int], prefix_tokens: int, mode: str) -> pb.GenerateResponse:
    """Worker B's first token of ``prompt``, whose prefix worker A published. ``always`` must have
    fetched the whole prefix (and waits for B's publishes, as bench.ttft); ``auto`` may compute it."""
    if mode == "always":
        return warm(f, f.stubs[1], prompt, prefix_tokens)
    return first_token(f.stubs[1], prompt)


def ttft_rows(model: BenchModel, genai: GenAIEngine, device: str, mode: str, plan: Plan) -> list[TTFTRow]:
    rng = np.random.default_rng(0)

    def question() -> list[int]:
        return model.random_ids(rng, QUESTION_TOKENS)

    rows = []
    with fleet(model, extra_args=("--device", device, "--prefix-fetch", mode)) as f:
        warm_up(f.stubs, model.random_ids(rng, max(plan.prefixes) + QUESTION_TOKENS))
        for i in range(plan.fetch_warm_ups):
            prefix_tokens = plan.prefixes[i % len(plan.prefixes)]
            prefix = model.random_ids(rng, prefix_tokens)
            cold(f, f.stubs[0], prefix + question())
            warm_start(f, prefix + question(), prefix_tokens, mode)
        for prefix_tokens in plan.prefixes:
            cold_ms, warm_ms, cached, genai_cold, genai_again = [], [], [], [], []
            for _ in range(plan.runs):
                prefix = model.random_ids(rng, prefix_tokens)
                first, second = prefix + question(), prefix + question()
                cold_ms.append(cold(f, f.stubs[0], first).timings.time_to_first_token_ms)
                w = warm_start(f, second, prefix_tokens, mode)
                warm_ms.append(w.timings.time_to_first_token_ms)
                cached.append(w.usage.cached_prompt_tokens)
                genai_cold.append(genai.load([first], [1]).streams[0].ttft * 1e3)
                genai_again.append(genai.load([second], [1]).streams[0].ttft * 1e3)
            rows.append(TTFTRow(mode, prefix_tokens, median(cold_ms), median(warm_ms), cached, median(genai_cold),
                                median(genai_again)))
            print(f"--prefix-fetch {mode}, prefix {prefix_tokens}: cold {rows[-1].kvshare_cold_ms:.1f} ms, "
                  f"warm {rows[-1].kvshare_warm_ms:.1f} ms, GenAI {rows[-1].genai_cold_ms:.1f} ms", flush=True)
    return rows


def environment(device: str) -> dict[str, str]:
    """Versions, and the GPU's name, for the JSON."""
    import onnxruntime_genai as og

    from services.runtime.ort import onnxruntime as ort

    found = {"device": device, "onnxruntime": ort.__version__, "onnxruntime_genai": og.__version__}
    if device != "cpu":
        import cupy

        properties = cupy.cuda.runtime.getDeviceProperties(DeviceChoice.parse(device).index)
        found |= {"gpu": properties["name"].decode(), "cupy": cupy.__version__}
    return found


def _names_a_device(text: str) -> bool:
    """cpu, cuda or cuda:N as the worker reads ``--device`` (``auto`` is no device to measure)."""
    try:
        return DeviceChoice.parse(text).kind != "auto"
    except ValueError:
        return False


def main() -> int:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--device", default="cuda", help="cuda (the first GPU), cuda:N, or cpu (checks the "
                                                             "benchmark itself where there is no GPU)")
        parser.add_argument("--json", type=Path, default=None,
                            help=f"where to write the results (default: {DEFAULT_JSON.relative_to(ROOT)}; "
                                 "none for a smoke run)")

    args = parse_args(__doc__.splitlines()[0], options)
    if not _names_a_device(args.device):
        print(f"bench.gpu: --device {args.device!r} is not cuda, cuda:N or cpu", file=sys.stderr)
        return 2
    if args.device != "cpu" and (reason := missing_gpu(args.device)):
        print(f"bench.gpu: no GPU to measure on: {reason}", file=sys.stderr)
        return 2
    plan = SMOKE if args.smoke else FULL
    model = BenchModel.of(args.model) if args.model else float16_smollm2()
    out = args.json or (None if args.smoke else DEFAULT_JSON)
    results: dict = {"model": model.name, "folder": str(model.folder), "environment": environment(args.device),
                     "plan": asdict(plan), "decode": [], "ttft": []}

    def save() -> None:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2) + "\n")

    genai = genai_engine(model, args.device)
    decode = decode_rows(model, genai, args.device, plan)
    results["decode"] = [asdict(r) for r in decode]
    save()
    print_table(f"{model.name} on {args.device}: {PROMPT_TOKENS} prompt + {plan.new_tokens} new tokens per stream, "
                f"greedy, both {ROWS} rows; medians of {plan.rounds} interleaved rounds",
                ("streams", "kvshare tok/s", "GenAI tok/s", "kvshare / GenAI", "same tokens"),
                [(r.streams, r.kvshare_tokens_per_s, r.genai_tokens_per_s, r.kvshare_over_genai,
                  f"{r.same_tokens} of {r.streams_compared}") for r in decode])

    ttft = [row for mode in FETCH_MODES for row in ttft_rows(model, genai, args.device, mode, plan)]
    results["ttft"] = [{**asdict(r), **r.ratios} for r in ttft]
    save()
    print_table(f"{model.name} on {args.device}: TTFT of a prefix + {QUESTION_TOKENS}-token question, 2 workers on "
                f"one Redis (server-side ms) and og.Engine in its process; medians of {plan.runs} runs",
                ("--prefix-fetch", "prefix tokens", "cold ms", "warm ms", "warm cached tokens", "warm / cold",
                 "GenAI ms", "GenAI same prefix ms", "GenAI / kvshare cold", "GenAI / kvshare warm"),
                [(r.prefix_fetch, r.prefix_tokens, r.kvshare_cold_ms, r.kvshare_warm_ms,
                  " ".join(map(str, r.warm_cached_tokens)), r.ratios["kvshare_warm_over_cold"], r.genai_cold_ms,
                  r.genai_same_prefix_ms, r.ratios["genai_cold_over_kvshare_cold"],
                  r.ratios["genai_cold_over_kvshare_warm"]) for r in ttft])
    if out is not None:
        print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
