"""The Gemma 3 graph: ONNX Runtime's sliding-window semantics (tests/gqa_window.py), and a tiny seeded Gemma 3 GGUF
converted and served, against llama.cpp's math written out in numpy (tests/gemma_reference.py)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import onnxruntime as ort
import pytest
from conftest import stream_async
from gemma_reference import TinyGemma, last_logits, tiny_tensors, write_tiny_gguf
from gqa_window import Probe

from services.engine.engine import Engine, EngineOptions
from services.engine.generation import GenerationRequest
from services.modelbuild.decoder_graph import local_window_size
from services.modelbuild.folder import write_gguf_folder
from services.modelbuild.gguf_model import GGUFError, read_gguf


@pytest.mark.parametrize("window", [4, 512])
def test_local_window_size_sees_exactly_the_window(window):
    """local_window_size(window), and neither of its neighbours, gives a query at p exactly the
    keys p - window + 1 .. p on the CPU (gqa_window.Probe.matches says where it looks)."""
    probe, chosen = Probe(head=8), local_window_size(window)
    assert probe.matches(chosen, window, atol=1e-5)
    assert not probe.matches(chosen - 1, window, atol=1e-5) and not probe.matches(chosen + 1, window, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """(shape, GGUF tensors, converted float32 folder) of a seeded tiny Gemma 3."""
    shape = TinyGemma()
    tensors = tiny_tensors(shape, seed=3)
    root = tmp_path_factory.mktemp("tiny-gemma")
    folder = write_gguf_folder(write_tiny_gguf(root / "tiny.gguf", shape, tensors), root / "model")
    return shape, tensors, folder


def test_the_gguf_reads_as_gemma_3(tiny_gemma, tmp_path):
    shape, tensors, _ = tiny_gemma
    model = read_gguf(write_tiny_gguf(tmp_path / "t.gguf", shape, tensors))
    s = model.shape
    assert (model.architecture, s.head_size, s.num_heads * s.head_size, s.sliding_window) == ("gemma3", 16, 32, 8)
    assert s.windowed_layers == (0, 1, 2, 3, 4) and [s.rope_base(i) for i in (0, 5)] == [1e4, 1e6]
    assert s.embedding_scale == float(np.float32(np.sqrt(np.float32(24)))) and model.tied_head


def test_the_folder_is_gemma_3_with_last_position_logits(tiny_gemma):
    import onnx

    _, _, folder = tiny_gemma
    config = json.loads((folder / "genai_config.json").read_text())
    assert config["model"]["type"] == "gemma3_text" and config["model"]["decoder"]["head_size"] == 16
    assert config["search"]["past_present_share_buffer"] is True
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    assert (folder / "model.onnx.data").stat().st_size > 0
    windows = {n.name.split(".")[2]: {a.name: a.i for a in n.attribute}.get("local_window_size")
               for n in graph.node if n.op_type == "GroupQueryAttention"}
    assert windows == {str(i): local_window_size(8) if i < 5 else None for i in range(6)}
    logits = next(o for o in graph.output if o.name == "logits")
    assert [d.dim_value or d.dim_param for d in logits.type.tensor_type.shape.dim] == ["batch_size", 1, len(TinyGemma().vocab)]
    assert "Transpose" not in {n.op_type for n in graph.node}


def test_greedy_steps_across_the_window_equal_the_reference(tiny_gemma, load_engine):
    """Prefill past the window, decode across it, then (a second engine, blocks of 4 through the
    store) a prompt continuing a cached one and two rows decoding together, every step's logits
    against llama.cpp's math."""
    shape, tensors, folder = tiny_gemma
    engine = load_engine(folder)
    rng = np.random.default_rng(0)
    prompt = rng.integers(4, len(shape.vocab), 19).tolist()

    def check(prompt_ids: list[int], ids: list[int], logits: list[np.ndarray]) -> None:
        for step, got in enumerate(logits):
            want = last_logits(shape, tensors, prompt_ids + ids[:step])
            np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max())
        assert ids == [int(np.argmax(g)) for g in logits]

    async def run(e: Engine, prompts: list[list[int]], n: int) -> list[int]:
        """Runs ``prompts`` together, checks them, returns each one's cached prompt tokens."""
        requests = [GenerationRequest(prompt_token_ids=p, max_new_tokens=n, ignore_eos=True, return_logits=True)
                    for p in prompts]
        cached = []
        for p, (ids, logits, last) in zip(prompts, await asyncio.gather(*(stream_async(e, r) for r in requests)),
                                          strict=True):
            check(p, ids, logits)
            cached.append(last.usage.cached_prompt_tokens)
        return cached

    asyncio.run(run(engine, [prompt], 14))
    from cachestore.memory import MemoryStore
    from cachestore.stats import CacheStats

    blocks = Engine.load(folder, EngineOptions(block_size=4, cache_dtype="float32"), MemoryStore(8 << 20), CacheStats(), device="cpu",
                         intra_op_threads=1)
    try:
        asyncio.run(run(blocks, [prompt], 1))
        assert asyncio.run(run(blocks, [prompt + [268, 269, 270], prompt[:6]], 12)) == [16, 4]
    finally:
        blocks.close()


@pytest.mark.parametrize(("key", "says"), [("gemma3.final_logit_softcapping", "final_logit_softcapping"),
                                             ("gemma3.rope.scaling.factor", "rope.scaling.factor")])
def test_what_the_gemma_graph_cannot_represent_is_refused(tmp_path, key, says):
    shape = TinyGemma()
    path = write_tiny_gguf(tmp_path / "t.gguf", shape, tiny_tensors(shape, seed=0), extra={key: 8.0})
    with pytest.raises(GGUFError, match=says):
        read_gguf(path)


def test_prompt_logprobs_are_refused_by_a_last_position_graph(tiny_gemma, load_engine):
    from services.errors import FailedPrecondition

    engine = load_engine(tiny_gemma[2])
    with pytest.raises(FailedPrecondition, match="only the last position"):
        engine.prepare(GenerationRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=1, prompt_logprobs=True))


@pytest.mark.genai
def test_onnxruntime_genai_runs_the_folder_to_the_references_tokens(tiny_gemma):
    """GenAI's own runtime (genai_config type gemma3_text, logits [batch, 1, vocab]) on the converted
    folder: greedy past the window, the reference's argmax at every step."""
    import onnxruntime_genai as og

    shape, tensors, folder = tiny_gemma
    prompt = np.random.default_rng(1).integers(4, len(shape.vocab), 11).tolist()
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 12, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([prompt], dtype=np.int32))
    ids = []
    while not generator.is_done():
        generator.generate_next_token()
        ids.append(int(generator.get_next_tokens()[0]))
    assert len(ids) == 12
    assert ids == [int(np.argmax(last_logits(shape, tensors, prompt + ids[:i]))) for i in range(len(ids))]


def test_int8_weights_quantize_every_matmul_and_the_tied_head(tiny_gemma, tmp_path):
    """int8: the layers' matmuls and the Gemm head on the embedding become MatMulNBits (the head
    its own 8-bit copy, no float transpose left), the Gather keeps the float embedding, and the
    logits stay near the reference (8-bit weights and, at accuracy level 4, activations)."""
    import onnx

    shape, tensors, _ = tiny_gemma
    folder = write_gguf_folder(write_tiny_gguf(tmp_path / "t.gguf", shape, tensors), tmp_path / "int8", weights="int8")
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") == 7 * shape.layers + 1 and not {"MatMul", "Gemm"} & set(ops)
    assert {i.name for i in graph.initializer if "embed_tokens" in i.name and not i.name.endswith(("_Q8", "_scales"))} \
        == {"model.embed_tokens.weight"}
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(2).integers(4, len(shape.vocab), 19).tolist()
    feed = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for i in range(shape.layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = np.zeros((1, shape.kv_heads, 0, shape.head), np.float32)
    want = last_logits(shape, tensors, ids)
    assert np.abs(session.run(["logits"], feed)[0].reshape(-1) - want).max() < 0.05 * np.abs(want).max()
