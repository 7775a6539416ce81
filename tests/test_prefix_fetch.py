"""Fetch or compute (``--prefix-fetch``): the decision from the worker's running estimates, a
skipped fetch over a real Redis (computed like a miss, nothing read, leased or published again,
counted and logged), and the flag. The decision is exercised on CPU by building the policy with
``on_device=True`` and estimates seeded by hand: nothing here depends on the machine's speed."""

import argparse
import logging
from dataclasses import fields

import pytest
from conftest import collect
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_batching import B, make_engine, prompt

from cachestore.factory import StoreOptions, open_store
from cachestore.keys import KEY_PREFIX
from cachestore.stats import CacheStats
from services.api.config import Settings
from services.api.metrics import WorkerMetrics
from services.api.server import load_engine
from services.engine.generation import GenerationRequest
from services.engine.kv_connector.fetch_policy import (
    FETCH_MARGIN,
    MIN_OBSERVATIONS,
    FetchPolicy,
    LookupClock,
    PrefixFetch,
    StoreRate,
)
from services.engine.run_waits import PrefillPace
from services.serving.flags import add_settings_flags, settings_from

TOKEN_BYTES = 1000
"""Stored bytes per token in the table below: a block of B tokens is 16 000 bytes."""


def pace(ms_per_token: float, observations: int = MIN_OBSERVATIONS) -> PrefillPace:
    measured = PrefillPace(first_ms_per_token=1.0)
    for _ in range(observations):
        measured.observe(100, 100 * ms_per_token)
    return measured


def store(first_block_ms: float, ms_per_byte: float, observations: int = MIN_OBSERVATIONS) -> StoreRate:
    return StoreRate(first_block_ms, observations, ms_per_byte, observations)


def policy(compute: PrefillPace, fetch: StoreRate, mode: PrefixFetch = PrefixFetch.AUTO, on_device: bool = True,
           probe_every: int = 1000, token_bytes: int = TOKEN_BYTES) -> FetchPolicy:
    return FetchPolicy(mode, on_device, compute, fetch, token_bytes, B, probe_every=probe_every)


# A 10-block prompt (160 tokens, 159 of them cacheable). Fetching it at 1 ms + 9 blocks x 16 000
# bytes x 1e-5 ms/byte = 2.44 ms; computing 159 tokens at 1e-3 ms/token = 0.159 ms.
PROMPT = 10 * B
SLOW_STORE, FAST_COMPUTE = store(1.0, 1e-5), pace(1e-3)
DECISIONS = [
    ("no estimates yet: fetch", policy(PrefillPace(1e-6), StoreRate()), PROMPT, True),
    ("compute measured, store not enough", policy(FAST_COMPUTE, store(1.0, 1e-5, MIN_OBSERVATIONS - 1)), PROMPT, True),
    ("store measured, compute not enough", policy(pace(1e-3, MIN_OBSERVATIONS - 1), SLOW_STORE), PROMPT, True),
    ("compute faster beyond the margin: skip", policy(FAST_COMPUTE, SLOW_STORE), PROMPT, False),
    # 2.44 ms fetching against 159 x 0.01 = 1.59 ms computing: faster, but not FETCH_MARGIN times.
    ("compute faster within the margin: fetch", policy(pace(1e-2), SLOW_STORE), PROMPT, True),
    ("fetch faster: fetch", policy(pace(1.0), SLOW_STORE), PROMPT, True),
    ("on the CPU provider auto always fetches", policy(FAST_COMPUTE, SLOW_STORE, on_device=False), PROMPT, True),
    ("always fetches on a device too", policy(FAST_COMPUTE, SLOW_STORE, PrefixFetch.ALWAYS), PROMPT, True),
    ("no full block: nothing to decide", policy(FAST_COMPUTE, SLOW_STORE), B - 1, True),
    # The latency term alone (no bytes cost): 5 ms per lookup against 1e-3 ms per token skips a
    # short prompt (2 x 63 tokens = 0.13 ms) but not a long one (2 x 2559 tokens = 5.1 ms).
    ("the lookup's latency decides a short prompt", policy(FAST_COMPUTE, store(5.0, 0.0)), 4 * B, False),
    ("the same latency spread over a long prompt", policy(FAST_COMPUTE, store(5.0, 0.0)), 160 * B, True),
]


@pytest.mark.parametrize(("decision", "prompt_tokens", "fetches"), [d[1:] for d in DECISIONS],
                         ids=[d[0] for d in DECISIONS])
def test_fetch_or_compute(decision, prompt_tokens, fetches):
    assert decision.fetches(prompt_tokens) is fetches


def test_the_margin_is_the_boundary():
    # Fetching 10 blocks costs 2.44 ms; computing 159 tokens at exactly 2.44 / (159 x margin) ms each ties.
    tie = 2.44 / (159 * FETCH_MARGIN)
    assert policy(pace(tie * 1.01), SLOW_STORE).fetches(PROMPT)
    assert not policy(pace(tie * 0.99), SLOW_STORE).fetches(PROMPT)


def test_one_in_probe_every_skips_fetches_to_keep_measuring_the_store():
    probing = policy(FAST_COMPUTE, SLOW_STORE, probe_every=3)
    assert [probing.fetches(PROMPT) for _ in range(6)] == [False, False, True, False, False, True]


def test_store_rate_is_a_running_estimate_of_the_first_block_and_the_bytes_after_it():
    rate = StoreRate()
    rate.observe(10.0, 0, 0.0)  # one block found: says nothing of the bytes after it
    assert (rate.first_block_ms, rate.first_observations, rate.byte_observations) == (10.0, 1, 0)
    assert rate.observations == 0
    rate.observe(20.0, 1000, 5.0)
    assert rate.first_block_ms == pytest.approx(12.0)  # weighted 0.2
    assert rate.ms_per_byte == pytest.approx(0.005)  # the first such observation is taken whole
    assert rate.observations == 1
    assert rate.expected_ms(blocks=3, block_bytes=100) == pytest.approx(12.0 + 2 * 100 * 0.005)


def test_a_lookup_is_timed_from_its_start_to_its_first_block_and_on_to_its_end():
    clock, kept = LookupClock(None), []
    assert clock.into(0, None, slice(None)) and clock.first is not None  # no receiver: every block is kept
    forwarding = LookupClock(lambda i, block, layers: kept.append(i) or i == 0)
    assert forwarding.into(0, None, slice(None)) and not forwarding.into(1, None, slice(None)) and kept == [0, 1]
    measured = policy(FAST_COMPUTE, StoreRate())
    measured.observe(LookupClock(None), 0)  # found nothing: nothing delivered, nothing learned
    assert measured.store.first_observations == 0
    measured.observe(forwarding, 2)
    assert (measured.store.first_observations, measured.store.byte_observations) == (1, 1)
    assert measured.store.first_block_ms >= 0 and measured.store.ms_per_byte >= 0


def test_pace_counts_its_observations():
    measured = PrefillPace(1.0)
    measured.observe(0, 5.0)
    assert measured.observations == 0 and measured.ms_per_token == 1.0
    measured.observe(10, 5.0)
    assert measured.observations == 1 and measured.ms_per_token == 0.5


@pytest.fixture()
def redis_engine(tiny_model, redis_url):
    engine = make_engine(tiny_model, open_store(redis_url, StoreOptions(), CacheStats()), cache_dtype="float32")
    yield engine
    engine.close()


def greedy(engine, ids):
    return collect(engine, GenerationRequest(prompt_token_ids=ids, max_new_tokens=8, ignore_eos=True))


def test_a_skipped_fetch_computes_the_prompt_and_reads_leases_and_publishes_nothing(redis_engine, redis_server,
                                                                                     caplog):
    engine = redis_engine
    records = []
    engine.request_observers.append(records.append)
    metrics = WorkerMetrics(engine)
    # 4 full blocks and 2 tokens; the answer's 7 fed tokens do not complete another block, so
    # whatever a request sends to the store is its prompt's.
    ids = prompt(4 * B + 2, seed=7)
    cold, cold_last = greedy(engine, ids)
    assert cold_last.usage.cached_prompt_tokens == 0
    with redis_server.client() as client:
        stored = sorted(client.keys(KEY_PREFIX + "*"))
    assert len(stored) == 4 and not any(b"lease:" in key for key in stored)
    written, sent = engine.cache_stats.blocks_written, engine.cache_stats.bytes_sent

    # Estimates that favour computing by far, seeded apart from the runner's own (which keeps
    # measuring the machine): the store takes 1000 s per lookup, computing 1 us per token.
    token_bytes = engine.spec.kv_bytes_per_token(engine.storage_dtype.itemsize)
    sources = engine.connector.scheduler_side
    sources.fetch_policy = policy(pace(1e-3), store(1e6, 1.0), token_bytes=token_bytes)
    with caplog.at_level(logging.INFO, logger="services.engine.output_processor"):
        warm, warm_last = greedy(engine, ids)
    assert warm == cold
    assert warm_last.usage.cached_prompt_tokens == 0
    assert engine.cache_stats.fetches_skipped == 1
    assert engine.cache_stats.bytes_read == 0  # nothing read
    assert (engine.cache_stats.blocks_written, engine.cache_stats.bytes_sent) == (written, sent)  # nor sent again
    with redis_server.client() as client:
        assert sorted(client.keys(KEY_PREFIX + "*")) == stored  # no lease taken
    assert [r.fetch_skipped for r in records] == [False, True]
    assert [r.read_cache for r in records] == [True, False]  # looked nothing up: its tokens are no queries
    (line,) = [r for r in caplog.records if getattr(r, "fields", {}).get("fetch_skipped") is not None]
    assert line.fields["fetch_skipped"] is True and line.fields["cached_prompt_tokens"] == 0
    samples = {s.name: s.value for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in family.samples}
    assert samples["kvshare_prefix_fetch_skipped_total"] == 1
    assert samples["kvshare_prefix_cache_queries_total"] == len(ids)  # the cold request's only

    # Pinned to always, the same estimates fetch: the store's blocks come back.
    sources.fetch_policy = policy(pace(1e-3), store(1e6, 1.0), PrefixFetch.ALWAYS, token_bytes=token_bytes)
    fetched, fetched_last = greedy(engine, ids)
    assert fetched == cold
    assert fetched_last.usage.cached_prompt_tokens == 4 * B
    assert engine.cache_stats.fetches_skipped == 1
    assert records[-1].fetch_skipped is False


def test_the_engine_on_the_cpu_provider_fetches_whatever_it_measures(redis_engine):
    """The suite's tiny models prefill faster than they fetch: on the CPU provider that must not matter."""
    policy_of = redis_engine.connector.scheduler_side.fetch_policy
    assert policy_of.mode is PrefixFetch.AUTO and policy_of.on_device is False
    assert policy_of.pace is redis_engine.runner.pace  # the runner's measurements, not a twin
    ids = prompt(4 * B + 2, seed=8)
    greedy(redis_engine, ids)
    for _ in range(MIN_OBSERVATIONS):  # as if every chunk had cost nothing
        policy_of.pace.observe(100, 1e-9)
    for _ in range(MIN_OBSERVATIONS + 1):
        assert greedy(redis_engine, ids)[1].usage.cached_prompt_tokens == 4 * B
    assert redis_engine.cache_stats.fetches_skipped == 0
    assert policy_of.store.observations >= MIN_OBSERVATIONS
    assert policy_of.token_bytes == redis_engine.spec.kv_bytes_per_token(4)  # float32 in the store


def parse(argv: list[str], environ: dict[str, str]) -> Settings:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, Settings)
    return settings_from(parser.parse_args(argv), Settings, environ)


def test_prefix_fetch_flag_and_environment():
    assert parse([], {}).prefix_fetch == "auto"
    assert parse(["--prefix-fetch", "always"], {}).prefix_fetch == "always"
    assert parse([], {"KVSHARE_PREFIX_FETCH": "always"}).prefix_fetch == "always"
    assert parse(["--prefix-fetch", "auto"], {"KVSHARE_PREFIX_FETCH": "always"}).prefix_fetch == "auto"
    with pytest.raises(SystemExit) as flag:
        parse(["--prefix-fetch", "never"], {})
    with pytest.raises(SystemExit) as env:
        parse([], {"KVSHARE_PREFIX_FETCH": "never"})
    assert flag.value.code == env.value.code == 2, "a setting that cannot be used exits 2, from a flag or the environment"
    # The flag's choices are the policy's modes.
    choices = next(f.metadata["choices"] for f in fields(Settings) if f.name == "prefix_fetch")
    assert choices == [mode.value for mode in PrefixFetch]


def test_the_setting_reaches_the_engine(tiny_model):
    engine = load_engine(Settings(model=tiny_model, prefix_fetch="always", device="cpu"))
    try:
        assert engine.connector.scheduler_side.fetch_policy.mode is PrefixFetch.ALWAYS
    finally:
        engine.close()
