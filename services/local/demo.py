"""The demo: a Redis server, two worker replicas sharing it, and a client that asks six questions,
each with the same 1,230-token support manual as system message, alternating between the replicas.
Prints each answer and what each request cost, then stops everything it started.

The model is SmolLM2-135M-Instruct (fetched and converted on first use, `kvshare fetch-model`);
``--model`` serves another folder. A folder without a chat template (such as the seeded-weight
presets) gets the manual and the question as plain text, and the demo says that its answers are
random text.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

import grpc

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.local.model_catalogue import fetch_model
from services.local.redis_process import RedisServer
from services.local.worker_process import WorkerProcess
from services.runtime.chat_template import load_chat_template

DEMO_MODEL = "smollm2-135m-instruct"
QUESTIONS = (
    "Can I return a helmet I bought last week?",
    "How much does delivery of a complete bicycle cost?",
    "When is the Lyon store open on Sundays?",
    "My parcel is a week late. What should I do?",
    "What does a basic service at the workshop include?",
    "How long is the warranty on an electric bike battery?",
)


def system_prompt() -> str:
    return resources.files(__package__).joinpath("demo_system_prompt.txt").read_text(encoding="utf-8").strip()


def _request(i: int, question: str, chat: bool, max_new_tokens: int) -> pb.GenerateRequest:
    if chat:
        messages = [pb.ChatMessage(role="system", content=system_prompt()), pb.ChatMessage(role="user", content=question)]
        return pb.GenerateRequest(request_id=f"demo-{i}", messages=messages, max_new_tokens=max_new_tokens)
    return pb.GenerateRequest(request_id=f"demo-{i}", prompt=f"{system_prompt()}\n\nQuestion: {question}\nAnswer:",
                              max_new_tokens=max_new_tokens)


def run_demo(model_dir: Path | None, max_new_tokens: int) -> int:
    model = model_dir or fetch_model(DEMO_MODEL)
    chat = load_chat_template(model) is not None
    with ExitStack() as stack:
        redis_server = stack.enter_context(RedisServer())
        print(f"redis-server on {redis_server.url}")
        workers = [stack.enter_context(WorkerProcess(model, "--cache", redis_server.url)) for _ in range(2)]
        stubs = [pb_grpc.GeneratorStub(stack.enter_context(grpc.insecure_channel(w.target))) for w in workers]
        info = stubs[0].GetModelInfo(pb.GetModelInfoRequest())
        print(f"replicas {workers[0].target} and {workers[1].target}: model {info.name}, {info.num_layers} layers, "
              f"{info.num_heads}/{info.num_kv_heads} heads, block {info.block_size} tokens, {info.execution_provider}")
        if not chat:
            print("This folder has no chat template: the questions go as plain text. If it is a seeded-weight "
                  "preset, its answers are RANDOM text; what the demo shows is the cache table below.")
        print(f"Every question comes with the same {len(system_prompt().split())}-word support manual as system "
              "message.\n")
        rows = []
        for i, question in enumerate(QUESTIONS):
            replica = i % 2
            print(f"replica {'AB'[replica]} <- {question}\n   ", end="", flush=True)
            done = complete(stubs[replica], _request(i, question, chat, max_new_tokens), timeout_s=300,
                            echo=lambda t: print(t.replace("\n", "\n   "), end="", flush=True))
            print("\n")
            u, t = done.last.usage, done.last.timings
            rows.append(("AB"[replica], u.prompt_tokens, u.cached_prompt_tokens, t.time_to_first_token_ms, t.cache_fetch_ms))
            # Publishing runs after the first token; give it a moment so the next replica finds it.
            time.sleep(0.2)
    header = ("replica", "prompt tokens", "cached tokens", "TTFT ms", "fetch ms")
    print("  ".join(f"{h:>13}" for h in header))
    for row in rows:
        print("  ".join(f"{v:>13.1f}" if isinstance(v, float) else f"{v!s:>13}" for v in row))
    print("\nThe first request computes the manual; every later one, on either replica, fetches its blocks "
          "from Redis and runs only the question.")
    return 0
