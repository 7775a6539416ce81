"""The Generator service, registered before the model is loaded.

A worker binds its ports first, so that a port in use is refused at once rather than after a model
load of seconds to minutes; but grpc.aio takes a server's handlers only before ``start``. So the
server is started with this stand-in, which refuses every call UNAVAILABLE ("the model is
loading": a client may retry, as for any server not up yet) until ``ready`` hands it the
GeneratorServicer; from then on every call is that servicer's.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from services.api.method_handlers import SERVICE
from services.api.servicer import GeneratorServicer

LOADING = "the model is loading"


class LateServicer:
    """What ``add_generator_to_server`` registers in place of a GeneratorServicer. ``admit`` and
    ``size_check`` work from the start; every other attribute of a GeneratorServicer (its methods,
    the handlers' other hooks) is a function that calls the servicer's own when called, whatever
    it takes and returns (a coroutine, an async generator), adding no layer to a stream.

    Invariant: the handlers call ``admit`` before anything else of a call, and ``admit`` lets
    nothing in before ``ready``, so those functions always find the servicer set."""

    def __init__(self) -> None:
        self._servicer: GeneratorServicer | None = None
        self._size_checks: dict[str, Callable[[int], str | None]] = {}

    def ready(self, servicer: GeneratorServicer) -> None:
        """Every call from now on is ``servicer``'s (its size checks included)."""
        self._size_checks = {m.name: check for m in SERVICE.methods if (check := servicer.size_check(m.name))}
        self._servicer = servicer

    async def admit(self, context: grpc.aio.ServicerContext) -> None:
        if self._servicer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{LOADING}: try again once the health service "
                                                             "reports SERVING")
        await self._servicer.admit(context)

    def size_check(self, method: str) -> Callable[[int], str | None]:
        """The servicer's bound on ``method``'s request bytes once ready; before, none (the call is
        refused unread or, where the handlers parse first, after parsing, which the message size
        limit bounds)."""

        def check(size: int) -> str | None:
            bound = self._size_checks.get(method)
            return None if bound is None else bound(size)

        return check

    def __getattr__(self, name: str) -> Callable:
        # Reached only for what this class lacks. The handlers look the servicer's methods up once,
        # when registered, before there is a servicer: each is bound to it when called.
        if name.startswith("_") or not callable(getattr(GeneratorServicer, name, None)):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

        def late(*args, **kwargs):
            return getattr(self._servicer, name)(*args, **kwargs)

        return late
