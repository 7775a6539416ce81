"""One engine's KV connector: both sides over one store, one publish queue, one waits' thread and
one encoder thread."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from cachestore.cross import CrossStore
from cachestore.keys import BlockHash, Namespace, encoder_input_hash
from cachestore.prefix import CANONICAL_LAYOUT, KVGeometry, PrefixStore
from cachestore.stats import CacheStats
from cachestore.store import KVStore
from services.engine.generation import CacheControl
from services.engine.kv_connector.deletions import Deletions
from services.engine.kv_connector.encoder_runs import EncoderRuns
from services.engine.kv_connector.fetch_policy import (
    FetchPolicy,
    PrefixFetch,
    StoreRate,
)
from services.engine.kv_connector.publish_queue import PublishQueue
from services.engine.kv_connector.scheduler_side import KVConnectorScheduler
from services.engine.kv_connector.state import SequenceKV
from services.engine.kv_connector.worker_side import KVConnectorWorker
from services.engine.run_waits import LeaseOptions, PrefillPace, RunWaits
from services.runtime.layer_windows import LayerWindows
from services.runtime.model_spec import ModelSpec


@dataclass(frozen=True, slots=True)
class ConnectorOptions:
    """The store-facing settings of an engine (``EngineOptions`` holds them for the flags)."""

    block_size: int
    """Tokens per shared cache block."""
    namespace_secret: bytes
    """Keys every block and cross-attention key (``Namespace.secret``); the same on every worker."""
    max_value_bytes: int
    """Cross-attention values larger than this are not stored."""
    store_write_threads: int
    max_pending_publishes: int
    max_pending_publish_bytes: int
    leases: LeaseOptions
    chunk_tokens: int
    """Prompt tokens prefilled per step: one chunk, what a waiter weighs against waiting."""
    prefix_fetch: PrefixFetch
    """Whether a prompt's cached run may be computed instead of fetched when that is expected
    faster (``fetch_policy``)."""
    numerics: str = ""
    """``Namespace.numerics``: the numerics fingerprint where K/V must match bit for bit."""
    shares: bool = True
    """False: no request reads or publishes K/V (a model whose answers would depend on the split
    between cache and computing on this runtime: ``numerics_probe``)."""


class KVConnector:
    """Owns the store-facing state of an engine. ``scheduler_side`` and ``worker_side`` are the
    two faces the scheduler and the runner use; the engine uses the rest."""

    def __init__(self, spec: ModelSpec, model_kv_dtype: np.dtype, cross_heads: int, storage_dtype: np.dtype,
                 store: KVStore, cache_stats: CacheStats, options: ConnectorOptions, pace: PrefillPace,
                 on_device: bool, layer_order: tuple[int, ...], split_windows: bool) -> None:
        """``on_device``: the decoder runs on a device, not the CPU provider (``FetchPolicy.on_device``).
        ``layer_order``: the model layers along the canonical layer axis, as the slots keep them
        (``ModelSpec.layer_order`` in ``SharedSlots``, the model's own order otherwise).
        ``split_windows``: the order groups the windowed layers last and a fetch reads their K/V
        only where a continuation reads it; otherwise every block is one value of every layer."""
        self.spec = spec
        self.options = options
        self.storage_dtype = storage_dtype
        """The K/V element type in the store; part of every namespace."""
        self.store = store
        self.layer_order = layer_order
        windows = spec.windows if split_windows else LayerWindows()
        self.geometry = KVGeometry(spec.num_layers, spec.num_kv_heads, spec.head_size, storage_dtype,
                                   windows.window, len(windows.layers))
        self.prefix = PrefixStore(store, self.geometry, cache_stats)
        self.cross = cross = CrossStore(store, cache_stats, options.max_value_bytes, storage_dtype)
        self.writes = PublishQueue(options.store_write_threads, options.max_pending_publishes,
                                   options.max_pending_publish_bytes, cache_stats)
        self.deletions = Deletions(store, self.writes)
        leases = options.leases
        self.waits = RunWaits(leases.poll_ms, store.notices if leases.enabled else None, store.stall_budget)
        self.encodes = EncoderRuns()
        # What crosses the wire is the storage dtype's K/V, not the model's, and of windowed layers
        # only a window's worth, which the estimate leaves out (``FetchPolicy.token_bytes``).
        full_layers = spec.num_layers - self.geometry.window_layers
        fetch_policy = FetchPolicy(options.prefix_fetch, on_device, pace, StoreRate(),
                                   spec.kv_bytes_per_token(storage_dtype.itemsize, full_layers), options.block_size)
        self.scheduler_side = KVConnectorScheduler(
            self.prefix, cross, (spec.num_layers, cross_heads, spec.head_size), store, cache_stats, leases,
            options.chunk_tokens, pace, self.waits, self.writes, fetch_policy, self.encodes)
        self.worker_side = KVConnectorWorker(
            self.prefix, cross, store, cache_stats, storage_dtype, spec.kv_bytes_per_token(model_kv_dtype.itemsize),
            self.writes, self.deletions, self.encodes)

    @property
    def _layout(self) -> str:
        """The canonical layout, with the layer order when it is not the model's, and how a
        block's layers are split when windowed ones are apart: the values under the keys differ."""
        g, layout = self.geometry, CANONICAL_LAYOUT
        if self.layer_order != tuple(range(self.spec.num_layers)):
            layout += ";layers=" + ",".join(map(str, self.layer_order))
        if g.window_layers:
            layout += f";windowed={g.window}x{g.window_layers}"
        return layout

    def namespace(self, salt: str, encoder_input: BlockHash | None = None, tenant: str = "") -> Namespace:
        """Everything this worker's prefix K/V depends on besides the tokens (docs/design.md, invariant 2):
        for an encoder-decoder model also the encoder input, whose cross-attention feeds every
        decoder layer, so the same decoder prompt under another encoder input never hits. Keyed by
        the fleet's namespace secret when one is configured."""
        return Namespace(
            model_fingerprint=self.spec.fingerprint,
            block_size=self.options.block_size,
            dtype=self.storage_dtype.name,
            layout=self._layout,
            salt=salt,
            tenant=tenant,
            extra=encoder_input.hex() if encoder_input else "",
            numerics=self.options.numerics,
            secret=self.options.namespace_secret,
        )

    def encoder_input_hash(self, salt: str, array: np.ndarray, tenant: str = "") -> BlockHash:
        """Names an encoder input (and so its cross K/V) under the model, dtype, layout, tenant and salt."""
        return encoder_input_hash(replace(self.namespace(salt, tenant=tenant), block_size=0), array)

    def states(self, cache: CacheControl, tenant: str, encoder_input: np.ndarray | None, rows: int) -> list[SequenceKV]:
        """The connector's state of each of a request's ``rows`` (its samples or beams): one
        namespace, each row its own lookup, leases and publishes."""
        if not self.options.shares:
            cache = replace(cache, skip_read=True, skip_write=True)
        input_hash = None if encoder_input is None else self.encoder_input_hash(cache.salt, encoder_input, tenant)
        namespace = self.namespace(cache.salt, input_hash, tenant)
        return [SequenceKV(namespace, cache, input_hash) for _ in range(rows)]

    async def drained(self) -> None:
        """Returns once every publish scheduled so far has reached the store (or failed)."""
        await self.writes.drained()

    def close(self) -> None:
        """Ends the encoder runs, finishes the writes, then closes the store (after the waits and
        the scheduler have stopped)."""
        self.encodes.close()
        self.writes.close()
        self.store.close()
