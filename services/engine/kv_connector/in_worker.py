"""Prefix reuse decided per step on the scheduler thread (lock held): copying a prompt's K/V from
another row of this worker (in-worker single-flight), and whether a row on a ``Trail`` waits for
the holder's next blocks before computing its next chunk. Both only plan: the copies run in the
step (``StepPlan.share``, ``StepPlan.adopt``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from services.engine.sequence import Phase, Sequence
from services.engine.step_plan import SchedulerStats, StepPlan

TRAIL_MISSES = 2
"""Waits in a row that bring less than a chunk in time before a ``Trail`` ends (the holder is
gone or behind)."""


def common_blocks(a: list, b: list) -> int:
    """How many leading block hashes two prompts share (chained hashes: equal up to there)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def plan_share(seq: Sequence, active: list[Sequence], plan: StepPlan, stats: SchedulerStats) -> int | None:
    """In-worker single-flight: when another row of ``active`` (the rows holding a slot, in
    admission order) shares full prompt blocks with ``seq`` beyond what ``seq`` holds, ``seq``
    copies what that row holds of them (planned in ``plan.share``) and, while that row is still
    fetching or computing the rest, sits this step out instead of computing the same tokens.
    Returns the prompt tokens ``seq`` holds once this step's copies are done, or None: it sits
    this step out.

    The rows waited for are the row holding the fleet's lease on the prompt (it waits for
    nobody), rows admitted earlier, which come first for the prefill budget, and rows waiting
    in the store for another worker's blocks, whose wait depends on no row (and is bounded:
    ``run_waits``). So a sequence never waits longer than computing would take it, and waits
    never form a cycle."""
    kv = seq.kv
    if seq.prompt_logprobs is not None or kv.cache.skip_read or kv.lookup is None:
        return seq.prefilled  # prompt log-probabilities need every position computed; skip_read means cold
    size = kv.namespace.block_size
    holder = kv.lease is not None  # copies what is there, never waits: the others wait for it
    earlier = True
    for row in active:
        if row is seq:
            earlier = False
            continue
        other = row.kv
        if other.lookup is None or row.phase not in (Phase.FETCHING, Phase.PREFILLING, Phase.DECODING):
            continue
        shared = min(common_blocks(kv.lookup.hashes, other.lookup.hashes) * size, len(seq.prompt) - 1)
        if shared < other.window_floor:  # its windowed layers lack positions a copy would read
            continue
        # Any row's K/V may be copied; a later row is waited for only if it holds the lease or
        # fetches (and then only for what it fetched, never for what it computes).
        waitable = earlier or other.lease is not None or other.awaiting
        if not earlier and other.lease is None and other.awaiting and row.phase is not Phase.FETCHING:
            shared = min(shared, other.lookup.hit_blocks * size)
        if shared <= seq.prefilled:
            continue
        held = 0
        if row.assembled and row.phase is not Phase.FETCHING:
            held = min(shared, row.slot.length)
        elif row in plan.assemble:  # its cached blocks go into its slot before the copies
            held = min(shared, row.prefilled)
        if held > seq.prefilled:
            plan.share.append((seq, row, held))
            return held if held == shared or holder or row.phase is Phase.DECODING else None
        if row.phase is Phase.DECODING or holder or not waitable:
            continue
        stats.shared_waits += 1
        return None
    return seq.prefilled


def looked(seq: Sequence, plan: StepPlan, look_ahead: Callable[[], Future], wake: Callable[[], None]) -> bool:
    """Whether a row on a ``Trail`` may compute its next chunk this step: once a wait for the
    holder's blocks since its last chunk brought less than a chunk in time. Otherwise it starts
    that wait (``look_ahead``; ``wake`` is called when it ends), or sits out while it runs; what
    came goes into its slot (``plan.adopt``) first, and a wait that kept up is followed by
    another."""
    kv = seq.kv
    trail = kv.trail
    if trail.looked:
        return True
    if trail.look is None:
        trail.look = look_ahead()
        trail.look.add_done_callback(lambda _: wake())  # inline when done already
    if trail.look.done():
        ahead = trail.look.result() if trail.look.exception() is None else None
    elif time.monotonic() < trail.give_up_at:
        return False
    else:  # the store holds the wait's polls up: compute rather than wait on it
        ahead = None
    trail.look = None
    trail.delivered = trail.delivered or ahead is not None
    # A row that moved since the wait began (it copied from another row) holds what came.
    adopting = ahead is not None and ahead.start == seq.prefilled
    if adopting:
        plan.adopt.append((seq, ahead))
        if ahead.kept_up:
            trail.misses = 0
            return False
    trail.looked = True
    trail.misses += 1
    if trail.misses >= TRAIL_MISSES:
        kv.trail = None
    return not adopting
