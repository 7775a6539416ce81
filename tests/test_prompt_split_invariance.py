"""An answer does not depend on how its prompt was split between the cache and computing, nor
on how a cold prompt was chunked: the default SmolLM2 folder (float activations), with float32
storage so that only the split differs (float16 storage's own rounding is tests/test_real_model.py's).

Why this file exists: the gguf folder (MatMulNBits at accuracy level 4, int8 activations) fails
it. ONNX Runtime 1.32's GroupQueryAttention computes the last row of a run of n tokens, n = 1 or
n = 1 (mod 128), about 4e-8 away from the same row inside a longer run (float rounding, and the
fp32 folder keeps it there), but int8 activations turn such differences into whole quantization
steps: logits up to 36 apart, greedy answers changed, for a warm repeat of a 128- or 129-token
prompt, or a 257-token prompt chunked as 256 + 1. So gguf is not fetch-model's default, and a
folder that quantizes activations stores float32 K/V and publishes no answers (which narrows the
difference, but does not remove it).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import stream

from cachestore.memory import MemoryStore
from cachestore.stats import CacheStats
from services.engine.engine import Engine, EngineOptions
from services.engine.generation import CacheControl, GenerationRequest
from services.engine.scheduler import SchedulerOptions

FLOAT32_TOLERANCE = 1e-3
"""tests/test_real_model.py's LOGIT_TOLERANCE["float32"]: warm over float32 K/V against cold."""
SYSTEM = "You are a careful assistant. " * 40
QUESTION = "What should I name my cat? Give one name only."


def _engine(folder, budget: int = 256) -> Engine:
    return Engine.load(folder, EngineOptions(cache_dtype="float32",
                                             scheduler=SchedulerOptions(max_prefill_tokens_per_step=budget)),
                       MemoryStore(256 << 20), CacheStats(), "cpu", 2)


def _prompt(engine: Engine, tokens: int) -> list[int]:
    ids = engine.tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                                  "<|im_start|>assistant\n")
    assert len(ids) >= tokens
    return ids[-tokens:]


def _run(engine: Engine, ids: list[int], **cache):
    return stream(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=12, return_logits=True,
                                            ignore_eos=True, cache=CacheControl(**cache)))


def _differ(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a[1], b[1], strict=True))


@pytest.mark.parametrize("tokens", [128, 129, 130])
def test_a_warm_repeat_answers_as_cold_whatever_the_prompts_length(smollm2, tokens):
    engine = _engine(smollm2)
    try:
        ids = _prompt(engine, tokens)
        cold = _run(engine, ids, skip_read=True)  # publishes its blocks
        warm = _run(engine, ids)
        assert warm[2].usage.cached_prompt_tokens >= 64
        assert warm[0] == cold[0] and _differ(warm, cold) < FLOAT32_TOLERANCE, _differ(warm, cold)
    finally:
        engine.close()


def test_a_cold_answer_does_not_depend_on_how_its_prompt_was_chunked(smollm2):
    chunked, whole = _engine(smollm2, 256), _engine(smollm2, 4096)
    try:
        ids = _prompt(chunked, 257)  # 256 + a one-token chunk
        a = _run(chunked, ids, skip_read=True, skip_write=True)
        b = _run(whole, ids, skip_read=True, skip_write=True)
        assert a[0] == b[0] and _differ(a, b) < FLOAT32_TOLERANCE, _differ(a, b)
    finally:
        chunked.close()
        whole.close()
