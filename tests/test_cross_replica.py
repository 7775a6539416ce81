"""Two `kvshare serve` processes sharing one Redis (or a 3-master Redis Cluster): a system prompt
computed by replica A is served from the store by replica B, and outages degrade to computing."""

import contextlib

import grpc
import pytest
from conftest import wait_until

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.client import complete
from services.local.redis_process import RedisClusterServers, stored_values
from services.local.worker_process import WorkerProcess

pytestmark = pytest.mark.subprocess
B = 64
SYSTEM = (
    "You are the support assistant of a company that runs decode workers. Answer briefly, say so when "
    "you do not know, and quote prices in euros. Keep customer data private. "
) * 8
FAST_BREAKER = ("--breaker-failures", "1", "--breaker-backoff-ms", "200", "--breaker-max-backoff-ms", "400",
                "--cache-op-timeout-ms", "300")


@contextlib.contextmanager
def two_replicas(model, cache_url, *extra):
    with WorkerProcess(model, "--cache", cache_url, "--block-size", str(B), *extra) as a, \
            WorkerProcess(model, "--cache", cache_url, "--block-size", str(B), *extra) as b, \
            grpc.insecure_channel(a.target) as ca, grpc.insecure_channel(b.target) as cb:
        yield pb_grpc.GeneratorStub(ca), pb_grpc.GeneratorStub(cb)


def ids_of(stub, text):
    return list(stub.Tokenize(pb.TokenizeRequest(text=text)).token_ids)


def ask(stub, system_ids, question_ids, **cache):
    request = pb.GenerateRequest(prompt_token_ids=system_ids + question_ids, max_new_tokens=16, ignore_eos=True,
                                 cache=pb.CacheOptions(**cache))
    return complete(stub, request, timeout_s=60)


def cross_replica_check(stub_a, stub_b, published_keys):
    system = ids_of(stub_a, SYSTEM)
    assert len(system) >= 600
    q1, q2 = ids_of(stub_a, "\nQuestion: how do I reset my password?"), ids_of(stub_a, "\nQuestion: where is my invoice?")
    first = ask(stub_a, system, q1)
    assert first.last.usage.cached_prompt_tokens == 0
    blocks = len(system) // B
    wait_until(lambda: published_keys() >= (len(system) + len(q1)) // B, what="replica A's publish")
    second = ask(stub_b, system, q2)
    assert second.last.usage.cached_prompt_tokens == blocks * B
    assert second.last.timings.cache_fetch_ms > 0
    assert second.token_ids == ask(stub_b, system, q2, skip_read=True).token_ids
    return system, q2, second


def test_system_prompt_prefilled_once_across_replicas(tiny_model, redis_server, redis_url):
    with two_replicas(tiny_model, redis_url) as (a, b), redis_server.client() as client:
        cross_replica_check(a, b, lambda: stored_values(client))


def test_redis_cluster_three_masters(tiny_model):
    with RedisClusterServers() as cluster:
        clients = [n.client() for n in cluster.nodes]

        def keys():
            return sum(stored_values(c) for c in clients)

        with two_replicas(tiny_model, cluster.url) as (a, b):
            cross_replica_check(a, b, keys)
        assert all(c.dbsize() > 0 for c in clients), "blocks spread over every master"
        for c in clients:
            c.close()


def test_redis_killed_then_back(tiny_model, redis_server, redis_url):
    with two_replicas(tiny_model, redis_url, *FAST_BREAKER) as (a, b), redis_server.client() as client:
        system, question, warm = cross_replica_check(a, b, lambda: stored_values(client))
        redis_server.kill()
        for stub in (a, b, a, b):
            down = ask(stub, system, question)
            assert down.token_ids == warm.token_ids
            assert down.last.usage.cached_prompt_tokens == 0
        redis_server.start()
        # The breaker probes again after its backoff; the store is empty after the restart, so
        # one request publishes and the next one, on the other replica, hits.
        def hit_again():
            ask(a, system, question)
            return ask(b, system, question).last.usage.cached_prompt_tokens > 0

        wait_until(hit_again, timeout_s=20, what="cache hits after Redis came back")
        assert ask(b, system, question).token_ids == warm.token_ids
