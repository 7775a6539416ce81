"""Decode tokens per second of a kvshare worker against ONNX Runtime GenAI on the same model
folder: same prompt, greedy, one stream, both on 2 intra-op threads, runs interleaved. Checks that
both produced the same tokens.

kvshare's rate comes from the worker's own timings, (completion_tokens - 1) / (total - TTFT); GenAI's
from timing its generate_next_token loop after the first token, in this process. A third row times
the worker's model path (its slot bank) in this process too, which separates the runtime from the
server path. The worker and the slot bank run with each ``--intra-op-spinning`` policy: kvshare's
default ``in-run`` (idle threads spin within a model run, sleep between runs), ``never`` (they
sleep between parallel sections; the default before 2026-12-02) and ``always`` (ONNX Runtime's
default, which GenAI keeps).

With ``--llama-cpp PYTHON --gguf FILE`` (a Python with llama-cpp-python installed, and the GGUF the
folder was converted from) a fourth row runs llama.cpp on that file, in a subprocess, interleaved
with the others; its tokens are reported but not required to match (other weights and arithmetic).

    .venv/bin/python -m bench.decode [--smoke] [--model DIR] [--llama-cpp PYTHON --gguf FILE]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.fleet import (
    INTRA_OP_THREADS,
    bench_model,
    fleet,
    genai_folder,
    median,
    parse_args,
    print_table,
)
from kvshare.v1 import generator_pb2 as pb
from services.client import complete
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import DecoderSession
from services.runtime.slots import SlotBank, open_slots


def genai_run(og_model, prompt: list[int], new_tokens: int) -> tuple[float, list[int], float]:
    """(decode tok/s, tokens, prefill ms: the prompt and the first token)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(og_model)
    length = len(prompt) + new_tokens
    params.set_search_options(do_sample=False, max_length=length, min_length=length)
    generator = og.Generator(og_model, params)
    start = time.perf_counter()
    generator.append_tokens(prompt)
    generator.generate_next_token()
    tokens = [int(generator.get_next_tokens()[0])]
    t0 = time.perf_counter()
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return (len(tokens) - 1) / (time.perf_counter() - t0), tokens, (t0 - start) * 1e3


def kvshare_run(stub, prompt: list[int], new_tokens: int) -> tuple[float, list[int], float]:
    """(decode tok/s, tokens, prefill ms: the worker's own time to first token)."""
    request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=new_tokens, ignore_eos=True,
                                 cache=pb.CacheOptions(skip_read=True, skip_write=True))
    done = complete(stub, request, timeout_s=600)
    t = done.last.timings
    rate = (done.last.usage.completion_tokens - 1) / ((t.total_ms - t.time_to_first_token_ms) / 1e3)
    return rate, done.token_ids, t.time_to_first_token_ms


def llama_cpp_run(python: str, gguf: Path, prompt: list[int], new_tokens: int) -> dict:
    """llama.cpp's answer (``bench/llama_cpp_peer.py``: rate, tokens, prefill_ms, version)."""
    request = {"gguf": str(gguf), "prompt": prompt, "new_tokens": new_tokens, "threads": INTRA_OP_THREADS}
    proc = subprocess.run([python, str(Path(__file__).with_name("llama_cpp_peer.py"))], input=json.dumps(request),
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(proc.stdout)


def slots_run(slots: SlotBank, prompt: list[int], new_tokens: int) -> tuple[float, list[int], float]:
    """The worker's own model path (its slot bank: prefill, then one-row decode steps) alone, with no
    scheduler, server or gRPC: separates the runtime from the transport. Returns (decode tok/s,
    tokens, prefill ms: the whole prompt in one run)."""
    slot = slots.acquire(len(prompt) + new_tokens)
    try:
        slots.begin(slot, [], 0)
        start = time.perf_counter()
        tokens = [int(np.argmax(slots.prefill(slot, prompt)))]
        t0 = time.perf_counter()
        while len(tokens) < new_tokens:
            tokens.append(int(np.argmax(slots.decode([slot], [tokens[-1]])[0])))
        return (len(tokens) - 1) / (time.perf_counter() - t0), tokens, (t0 - start) * 1e3
    finally:
        slots.release(slot)


def main() -> int:
    import onnxruntime_genai as og

    def extra(parser) -> None:
        parser.add_argument("--llama-cpp", default=None, metavar="PYTHON", help="a Python with llama-cpp-python")
        parser.add_argument("--gguf", type=Path, default=None, help="the GGUF for the llama.cpp row")

    args = parse_args(__doc__.splitlines()[0], extra)
    model = bench_model(args)
    prompt_tokens, new_tokens, rounds = (64, 16, 2) if args.smoke else (1024, 128, 7)
    prompt = model.random_ids(np.random.default_rng(4), prompt_tokens)
    og_model = og.Model(str(genai_folder(model)))
    spec = load_model_spec(model.folder)
    threads = {"": "in-run", ", threads never spin": "never", ", threads always spin": "always"}
    slots = {name: open_slots(DecoderSession(spec, "auto", INTRA_OP_THREADS, spinning), 1, spec.context_length)
             for name, spinning in threads.items()}
    rates: dict[str, list[float]] = {}
    prefills: dict[str, list[float]] = {}
    outputs: list[list[int]] = []
    with fleet(model, replicas=1) as f, \
            fleet(model, replicas=1, extra_args=("--intra-op-spinning", "never")) as g, \
            fleet(model, replicas=1, extra_args=("--intra-op-spinning", "always")) as h:
        stubs = {"": f.stubs[0], ", threads never spin": g.stubs[0], ", threads always spin": h.stubs[0]}
        for stub in stubs.values():
            kvshare_run(stub, prompt, 4)

        def record(name: str, rate: float, prefill_ms: float) -> None:
            rates.setdefault(name, []).append(rate)
            prefills.setdefault(name, []).append(prefill_ms)

        for _ in range(rounds):
            for name in threads:
                rate, served, prefill_ms = kvshare_run(stubs[name], prompt, new_tokens)
                record(f"kvshare worker (gRPC stream){name}", rate, prefill_ms)
                rate, looped, prefill_ms = slots_run(slots[name], prompt, new_tokens)
                record(f"kvshare step loop (in-process){name}", rate, prefill_ms)
                outputs += [served, looped]
            rate, reference, prefill_ms = genai_run(og_model, prompt, new_tokens)
            record("onnxruntime-genai", rate, prefill_ms)
            if args.llama_cpp:
                peer = llama_cpp_run(args.llama_cpp, args.gguf, prompt, new_tokens)
                theirs, peer_name = peer["tokens"], f"llama.cpp {peer['version']} (GGUF)"
                record(peer_name, peer["rate"], peer["prefill_ms"])
    same = all(tokens == reference for tokens in outputs)
    genai = median(rates["onnxruntime-genai"])
    peer = next((name for name in rates if name.startswith("llama.cpp")), None)

    def versus_peer(name: str) -> tuple:
        if peer is None:
            return ()
        return (median(rates[name]) / median(rates[peer]), median(prefills[peer]) / median(prefills[name]))

    rows = [(name, prompt_tokens, new_tokens, median(r), median(r) / genai, *versus_peer(name), median(prefills[name]),
             ("yes" if same else "NO") if not name.startswith("llama.cpp") else
             f"first {next((i for i, (a, b) in enumerate(zip(theirs, reference, strict=False)) if a != b), len(theirs))}")
            for name, r in rates.items()]
    peer_columns = ("× llama.cpp", "prefill speed × llama.cpp") if peer else ()
    print_table(f"{model.name} model, greedy, one stream, {INTRA_OP_THREADS} intra-op threads; medians of {rounds} interleaved rounds",
                ("decoder", "prompt tokens", "new tokens", "tok/s", "× GenAI", *peer_columns, "prefill ms", "same tokens"),
                rows)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
