"""Registers the Generator service's methods so that a call is admitted before its body is read,
and a request that does not parse is answered INVALID_ARGUMENT.

Every method is registered as request-streaming, whatever the .proto says (on the wire a unary
request is a stream of one message): gRPC then hands the call over on its headers alone, and the
servicer's ``admit`` (the API key) and ``door`` (a full worker, a client over its share, every place
for audio or Tokenize taken) refuse it before one byte of its body is buffered or parsed. A unary
registration reads the whole message first: 20 refused calls of 22 MiB held 740 MB here. The body
is read only once admitted, within ``read_timeout_s`` of the call, so a call whose body never
comes holds its place no longer than that.

grpc's generated ``add_GeneratorServicer_to_server`` deserializes with ``FromString``; when that
raises (invalid UTF-8 in a string field, a truncated message, a wrong wire type) the client gets
UNKNOWN, "Exception deserializing request!", which reads like a server fault. Here the deserializer
never raises: it returns an ``Unparseable`` marker, and every method answers it INVALID_ARGUMENT
before the servicer sees it (so a caller without a valid API key learns UNAUTHENTICATED, not how
its bytes parsed). The handlers are made from the service descriptor, one rule for all methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from kvshare.v1 import generator_pb2 as pb
from services.engine.door import Ticket, Tickets
from services.errors import Overloaded

SERVICE = pb.DESCRIPTOR.services_by_name["Generator"]


@dataclass(frozen=True, slots=True)
class Unparseable:
    """A request whose bytes are not a valid message of ``type_name``; ``error`` says why."""

    type_name: str
    error: str

    @property
    def details(self) -> str:
        return f"request is not a valid {self.type_name}: {self.error}"


@dataclass(frozen=True, slots=True)
class Oversized:
    """A request larger than any valid one of its method can be (``details`` says why), refused
    unparsed: parsing four million ids holds the event loop and costs tens of MB."""

    details: str


def lenient_deserializer(message_type: type[Message],
                         most_bytes: Callable[[int], str | None] | None = None) -> Callable[[bytes], Message | Unparseable | Oversized]:
    """``most_bytes(size)``: None for a request size that may be valid, else the refusal's details."""
    name = message_type.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Message | Unparseable | Oversized:
        if most_bytes is not None and (refusal := most_bytes(len(data))) is not None:
            return Oversized(refusal)
        try:
            return message_type.FromString(data)
        except Exception as exc:  # noqa: BLE001 - whatever FromString raises, the bytes did not parse
            return Unparseable(name, str(exc) or type(exc).__name__)

    return deserialize


def receiving_places(budget_bytes: int, message_bytes: int) -> int:
    """Calls whose message may be arriving at once: as many of the largest message as the budget
    holds, at least one."""
    return max(1, budget_bytes // message_bytes)


def receiving_tickets(budget_bytes: int, message_bytes: int) -> Tickets:
    """The places of calls whose request message is arriving (those the door gave no place):
    each may hold up to ``message_bytes`` (the server's receive bound) until it has come, so
    ``budget_bytes`` bounds what such calls hold together, and one client holds at most half."""
    return Tickets(receiving_places(budget_bytes, message_bytes), "calls whose request message is still arriving",
                   f"--max-receiving-bytes {budget_bytes} over messages of up to {message_bytes} bytes:")


async def _one_message(context: grpc.aio.ServicerContext, read_timeout_s: float, places: tuple[Ticket, ...]) -> Message:
    """The call's single request message, read within ``read_timeout_s`` (0: no bound); a call
    without one, whose body does not arrive in time, or one of whose ``places`` is taken back
    meanwhile (for another client: ``door.Tickets``), is aborted."""
    read = asyncio.ensure_future(context.read())
    loop = asyncio.get_running_loop()
    for place in places:
        place.waiting(lambda: loop.call_soon_threadsafe(read.cancel))
    try:
        async with asyncio.timeout(read_timeout_s or None):
            request = await read
    except TimeoutError:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"the request message did not arrive within {read_timeout_s:g} s of the call "
                            "(--request-read-timeout-s): the worker holds no place for a body that does not come")
    except asyncio.CancelledError:
        if not any(place.revoked for place in places):
            raise
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            "refused before its message arrived: every place for such calls was taken, and another "
                            "client holding fewer took this one; send the message with the call, or retry later")
    finally:
        for place in places:
            place.waiting(None)
    if request is grpc.aio.EOF:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request message")
    if isinstance(request, Unparseable | Oversized):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
    return request


async def _message(context: grpc.aio.ServicerContext, read_timeout_s: float, place: Ticket | None,
                   receiving: Tickets | None, client: Callable) -> Message:
    """``_one_message``, held by the door's ``place``; a call the door gave none (a text model's
    Generate, GetModelInfo) takes a receiving place of ``client(context)`` until its message has
    come, RESOURCE_EXHAUSTED at once when none is free. A call with a place of the door needs no
    other: those places are as few as the calls whose messages may be arriving."""
    if place is not None or receiving is None:
        return await _one_message(context, read_timeout_s, () if place is None else (place,))
    try:
        arriving = receiving.take(client(context))
    except Overloaded as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    with arriving:
        return await _one_message(context, read_timeout_s, (arriving,))


def _admitted(behavior: Callable, admit: Callable, door: Callable, client: Callable, streaming: bool,
              read_timeout_s: float, receiving: Tickets | None) -> Callable:
    """``behavior(request, context, place)`` after ``admit(context)`` and ``place = door(context)``
    (either aborts a call it refuses), on the request read only then (``_message``); the place is
    released when the call ends. A server-streaming method is an async generator, a unary one a
    coroutine; both take the request stream gRPC hands a request-streaming handler, and ignore it
    for ``context.read``."""
    if streaming:
        async def stream(_requests, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
            await admit(context)
            with await door(context) or contextlib.nullcontext() as place:
                responses = behavior(await _message(context, read_timeout_s, place, receiving, client), context, place)
                async for response in responses:  # holding no reference to the request: see servicer
                    yield response
        return stream

    async def unary(_requests, context: grpc.aio.ServicerContext) -> Message:
        await admit(context)
        with await door(context) or contextlib.nullcontext() as place:
            request = await _message(context, read_timeout_s, place, receiving, client)
            return await behavior(request, context, place)
    return unary


def _serialize(response: Message | bytes) -> bytes:
    """A method may answer bytes it serialized itself (off the event loop, in pieces)."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def method_handlers(servicer: object, read_timeout_s: float = 0.0,
                    receiving: Tickets | None = None) -> dict[str, grpc.RpcMethodHandler]:
    """A handler for every method of the Generator service, each calling the servicer's ``admit``
    and ``door(method, context)`` (which abort a call they refuse), then, under a place of
    ``receiving`` (None: no bound) for the servicer's ``client(context)``, reading the message, then
    its method of the same name with the place the door gave. A servicer's ``size_check(method)``
    may bound a method's request bytes before they are parsed."""
    handlers = {}
    for method in SERVICE.methods:
        if method.client_streaming:
            raise TypeError(f"{method.full_name}: client-streaming methods are not handled here")
        make = grpc.stream_stream_rpc_method_handler if method.server_streaming else grpc.stream_unary_rpc_method_handler
        handlers[method.name] = make(
            _admitted(getattr(servicer, method.name), servicer.admit, functools.partial(servicer.door, method.name),
                      servicer.client, method.server_streaming, read_timeout_s, receiving),
            request_deserializer=lenient_deserializer(GetMessageClass(method.input_type),
                                                      getattr(servicer, "size_check", lambda _: None)(method.name)),
            response_serializer=_serialize,
        )
    return handlers


def add_generator_to_server(servicer: object, server: grpc.aio.Server, read_timeout_s: float = 0.0,
                            receiving: Tickets | None = None) -> None:
    """What the generated ``add_GeneratorServicer_to_server`` does, with the door before the body,
    bodies arriving under ``receiving``, and lenient deserializers."""
    handlers = method_handlers(servicer, read_timeout_s, receiving)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
