"""What the benchmarks share: the model, a Redis server with worker replicas, and measuring calls.

Every benchmark runs from the repository root as ``.venv/bin/python -m bench.<name>``, starts what
it needs and stops it again. ``--smoke`` runs a seconds-long version on the tiny preset, so that
the test suite can check the benchmarks still work (not their numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import redis

from bench.verdict import exit_code
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.local.model_cache import STAMP, cache_dir, ensure_model
from services.local.redis_process import RedisServer, stored_values
from services.local.traffic import FIRST_TOKEN_ID
from services.local.worker_process import WorkerProcess
from services.modelbuild.presets import DECODER_PRESETS
from services.runtime.model_spec import load_model_spec

INTRA_OP_THREADS = 2
QUESTION_TOKENS = 32  # the part of a prompt that differs between requests sharing a prefix
CALL_TIMEOUT_S = 300.0
PUBLISH_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class BenchModel:
    folder: Path
    name: str
    vocab_size: int

    @classmethod
    def of(cls, folder: Path, name: str | None = None) -> BenchModel:
        return cls(folder, name or folder.name, load_model_spec(folder).vocab_size)

    def random_ids(self, rng: np.random.Generator, count: int) -> list[int]:
        return rng.integers(FIRST_TOKEN_ID, self.vocab_size, size=count).tolist()


def genai_folder(model: BenchModel, engine_rows: int | None = None) -> Path:
    """A copy of the model folder for ONNX Runtime GenAI, the same files with its intra-op threads
    pinned like kvshare's (and, for og.Engine, ``engine_rows`` static-batching rows). Copied again
    whenever the model was rebuilt, so both engines always read the same weights."""
    suffix = "-genai" if engine_rows is None else f"-genai-engine-{engine_rows}"
    folder = model.folder.with_name(model.folder.name + suffix)
    stamp = model.folder / STAMP
    if not folder.exists() or (folder / STAMP).read_bytes() != stamp.read_bytes():
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(model.folder, folder)
    config_path = folder / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = INTRA_OP_THREADS
    if engine_rows is not None:
        config["engine"] = {"static_batching": {"max_batch_size": engine_rows}}
    config_path.write_text(json.dumps(config, indent=4))
    return folder


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None,
               smoke_help: str = "tiny model, few runs: checks the benchmark works",
               model_help: str = "model folder to measure instead of the seeded bench preset (e.g. from kvshare fetch-model)",
               ) -> argparse.Namespace:
    """The flags every benchmark has (``--smoke``, ``--model``; a benchmark of a real model says
    what they mean for it) and ``extra``'s."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--model", type=Path, default=None, help=model_help)
    if extra:
        extra(parser)
    # A benchmark measures serving, never a shutdown: the workers and routers it starts (they get
    # this environment) stop at once on SIGTERM instead of reporting NOT_SERVING for 2 s first, most
    # of a smoke run's stops. Set here, in the benchmark's own process, not on import: tests import
    # bench modules. A flag or a variable the caller set still wins.
    os.environ.setdefault("KVSHARE_NOT_SERVING_S", "0")
    os.environ.setdefault("KVSHARE_ROUTE_NOT_SERVING_S", "0")
    return parser.parse_args()


def bench_model(args: argparse.Namespace) -> BenchModel:
    """``--model``, else the bench preset (tiny for smoke runs), built once into the user's cache
    folder and reused while verified."""
    if args.model is not None:
        return BenchModel.of(args.model)
    preset = "tiny" if args.smoke else "bench"
    return BenchModel(ensure_model(cache_dir() / f"decoder-{preset}", preset), preset, DECODER_PRESETS[preset].vocab_size)


@dataclass(slots=True)
class Fleet:
    """A Redis server, a client for it, and worker replicas sharing it."""

    redis: RedisServer
    client: redis.Redis
    stubs: list[pb_grpc.GeneratorStub]
    block_size: int
    workers: list[WorkerProcess]


@contextmanager
def fleet(model: BenchModel, replicas: int = 2, block_size: int = 64, redis_server: RedisServer | None = None,
          extra_args: Sequence[str] = ()) -> Iterator[Fleet]:
    """Starts ``replicas`` workers on one (flushed) Redis; stops all that it started on exit."""
    with ExitStack() as stack:
        server = redis_server or stack.enter_context(RedisServer())
        client = stack.enter_context(server.client())
        client.flushdb()
        args = ("--cache", server.url, "--block-size", str(block_size), "--intra-op-threads", str(INTRA_OP_THREADS),
                *extra_args)
        workers = [stack.enter_context(WorkerProcess(model.folder, *args)) for _ in range(replicas)]
        stubs = [pb_grpc.GeneratorStub(stack.enter_context(grpc.insecure_channel(w.target))) for w in workers]
        yield Fleet(server, client, stubs, block_size, workers)


def first_token(stub: pb_grpc.GeneratorStub, prompt: list[int], skip_cache: bool = False) -> pb.GenerateResponse:
    """One single-token Generate call; returns its last message (usage and timings)."""
    request = pb.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=1, ignore_eos=True,
        cache=pb.CacheOptions(skip_read=skip_cache, skip_write=skip_cache),
    )
    return complete(stub, request, timeout_s=CALL_TIMEOUT_S).last


def wait_for_keys(client: redis.Redis, count: int, timeout_s: float = PUBLISH_TIMEOUT_S) -> None:
    """Polls DBSIZE until Redis holds at least ``count`` keys (a worker's publish landed)."""
    deadline = time.monotonic() + timeout_s
    while stored_values(client) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Redis holds {stored_values(client)} values after {timeout_s} s, expected {count}")
        time.sleep(0.005)


def published(fleet: Fleet, call: Callable[[], pb.GenerateResponse], new_blocks: int) -> pb.GenerateResponse:
    """Runs ``call`` and returns once the ``new_blocks`` blocks it publishes are in Redis, so that
    publishing never overlaps the next measurement."""
    expected = stored_values(fleet.client) + new_blocks
    result = call()
    wait_for_keys(fleet.client, expected)
    return result


def cold(fleet: Fleet, stub: pb_grpc.GeneratorStub, prompt: list[int]) -> pb.GenerateResponse:
    """``prompt`` with nothing of it cached; waits for its blocks to be published."""
    result = published(fleet, lambda: first_token(stub, prompt), len(prompt) // fleet.block_size)
    assert result.usage.cached_prompt_tokens == 0, f"cold request found {result.usage.cached_prompt_tokens} cached"
    return result


def warm(fleet: Fleet, stub: pb_grpc.GeneratorStub, prompt: list[int], cached: int) -> pb.GenerateResponse:
    """``prompt`` whose first ``cached`` tokens another replica published."""
    result = published(fleet, lambda: first_token(stub, prompt), (len(prompt) - cached) // fleet.block_size)
    assert result.usage.cached_prompt_tokens == cached, (
        f"warm request cached {result.usage.cached_prompt_tokens} tokens, expected {cached}")
    return result


def warm_up(stubs: Sequence[pb_grpc.GeneratorStub], prompt: list[int]) -> None:
    """One uncached request per worker, so the first measured run pays no start-up cost."""
    for stub in stubs:
        first_token(stub, prompt, skip_cache=True)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Prints a Markdown table (so a run can be pasted into docs/benchmarks.md as it is)."""
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row) + " |")


def verdict(results: Sequence, smoke: bool) -> int:
    """The exit code of a benchmark whose results each say whether they ``held`` (by ``name``): the
    names of those that did not go to stderr; ``bench.verdict.exit_code`` judges (never a smoke run)."""
    bad = [r.name for r in results if not r.held]
    if bad:
        print(f"\nFAILED: {', '.join(bad)}", file=sys.stderr)
    return exit_code(not bad, smoke)
