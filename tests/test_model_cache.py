"""The demo's and benchmarks' seeded models: per-user cache, reused only when verified."""

import json
from pathlib import Path

from services.local.model_cache import STAMP, cache_dir, ensure_model


def test_cache_dir_is_per_user(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kvshare" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "kvshare" / "models"


def test_reused_when_verified_rebuilt_when_not(tmp_path, capsys):
    folder = tmp_path / "decoder-tiny"
    ensure_model(folder, "tiny")
    out = capsys.readouterr()
    # Progress goes to stderr: `MODEL=$(kvshare fetch-model ...)` must capture the folder alone.
    assert "building" in out.err and out.out == ""
    built = (folder / "model.onnx").stat().st_mtime_ns

    ensure_model(folder, "tiny")
    assert "building" not in capsys.readouterr().err and (folder / "model.onnx").stat().st_mtime_ns == built

    with (folder / "model.onnx").open("ab") as f:  # an edited or half-written file
        f.write(b"\0")
    ensure_model(folder, "tiny")
    assert "building" in capsys.readouterr().err

    for name in ("tokenizer.json", "genai_config.json", "tokenizer_config.json"):  # every file counts
        (folder / name).write_text((folder / name).read_text() + " ")
        ensure_model(folder, "tiny")
        assert "building" in capsys.readouterr().err, name

    stamp = json.loads((folder / STAMP).read_text())
    (folder / STAMP).write_text(json.dumps({**stamp, "builder": "an older builder"}))
    ensure_model(folder, "tiny")
    assert "building" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.part")), "the partial build folder was left behind"
