"""What an ``Engine`` is built with: its options, and the slot count derived from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from cachestore.storage_dtype import DEFAULT as DEFAULT_CACHE_DTYPE
from services.engine.kv_connector.fetch_policy import PrefixFetch
from services.engine.run_waits import LeaseOptions
from services.engine.scheduler import SchedulerOptions

MAX_DERIVED_BATCH = 64


@dataclass(frozen=True, slots=True)
class EngineOptions:
    max_new_tokens_cap: int = 4096
    block_size: int = 64
    """Tokens per shared cache block."""
    cache_dtype: str = DEFAULT_CACHE_DTYPE
    """Element type of K/V in the store (``cachestore.storage_dtype``): auto (float32 for a model
    that quantizes its activations, else float16), float32, float16 or bfloat16."""
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    """Batch, queue, prefill budget and back-pressure; ``max_batch`` 0 is derived from ``kv_cache_bytes``."""
    kv_cache_bytes: int = 0
    """K/V memory budget of the slots when ``scheduler.max_batch`` is 0 (bytes); 0 takes the
    device's default (``device_arrays``: 2 GiB on the host, a share of free memory on CUDA)."""
    store_read_threads: int = 4
    """Concurrent store lookups; never shared with publishes."""
    store_write_threads: int = 2
    """Concurrent publishes."""
    max_pending_publishes: int = 16
    """Publishes waiting for the store beyond this are dropped (counted), bounding memory."""
    max_pending_publish_bytes: int = 512 * 1024 * 1024
    """K/V bytes the waiting publishes may hold; beyond, a publish is dropped (counted) uncopied."""
    max_value_bytes: int = 128 * 1024 * 1024
    """Cross-attention values larger than this are not stored (Redis caps a value at 512 MiB)."""
    namespace_secret: bytes = field(default=b"", repr=False)
    """Keys every block and cross-attention key (``Namespace.secret``); the same on every worker."""
    max_prompt_bytes: int = 0
    """UTF-8 bytes of a prompt's text (prompt, messages, encoder prompt, Tokenize text); 0 derives
    the most that can fit the context (``request_limits.derived_prompt_bytes``)."""
    max_stop_strings: int = 64
    """Stop strings per request."""
    max_stop_string_bytes: int = 256
    """UTF-8 bytes of one stop string."""
    max_answer_bytes: int = 32 * 1024 * 1024
    """The largest message the faces send (``--max-message-bytes``): a Tokenize call whose answer
    could be larger is refused before any work."""
    tokenizer_threads: int = 2
    """Threads that render chat templates, tokenize and build stop automata, off the event loop."""
    audio_threads: int = 1
    """Threads that decode requests' audio (WAV, resampling, log-mel), apart from the tokenizer's."""
    max_audio_requests: int = 8
    """Requests with audio from the door until prepared (their bodies read, their audio decoded or
    waiting for an audio thread); one more is refused (RESOURCE_EXHAUSTED) at once, before its body
    is read. One client holds at most half of them."""
    max_tokenize_requests: int = 4
    """Tokenize calls in progress (from the door to their answer), on a thread of their own, so
    that they never queue ahead of a request's tokenizing; one more is refused (RESOURCE_EXHAUSTED)
    at once, before its body is read. One client holds at most half of them."""
    leases: LeaseOptions = field(default_factory=LeaseOptions)
    """Fleet-wide single-flight: leases on computing uncached blocks, and how long to wait for them."""
    window_fetch: bool = True
    """Models with sliding-window layers: a fetch reads their K/V only for a continuation's last
    window (``cachestore.prefix``). False keeps each block as one value of every layer, as for other
    models: what ``bench.gemma`` compares the windowed fetch with."""
    prefix_fetch: PrefixFetch = PrefixFetch.AUTO
    """``auto``: on a device, a prompt's cached run is computed instead of fetched when that is
    expected faster (``kv_connector.fetch_policy``); ``always``: always fetched."""


def derived_max_batch(kv_bytes_per_token: int, context_length: int, kv_cache_bytes: int) -> int:
    """Slots that fit ``kv_cache_bytes`` when each may hold a whole context (at least 1, at most
    ``MAX_DERIVED_BATCH``): a sequence admitted can always run to its end."""
    return max(1, min(MAX_DERIVED_BATCH, kv_cache_bytes // (kv_bytes_per_token * context_length)))
