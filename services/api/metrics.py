"""Prometheus metrics of a worker, on a port of their own (``--metrics-port``).

Per-request cache state is sensitive (it tells which prompts are cached), so the metrics are not
served to gRPC clients; the chart scrapes this port from inside the cluster. Names follow the
field's (vLLM ``prefix_cache_queries``/``_hits`` in tokens, LMCache ``time_to_retrieve``) under a
``kvshare_`` prefix. Counters the engine and the store already keep are read at scrape time; the
latency histograms are fed once per finished request. Nothing here runs on the token path.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cachestore.codec import RejectReason
from cachestore.resilient import ResilientStore
from cachestore.store import ERROR_KINDS
from cachestore.tiered import TieredStore
from services.engine.engine import Engine
from services.engine.generation import RequestRecord
from services.engine.run_waits import WaitEnd

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

# CacheStats field -> (metric name without _total, help)
_CACHE_COUNTERS = {
    "cross_hits": ("kvshare_cross_cache_hits", "Encoder inputs whose cross-attention K/V came from the store."),
    "cross_misses": ("kvshare_cross_cache_misses", "Encoder inputs whose cross-attention K/V was computed."),
    "bytes_read": ("kvshare_cache_fetch_bytes", "Bytes of checked values read from the store."),
    "bytes_sent": ("kvshare_cache_publish_bytes", "Bytes of values sent to the store."),
    "blocks_written": ("kvshare_cache_blocks_written",
                       "Prefix block values the store did not have and now has (two per block for models with "
                       "sliding-window layers)."),
    "window_misses": ("kvshare_cache_window_misses",
                      "Cached runs cut short because a block's sliding-window layers were missing or bad."),
    "publishes_dropped": ("kvshare_cache_publishes_dropped", "Publishes dropped because too many were pending."),
    "values_too_large": ("kvshare_cache_values_too_large", "Cross-attention values not stored for their size."),
    "short_circuited": ("kvshare_cache_short_circuited", "Store operations skipped while a breaker was open."),
    "budget_skipped": ("kvshare_cache_budget_skipped",
                       "Store operations skipped because their request had already waited twice "
                       "--cache-op-timeout-ms on a store that did not answer (it computes instead)."),
    "blocks_awaited": ("kvshare_cache_blocks_awaited", "Missing blocks another worker held the lease on computing."),
    "blocks_received": ("kvshare_cache_blocks_received", "Awaited blocks that arrived while waiting (not computed here)."),
    "fetches_skipped": ("kvshare_prefix_fetch_skipped",
                        "Prompts whose cached blocks were computed, not fetched: computing was expected faster "
                        "(--prefix-fetch auto, on a device)."),
}


def _resilient(store) -> ResilientStore | None:
    if isinstance(store, TieredStore):
        store = store.l2
    return store if isinstance(store, ResilientStore) else None


class _EngineCollector(Collector):
    """Reads the engine's, the scheduler's and the store's own counters when Prometheus scrapes."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self):
        engine, scheduler = self._engine, self._engine.scheduler
        stats, cache = scheduler.stats, engine.cache_stats.snapshot()
        yield GaugeMetricFamily("kvshare_requests_running", "Sequences holding a slot.", value=scheduler.running)
        yield GaugeMetricFamily("kvshare_requests_queued", "Admitted requests waiting for a slot.", value=scheduler.queued)
        yield GaugeMetricFamily("kvshare_requests_in_flight",
                                "Requests holding or waiting for a slot (running + queued): the autoscaling signal.",
                                value=scheduler.running + scheduler.queued)
        yield GaugeMetricFamily("kvshare_slots", "Slots (the decode batch's most rows).", value=engine.slots.max_batch)
        yield CounterMetricFamily("kvshare_requests_rejected", "Requests refused at the door (RESOURCE_EXHAUSTED).",
                                  value=stats.rejected)
        yield CounterMetricFamily("kvshare_requests_client_rejected",
                                  "Of the requests refused at the door, those whose client held --max-client-rows.",
                                  value=stats.client_rejected)
        yield CounterMetricFamily("kvshare_requests_pushed_out",
                                  "Queued requests refused to make room for a client holding fewer rows in a full worker.",
                                  value=stats.pushed_out)
        yield CounterMetricFamily("kvshare_streams_yielded",
                                  "Unread (paused) streams ended to give their slots to another client's waiting request.",
                                  value=stats.yielded)
        yield CounterMetricFamily("kvshare_decode_steps", "Batched decode runs.", value=stats.decode_steps)
        yield CounterMetricFamily("kvshare_decode_rows", "Rows advanced by decode runs (rows / steps = mean batch).",
                                  value=stats.decode_rows)
        copies = CounterMetricFamily("kvshare_slot_copy_bytes",
                                     "K/V bytes copied into the batched slots (in: from the host), out of them (out: "
                                     "to the host, to publish) and between rows (within), on any device.",
                                     labels=["direction"])
        for direction, nbytes in engine.session.device.copied.bytes.items():
            copies.add_metric([direction], nbytes)
        yield copies
        if engine.encoder is not None:
            yield CounterMetricFamily("kvshare_encoder_runs", "Encoder runs (cross-attention K/V computed here, not "
                                      "fetched from the store).", value=engine.encoder.runs)
        yield CounterMetricFamily("kvshare_prefill_tokens", "Prompt tokens computed (not served from the store).",
                                  value=stats.prefill_tokens)
        yield CounterMetricFamily("kvshare_prefill_shared_tokens",
                                  "Prompt tokens copied from another request of this worker holding the same prefix.",
                                  value=stats.shared_tokens)
        yield CounterMetricFamily("kvshare_prefill_adopted_tokens",
                                  "Prompt tokens taken from blocks another worker published after this one stopped "
                                  "waiting for them, instead of computing them too.",
                                  value=stats.adopted_tokens)
        yield GaugeMetricFamily("kvshare_lease_waiting", "Requests waiting for blocks another worker is computing.",
                                value=engine.waits.waiting)
        yield CounterMetricFamily("kvshare_lease_notices",
                                  "Waits woken by another worker announcing its progress (Redis pub/sub); without "
                                  "announcements, waits poll every --lease-poll-ms.",
                                  value=engine.waits.woken)
        waits = CounterMetricFamily("kvshare_lease_waits", "Waits for another worker's blocks, by how they ended.",
                                    labels=["end"])
        for end in WaitEnd:
            waits.add_metric([end.value], cache["lease_waits"].get(end.value, 0))
        yield waits
        rejected = CounterMetricFamily("kvshare_cache_values_rejected",
                                       "Stored values that failed a check (deleted, computed instead).", labels=["reason"])
        for reason in RejectReason:
            rejected.add_metric([reason.value], cache["rejected_values"].get(reason, 0))
        yield rejected
        errors = CounterMetricFamily("kvshare_cache_store_errors", "Store calls that failed (computed instead), by kind.",
                                     labels=["kind"])
        for kind in ERROR_KINDS:
            errors.add_metric([kind], cache["store_errors"].get(kind, 0))
        yield errors
        for field, (name, help_text) in _CACHE_COUNTERS.items():
            yield CounterMetricFamily(name, help_text, value=cache[field])
        store = _resilient(engine.store)
        if store is not None:
            breaker = GaugeMetricFamily("kvshare_cache_breaker_open", "1 while the store's breaker keeps calls away.",
                                        labels=["direction"])
            for direction, b in (("reads", store.read_breaker), ("writes", store.write_breaker)):
                breaker.add_metric([direction], float(b.keeps_calls_away))
            yield breaker


def serve_metrics(host: str, port: int) -> CollectorRegistry:
    """Serves /metrics on ``host:port`` from a daemon thread, from the registry it returns, which
    is empty until a WorkerMetrics fills it: the port is bound before the model loads, so a taken
    one is refused at once. Raises OSError when it cannot be bound."""
    registry = CollectorRegistry()
    start_http_server(port, addr=host, registry=registry)
    return registry


class WorkerMetrics:
    def __init__(self, engine: Engine, registry: CollectorRegistry | None = None) -> None:
        """The engine's metrics, in ``registry`` (None: a registry of their own)."""
        self.registry = CollectorRegistry() if registry is None else registry
        r = self.registry
        self.ttft = Histogram("kvshare_time_to_first_token_seconds",
                              "Time to first token; prefix_cache=hit when some prompt blocks came from the store.",
                              ["prefix_cache"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvshare_inter_token_latency_seconds",
                             "Gap between consecutive tokens of a request, one observation per gap.",
                             buckets=_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("kvshare_e2e_request_latency_seconds", "Request time, received to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.fetch = Histogram("kvshare_cache_fetch_seconds", "Store lookup and copy into the slot, per request.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.queries = Counter("kvshare_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (tokens).", registry=r)
        self.hits = Counter("kvshare_prefix_cache_hits", "Prompt tokens served from cached blocks (tokens).", registry=r)
        self.prompt_tokens = Counter("kvshare_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("kvshare_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("kvshare_requests", "Requests that ended, by outcome.", ["outcome"], registry=r)
        r.register(_EngineCollector(engine))
        engine.request_observers.append(self.observe)

    def observe(self, record: RequestRecord) -> None:
        u, t = record.usage, record.timings
        self.requests.labels(record.outcome).inc()
        self.prompt_tokens.inc(u.prompt_tokens)
        self.generation_tokens.inc(u.completion_tokens)
        if record.read_cache:
            self.queries.inc(u.prompt_tokens)
            self.hits.inc(u.cached_prompt_tokens)
        if u.completion_tokens:
            self.ttft.labels("hit" if u.cached_prompt_tokens else "miss").observe(t.time_to_first_token_ms / 1e3)
            self.e2e.observe(record.total_s)
            self.fetch.observe(t.cache_fetch_ms / 1e3)
        for gap in np.diff(record.token_times).tolist():
            self.itl.observe(gap)
