"""Decoding with the KV cache equals recomputing the whole sequence without it."""

from pathlib import Path

import numpy as np
import onnxruntime
import pytest
from conftest import record_margin

from services.modelbuild.presets import DECODER_PRESETS
from services.runtime.kv_layout import KVLayout
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import DecoderSession

STEPS = 32
TOLERANCE = 1e-4  # fp32 logits


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_cached_decoding_matches_full_recompute(model_dirs, preset, layout):
    shape = DECODER_PRESETS[preset]
    assert shape.num_kv_heads < shape.num_heads, "presets are GQA"
    session = DecoderSession(load_model_spec(model_dirs[preset, layout]), "cpu", intra_op_threads=2)
    rng = np.random.default_rng(7)
    sequence = rng.integers(3, shape.vocab_size, size=11).tolist()
    logits, cache = session.run(sequence, session.empty_cache(len(sequence) + STEPS))
    worst = 0.0
    for step in range(STEPS):
        cold, _ = session.run(sequence, session.empty_cache(len(sequence)))
        worst = max(worst, float(np.max(np.abs(cold - logits))))
        record_margin(f"kv cache vs recompute ({preset}, {layout})", cold)
        token = int(np.argmax(logits))
        assert token == int(np.argmax(cold)), f"step {step}: greedy token differs"
        sequence.append(token)
        logits, cache = session.run([token], cache)
        assert cache.length == len(sequence)
    assert worst <= TOLERANCE, f"max |logit diff| {worst:.2e}"


SPIN_KEY = "session.intra_op.allow_spinning"


@pytest.mark.parametrize("spinning", [False, True])
def test_onnx_runtime_threads_spin_only_when_asked(tiny_model, spinning):
    """Replicas, Redis and other pods share a node's cores: an idle thread spin-waiting for the
    next parallel section holds a core another process needs, so the worker's threads sleep unless
    --intra-op-spinning says the cores are its own. ONNX Runtime takes the setting from a map of
    strings and ignores a key it does not read (a misspelt key, or one a release renamed, is
    accepted without a word, and its threads spin, ONNX Runtime's default): reading back what the
    session was given proves only the wiring, so the key must also be one this ONNX Runtime looks
    up, i.e. a string compiled into its library."""
    session = DecoderSession(load_model_spec(tiny_model), "cpu", intra_op_threads=2, intra_op_spinning=spinning)
    options = session._session.get_session_options()
    assert options.get_session_config_entry(SPIN_KEY) == ("1" if spinning else "0")
    libraries = list((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so*"))
    assert libraries, "ONNX Runtime's library not found next to its Python package"
    assert any(SPIN_KEY.encode() + b"\0" in library.read_bytes() for library in libraries), (
        f"ONNX Runtime {onnxruntime.__version__} does not read {SPIN_KEY}: the setting would be ignored")
