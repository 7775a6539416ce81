"""Domain errors raised by the engine; the gRPC servicer maps each to one status code."""

from __future__ import annotations


class KVShareError(Exception):
    """Base of the errors kvshare raises on purpose."""


class ModelLoadError(KVShareError):
    """The model folder cannot be served (missing file, malformed genai_config.json, bad graph)."""


class InvalidRequest(KVShareError):
    """A request field is malformed. ``field`` names it as the client wrote it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class RequestOutOfRange(InvalidRequest):
    """A request asks for more than the model can hold (prompt + new tokens past the context)."""


class FailedPrecondition(KVShareError):
    """The request is well-formed but the served model cannot take it (messages for a model folder
    without a chat template)."""


class Unauthenticated(KVShareError):
    """The call carries no API key the worker knows (API keys are configured)."""


class Overloaded(KVShareError):
    """The worker cannot take the request now (every slot busy and the queue full, or shutting
    down); the message says what was full. Decided at once, before any work is done."""


class Unavailable(KVShareError):
    """The worker can no longer serve (its scheduler thread stopped on a bug): what was in flight is
    failed with this, the worker reports NOT_SERVING and exits; another replica can serve it."""


class WorkerDied(KVShareError):
    """The worker stopped serving on a fault of its own (its scheduler thread died): it exits
    non-zero so that its orchestrator restarts it."""


class NumericalError(KVShareError):
    """The model produced NaN or infinite logits for a request whose K/V was all computed by this
    worker (cached K/V under suspicion is dropped and recomputed instead): a fault of the model or
    the runtime, not of the client."""


class StartupError(KVShareError):
    """The worker cannot start as configured (its address is taken, a setting is unusable)."""
