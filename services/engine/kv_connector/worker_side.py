"""The KV connector's worker side: moves K/V between the store and the runner's slots.

Called by the ``ModelRunner`` on the scheduler thread with its slot bank (as vLLM's runner hands
its KV caches to its connector): blocks a lookup found, another row holds or another worker
published go into a slot; blocks a prompt chunk or an answer completed are copied out of it at
once (the slot goes to the next sequence as soon as this one ends: publishing from the live
buffer could put another request's K/V under this prompt's keys) and published on the write
threads (``PublishQueue``), off the token path.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import numpy as np

from cachestore.codec import RejectReason
from cachestore.cross import CrossStore
from cachestore.keys import (
    block_hashes,
    block_key,
    cross_key,
    lease_key,
    window_block_key,
)
from cachestore.prefix import PrefixLookup, PrefixStore
from cachestore.ratelimit import RateLimitedLog
from cachestore.stats import CacheStats
from cachestore.store import KVStore
from services.engine.kv_connector.deletions import Deletions
from services.engine.kv_connector.encoder_runs import Encode, EncoderRuns
from services.engine.kv_connector.publish_queue import PublishQueue, after
from services.engine.kv_connector.scheduler_side import release_leases
from services.engine.kv_connector.state import Ahead
from services.engine.run_waits import MIN_PACE_TOKENS
from services.engine.sequence import Sequence
from services.runtime.kv_cast import converted
from services.runtime.slots import SlotBank

log = logging.getLogger(__name__)
# One line per 10 s however many poisoned prompts arrive; each is counted as bad_output.
_distrusted = RateLimitedLog(log)


class KVConnectorWorker:
    """Block copies into and out of slots, and the publishes they feed (scheduler thread)."""

    def __init__(self, prefix: PrefixStore, cross: CrossStore, store: KVStore, cache_stats: CacheStats,
                 storage_dtype: np.dtype, kv_bytes_per_token: int, writes: PublishQueue, deletions: Deletions,
                 encodes: EncoderRuns) -> None:
        self.prefix = prefix
        self.cross = cross
        self.store = store
        self.cache_stats = cache_stats
        self.storage_dtype = storage_dtype
        self._kv_bytes_per_token = kv_bytes_per_token
        """Bytes of one token's K/V in the slots (the model's own dtype): what a copy holds."""
        self.writes = writes
        self.deletions = deletions
        self.encodes = encodes
        self._published: weakref.WeakSet[Future] = weakref.WeakSet()
        """Encoder runs whose cross K/V was published (scheduler thread): gone with their requests."""

    def load(self, seq: Sequence, slots: SlotBank) -> None:
        """Copies the cached blocks the fetch kept (all, or block 0: see ``SlotBank.receiver``)
        into the sequence's slot and, for encoder-decoder models, its cross K/V: from the store,
        or, on a miss, from the encoder's run, which has ended (``SequenceKV.encoding``): its
        error fails this request here, its cross K/V is published unless the request skips
        writing."""
        t = time.perf_counter()
        kv = seq.kv
        cross = kv.cross_kv
        if kv.encoding is not None:
            cross = kv.encoding.result()
            # A run several requests shared (EncoderRuns) is published once, by the first loaded.
            if not kv.cache.skip_write and kv.encoding not in self._published:
                self._published.add(kv.encoding)
                input_hash, computed = kv.encoder_hash, cross

                def store_cross() -> None:
                    self.cross.put(input_hash, converted(computed, self.storage_dtype))

                self.writes.bounded(cross.nbytes, lambda: store_cross)
        slots.begin(seq.slot, kv.lookup.blocks, seq.prefilled, cross, kv.lookup.windows)
        # The fetched values are in the slot now; do not hold them for the whole decode.
        kv.lookup.release()
        kv.cross_kv = kv.encoding = None
        seq.timings.cache_fetch_ms += (time.perf_counter() - t) * 1e3

    def encode(self, seq: Sequence, encode: Encode) -> Future:
        """Computes the sequence's cross K/V again on the encoder thread (its cross K/V was dropped
        by ``distrust``); returns the run, which ``load`` takes once it is done."""
        return self.encodes.start(seq, encode)

    def share(self, seq: Sequence, row: Sequence, tokens: int, slots: SlotBank, began: float) -> int:
        """Copies ``row``'s first ``tokens`` tokens into ``seq``'s slot (both hold the same prompt
        up to there): tokens neither computed nor fetched again, counted as cached. Returns how
        many tokens came."""
        slots.share(row.slot, seq.slot, tokens)
        seq.kv.window_floor = max(seq.kv.window_floor, row.kv.window_floor)
        # The row (or the store) has those blocks published; or the row's windowed layers hold
        # K/V only over its last window (it fetched them so), and the copy carries what its row
        # held before that: this row would store it as this prompt's K/V. Never published, then.
        if row.kv.publishes_prompt or row.kv.window_floor:
            seq.kv.published_blocks = max(seq.kv.published_blocks, tokens // seq.kv.namespace.block_size)
        return self._copied(seq, tokens, began)

    def adopt(self, seq: Sequence, ahead: Ahead, slots: SlotBank) -> int:
        """Puts blocks that another worker published (``Trail``) after the sequence's tokens:
        neither computed nor fetched again by anyone, counted as cached. Only where the wait
        began: blocks are positions. Returns how many tokens came."""
        if seq.done or ahead.start != seq.prefilled or ahead.tokens <= seq.prefilled:
            return 0
        t = time.perf_counter()
        slots.append(seq.slot, ahead.blocks, ahead.tokens, ahead.windows)
        kv = seq.kv
        size = kv.namespace.block_size
        window_from = min((i for i, _ in ahead.windows), default=0)
        if window_from * size > ahead.start:  # the row's windowed layers now skip the positions between
            kv.window_floor = max(kv.window_floor, self.prefix.geometry.window_floor(window_from, size))
        kv.published_blocks = max(kv.published_blocks, ahead.start // kv.namespace.block_size + len(ahead.blocks))
        return self._copied(seq, ahead.tokens, t)

    @staticmethod
    def _copied(seq: Sequence, tokens: int, began: float) -> int:
        """Books the prompt tokens up to ``tokens`` that were just copied into ``seq``'s slot from
        elsewhere (another row, another worker's blocks) as cached, the copy's time (since
        ``began``, perf_counter) as fetching; returns how many tokens that was."""
        copied = tokens - seq.prefilled
        seq.prefilled = tokens
        seq.usage.cached_prompt_tokens += copied
        seq.timings.cache_fetch_ms += (time.perf_counter() - began) * 1e3
        return copied

    def chunk_done(self, seq: Sequence, slots: SlotBank, tokens: int, run_ms: float, finite: bool) -> None:
        """After each prompt chunk of ``tokens`` tokens that took ``run_ms`` to run: a row on a
        ``Trail`` looks for the holder's blocks again before its next chunk, bounded by what this
        one cost; and when the chunk's logits are finite (K/V whose logits blew up is never
        published), the full blocks completed since the last publish (and not in the store) are
        copied out and published, so that workers waiting for this prompt's blocks fetch each
        chunk as soon as it is computed. After the last chunk the sequence's lease ends, once
        its blocks are stored."""
        trail = seq.kv.trail
        if trail is not None:
            trail.looked = False
            if tokens >= MIN_PACE_TOKENS:
                trail.ms_per_token = run_ms / tokens
        if finite:
            self._publish_prompt(seq, slots)

    def _publish_prompt(self, seq: Sequence, slots: SlotBank) -> None:
        kv = seq.kv
        hashes, first, size = kv.lookup.hashes, kv.published_blocks, kv.namespace.block_size
        last = min(len(hashes), seq.prefilled // size)
        lease, earlier = kv.lease, kv.publishing
        prompt_done = seq.prefilled == len(seq.prompt)
        if not kv.publishes_prompt or last <= first:
            if prompt_done:
                release_leases([seq], self.writes)
            return
        if prompt_done:
            kv.lease = None

        def publish(blocks: np.ndarray) -> None:
            # Chunks reach the store in order, each after the lease on the block that follows it,
            # and the leases end after the last chunk: a worker arriving mid-prompt finds its first
            # missing block leased, and a waiter never finds a gap or the lease gone too early.
            after(earlier)
            if lease is not None and last < len(hashes):
                lease.extend(lease_key(hashes[last]))
            self.prefix.publish(hashes[:last], blocks, first, size)
            if lease is not None and prompt_done:
                lease.end()
            elif lease is not None:  # waiters elsewhere look now (``run_waits``)
                lease.announce()

        kv.published_blocks = last
        published = self._publish_blocks(seq, slots, first, last, publish)
        if published is not None:
            kv.publishing = published
        elif prompt_done and lease is not None:  # dropped: the leases end after the earlier chunks
            kv.lease = lease
            release_leases([seq], self.writes)

    def save_answer(self, seq: Sequence, slots: SlotBank) -> None:
        """When a sequence ended by EOS, a stop token or string, or its length, before its slot is
        freed: the full blocks of prompt + answer that the prompt's own publish did not cover are
        copied out and published, so a chat's next turn (which sends this answer back) finds them
        on any replica. The last token's K/V was never computed (it was not fed), so the blocks
        stop before it. Beams are not published: their rows were reordered along the search.

        A model whose matmuls round activations to 8 bits needs its answer's positions computed
        again as prompt first (``ModelRunner``, ``answer_end``): a decode step computes one row where a
        prefill computes many, and float differences at rounding level between the two move whole
        quantization steps of the next activations there. SmolLM2 (gguf) served turn 2 over turn
        1's decoded blocks with logits up to 0.98 from computing it (a greedy token changed at a
        0.04 margin), over prefilled blocks identically."""
        end = self.answer_end(seq)
        if end is None:
            return
        kv, size = seq.kv, seq.kv.namespace.block_size
        first, last = len(seq.prompt) // size, end // size
        tokens, namespace = [*seq.prompt, *seq.tokens][:end], kv.namespace
        # Hashing the whole chain is the write thread's work; only the copy must happen now.
        self._publish_blocks(seq, slots, first, last,
                             lambda blocks: self.prefix.publish(block_hashes(namespace, tokens), blocks, first, size))

    def answer_end(self, seq: Sequence) -> int | None:
        """Where the blocks ``save_answer`` publishes for ``seq`` end (a position past its prompt's
        last full block), or None when it publishes none."""
        kv = seq.kv
        if kv.cache.skip_write or (seq.group is not None and seq.group.beams is not None):
            return None
        size = kv.namespace.block_size
        last = seq.slot.length // size
        return last * size if last > len(seq.prompt) // size else None

    def _publish_blocks(self, seq: Sequence, slots: SlotBank, first: int, last: int,
                        publish: Callable[[np.ndarray], object]) -> Future | None:
        """Copies blocks ``first .. last`` of the sequence's slot now and hands them, narrowed to
        the storage dtype on a write thread, to ``publish``, unless the pending publishes have no
        room for them: then nothing is copied (``PublishQueue.bounded``) and None is returned."""
        size = seq.kv.namespace.block_size
        nbytes = (last - first) * size * self._kv_bytes_per_token

        def prepare() -> Callable[[], object]:
            # The copy starts now (the slot is reused once the sequence ends); the write thread
            # waits for it to land in host memory, then narrows and publishes.
            blocks = slots.canonical(seq.slot, first * size, last * size)
            return lambda: publish(converted(blocks.result(), self.storage_dtype))

        return self.writes.bounded(nbytes, prepare)

    def distrust(self, seq: Sequence) -> bool:
        """When the first token's logits are NaN or infinite. Values that pass the codec's checks
        can still be forged; if any of this request's K/V came from the store or from another
        row, the values it read and the blocks it published over them are deleted (off the token
        path, after its publishes in flight, never dropped: ``Deletions``), counted as
        ``bad_output``, and the request computes its whole prompt (and its cross K/V:
        ``encode``), reading and publishing nothing: the next request publishes afresh. Returns
        False when nothing came from elsewhere (the model itself failed)."""
        kv = seq.kv
        cached, cross = seq.usage.cached_prompt_tokens, seq.usage.encoder_cache_hit
        if not cached and not cross:
            return False
        hashes = kv.lookup.hashes[: max(kv.lookup.hit_blocks, kv.published_blocks)]
        keys = [block_key(h) for h in hashes]
        if self.prefix.geometry.window_layers:
            keys += [window_block_key(h) for h in hashes]
        if cross:
            keys.append(cross_key(kv.encoder_hash))
        self.cache_stats.count("rejected_values", RejectReason.BAD_OUTPUT)
        _distrusted.warning("request %s: NaN or infinite logits over %d cached prompt tokens; deleting %d values and "
                            "computing the prompt again", seq.request_id, cached, len(keys))
        self.deletions.add(keys, kv.publishing)
        release_leases([seq], self.writes)
        kv.lookup = PrefixLookup(hashes=kv.lookup.hashes, blocks=[])
        kv.trail = None
        kv.window_floor = 0
        seq.prefilled = seq.usage.cached_prompt_tokens = kv.published_blocks = 0
        seq.usage.encoder_cache_hit = False
        kv.cross_kv = kv.encoding = None
        kv.cache = replace(kv.cache, skip_read=True, skip_write=True)
        return True
