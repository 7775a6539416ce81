"""n samples and beam search: the wall time of one request with n = 4 samples against n = 1, and of a
4-beam search against greedy decoding, on a kvshare worker and ONNX Runtime GenAI 0.18 on the same
model folder, side by side in one run.

kvshare: a real worker over gRPC (``--max-batch 4``, 2 intra-op threads, ``memory://`` store; every
request skips reading and writing it). A request with n = 4 prefills its prompt once and forks the
K/V into 4 rows that decode in one batched run per step; 4 beams decode in lockstep, their K/V
reordered by parent with one gather per step. The worker's ``kvshare_prefill_tokens`` and decode
counters (``--metrics-port``), read before and after each request, show what ran: the prompt's
tokens once per request, and how many rows each decode step advanced.

GenAI: ``og.Generator`` (its ``og.Engine`` has no beam search) with the same 2 threads:
``do_sample`` with temperature 1 and no top-k/top-p filter for samples, ``num_beams=4`` for beams,
``min_length`` = ``max_length`` in place of ignore_eos. ``num_return_sequences=4`` with sampling is
tried and, if GenAI refuses it, reported as unsupported with its error; what a GenAI user does
instead, 4 copies of the prompt in one batch (``batch_size=4``: the prompt is prefilled 4 times),
is measured in its own row.

Every case: a fresh random prompt per round (the same one for all cases of a round), 128 new tokens
with EOS ignored, so every sample, beam and greedy run makes exactly 128 tokens (beam search too:
with EOS ignored no hypothesis ends early, so the 4 beams run the same 128 steps as greedy and the
ratio compares the cost of a step, not how soon a search happens to end). Samples: temperature 1.0, seed 1234 (sample i
of n = 4 uses seed + i, so sample 0 must equal the n = 1 request: checked). Ratios are medians of
the per-round ratios over interleaved rounds. Targets: n4/n1 <= 1.5 and beams/greedy <= 2, printed
as met or missed; the exit code is 1 only for a broken run (an error, wrong token or prefill counts,
sample 0 differing from n = 1), never for a missed target.

    .venv/bin/python -m bench.samples [--smoke] [--model DIR] [--rounds N]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.request import urlopen

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.fleet import (
    INTRA_OP_THREADS,
    BenchModel,
    bench_model,
    genai_folder,
    parse_args,
    print_table,
)
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.local.redis_process import free_port
from services.local.worker_process import WorkerProcess

SAMPLES = 4
BEAMS = 4
SEED = 1234
TEMPERATURE = 1.0
SAMPLES_TARGET = 1.5
BEAMS_TARGET = 2.0
CALL_TIMEOUT_S = 600.0
COUNTERS = ("kvshare_prefill_tokens", "kvshare_decode_steps", "kvshare_decode_rows")


@dataclass(slots=True)
class Run:
    """One request: wall time, the tokens of each returned sequence, and (kvshare) counter deltas."""

    wall_s: float
    sequences: list[list[int]]
    prefill_ms: float
    """Running the prompt (kvshare: the worker's timings; GenAI: ``append_tokens``)."""
    step_ms: float
    """The rest divided by the steps after the first token (kvshare: the worker's total minus its
    prefill; GenAI: the ``generate_next_token`` loop): model run, sampling or search, K/V moves."""
    prefill_tokens: int | None = None
    decode_steps: int | None = None
    decode_rows: int | None = None


@dataclass(slots=True)
class Case:
    """A request shape measured on one engine; ``error`` set when the engine refuses it."""

    engine: str
    name: str
    rows: int
    """Rows decoded at once (samples, beams, or batch rows)."""
    outputs: int
    """Sequences the request returns."""
    runs: list[Run] = field(default_factory=list)
    error: str = ""

    @property
    def wall_ms(self) -> float:
        return statistics.median(r.wall_s for r in self.runs) * 1e3

    @property
    def prefill_ms(self) -> float:
        return statistics.median(r.prefill_ms for r in self.runs)

    @property
    def step_ms(self) -> float:
        return statistics.median(r.step_ms for r in self.runs)


class Checks:
    """What must hold for the run to be valid (not speed): failures are printed and set the exit code."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.failed.append(what)
            print(f"CHECK FAILED: {what}", flush=True)


# kvshare: a worker over gRPC ------------------------------------------------------------------------


class KvshareWorker:
    def __init__(self, worker: WorkerProcess, metrics_port: int) -> None:
        self.channel = grpc.insecure_channel(worker.target)
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.metrics_port = metrics_port

    def counters(self) -> dict[str, int]:
        text = urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        values = {}
        for family in text_string_to_metric_families(text):
            if family.name in COUNTERS:
                values[family.name] = int(sum(s.value for s in family.samples if s.name.endswith("_total")))
        return values

    def run(self, prompt: list[int], new: int, n: int = 1, beams: int = 1, sample: bool = False) -> Run:
        request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=new, ignore_eos=True, n=n,
                                     num_beams=beams, cache=pb.CacheOptions(skip_read=True, skip_write=True))
        if sample:
            request.sampling.CopyFrom(pb.SamplingParams(temperature=TEMPERATURE, seed=SEED))
        before = self.counters()
        sequences: dict[int, list[int]] = {}
        finished: dict[int, int] = {}
        timings: list[pb.Timings] = []
        t0 = time.perf_counter()
        for message in self.stub.Generate(request, timeout=CALL_TIMEOUT_S):
            sequences.setdefault(message.index, []).extend(message.token_ids)
            if message.finish_reason:
                finished[message.index] = message.finish_reason
                timings.append(message.timings)
        wall = time.perf_counter() - t0
        after = self.counters()
        bad = {i: pb.FinishReason.Name(r) for i, r in finished.items() if r != pb.FINISH_REASON_LENGTH}
        if sorted(finished) != sorted(sequences) or bad:
            raise RuntimeError(f"kvshare: sequences {sorted(sequences)} finished {sorted(finished)}, not by length: {bad}")
        delta = {k: after[k] - before[k] for k in COUNTERS}
        prefill_ms = timings[0].prefill_ms
        step_ms = (max(t.total_ms for t in timings) - prefill_ms) / max(new - 1, 1)
        return Run(wall, [sequences[i] for i in sorted(sequences)], prefill_ms, step_ms,
                   delta["kvshare_prefill_tokens"], delta["kvshare_decode_steps"], delta["kvshare_decode_rows"])

    def close(self) -> None:
        self.channel.close()


# ONNX Runtime GenAI: og.Generator ------------------------------------------------------------------


class GenAIGenerator:
    def __init__(self, model: BenchModel) -> None:
        import onnxruntime_genai as og

        self.og = og
        self.model = og.Model(str(genai_folder(model)))

    def run(self, prompt: list[int], new: int, batch: int = 1, returned: int = 1, beams: int = 1,
            sample: bool = False) -> Run:
        og = self.og
        length = len(prompt) + new
        options = {"max_length": length, "min_length": length, "batch_size": batch, "num_beams": beams,
                   "num_return_sequences": returned}
        if sample:
            # top_k 0 and top_p 1: GenAI samples the whole distribution, as kvshare does without filters.
            options.update(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, random_seed=SEED)
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        params.set_search_options(**options)
        generator = og.Generator(self.model, params)
        ids = np.asarray(prompt, dtype=np.int32)
        generator.append_tokens(np.stack([ids] * batch) if batch > 1 else ids)  # runs the prompt
        t1 = time.perf_counter()
        steps = 0
        while not generator.is_done():
            generator.generate_next_token()
            steps += 1
        wall = time.perf_counter() - t0
        sequences = [np.asarray(generator.get_sequence(i))[len(prompt):].tolist() for i in range(batch * returned)]
        return Run(wall, sequences, (t1 - t0) * 1e3, (wall - (t1 - t0)) * 1e3 / max(steps - 1, 1))


# The run --------------------------------------------------------------------------------------------


def same_tokens(ours: list[int], theirs: list[int]) -> str:
    if ours == theirs:
        return "yes"
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return f"from token {first}"


def ratios(num: Case, den: Case) -> list[float]:
    return [a.wall_s / b.wall_s for a, b in zip(num.runs, den.runs, strict=True)]


def ratio_text(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def main() -> int:
    def flags(parser) -> None:
        parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; 1 with --smoke)")
        parser.add_argument("--prompt-tokens", type=int, default=None,
                            help="prompt length (default 256; 64 with --smoke); the prompt is computed once per request")

    args = parse_args(__doc__.splitlines()[0], flags)
    model = bench_model(args)
    prompt_tokens, new, rounds = (64, 16, 1) if args.smoke else (256, 128, 3)
    rounds, prompt_tokens = args.rounds or rounds, args.prompt_tokens or prompt_tokens
    rng = np.random.default_rng(17)
    checks = Checks()

    genai = GenAIGenerator(model)
    ours = {name: Case("kvshare", name, rows, outputs) for name, rows, outputs in
            (("n=1", 1, 1), (f"n={SAMPLES}", SAMPLES, SAMPLES), ("greedy", 1, 1), (f"num_beams={BEAMS}", BEAMS, 1))}
    theirs = {name: Case("onnxruntime-genai", name, rows, outputs) for name, rows, outputs in
              (("n=1", 1, 1), (f"num_return_sequences={SAMPLES}", SAMPLES, SAMPLES),
               (f"{SAMPLES} prompt copies, batch_size={SAMPLES}", SAMPLES, SAMPLES), ("greedy", 1, 1),
               (f"num_beams={BEAMS}", BEAMS, 1))}
    k_n1, k_n4, k_greedy, k_beams = ours.values()
    g_n1, g_returned, g_copies, g_greedy, g_beams = theirs.values()

    # GenAI's num_return_sequences with sampling: measured if it runs, else reported as unsupported.
    try:
        genai.run(model.random_ids(rng, 8), 2, returned=SAMPLES, sample=True)
    except Exception as exc:  # noqa: BLE001 - any refusal is what we report
        g_returned.error = f"{type(exc).__name__}: {exc}"
    genai_cases: list[tuple[Case, Callable[[list[int]], Run]]] = [
        (g_n1, lambda p: genai.run(p, new, sample=True)),
        *([] if g_returned.error else [(g_returned, lambda p: genai.run(p, new, returned=SAMPLES, sample=True))]),
        (g_copies, lambda p: genai.run(p, new, batch=SAMPLES, sample=True)),
        (g_greedy, lambda p: genai.run(p, new)),
        (g_beams, lambda p: genai.run(p, new, beams=BEAMS)),
    ]

    metrics_port = free_port()
    with WorkerProcess(model.folder, "--intra-op-threads", str(INTRA_OP_THREADS), "--cache", "memory://",
                       "--max-batch", str(max(SAMPLES, BEAMS)), "--metrics-port", str(metrics_port)) as worker:
        kv = KvshareWorker(worker, metrics_port)
        kvshare_cases: list[tuple[Case, Callable[[list[int]], Run]]] = [
            (k_n1, lambda p: kv.run(p, new, sample=True)),
            (k_n4, lambda p: kv.run(p, new, n=SAMPLES, sample=True)),
            (k_greedy, lambda p: kv.run(p, new)),
            (k_beams, lambda p: kv.run(p, new, beams=BEAMS)),
        ]
        try:
            warm = model.random_ids(rng, prompt_tokens)  # first runs of each shape pay one-off costs
            for _, call in [*kvshare_cases, *genai_cases]:
                call(warm)
            for r in range(rounds):  # interleaved, so that a noisy moment hits both engines alike
                prompt = model.random_ids(rng, prompt_tokens)
                for case, call in [*kvshare_cases, *genai_cases]:
                    case.runs.append(call(prompt))
                    print(f"round {r + 1}: {case.engine} {case.name}: {case.runs[-1].wall_s * 1e3:.0f} ms", flush=True)
                check_round(checks, ours, theirs, prompt_tokens, new)
        finally:
            kv.close()

    report(ours, theirs, model, prompt_tokens, new, rounds)
    if checks.failed:
        print(f"\nBROKEN RUN: {len(checks.failed)} check(s) failed: {'; '.join(checks.failed)}", file=sys.stderr)
        return 1
    print("\nchecks: every sequence made its tokens, kvshare prefilled each prompt once per request, "
          f"n={SAMPLES} sample 0 = the n=1 request")
    return 0


def check_round(checks: Checks, ours: dict[str, Case], theirs: dict[str, Case], prompt_tokens: int, new: int) -> None:
    """The counts of the round just run: tokens per sequence, sequences per request, the prompt
    prefilled once by kvshare whatever the rows, and every decode step advancing all rows."""
    for case in [*ours.values(), *theirs.values()]:
        if case.error:
            continue
        run = case.runs[-1]
        checks.expect(len(run.sequences) == case.outputs,
                      f"{case.engine} {case.name}: {len(run.sequences)} sequences, expected {case.outputs}")
        checks.expect(all(len(s) == new for s in run.sequences),
                      f"{case.engine} {case.name}: sequence lengths {[len(s) for s in run.sequences]}, expected {new}")
        if case.engine == "kvshare":
            checks.expect(run.prefill_tokens == prompt_tokens,
                          f"kvshare {case.name}: prefilled {run.prefill_tokens} tokens, expected the prompt's "
                          f"{prompt_tokens} once")
            checks.expect(run.decode_steps == new - 1 and run.decode_rows == case.rows * (new - 1),
                          f"kvshare {case.name}: {run.decode_steps} decode steps advancing {run.decode_rows} rows, "
                          f"expected {new - 1} steps of {case.rows}")
    n1, n4 = ours["n=1"].runs[-1], ours[f"n={SAMPLES}"].runs[-1]
    checks.expect(n4.sequences[0] == n1.sequences[0],
                  f"kvshare n={SAMPLES} sample 0 differs from the n=1 request with the same seed "
                  f"({same_tokens(n4.sequences[0], n1.sequences[0])})")


def report(ours: dict[str, Case], theirs: dict[str, Case], model: BenchModel, prompt_tokens: int, new: int,
           rounds: int) -> None:
    k_n1, k_n4, k_greedy, k_beams = ours.values()
    g_n1, g_returned, g_copies, g_greedy, g_beams = theirs.values()
    baselines = {id(k_n4): k_n1, id(k_beams): k_greedy, id(g_returned): g_n1, id(g_copies): g_n1, id(g_beams): g_greedy}
    rows = []
    for case in [*ours.values(), *theirs.values()]:
        if case.error:
            rows.append((case.engine, case.name, case.rows, "-", "-", "-", "-", "unsupported", "-"))
            continue
        last = case.runs[-1]
        if case.engine == "kvshare":
            prefill = f"{last.prefill_tokens}"
            steps = f"{last.decode_steps} × {last.decode_rows // max(last.decode_steps, 1)}"
        else:
            prefill = f"{prompt_tokens * case.rows} (batch input)" if "batch_size" in case.name else "-"
            steps = "-"
        base = baselines.get(id(case))
        ratio = f"{statistics.median(ratios(case, base)):.2f}" if base is not None else "1.00"
        rows.append((case.engine, case.name, case.rows, prefill, steps, case.prefill_ms, case.step_ms, case.wall_ms,
                     ratio))
    print_table(f"{model.name} model, {prompt_tokens} prompt + {new} new tokens per sequence (EOS ignored), "
                f"{INTRA_OP_THREADS} intra-op threads; samples at temperature {TEMPERATURE}; medians of {rounds} "
                "interleaved rounds; ratio against n=1 (samples) or greedy (beams)",
                ("engine", "request", "rows", "prefill tokens", "decode steps × rows", "prefill ms", "ms per step",
                 "wall ms", "ratio"), rows)
    print("\nprefill ms: kvshare the worker's prefill timing, GenAI append_tokens; ms per step: the rest of the "
          "request per token after the first (kvshare: the worker's total minus prefill, so it includes sampling, "
          "the beam search and its K/V gather, and handing tokens to gRPC; GenAI: its generate_next_token loop); "
          "wall ms: the client's, from sending the request to the last token")

    print()
    for label, num, den, target in (
        (f"kvshare n={SAMPLES} / n=1", k_n4, k_n1, SAMPLES_TARGET),
        (f"kvshare num_beams={BEAMS} / greedy", k_beams, k_greedy, BEAMS_TARGET),
        (f"GenAI num_return_sequences={SAMPLES} / n=1", g_returned, g_n1, SAMPLES_TARGET),
        (f"GenAI {SAMPLES} prompt copies / n=1", g_copies, g_n1, SAMPLES_TARGET),
        (f"GenAI num_beams={BEAMS} / greedy", g_beams, g_greedy, BEAMS_TARGET),
    ):
        if num.error:
            print(f"{label}: unsupported ({num.error})")
            continue
        values = ratios(num, den)
        value = statistics.median(values)
        print(f"{label}: {value:.2f} (rounds: {ratio_text(values)}); target <= {target:g}: "
              f"{'met' if value <= target else 'missed'}")
    print(f"\ngreedy tokens, kvshare = GenAI: {same_tokens(k_greedy.runs[-1].sequences[0], g_greedy.runs[-1].sequences[0])}; "
          f"best beam, kvshare = GenAI: {same_tokens(k_beams.runs[-1].sequences[0], g_beams.runs[-1].sequences[0])}; "
          f"kvshare best beam = its greedy: {same_tokens(k_beams.runs[-1].sequences[0], k_greedy.runs[-1].sequences[0])}")
    distinct = len({tuple(s) for s in k_n4.runs[-1].sequences})
    print(f"kvshare n={SAMPLES}: {distinct} distinct samples of {SAMPLES}")
    verdict_samples = statistics.median(ratios(k_n4, k_n1))
    verdict_beams = statistics.median(ratios(k_beams, k_greedy))
    print(f"\nverdict: kvshare n={SAMPLES}/n=1 {verdict_samples:.2f} (target <= {SAMPLES_TARGET:g}: "
          f"{'met' if verdict_samples <= SAMPLES_TARGET else 'missed'}), num_beams={BEAMS}/greedy {verdict_beams:.2f} "
          f"(target <= {BEAMS_TARGET:g}: {'met' if verdict_beams <= BEAMS_TARGET else 'missed'})")


if __name__ == "__main__":
    sys.exit(main())
