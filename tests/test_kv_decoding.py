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
from services.runtime.threads import SPINNING_VARIABLE, default_spinning

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


@pytest.mark.parametrize("policy, allow, stop", [("in-run", "1", "1"), ("always", "1", "0"), ("never", "0", "0")])
def test_onnx_runtime_threads_spin_as_the_policy_says(tiny_model, policy, allow, stop):
    """Replicas, Redis and other pods share a node's cores: an idle thread spin-waiting holds a
    core another process needs, so by default (in-run) the worker's threads spin only while a run
    is in flight and stop when it returns. ONNX Runtime takes the settings from a map of strings
    and ignores a key it does not read (a misspelt key, or one a release renamed, is accepted
    without a word, and its threads spin, ONNX Runtime's default): reading back what the session
    was given proves only the wiring, so each key must also be one this ONNX Runtime looks up,
    i.e. a string compiled into its library."""
    session = DecoderSession(load_model_spec(tiny_model), "cpu", intra_op_threads=2, intra_op_spinning=policy)
    options = session._session.get_session_options()
    expected = {"session.intra_op.allow_spinning": allow, "session.force_spinning_stop": stop}
    assert {key: options.get_session_config_entry(key) for key in expected} == expected
    libraries = list((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so*"))
    assert libraries, "ONNX Runtime's library not found next to its Python package"
    for key in expected:
        assert any(key.encode() + b"\0" in library.read_bytes() for library in libraries), (
            f"ONNX Runtime {onnxruntime.__version__} does not read {key}: the setting would be ignored")


def test_intra_op_threads_follow_the_cpus_the_process_may_use():
    """0 (the default) is ONNX Runtime's choice, one per physical core of the machine, unless the
    process may use fewer CPUs: a cgroup quota (a Kubernetes CPU limit) of 1.5 CPUs gives 2 threads
    where the machine has more cores; a configured count is kept."""
    import os

    from services.runtime.threads import intra_op_threads

    usable = len(os.sched_getaffinity(0))
    assert intra_op_threads(3, limit=1.0) == 3
    assert intra_op_threads(0, limit=1.5) == (min(2, usable) if min(2, usable) < os.cpu_count() else 0)
    assert intra_op_threads(0, limit=0.2) == (1 if os.cpu_count() > 1 else 0)
    assert intra_op_threads(0, limit=float(os.cpu_count() + 8)) == (usable if usable < os.cpu_count() else 0)


def test_a_session_opened_without_a_policy_follows_the_workers_variable(tiny_model, monkeypatch):
    """In-process sessions (benchmarks, tests, an embedding program) take KVSHARE_INTRA_OP_SPINNING
    as the worker does, else in-run; a value that is no policy is refused naming the choices."""
    monkeypatch.delenv(SPINNING_VARIABLE, raising=False)
    assert default_spinning() == "in-run"
    monkeypatch.setenv(SPINNING_VARIABLE, "always")
    session = DecoderSession(load_model_spec(tiny_model), "cpu", intra_op_threads=2)
    options = session._session.get_session_options()
    assert options.get_session_config_entry("session.force_spinning_stop") == "0"
    monkeypatch.setenv(SPINNING_VARIABLE, "sometimes")
    with pytest.raises(ValueError, match="in-run, always, never"):
        default_spinning()
