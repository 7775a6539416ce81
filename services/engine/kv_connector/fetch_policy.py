"""Fetch or compute: whether a prompt's cached run of blocks is read from the store or computed here.

On the CPU provider fetching wins by far (measured here: 10-40x faster than computing the same
prefix for real models, ``docs/benchmarks.md``), so a worker there always fetches. On a device a
small model can prefill faster than a loopback Redis delivers its K/V (SmolLM2-135M moves 22.5 KiB
of float16 K/V per token); with ``--prefix-fetch auto`` such a worker weighs two running estimates
and skips the lookup when computing the run is expected to be faster:

- fetching (``StoreRate``, from this worker's own lookups): the time to a lookup's first block
  (hashing, the round trip, the first block's transfer and checks: the per-lookup latency term),
  plus the time per byte of the blocks after it;
- computing (``PrefillPace``, which the runner feeds after every prefill chunk of at least
  ``MIN_PACE_TOKENS``): ms per prompt token at the load the chunks ran under.

Rules, so that a guess never replaces a fetch that would have paid:

- no skip until each estimate has ``MIN_OBSERVATIONS`` observations (lookups that found at least
  two blocks; measured chunks);
- skip only when computing is expected at least ``FETCH_MARGIN`` times faster than fetching:
  computed tokens take the scheduler's prefill budget and device time from every decoding row,
  and the prompt is computed in chunks with decode steps between them, while a fetch runs on a
  read thread beside the steps; the margin also keeps noise in either estimate from deciding;
- the decision is made before the lookup, for the prompt's whole run of full blocks: a shorter
  run only favours computing more (the latency term weighs more, since a lookup's first block
  costs at least what each later one does), so a skip judged on the whole run is right for any
  run the store holds, and deciding without knowing costs only skips that did not happen;
- one in ``PROBE_EVERY`` decisions to skip fetches anyway, so the store's estimate follows the
  store (it is measured only by fetching) and a prompt the store lacks is published now and then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from services.engine.kv_connector.state import cached_tokens
from services.engine.run_waits import PrefillPace, running_mean

FETCH_MARGIN = 2.0
"""A fetch is skipped only when computing the run is expected this many times faster."""
MIN_OBSERVATIONS = 8
"""Observations each estimate needs before any fetch is skipped."""
PROBE_EVERY = 16
"""One in this many decisions to skip fetches anyway."""


class PrefixFetch(Enum):
    """``--prefix-fetch``: ``auto`` skips a fetch expected slower than computing (on a device only);
    ``always`` fetches every prompt's cached run."""

    AUTO = "auto"
    ALWAYS = "always"


@dataclass(slots=True)
class StoreRate:
    """How fast this worker's store delivers a cached run, as exponentially weighted means over its
    own lookups (the read threads observe, under a lock; any thread reads)."""

    first_block_ms: float = 0.0
    """From a lookup's start to its first block (ms): the cost of any fetch, however short."""
    first_observations: int = 0
    ms_per_byte: float = 0.0
    """Each further byte of the run, once the first block is there (ms per stored byte)."""
    byte_observations: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def observe(self, first_block_ms: float, further_bytes: int, further_ms: float) -> None:
        """One lookup that found at least one block: ``first_block_ms`` to its first, then
        ``further_ms`` for the ``further_bytes`` bytes of the blocks after it (0: none)."""
        with self._lock:
            self.first_block_ms = running_mean(self.first_block_ms, first_block_ms, self.first_observations)
            self.first_observations += 1
            if further_bytes > 0:
                self.ms_per_byte = running_mean(self.ms_per_byte, further_ms / further_bytes, self.byte_observations)
                self.byte_observations += 1

    @property
    def observations(self) -> int:
        """Lookups behind the whole estimate (both terms)."""
        return min(self.first_observations, self.byte_observations)

    def expected_ms(self, blocks: int, block_bytes: int) -> float:
        """Expected time to fetch a run of ``blocks`` blocks of ``block_bytes`` stored bytes each (ms)."""
        return self.first_block_ms + max(0, blocks - 1) * block_bytes * self.ms_per_byte


class LookupClock:
    """Times one lookup for ``StoreRate``: ``into`` wraps the receiver handed to
    ``PrefixStore.lookup`` (None: every block is kept, as ``lookup`` keeps them without one) and
    notes when the first block arrived."""

    def __init__(self, receiver: Callable[[int, np.ndarray, slice], bool] | None) -> None:
        self._receiver = receiver
        self.began = time.perf_counter()
        self.first: float | None = None
        """perf_counter() when the first block arrived (None: none yet)."""

    def into(self, i: int, block: np.ndarray, layers: slice) -> bool:
        if self.first is None:
            self.first = time.perf_counter()
        return True if self._receiver is None else self._receiver(i, block, layers)


@dataclass(slots=True, eq=False)
class FetchPolicy:
    """Whether a prompt's cached run is fetched (``fetches``), from the estimates it holds:
    ``pace`` (the runner's, shared) and ``store`` (fed by ``observe``). ``fetches`` runs on the
    read threads."""

    mode: PrefixFetch
    on_device: bool
    """Whether the decoder runs on a device (``DecoderSession.on_host`` False). On the CPU
    provider ``auto`` always fetches."""
    pace: PrefillPace
    store: StoreRate
    token_bytes: int
    """Stored K/V bytes of one token in the values a lookup reads (``ModelSpec.kv_bytes_per_token``
    of the storage dtype's itemsize; with windowed layers those of the other layers): what crosses
    the wire per cached token. A windowed group's values, read for one window whatever the run,
    are left out: a fixed cost the estimate's first-block term stands in for."""
    block_size: int
    margin: float = FETCH_MARGIN
    min_observations: int = MIN_OBSERVATIONS
    probe_every: int = PROBE_EVERY
    _skips: int = 0
    """Decisions to skip so far, probes included (under ``_lock``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    def fetches(self, prompt_tokens: int) -> bool:
        """Whether a prompt of ``prompt_tokens`` tokens reads its cached run from the store: always
        under ``always``, on the CPU provider, for a prompt without a full block, and until both
        estimates have ``min_observations``; otherwise unless computing the whole run of full
        blocks is expected ``margin`` times faster than fetching it (then one in
        ``probe_every`` such decisions fetches anyway)."""
        if self.mode is PrefixFetch.ALWAYS or not self.on_device:
            return True
        blocks = prompt_tokens // self.block_size
        tokens = cached_tokens(blocks, self.block_size, prompt_tokens)
        if tokens <= 0 or min(self.pace.observations, self.store.observations) < self.min_observations:
            return True
        if self.margin * self.pace.expected_ms(tokens) >= self.store.expected_ms(blocks, self.block_bytes):
            return True
        with self._lock:
            self._skips += 1
            return self._skips % self.probe_every == 0

    def observe(self, clock: LookupClock, hit_blocks: int) -> None:
        """After a lookup timed by ``clock`` found ``hit_blocks`` blocks (one that found none says
        nothing of delivery: nothing was delivered)."""
        if not hit_blocks or clock.first is None:
            return
        end = time.perf_counter()
        self.store.observe((clock.first - clock.began) * 1e3, (hit_blocks - 1) * self.block_bytes,
                           (end - clock.first) * 1e3)
