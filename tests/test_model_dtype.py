"""`kvshare build-model --dtype`: float16 folders (decoder, both K/V layouts; encoder-decoder; a
converted GGUF) serve on CPU and follow the float32 folder of the same weights, their K/V
round-trips a real Redis (warm answers equal cold ones), and bfloat16 folders, which ONNX
Runtime's CPU provider cannot run, are refused at load with one line naming the fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import collect, engine_greedy, note_margin
from onnx import TensorProto

from cachestore.factory import StoreOptions, open_store
from cachestore.stats import CacheStats
from services.cli import main
from services.engine.encoder_input import EncoderRequest
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import GenerationRequest
from services.errors import ModelLoadError
from services.runtime.kv_layout import KVLayout
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import DecoderSession

B = 16
FLOAT16_LOGIT_TOLERANCE = 0.1
"""Largest |logit difference| accepted between a float16 folder and the float32 folder of the same
seed fed the same tokens (seeded logits have std 16). Measured, 4 prompts x 72 positions: decoder
tiny 0.039, small 0.048 (both layouts), encoder-decoder tiny 0.037, small 0.046. The float16
logits' own rounding is up to 0.016 at |logit| 32-64 (one ulp is 0.031 there)."""
ENCODER_IDS = list(range(10, 70))
PROMPTS = [np.random.default_rng(seed).integers(3, 500, size=3 * B + 5).tolist() for seed in range(3)]


def build(out: Path, *flags: str) -> Path:
    """`kvshare build-model OUT FLAGS...`, run in this process."""
    assert main(["build-model", str(out), *flags]) == 0
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Folders by (arch, layout, dtype), written by the CLI lazily and once."""
    root = tmp_path_factory.mktemp("dtypes")

    class Lazy(dict):
        def __missing__(self, key):
            arch, layout, dtype = key
            flags = ["--arch", arch, "--dtype", dtype] + (["--kv-layout", layout] if layout else [])
            self[key] = build(root / "-".join(filter(None, key)), *flags)
            return self[key]

    return Lazy()


KINDS = [("decoder", "separate"), ("decoder", "combined"), ("encoder-decoder", None)]


def graphs(folder: Path) -> list[onnx.GraphProto]:
    return [onnx.load(str(path)).graph for path in sorted(folder.glob("*.onnx"))]


def float_types(graph: onnx.GraphProto) -> dict[str, int]:
    """Element type of each graph input and output that is not an integer."""
    return {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output)
            if v.type.tensor_type.elem_type not in (TensorProto.INT64, TensorProto.INT32)}


@pytest.mark.parametrize("arch, layout", KINDS)
def test_a_float16_build_is_float16_throughout_and_serves(built, arch, layout):
    folder = built[arch, layout, "float16"]
    for graph in graphs(folder):
        assert float_types(graph) and set(float_types(graph).values()) == {TensorProto.FLOAT16}
        assert not [t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT]
        assert all(np.all(np.isfinite(onnx.numpy_helper.to_array(t))) for t in graph.initializer)
    session = DecoderSession(load_model_spec(folder), "cpu", 2)
    assert session.kv_dtype == np.float16 and session.logits_dtype == np.float16
    if arch == "decoder":
        logits = session.run(PROMPTS[0], session.empty_cache(len(PROMPTS[0])))[0]
        assert logits.dtype == np.float32 and np.all(np.isfinite(logits)), "sampling gets float32 logits"


def test_the_conversion_reaches_casts_constants_and_out_of_range_values():
    """What the built graphs do not exercise: a Cast to float, a Constant's tensor, and an
    initializer beyond float16's range (it becomes the largest finite value, as -1e9 masks do)."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from services.modelbuild.graph_dtype import convert_model

    graph = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT),
         helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array([0.5, 1.5], np.float32))),
         helper.make_node("Add", ["fi", "c"], ["s"]), helper.make_node("Min", ["s", "big"], ["y"])],
        "g", [helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.array([-1e9, 1e9], np.float32), "big")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    converted = convert_model(model, "float16")
    assert numpy_helper.to_array(converted.graph.initializer[0]).tolist() == [-65504.0, 65504.0]
    session = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"i": np.array([2, 3], np.int64)})
    assert y.dtype == np.float16 and y.tolist() == [-65504.0, 4.5]
    assert convert_model(model, "float32") is model


def teacher_forced(session: DecoderSession, ids: list[int], cross=None) -> np.ndarray:
    """Logits ``[len(ids), vocab]`` at every position of ``ids``."""
    cache = session.empty_cache(len(ids))
    cache.cross = cross
    return session.run(ids, cache, all_positions=True)[0]


def compare_greedy(label: str, f32: list[int], f16: list[int], logits32: np.ndarray) -> int:
    """Asserts the float16 run picked the float32 run's tokens up to the first step where the
    float32 top-1/top-2 margin is within twice the tolerance (where a flip is allowed); returns
    how many tokens that compared."""
    top2 = np.sort(logits32[-len(f32) - 1 : -1].astype(np.float64), axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    close = np.flatnonzero(margins <= 2 * FLOAT16_LOGIT_TOLERANCE)
    compared = int(close[0]) if close.size else len(f32)
    assert f16[:compared] == f32[:compared], f"{label}: float16 greedy tokens left the float32 ones"
    if compared:
        note_margin(f"float16 vs float32 greedy ({label})", float(margins[:compared].min()))
    return compared


@pytest.mark.parametrize("layout", [KVLayout.SEPARATE, KVLayout.COMBINED])
def test_float16_decoder_follows_its_float32_twin(built, model_dirs, load_engine, layout):
    e32, e16 = load_engine(model_dirs["tiny", layout]), load_engine(built["decoder", layout.value, "float16"])
    compared = 0
    for ids in PROMPTS:
        f32, f16 = engine_greedy(e32, ids, 16), engine_greedy(e16, ids, 16)
        logits32 = teacher_forced(e32.session, ids + f32)
        logits16 = teacher_forced(e16.session, ids + f32)
        assert np.max(np.abs(logits16 - logits32)) <= FLOAT16_LOGIT_TOLERANCE
        compared += compare_greedy(f"tiny {layout}", f32, f16, logits32)
    assert compared >= 16, "too few tokens compared to tell anything"


def test_float16_encoder_decoder_follows_its_float32_twin(built, encdec_model, load_engine):
    e32, e16 = load_engine(encdec_model), load_engine(built["encoder-decoder", None, "float16"])
    array = np.asarray([ENCODER_IDS], np.int64)
    cross32 = e32.session.cross_values(e32.encoder.run(array))
    cross16 = e16.session.cross_values(e16.encoder.run(array))
    compared = 0
    for ids in PROMPTS:
        request = GenerationRequest(prompt_token_ids=ids, max_new_tokens=16, ignore_eos=True,
                                    encoder=EncoderRequest(token_ids=ENCODER_IDS))
        f32, f16 = collect(e32, request)[0], collect(e16, request)[0]
        logits32 = teacher_forced(e32.session, ids + f32, cross32)
        logits16 = teacher_forced(e16.session, ids + f32, cross16)
        assert np.max(np.abs(logits16 - logits32)) <= FLOAT16_LOGIT_TOLERANCE
        compared += compare_greedy("encoder-decoder tiny", f32, f16, logits32)
    assert compared >= 16, "too few tokens compared to tell anything"


def redis_engine(folder: Path, url: str) -> Engine:
    return Engine.load(folder, EngineOptions(block_size=B), open_store(url, StoreOptions(), CacheStats()),
                       CacheStats(), "cpu", 2)


@pytest.mark.parametrize("arch, layout", KINDS)
def test_float16_kv_through_redis_answers_as_computing(built, redis_url, arch, layout):
    """A second replica over the same Redis, reading the first one's float16 blocks (stored as
    float16, the default --cache-dtype: the model's own values, unchanged), answers the same greedy
    tokens, and (decoder-only) its first token's logits are bit-identical to computing the prompt,
    as with float32 models (tests/test_cache_dtype.py). The encoder-decoder's second replica also
    reads the cross-attention K/V and never runs its encoder."""
    folder = built[arch, layout, "float16"]
    cold, warm = redis_engine(folder, redis_url), redis_engine(folder, redis_url)
    encoder = {"encoder": EncoderRequest(token_ids=ENCODER_IDS)} if arch == "encoder-decoder" else {}
    try:
        assert warm.storage_dtype == np.float16
        for ids in PROMPTS:
            request = GenerationRequest(prompt_token_ids=ids, max_new_tokens=16, ignore_eos=True, **encoder)
            cold_tokens, _ = collect(cold, request)
            warm_tokens, last = collect(warm, request)
            assert last.usage.cached_prompt_tokens == 3 * B
            assert warm_tokens == cold_tokens
            if encoder:
                assert last.usage.encoder_cache_hit and warm.encoder.runs == 0
                continue
            session = warm.session
            cold_logits = session.run(ids, session.empty_cache(len(ids)))[0]
            lookup = warm.prefix.lookup(warm.namespace(""), ids)
            warm_logits = session.run(ids[3 * B:], session.cache_from_blocks(lookup.blocks, 3 * B, len(ids)))[0]
            assert np.array_equal(warm_logits, cold_logits)
    finally:
        cold.close()
        warm.close()


@pytest.mark.parametrize("arch, layout", [("decoder", "separate"), ("encoder-decoder", None)])
def test_a_bfloat16_build_is_written_and_refused_on_cpu_with_the_fix(built, arch, layout):
    """As in ONNX Runtime GenAI's bf16 models, the logits stay float32 (one Cast after the head)."""
    folder = built[arch, layout, "bfloat16"]
    for graph in graphs(folder):
        types = float_types(graph)
        assert {t for name, t in types.items() if name != "logits"} == {TensorProto.BFLOAT16}
        assert types.get("logits", TensorProto.FLOAT) == TensorProto.FLOAT
        assert not [t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT]
    with pytest.raises(ModelLoadError, match=r"no bfloat16 kernel for \w+: rebuild it with `kvshare build-model "
                                             r"--dtype float16` \(or float32\)") as err:
        Engine.load(folder, EngineOptions(), open_store("memory://", StoreOptions(), CacheStats()), CacheStats(), "cpu", 2)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def smollm2_float16(smollm2, tmp_path_factory) -> Path:
    """SmolLM2 as `kvshare fetch-model smollm2-135m-instruct OUT --dtype float16` converts it from its
    GGUF (the route the GPU section of the README gives; once: about 10 s of CPU): with float16,
    fetch-model's default weights are fp32's, dequantized."""
    folder = tmp_path_factory.mktemp("smollm2-fp16") / "model"
    assert main(["fetch-model", "smollm2-135m-instruct", str(folder), "--dtype", "float16"]) == 0
    return folder


SMOLLM2_LOGIT_TOLERANCE = 0.15
"""Measured 0.055 between the float16 and float32 conversions of SmolLM2 (logits of std 7.8) over
a 36-token prompt and 16 answer tokens."""


def test_a_gguf_converts_to_float16_and_answers_as_float32(smollm2, smollm2_float16, load_engine):
    import json

    (graph,) = graphs(smollm2_float16)
    assert set(float_types(graph).values()) == {TensorProto.FLOAT16}
    reference = json.loads((Path(__file__).parent / "fixtures" / "smollm2" / "llama_cpp_reference.json").read_text())
    france, bicycle = reference["greedy"][:2]
    e16, e32 = load_engine(smollm2_float16), load_engine(smollm2)
    # llama.cpp's answer, as the float32 folder gives it (tests/test_real_model.py).
    assert collect(e16, GenerationRequest(prompt_token_ids=france["prompt_ids"], max_new_tokens=32))[0] == \
        france["greedy_ids"]
    ids = bicycle["prompt_ids"] + bicycle["greedy_ids"][:16]
    logits16, logits32 = teacher_forced(e16.session, ids), teacher_forced(e32.session, ids)
    assert np.max(np.abs(logits16 - logits32)) <= SMOLLM2_LOGIT_TOLERANCE


def test_a_bfloat16_input_is_refused_with_the_fix(tmp_path):
    """Where ONNX Runtime opens a bfloat16 graph (CUDA; here a Cast, which the CPU runs), the
    session's inputs stop it: nothing in the worker has a bfloat16 array type to bind."""
    from onnx import TensorProto, helper

    from services.errors import ModelLoadError
    from services.runtime.onnx_decoder import input_dtypes
    from services.runtime.ort import onnxruntime as ort

    graph = helper.make_graph([helper.make_node("Cast", ["past_key_values.0.key"], ["y"], to=TensorProto.FLOAT)], "g",
                              [helper.make_tensor_value_info("past_key_values.0.key", TensorProto.BFLOAT16, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(ModelLoadError, match=r"bfloat16 graph.*--dtype float16"):
        input_dtypes(session, tmp_path / "model.onnx")
