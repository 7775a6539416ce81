"""Authenticated tenants, gRPC over TLS and mutual TLS, and Redis over TLS with AUTH: real
`kvshare serve` processes, real gRPC over loopback, a real TLS-enabled redis-server."""

import hashlib
import os
import re
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import grpc
import numpy as np
import pytest
from certs import TestCA
from conftest import wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from test_lease_notices import listening

from cachestore.factory import StoreOptions, open_store
from cachestore.keys import progress_channel
from cachestore.signing import Keyring
from cachestore.stats import CacheStats
from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.api.api_keys import key_line
from services.local.redis_process import (
    RedisClusterServers,
    RedisServer,
    ServerTLS,
    free_port,
    supports_tls,
)
from services.local.worker_process import WorkerProcess

pytestmark = pytest.mark.subprocess
KEYS = {"acme": "acme-key-" + "1" * 32, "globex": "globex-key-" + "2" * 32}
PROMPT = np.random.default_rng(11).integers(3, 500, size=3 * 64 + 9).tolist()


def bearer(tenant: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def generate(stub, ids=PROMPT, metadata=(), salt=""):
    last = None
    for last in stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, max_new_tokens=4, ignore_eos=True,
                                                 cache=pb.CacheOptions(salt=salt)), metadata=metadata, timeout=60):
        pass
    return last.usage.cached_prompt_tokens


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "api-keys"
    path.write_text("# tenant  sha256(key)\n" + "".join(
        key_line(tenant, key) for tenant, key in KEYS.items()))
    return path


@pytest.fixture(scope="module")
def keyed_worker(tiny_model, keys_file):
    with WorkerProcess(tiny_model, "--api-keys-file", str(keys_file)) as worker:
        yield worker


@pytest.fixture()
def keyed_stub(keyed_worker):
    with keyed_worker.channel() as channel:
        yield pb_grpc.GeneratorStub(channel), channel


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer not-a-key"),), (("authorization", KEYS["acme"]),)],
                         ids=["no key", "unknown key", "no Bearer"])
def test_calls_without_a_valid_key_are_unauthenticated_and_health_stays_open(keyed_stub, keyed_worker, metadata):
    stub, channel = keyed_stub
    calls = [lambda: generate(stub, metadata=metadata),
             lambda: stub.Tokenize(pb.TokenizeRequest(text="hello"), metadata=metadata, timeout=10),
             lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10)]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer KEY" in err.value.details()
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert any("refused a call without a valid API key from" in line for line in keyed_worker.log_lines)
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer("acme"), timeout=10).block_size == 64


def test_tenants_never_share_blocks_and_cannot_probe_each_other(keyed_stub):
    stub, _ = keyed_stub
    probe = np.random.default_rng(12).integers(3, 500, size=3 * 64 + 9).tolist()
    # Globex learns the same from a prompt Acme used and from one nobody used: nothing.
    assert generate(stub, PROMPT, bearer("acme")) == 0
    assert generate(stub, PROMPT, bearer("globex")) == 0
    assert generate(stub, probe, bearer("globex")) == 0
    # Within a tenant, blocks are shared; a salt splits further.
    assert generate(stub, PROMPT, bearer("acme")) == 3 * 64
    assert generate(stub, PROMPT, bearer("acme"), salt="team-b") == 0


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return TestCA(tmp_path_factory.mktemp("ca"))


def tls_credentials(ca, client=None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.cert.read_bytes(), private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None)


def test_grpc_over_tls_with_api_keys_and_the_cli_and_plaintext_is_refused(tiny_model, ca, keys_file, tmp_path):
    server = ca.issue("worker", server=True)
    with WorkerProcess(tiny_model, "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key),
                       "--api-keys-file", str(keys_file), credentials=tls_credentials(ca)) as worker:
        with worker.channel() as channel:
            assert generate(pb_grpc.GeneratorStub(channel), metadata=bearer("acme")) == 0
        with grpc.insecure_channel(worker.target) as plain, pytest.raises(grpc.RpcError) as err:
            generate(pb_grpc.GeneratorStub(plain), metadata=bearer("acme"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        key_file = tmp_path / "key"
        key_file.write_text(KEYS["globex"] + "\n")
        cli = [sys.executable, "-m", "services.cli", "generate", "hello", "--max-new-tokens", "3",
               "--target", worker.target, "--tls-ca-file", str(ca.cert)]
        by_env = subprocess.run(cli, capture_output=True, text=True, timeout=60,
                                env={**os.environ, "KVSHARE_API_KEY": KEYS["acme"]})
        assert by_env.returncode == 0 and "completion_tokens=3" in by_env.stderr, by_env.stderr
        by_file = subprocess.run([*cli, "--api-key-file", str(key_file)], capture_output=True, text=True, timeout=60)
        assert by_file.returncode == 0, by_file.stderr
        anonymous = subprocess.run(cli, capture_output=True, text=True, timeout=60,
                                   env={k: v for k, v in os.environ.items() if k != "KVSHARE_API_KEY"})
        assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr


def test_mutual_tls_needs_a_client_certificate_from_the_ca(tiny_model, ca, tmp_path):
    server, client = ca.issue("worker-m", server=True), ca.issue("client-m", server=False)
    stranger = TestCA(tmp_path / "stranger").issue("stranger", server=False)
    with WorkerProcess(tiny_model, "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key),
                       "--tls-client-ca-file", str(ca.cert), credentials=tls_credentials(ca, client)) as worker:
        with worker.channel() as channel:
            assert generate(pb_grpc.GeneratorStub(channel)) == 0
        for credentials in (tls_credentials(ca), tls_credentials(ca, stranger)):
            with grpc.secure_channel(worker.target, credentials) as channel, pytest.raises(grpc.RpcError) as err:
                generate(pb_grpc.GeneratorStub(channel))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_tls_worker_answers_kubelet_style_plaintext_health_checks_on_its_health_port_only(tiny_model, ca):
    """Kubernetes' gRPC probes speak no TLS: --health-port serves grpc.health.v1 in plaintext and
    nothing else; --reflection false leaves the API's shape to those who hold the .proto files."""
    server, health_port = ca.issue("worker-h", server=True), free_port()
    with WorkerProcess(tiny_model, "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key),
                       "--health-port", str(health_port), "--reflection", "false",
                       credentials=tls_credentials(ca)) as worker:
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as plain:
            for service in ("", "kvshare.v1.Generator"):
                reply = health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                generate(pb_grpc.GeneratorStub(plain))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with worker.channel() as channel:
            assert generate(pb_grpc.GeneratorStub(channel)) == 0
            with pytest.raises(grpc.RpcError) as err:
                ProtoReflectionDescriptorDatabase(channel).get_services()
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # The image's HEALTHCHECK (docker/healthcheck.py) asks the health port when there is one.
        script = Path(__file__).resolve().parent.parent / "docker" / "healthcheck.py"
        port = worker.target.rsplit(":", 1)[1]
        check = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30,
                               env={**os.environ, "KVSHARE_PORT": port, "KVSHARE_HEALTH_PORT": str(health_port)})
        assert check.returncode == 0 and "SERVING" in check.stdout, check.stderr


def documented_acl() -> list[str]:
    """The ACL rules docs/security.md gives the workers' Redis user."""
    text = (Path(__file__).parents[1] / "docs" / "security.md").read_text()
    match = re.search(r"`ACL SETUSER kvshare on >PASSWORD ([^`]+)`", text)
    assert match, "docs/security.md gives the workers' ACL user"
    return match.group(1).split()


def _delete_user(server, user: str) -> None:
    with server.client() as c:
        c.execute_command("ACL", "DELUSER", user)


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_the_documented_acl_user_runs_every_store_operation(redis_server, cluster):
    """Blocks, leases (set-if-absent, the compare-and-delete and renew scripts) and announcements,
    as the worker's ACL user from docs/security.md, on one server and on a cluster: not one store
    error."""
    with ExitStack() as stack:
        target = stack.enter_context(RedisClusterServers()) if cluster else redis_server
        for server in target.nodes if cluster else [redis_server]:
            with server.client() as c:
                c.execute_command("ACL", "SETUSER", "kvshare-doc", "on", ">doc-password", *documented_acl())
            stack.callback(lambda server=server: _delete_user(server, "kvshare-doc"))
        url = target.url
        stats = CacheStats()
        store = open_store(url, StoreOptions(username="kvshare-doc", password="doc-password"), stats)
        stack.callback(store.close)
        notices, heard = listening(store)
        stack.callback(notices.close)
        blocks = [(f"kvshare:v1:blk:{i}", b"%d" % i) for i in range(6)]
        assert store.put_many(blocks) == len(blocks)
        assert store.get_many([key for key, _ in blocks]) == [value for _, value in blocks]
        assert list(store.iter_many([key for key, _ in blocks])) == [value for _, value in blocks]
        lease = "kvshare:v1:lease:a"
        assert store.claim(lease, b"w.1", 60_000) == b"w.1" == store.holder(lease)
        store.renew(lease, b"w.1", 60_000)
        store.release(lease, b"w.1")
        assert store.holder(lease) is None, "released early, not left to expire"
        channel = progress_channel(b"w.1")
        notices.listen({channel})
        assert heard.get(timeout=10) == (channel, False)
        store.announce([channel])
        assert heard.get(timeout=10) == (channel, True)
        store.delete([blocks[0][0]])
        store.ping()
        assert stats.store_errors == {}


needs_tls_redis = pytest.mark.skipif(
    not supports_tls(), reason="the redis-server found was built without TLS; as root, scripts/test.sh installs "
                               "the system's redis-server, which has it (apt-get install redis-server)")


@pytest.fixture(scope="module")
def tls_redis(ca):
    server = ca.issue("redis", server=True)
    with RedisServer(tls=ServerTLS(server.cert, server.key, ca.cert, require_client_cert=True),
                     password="redis-password-" + "9" * 24) as redis_server:
        with redis_server.client() as c:
            c.execute_command("ACL", "SETUSER", "kvshare", "on", ">worker-password-" + "8" * 24, *documented_acl())
        yield redis_server


@needs_tls_redis
def test_workers_share_blocks_through_rediss_with_an_acl_user_and_client_certificate(tiny_model, ca, tls_redis, tmp_path):
    client = ca.issue("worker-r", server=False)
    password = tmp_path / "redis-password"
    password.write_text("worker-password-" + "8" * 24 + "\n")
    signing = tmp_path / "signing-keys"
    signing.write_text("k1 " + "s" * 64 + "\n")
    common = ("--cache", tls_redis.url, "--cache-tls-ca-file", str(ca.cert), "--cache-tls-cert-file", str(client.cert),
              "--cache-tls-key-file", str(client.key), "--cache-username", "kvshare", "--cache-signing-key-file", str(signing))
    with (WorkerProcess(tiny_model, *common, "--cache-password-file", str(password)) as a,
          WorkerProcess(tiny_model, *common, env={"KVSHARE_CACHE_PASSWORD": password.read_text().strip()}) as b):
        with a.channel() as channel:
            assert generate(pb_grpc.GeneratorStub(channel)) == 0
        with tls_redis.client() as redis_client:
            # Publishes run on the write threads, off the token path: the stream may end first.
            wait_until(lambda: len(redis_client.keys("kvshare:v1:blk:*")) >= 3, 30, "worker A's blocks in Redis")
            stored = {k.decode(): redis_client.get(k) for k in redis_client.keys("kvshare:v1:blk:*")}
        keyring = Keyring.load(signing)
        assert len(stored) == 3 and all(isinstance(keyring.verify(k, v), memoryview) for k, v in stored.items())
        with b.channel() as channel:
            assert generate(pb_grpc.GeneratorStub(channel)) == 3 * 64


def serve_fails(tiny_model, *args, env=None) -> str:
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", str(tiny_model), "--port", "0",
                           *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stderr.strip().splitlines()[-1]


@needs_tls_redis
def test_a_wrong_redis_password_or_ca_stops_the_worker_with_one_clear_line(tiny_model, ca, tls_redis, tmp_path):
    client = ca.issue("worker-x", server=False)
    other_ca = TestCA(tmp_path / "other")
    tls = ("--cache-tls-cert-file", str(client.cert), "--cache-tls-key-file", str(client.key))
    wrong_password = serve_fails(tiny_model, "--cache", tls_redis.url, "--cache-tls-ca-file", str(ca.cert), *tls,
                                 env={"KVSHARE_CACHE_PASSWORD": "wrong"})
    assert "refused the credentials" in wrong_password and "--cache-password-file" in wrong_password
    wrong_ca = serve_fails(tiny_model, "--cache", tls_redis.url, "--cache-tls-ca-file", str(other_ca.cert), *tls,
                           env={"KVSHARE_CACHE_PASSWORD": "redis-password-" + "9" * 24})
    assert "TLS handshake failed" in wrong_ca and "--cache-tls-ca-file" in wrong_ca
    no_password = serve_fails(tiny_model, "--cache", tls_redis.url, "--cache-tls-ca-file", str(ca.cert), *tls)
    assert "requires a password and none was given" in no_password


def test_secrets_never_come_from_the_command_line_and_bad_key_files_refuse_to_start(tiny_model, tmp_path):
    for url in ("redis://:hunter2@127.0.0.1:1", "tiered+redis://127.0.0.1:1/0?password=hunter2"):
        line = serve_fails(tiny_model, "--cache", url)
        assert "process list" in line and "hunter2" not in line
    short = tmp_path / "short"
    short.write_text("k1 tooshort\n")
    assert "at least 32" in serve_fails(tiny_model, "--cache-signing-key-file", str(short))
    assert "at least 32" in serve_fails(tiny_model, "--cache-namespace-secret-file", str(short))
    plain = tmp_path / "plain-keys"
    plain.write_text(f"acme {KEYS['acme']}\n")
    assert "never the key itself" in serve_fails(tiny_model, "--api-keys-file", str(plain))
    assert "cannot read" in serve_fails(tiny_model, "--api-keys-file", str(tmp_path / "missing"))
    sha256sum_output = tmp_path / "sha256sum-keys"
    sha256sum_output.write_text(f"acme {hashlib.sha256(b'k').hexdigest()}  -\n")
    assert "cut -d' ' -f1" in serve_fails(tiny_model, "--api-keys-file", str(sha256sum_output))
    key_file_as_secret = tmp_path / "signing-keys"
    key_file_as_secret.write_text("k1 " + "s" * 64 + "\n")
    assert "one word" in serve_fails(tiny_model, "--cache-namespace-secret-file", str(key_file_as_secret))


def test_a_certificate_and_key_that_do_not_match_refuse_to_start_saying_so(tiny_model, ca, tmp_path):
    first, second = ca.issue("first", server=True), ca.issue("second", server=True)
    line = serve_fails(tiny_model, "--tls-cert-file", str(first.cert), "--tls-key-file", str(second.key))
    assert "not a usable PEM certificate chain and its private key" in line and "in use" not in line
    line = serve_fails(tiny_model, "--tls-cert-file", str(first.cert), "--tls-key-file", str(first.key),
                       "--tls-client-ca-file", str(first.key))
    assert "--tls-client-ca-file" in line and "no usable PEM certificate" in line


def test_client_flags_naming_unusable_files_get_one_line(tmp_path):
    for args, expected in ((["--api-key-file", str(tmp_path / "missing")], "cannot read --api-key-file"),
                           (["--tls-ca-file", str(tmp_path / "missing")], "--tls-ca-file"),
                           (["--tls-cert-file", __file__], "needs both --tls-cert-file and --tls-key-file")):
        proc = subprocess.run([sys.executable, "-m", "services.cli", "generate", "hi", "--target", "127.0.0.1:1", *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr


def test_an_unauthenticated_caller_learns_nothing_from_how_its_bytes_parse(keyed_worker):
    with keyed_worker.channel() as channel:
        raw = channel.unary_unary("/kvshare.v1.Generator/Tokenize", request_serializer=None, response_deserializer=None)
        for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED), (bearer("acme"), grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as err:
                raw(b"\x0a\x02\xff\xfe", metadata=metadata, timeout=10)  # field 1 (text): invalid UTF-8
            assert err.value.code() == code
