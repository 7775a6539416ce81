"""What a server's grpc.health.v1 service answers, from the reasons it holds against being used.

A reason is a short phrase ("the model is loading", "cache store redis does not answer") that
whoever notices it holds and releases; the answers follow at once and each change is logged (INFO:
whoever holds a reason for a fault says what went wrong). Two names are answered, as the Helm
chart probes them:

- the server's own service (``ready_service``: the worker's ``kvshare.v1.Generator``), which
  readiness probes and ``kvshare route`` ask: SERVING exactly when no reason holds;
- the whole server (``""``), which liveness and startup probes and the HTTP ``/health`` ask:
  SERVING exactly when no *server-wide* reason holds. A reason is server-wide when nothing can be
  answered while it holds (the model is loading). One that only makes the server a poor choice
  (its cache store down, under ``--cache-required``) leaves ``""`` SERVING, so that a liveness
  probe never restarts a fleet for a fault outside it.

Once graceful shutdown began (``HealthServicer.enter_graceful_shutdown``) both stay NOT_SERVING:
the servicer ignores later updates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from grpc_health.v1 import health, health_pb2

log = logging.getLogger(__name__)

_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Readiness:
    """The reasons held, and the health answers they make. Used from the event loop only."""

    def __init__(self, health_servicer: health.aio.HealthServicer, ready_service: str) -> None:
        self._health = health_servicer
        self.ready_service = ready_service
        self._reasons: dict[str, bool] = {}  # reason -> server-wide
        # One publication at a time: each reads the reasons as they are when it sets the answers,
        # so that an older one never lands after a newer one.
        self._publishing = asyncio.Lock()

    @property
    def reasons(self) -> tuple[str, ...]:
        """The reasons held now, oldest first (empty: both names SERVING)."""
        return tuple(self._reasons)

    async def hold(self, reason: str, *, server_wide: bool = False) -> None:
        """Answers NOT_SERVING for ``ready_service`` (and ``""`` too when ``server_wide``) until
        ``release(reason)``. Holding a reason already held changes nothing."""
        if reason in self._reasons:
            return
        self._reasons[reason] = server_wide
        log.info("health: %s NOT_SERVING: %s", "the server" if server_wide else self.ready_service, reason)
        await self._publish()

    async def release(self, reason: str) -> None:
        """Ends ``reason``; SERVING again once no other reason holds. Releasing one not held changes nothing."""
        if self._reasons.pop(reason, None) is None:
            return
        log.info("health: over: %s; %s", reason,
                 f"still NOT_SERVING: {'; '.join(self._reasons)}" if self._reasons else "SERVING")
        await self._publish()

    async def _publish(self) -> None:
        async with self._publishing:
            whole = not any(self._reasons.values())
            await self._health.set("", _SERVING if whole else _NOT_SERVING)
            await self._health.set(self.ready_service, _NOT_SERVING if self._reasons else _SERVING)


async def watch_reachable(probe: Callable[[], object], readiness: Readiness, reason: str, period_s: float,
                          failures: int) -> asyncio.Task:
    """Holds ``reason`` now (nothing is known yet) and returns the task that keeps it true: released
    at the first call of ``probe`` that returns, held again once ``failures`` calls in a row
    raised. ``probe`` runs on a thread, since it may block (its own timeouts bound it), one call
    at a time, ``period_s`` seconds from the end of one to the start of the next. Cancel the task
    to stop watching; ``reason`` then stays as it was."""
    await readiness.hold(reason)
    return asyncio.create_task(_watch(probe, readiness, reason, period_s, failures), name=f"watch: {reason}")


async def _watch(probe: Callable[[], object], readiness: Readiness, reason: str, period_s: float,
                 failures: int) -> None:
    failed = 0
    while True:
        try:
            await asyncio.to_thread(probe)
        except Exception as exc:  # noqa: BLE001 - whatever the probe raises, it did not answer
            failed += 1
            if failed == max(failures, 1):  # once per outage: the count goes on past it
                log.warning("%s: %d checks in a row failed, the last with %s: %s", reason, failed,
                            type(exc).__name__, exc)
                await readiness.hold(reason)
        else:
            failed = 0
            await readiness.release(reason)
        await asyncio.sleep(period_s)
