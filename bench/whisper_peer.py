"""faster-whisper's greedy transcripts of the test clips, and the inputs it computes for them, for
bench.whisper_references; or its timed transcripts, for bench.whisper. Run by the peer
environment's Python (bench.peer_env: faster-whisper and its dependencies, numpy among them;
nothing of kvshare). Reads a JSON request as the first line of stdin, prints a JSON answer:

    {"model": DIR, "threads": T, "clips": [wav], "decode_only": [wav], "arrays": NPZ, "options": {...}}
    ->  {"versions": {...}, "clips": [{"token_ids", "text", "prompt", "generate", ...}]}

and writes to ``arrays`` (compressed npz, float32): ``mel_<clip>``, the log-mel frames (80, n) that
the encoder was fed before the zero columns that pad them to 3000, with ``frames_<clip>`` = n;
``decoded_<file>``, ``decode_audio(file)`` (16 kHz mono) of each ``decode_only`` file; and
``mel_filters`` (80, 201), the filter bank.

A request ``{"model": DIR, "threads": T, "timed": true, "options": {...}}`` loads the model once and
prints ``{"versions": {...}}``; then each further stdin line is a WAV path, answered by one line
``{"ms", "token_ids", "text"}``: the wall time of ``transcribe`` with its segments consumed
(decoding the file included), until stdin ends.
"""

import json
import sys
import time
from pathlib import Path

import ctranslate2
import faster_whisper
import numpy as np
from faster_whisper import WhisperModel, decode_audio

ENCODER_FRAMES = 3000


class RecordingModel:
    """The CTranslate2 model, with the prompt and options of every ``generate`` call kept: what
    faster-whisper really asked for, not what its signature suggests."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, features, prompts, **options):
        self.calls.append({"prompts": [list(p) for p in prompts], **options})
        return self.inner.generate(features, prompts, **options)


def encoder_input(model: WhisperModel, wav: str, options: dict) -> tuple[list, np.ndarray]:
    """The segments of ``transcribe`` and the one (80, 3000) log-mel window it fed the encoder."""
    fed = []
    encode = model.encode
    model.encode = lambda features: fed.append(np.array(features)) or encode(features)
    try:
        segments = list(model.transcribe(wav, **options)[0])
    finally:
        del model.encode
    if len(fed) != 1 or fed[0].shape != (80, ENCODER_FRAMES):
        raise SystemExit(f"{wav}: expected one (80, {ENCODER_FRAMES}) window, got {[f.shape for f in fed]}")
    return segments, fed[0]


def top2_gaps(ct2_model, encoded, call: dict) -> tuple[list[int], list[float]]:
    """The recorded generate call again, with its logits: the tokens and, per step (the end token's
    too), the gap from the chosen token's logit to the runner-up's, after suppression. A small gap
    is where another runtime's rounding may pick the other token."""
    options = {k: v for k, v in call.items() if k != "prompts"}
    (result,) = ct2_model.generate(encoded, call["prompts"], return_logits_vocab=True, **options)
    gaps = [float(np.diff(np.sort(np.asarray(step).ravel())[-2:])[0]) for step in result.logits[0]]
    return result.sequences_ids[0], gaps


def versions() -> dict:
    return {"faster-whisper": faster_whisper.__version__, "ctranslate2": ctranslate2.__version__,
            "numpy": np.__version__}


def serve_timings(model: WhisperModel, options: dict) -> None:
    """One timed ``transcribe`` per WAV path read from stdin, each answered on its own line (flushed:
    the caller waits for it before its next measurement)."""
    print(json.dumps({"versions": versions()}), flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        segments = list(model.transcribe(line.rstrip("\n"), **options)[0])
        ms = (time.perf_counter() - start) * 1000
        print(json.dumps({"ms": ms, "token_ids": [t for s in segments for t in s.tokens],
                          "text": "".join(s.text for s in segments)}), flush=True)


def main() -> None:
    request = json.loads(sys.stdin.readline())
    model = WhisperModel(request["model"], device="cpu", compute_type="float32", cpu_threads=request["threads"])
    if request.get("timed"):
        serve_timings(model, request["options"])
        return
    recorder = model.model = RecordingModel(model.model)
    arrays = {"mel_filters": model.feature_extractor.mel_filters}
    clips = []
    for wav in request["clips"]:
        name = Path(wav).stem
        samples = decode_audio(wav)
        # What the log-mel window holds: the padding is the columns past the clip's own frames (the
        # extractor's last frame, over its 160 appended zero samples, is dropped as transcribe does).
        frames = model.feature_extractor(samples).shape[-1] - 1
        recorder.calls.clear()
        segments, window = encoder_input(model, wav, request["options"])
        if np.any(window[:, frames:]):
            raise SystemExit(f"{wav}: the window's padding past frame {frames} is not all 0.0")
        arrays[f"mel_{name}"] = np.ascontiguousarray(window[:, :frames], dtype=np.float32)
        arrays[f"frames_{name}"] = np.int64(frames)
        (call,) = recorder.calls
        token_ids = [t for s in segments for t in s.tokens]
        tokens, gaps = top2_gaps(recorder.inner, model.encode(window), call)
        if tokens != token_ids:
            raise SystemExit(f"{wav}: generate gave {tokens} the second time, transcribe {token_ids}")
        clips.append({
            "samples": len(samples), "frames": frames,
            "token_ids": token_ids, "top2_logit_gaps": [round(g, 4) for g in gaps],
            "text": "".join(s.text for s in segments),
            "segments": [{"text": s.text, "avg_logprob": s.avg_logprob, "no_speech_prob": s.no_speech_prob,
                          "compression_ratio": s.compression_ratio} for s in segments],
            "prompt": call.pop("prompts")[0], "generate": call,
        })
    for path in request["decode_only"]:
        arrays[f"decoded_{Path(path).stem}"] = decode_audio(path)
    np.savez_compressed(request["arrays"], **arrays)
    json.dump({"versions": versions(), "clips": clips}, sys.stdout)


if __name__ == "__main__":
    main()
