"""How a worker's scheduler admits, plans and paces: ``SchedulerOptions``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerOptions:
    max_batch: int = 0
    """Sequences holding a slot at once (fetching, prefilling or decoding): the decode batch's most
    rows. 0 lets the engine derive it from its K/V memory budget."""
    max_queued: int = 128
    """Admitted sequences waiting for a slot; one more is refused with ``Overloaded`` at once."""
    max_prefill_tokens_per_step: int = 256
    """Prompt tokens prefilled per step, across all prefilling sequences (bounds the gap between
    the tokens of the streams already decoding)."""
    max_unread_tokens: int = 256
    """A sequence whose consumer has this many tokens still to read sits out decode steps."""
    max_paused_s: float = 30.0
    """A sequence paused this long (its client stopped reading) is ended with ``Overloaded``,
    freeing its slot."""
    max_unread_bytes: int = 64 * 1024
    """A sequence whose unread tokens' messages would take about this many bytes pauses too
    (``output_processor.unread_limit``: log-probabilities make a token up to ~50x larger)."""
    max_client_rows: int = 0
    """Rows one client may hold (being prepared, queued or in a slot); 0: no fixed bound, only the
    fair shares kept when clients contend (``fair_share``)."""
    yield_paused_s: float = 2.0
    """While another client waits for a slot, a stream paused this long whose client holds more
    than its fair part of the slots is ended with ``Overloaded``, freeing its slot."""
    stream_interval: int = 1
    """Tokens a stream's consumer is woken for at once: 1 hands over each token as it is made; N
    hands over every N tokens (the first, the last and one held ``lifecycle.MAX_HOLD_S`` at once;
    every token of a request with stop strings), so a stream takes fewer, larger messages and its
    worker fewer wake-ups per token (vLLM's ``--stream-interval``)."""
