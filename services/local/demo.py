"""The demo: a Redis server, two worker replicas sharing it, and a client that sends the same long
system prompt with different questions to each replica in turn. Prints what each request cost,
then stops everything it started."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import grpc

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.api.client import complete
from services.local.model_cache import cache_dir, ensure_model
from services.local.redis_process import RedisServer
from services.local.worker_process import WorkerProcess

SYSTEM_PROMPT = (
    "You are the support assistant of a company that runs decode workers for language models. "
    "Answer briefly and politely. When you do not know, say so. Prices are in euros. "
    "Never share one customer's data with another. Escalate outages to the on-call engineer. "
) * 10
QUESTIONS = (
    "How do I reset my password?",
    "Which of these invoices is overdue?",
    "Translate the following text into German.",
    "Summarise the attached report in three sentences.",
    "What is the capital of France?",
    "Can I pay by bank transfer?",
)


def run_demo(model_dir: Path | None, max_new_tokens: int) -> int:
    model = model_dir or ensure_model(cache_dir() / "decoder-small", "small")
    with ExitStack() as stack:
        redis_server = stack.enter_context(RedisServer())
        print(f"redis-server on {redis_server.url}")
        workers = [stack.enter_context(WorkerProcess(model, "--cache", redis_server.url)) for _ in range(2)]
        stubs = [pb_grpc.GeneratorStub(stack.enter_context(grpc.insecure_channel(w.target))) for w in workers]
        info = stubs[0].GetModelInfo(pb.GetModelInfoRequest())
        print(f"replicas {workers[0].target} and {workers[1].target}: model {info.name}, {info.num_layers} layers, "
              f"{info.num_heads}/{info.num_kv_heads} heads, block {info.block_size} tokens, {info.execution_provider}")
        if model_dir is None:
            print("The model has seeded RANDOM weights: its answers are meaningless text (the same for every "
                  "question, since the long shared prompt dominates). What the demo shows is the cache table below.\n")
        rows = []
        for i, question in enumerate(QUESTIONS):
            replica = i % 2
            request = pb.GenerateRequest(
                request_id=f"demo-{i}", prompt=SYSTEM_PROMPT + "\nQuestion: " + question + "\nAnswer:",
                max_new_tokens=max_new_tokens,
            )
            print(f"replica {'AB'[replica]} <- {question}\n   ", end="", flush=True)
            done = complete(stubs[replica], request, timeout_s=120, echo=lambda t: print(t, end="", flush=True))
            print("\n")
            u, t = done.last.usage, done.last.timings
            rows.append(("AB"[replica], u.prompt_tokens, u.cached_prompt_tokens, t.time_to_first_token_ms, t.cache_fetch_ms))
            # Publishing runs after the first token; give it a moment so the next replica finds it.
            time.sleep(0.2)
    header = ("replica", "prompt tokens", "cached tokens", "TTFT ms", "fetch ms")
    print("  ".join(f"{h:>13}" for h in header))
    for row in rows:
        print("  ".join(f"{v:>13.1f}" if isinstance(v, float) else f"{v!s:>13}" for v in row))
    print("\nThe first request computes the system prompt; every later one, on either replica, fetches its "
          "blocks from Redis and runs only the question.")
    return 0
