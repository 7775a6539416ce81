"""The demo: builds the small seeded model, starts a worker, sends a shared long system prompt with
different questions, and prints what each request cost. Stops everything it started."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import grpc

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.modelbuild.folder import write_decoder_folder
from services.modelbuild.presets import KVLayout
from services.worker_process import WorkerProcess

SYSTEM_PROMPT = (
    "You are the support assistant of a company that runs decode workers for language models. "
    "Answer briefly and politely. When you do not know, say so. Prices are in euros. "
) * 12
QUESTIONS = (
    "How do I reset my password?",
    "Which of these invoices is overdue?",
    "Translate the following text into German.",
    "Summarise the attached report in three sentences.",
)


def ensure_model(folder: Path, preset: str = "small") -> Path:
    """Builds the seeded model once; the builder is deterministic, so a finished folder is reused."""
    if not (folder / "genai_config.json").exists():
        print(f"building the seeded '{preset}' decoder into {folder} ...", flush=True)
        write_decoder_folder(folder, preset, KVLayout.SEPARATE)
    return folder


def run_demo(model_dir: Path | None, max_new_tokens: int) -> int:
    model = ensure_model(model_dir or Path(tempfile.gettempdir()) / "kvshare-demo" / "decoder-small")
    with WorkerProcess(model) as worker, grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        print(f"worker {worker.target}: model {info.name}, {info.num_layers} layers, "
              f"{info.num_heads}/{info.num_kv_heads} heads, {info.execution_provider}\n")
        rows = []
        for i, question in enumerate(QUESTIONS):
            request = pb.GenerateRequest(
                request_id=f"demo-{i}", prompt=SYSTEM_PROMPT + "\nQuestion: " + question + "\nAnswer:",
                max_new_tokens=max_new_tokens,
            )
            print(f"[{question}] ", end="", flush=True)
            done = complete(stub, request, timeout_s=120, echo=lambda t: print(t, end="", flush=True))
            print("\n")
            u, t = done.last.usage, done.last.timings
            rows.append((worker.target, u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens,
                         t.time_to_first_token_ms, t.total_ms))
    header = ("replica", "prompt tokens", "cached tokens", "new tokens", "TTFT ms", "total ms")
    print("  ".join(f"{h:>14}" for h in header))
    for row in rows:
        print("  ".join(f"{v:>14.1f}" if isinstance(v, float) else f"{v!s:>14}" for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(run_demo(None, 24))
