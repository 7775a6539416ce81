"""Where one decode step goes: ONNX Runtime's profile of decode steps after a 1,024-token prompt,
per kind of kernel, plus what the runtime, the worker's sampler and the served stream add.

For the ``--model`` folder with the worker's default ``--intra-op-spinning``, and a ``--before``
folder with ``--before-spinning`` (SmolLM2's ``fp32`` folder and ``never``: the defaults before
2026-12-02):

- the kernels' shares come from a profiled session (ONNX Runtime's profiler, ``enable_profiling``:
  it slows every node, so only shares are taken from it) over 30 decode steps; they are applied to
  the step's time measured without the profiler. Kinds: projections (MatMul/MatMulNBits of the
  layers), Q4_1 minimums (the block sums and their product), attention (GroupQueryAttention),
  head (the last matmul, to logits), other kernels (norms, activations, adds), and the runtime
  between kernels (a run's time less its kernels');
- "Python step" is the slot bank's own work around a run (binding, bookkeeping);
- "sampling" is the worker's greedy sampler on one row of logits;
- the served stream, through a worker over gRPC (``kvshare serve``, a client in this process), with
  ``--stream-interval`` 1 (each token its own message, the default) and 4: its ms per token against
  the in-process step loop's (wall clock, so within the runs' spread), and the CPU it costs, which
  is not: the worker's event-loop thread (output processing, gRPC, wake-ups; read from
  ``/proc/PID/task/PID/stat``) and the client's, per token. On 2 vCPUs both take it from the two
  ONNX Runtime threads.

    .venv/bin/python -m bench.step_profile [--smoke] [--model DIR] [--before DIR [--before-spinning never]]
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bench.decode import kvshare_run, slots_run
from bench.fleet import (
    INTRA_OP_THREADS,
    BenchModel,
    bench_model,
    fleet,
    median,
    parse_args,
    print_table,
)
from services.engine.sampling import Sampler, SamplingConfig
from services.runtime import onnx_decoder
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import DecoderSession
from services.runtime.slots import open_slots

PROMPT, STEPS = 1024, 40
SMOKE_PROMPT = 64
MINIMUMS = (".mins", ".add_mins", ".blocks", ".block_sums")


@contextmanager
def profiled_sessions(prefix: Path):
    """Sessions opened inside have ONNX Runtime's profiler on (file names start with ``prefix``)."""
    plain = onnx_decoder.ort.SessionOptions

    class Profiled(plain):
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling, self.profile_file_prefix = True, str(prefix)

    onnx_decoder.ort.SessionOptions = Profiled
    try:
        yield
    finally:
        onnx_decoder.ort.SessionOptions = plain


def kind(node: str, op: str, head: str) -> str:
    if node.endswith(MINIMUMS) or (op == "ReduceSum" and "block" in node):
        return "Q4_1 minimums"
    if node.startswith(head):
        return "head"
    if op in ("MatMul", "MatMulNBits", "Gemm"):
        return "projections"
    if op == "GroupQueryAttention":
        return "attention"
    return "other kernels"


def kernel_shares(session: DecoderSession, slots, prompt: list[int]) -> dict[str, float]:
    """Each kind's share of the last 30 profiled decode runs (kernels and the runtime between)."""
    slot = slots.acquire(len(prompt) + STEPS)
    slots.begin(slot, [], 0)
    token = int(np.argmax(slots.prefill(slot, prompt)))
    for _ in range(STEPS):
        token = int(np.argmax(slots.decode([slot], [token])[0]))
    slots.release(slot)
    path = Path(session._session.end_profiling())
    events = json.loads(path.read_text())
    path.unlink()
    runs = [e for e in events if e.get("name") == "model_run"][-30:]
    head = session.spec.logits_name
    totals: dict[str, float] = defaultdict(float)
    first = runs[0]["ts"]
    for e in events:
        if e.get("cat") == "Node" and e["ts"] >= first and e["name"].endswith("_kernel_time"):
            totals[kind(e["name"].removesuffix("_kernel_time"), e["args"]["op_name"], head)] += e["dur"]
    totals["runtime between kernels"] = sum(r["dur"] for r in runs) - sum(totals.values())
    whole = sum(totals.values())
    return {k: v / whole for k, v in totals.items()}


def step_times(slots, prompt: list[int]) -> tuple[float, float]:
    """(ms per decode step of the slot bank, ms of its model run alone), unprofiled: both means over
    the same decode steps."""
    inner: list[float] = []
    session = slots.session
    run = session.run_binding

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            inner.append(time.perf_counter() - start)

    session.run_binding = timed
    try:
        rate, _, _ = slots_run(slots, prompt, STEPS * 2)
    finally:
        del session.run_binding
    return 1e3 / rate, sum(inner[1:]) / len(inner[1:]) * 1e3  # inner[0]: the prompt's run


def thread_cpu_s(pid: int, tid: int) -> float:
    """CPU seconds (user and system) thread ``tid`` of process ``pid`` has used."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served(bench: BenchModel, spinning: str, prompt: list[int], interval: int, new_tokens: int) -> dict[str, float]:
    """One stream through a worker at ``--stream-interval interval``: ms per token (the worker's own
    timings, median of 3) and the CPU ms per token of the worker's event loop and of the client."""
    args = ("--intra-op-spinning", spinning, "--stream-interval", str(interval))
    with fleet(bench, replicas=1, extra_args=args) as f:
        kvshare_run(f.stubs[0], prompt, 4)
        pid = f.workers[0].pid  # asyncio.run runs the event loop on the main thread
        loop_s, client_s = thread_cpu_s(pid, pid), time.process_time()
        rates = [kvshare_run(f.stubs[0], prompt, new_tokens)[0] for _ in range(3)]
        tokens = 3 * new_tokens
        return {"ms": median([1e3 / r for r in rates]),
                "loop": (thread_cpu_s(pid, pid) - loop_s) / tokens * 1e3,
                "client": (time.process_time() - client_s) / tokens * 1e3}


def main() -> int:
    def extra(parser) -> None:
        parser.add_argument("--before", type=Path, default=None, help="a folder to profile first (the 'before')")
        parser.add_argument("--before-spinning", default="never", help="its --intra-op-spinning")

    args = parse_args(__doc__.splitlines()[0], extra)
    model = bench_model(args)
    configs = [(model, "in-run")]
    if args.before:
        configs.insert(0, (BenchModel.of(args.before), args.before_spinning))
    prompt_tokens = SMOKE_PROMPT if args.smoke else PROMPT
    columns: dict[str, dict[str, float]] = {}
    for bench, spinning in configs:
        folder = bench.folder
        spec = load_model_spec(folder)
        prompt = bench.random_ids(np.random.default_rng(4), prompt_tokens)
        with profiled_sessions(Path("/tmp") / "kvshare-step-profile"):
            profiled = DecoderSession(spec, "cpu", INTRA_OP_THREADS, spinning)
        shares = kernel_shares(profiled, open_slots(profiled, 1, len(prompt) + STEPS), prompt)
        slots = open_slots(DecoderSession(spec, "cpu", INTRA_OP_THREADS, spinning), 1, len(prompt) + 128)
        step_ms, run_ms = step_times(slots, prompt)
        logits = np.random.default_rng(0).standard_normal(spec.vocab_size).astype(np.float32)
        sampler, start = Sampler(SamplingConfig()), time.perf_counter()
        for _ in range(200):
            sampler(logits)
        sampling_ms = (time.perf_counter() - start) / 200 * 1e3
        each, four = (served(bench, spinning, prompt, interval, 128) for interval in (1, 4))
        in_process_ms = median([1e3 / slots_run(slots, prompt, 128)[0] for _ in range(3)])
        column = {name: share * run_ms for name, share in shares.items()}
        column |= {"Python step": step_ms - run_ms, "sampling": sampling_ms,
                   "in-process step loop, ms per token": in_process_ms,
                   "served, ms per token": each["ms"], "served, --stream-interval 4": four["ms"],
                   "worker event loop CPU": each["loop"], "worker event loop CPU, interval 4": four["loop"],
                   "client CPU": each["client"], "client CPU, interval 4": four["client"]}
        columns[f"{folder.name}, {spinning}"] = column
        print(f"{folder.name} ({spinning}): step {step_ms:.2f} ms, in-process {in_process_ms:.2f}, served "
              f"{each['ms']:.2f} ms per token", flush=True)
    names = ["projections", "Q4_1 minimums", "attention", "head", "other kernels", "runtime between kernels",
             "Python step", "sampling", "in-process step loop, ms per token", "served, ms per token",
             "served, --stream-interval 4", "worker event loop CPU", "worker event loop CPU, interval 4",
             "client CPU", "client CPU, interval 4"]
    print_table(f"ms per decode step after {prompt_tokens} tokens, {INTRA_OP_THREADS} intra-op threads (kernel shares "
                f"from ONNX Runtime's profiler, applied to unprofiled runs)", ("", *columns),
                [(name, *(c.get(name, 0.0) for c in columns.values())) for name in names])
    return 0


if __name__ == "__main__":
    sys.exit(main())
