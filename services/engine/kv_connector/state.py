"""What the KV connector keeps about one sequence: where its prompt's K/V comes from and goes to.

The scheduler, the runner and the output side never read these fields; they belong to the
connector (``services.engine.kv_connector``), which creates one ``SequenceKV`` per row. The read
threads write ``lookup``, ``cross_kv``, ``encoding`` and ``lease`` during the fetch, before the
row's first step; from then on the scheduler thread owns them (the waits' thread fills a
``Trail``'s look, and the encoder thread an ``encoding``, into a future of its own).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from cachestore.budget import StallBudget
from cachestore.keys import BlockHash, Namespace
from cachestore.prefix import PrefixLookup
from services.engine.generation import CacheControl
from services.engine.leases import HeldLeases


def cached_tokens(hit_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Prompt tokens served from cached blocks. At least the last prompt token always runs,
    since its logits start generation: when every block of the prompt is cached, the past holds
    all but the last token (docs/design.md, invariant 3)."""
    return min(hit_blocks * block_size, prompt_tokens - 1)


@dataclass(slots=True, eq=False)
class Trail:
    """A row whose wait for another worker's blocks ended before they all came (the holder looked
    stalled or slower than computing) computes them itself, one chunk at a time; before each
    further chunk it waits for the holder's blocks again, but only as long as computing that chunk
    takes it now (the cost of the chunk it just computed, under the load it shares). What comes
    it takes; when the whole chunk came in time it waits again, else it computes the next chunk.
    A holder that only looked slow, because the machine was busy, is followed again; one that is
    really behind costs a short wait per chunk and never sets the row's pace. Two waits in a row
    that bring less than a chunk end the trail. While the holder has published nothing, a look
    does not wait (``delivered``)."""

    key: str
    """The lease the row stopped waiting on, and its holder's token."""
    holder: bytes
    look: Future | None = None
    """The wait in flight: an ``Ahead``, or None when nothing came."""
    give_up_at: float = 0.0
    """time.monotonic() past which the row stops waiting for that wait (a store that hangs
    holds its polls up): twice its bound."""
    looked: bool = True
    """Whether a wait since the row's last chunk brought less than a chunk (it computes the next
    one). True at the start: the wait that just ended did, so the first chunk comes first."""
    misses: int = 0
    """Waits in a row that brought less than a chunk."""
    delivered: bool = True
    """Whether the holder has published any block this row waited for (in the wait that ended, or
    in a look since). While it has not, each look takes what the store holds at once and never
    waits: a holder that published nothing while this row waited for the whole run is behind
    it, and a forged or replayed lease's "holder" never will."""
    ms_per_token: float = 0.0
    """What the row's latest chunk of at least ``MIN_PACE_TOKENS`` cost (ms per prompt token):
    the next wait's bound. Not the worker's smoothed pace, which lags a machine that has just
    become busy."""


@dataclass(frozen=True, slots=True)
class Ahead:
    """What a ``Trail``'s wait brought: canonical blocks from prompt token ``start`` on (where the
    row stood when the wait began), the prompt tokens the row holds with them (capped as cached
    tokens are: the last prompt token always runs), and whether they came at least as fast as the
    row would have computed them, wait factor included."""

    start: int
    blocks: list[np.ndarray]
    tokens: int
    kept_up: bool
    windows: list[tuple[int, np.ndarray]]
    """With windowed layers: (block index, those layers' K/V) of the blocks a continuation after
    ``tokens`` reads (``PrefixStore.complete_windows``)."""


@dataclass(slots=True, eq=False)
class SequenceKV:
    """The connector's state of one row: its keys, what the store gave it, what it publishes."""

    namespace: Namespace
    cache: CacheControl
    """The request's store controls (skip reading, skip writing, salt)."""
    encoder_hash: BlockHash | None = None
    """Encoder-decoder models: the name of the encoder input, and so of its cross K/V."""
    lookup: PrefixLookup | None = None
    """The prompt's block hashes and the cached run found (set by the fetch)."""
    cross_kv: np.ndarray | None = None
    """Encoder-decoder models: cross K/V found in the store, until copied into the slot."""
    encoding: Future | None = None
    """Encoder-decoder models, on a cross K/V miss: the encoder's run on the encoder thread
    (``EncoderRuns``), until its cross K/V is copied into the slot and published. The row is not
    assembled before it is done."""
    published_blocks: int = 0
    """Prompt blocks in the store or on their way there (found, published, or held by the row
    they were copied from), or never to be published by this row (copied from a row whose
    windowed layers lack some of them: ``KVConnectorWorker.share``): each chunk publishes the
    full blocks past these."""
    awaiting: bool = False
    """Its fetch waits in the store for blocks another worker computes (``run_waits``); the
    worker's other rows that lack the same blocks wait for this row instead of the store."""
    publishing: Future | None = None
    """The sequence's latest publish of prompt blocks: the next one starts after it."""
    lease: HeldLeases | None = None
    """The leases this row holds on computing the prompt's uncached blocks, until its prompt is
    done (or it ends)."""
    trail: Trail | None = None
    """Set when its wait for another worker's blocks ended early (see ``Trail``)."""
    window_floor: int = 0
    """Models with windowed layers: the fewest prompt tokens another row may copy from this one.
    The windowed layers of a fetched run hold K/V only over its last window (the rest is never
    read by this row), so a copy of fewer tokens would give the copier positions it reads but
    this row never filled. 0: any."""
    store_budget: StallBudget | None = None
    """What the row's store calls may still wait on a store that does not answer (set by its
    fetch; ``cachestore.budget``): its fetch, its waits for another worker's blocks and its
    trail's looks all spend it, so a stalled store holds the row up once, not at each."""
    fetch_skipped: bool = False
    """Its prompt's cached run was expected faster to compute than to fetch (``fetch_policy``):
    it read, claimed and waited for none of it, and publishes none of its prompt. The store
    refuses a block it holds only once the block has crossed the wire (set-if-absent), so
    publishing a run the store holds costs what fetching it would have; a prompt the store lacks
    gets there with the fetches that still happen (``fetch_policy``'s probes, other workers)."""

    @property
    def publishes_prompt(self) -> bool:
        """Whether the prompt's blocks this row computes go to the store."""
        return not (self.cache.skip_write or self.fetch_skipped)
