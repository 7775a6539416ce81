"""What one scheduler step does, as data: the plan ``Scheduler.schedule()`` decides and the
``ModelRunner`` carries out, and the counters of the steps run so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.kv_connector.state import Ahead
from services.engine.sequence import Sequence


@dataclass(slots=True)
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    """(sequence, prompt tokens to run this step), in admission order."""
    assemble: list[Sequence] = field(default_factory=list)
    """Sequences whose fetch ended: their cached blocks go into their slots first thing, so that
    rows waiting for those blocks can copy them whether or not a chunk of theirs runs."""
    share: list[tuple[Sequence, Sequence, int]] = field(default_factory=list)
    """(sequence, row, tokens): the sequence's prompt up to ``tokens`` is copied from the other
    row, which holds it, before the step's model runs."""
    adopt: list[tuple[Sequence, Ahead]] = field(default_factory=list)
    """Blocks another worker published since the sequence stopped waiting for them (``Trail``):
    they go into its slot after what it holds."""

    completing: list[Sequence] = field(default_factory=list)
    """Sequences a stop string ended: their answers are published and their slots freed before
    the step runs, outside the scheduler's lock (``Lifecycle.complete``)."""

    @property
    def runs(self) -> bool:
        """Whether the runner has anything to do."""
        return bool(self.decode or self.prefill or self.share or self.assemble or self.adopt)

    @property
    def empty(self) -> bool:
        return not self.runs and not self.completing


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start (tokens, runs, sequences); read by tests, benchmarks and metrics."""

    admitted: int = 0
    rejected: int = 0
    """Requests refused at the door (``Overloaded``): the worker full, or the client over its share."""
    client_rejected: int = 0
    """Of ``rejected``, those refused because their client held its share (``--max-client-rows``)."""
    pushed_out: int = 0
    """Queued requests refused to make room for a client holding fewer rows in a full worker."""
    yielded: int = 0
    """Paused streams ended to give their slots to another client's waiting request."""
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    """Sum over decode steps of the sequences advanced: decode_rows / decode_steps is the mean batch."""
    max_decode_rows: int = 0
    prefill_runs: int = 0
    prefill_tokens: int = 0
    """Prompt tokens computed (not served from the store or copied from another row)."""
    shared_tokens: int = 0
    """Prompt tokens copied from another row of this worker that computed (or fetched) the same
    prefix, instead of being computed again (in-worker single-flight)."""
    shared_waits: int = 0
    """Steps a prefilling sequence sat out because another row was about to hold its prefix."""
    recomputed_answer_tokens: int = 0
    """Decoded tokens computed again as prompt before their publish (``ModelRunner._save_answer``)."""
    adopted_tokens: int = 0
    """Prompt tokens taken from blocks another worker published after this one stopped waiting
    for them (``Trail``), instead of being computed twice."""
