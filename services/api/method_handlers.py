"""Registers the Generator service's methods so that a call is admitted before its body is read,
and a request that does not parse is answered INVALID_ARGUMENT.

Every method is registered as request-streaming, whatever the .proto says (on the wire a unary
request is a stream of one message): gRPC then hands the call over on its headers alone, and the
servicer's ``admit`` (the API key) and ``door`` (a full worker, a client over its share, every place
for audio or Tokenize taken) refuse it before one byte of its body is buffered or parsed. A unary
registration reads the whole message first: 20 refused calls of 22 MiB held 740 MB here. The body
is read only once admitted, as ``message_intake.MessageIntake`` says (within a read timeout, under
a receiving place, never while the worker drains).

grpc's generated ``add_GeneratorServicer_to_server`` deserializes with ``FromString``; when that
raises (invalid UTF-8 in a string field, a truncated message, a wrong wire type) the client gets
UNKNOWN, "Exception deserializing request!", which reads like a server fault. Here the deserializer
never raises: it returns an ``Unparseable`` marker, and every method answers it INVALID_ARGUMENT
before the servicer sees it (so a caller without a valid API key learns UNAUTHENTICATED, not how
its bytes parsed). The handlers are made from the service descriptor, one rule for all methods.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2

from kvshare.v1 import generator_pb2 as pb
from services.api.message_intake import MessageIntake, Oversized, Unparseable
from services.engine.door import Ticket
from services.engine.fair_share import client_of

SERVICE = pb.DESCRIPTOR.services_by_name["Generator"]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]


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


def _reader(message_type: type[Message], intake: MessageIntake, client: Callable) -> Callable:
    """``read(context, place)``: the call's request as ``intake`` reads it; for a request type
    without fields (GetModelInfo's, the health List's), an empty one, unread: nothing it could
    carry means anything, and a call that answers at once holds no bytes a client sends after."""
    if not message_type.DESCRIPTOR.fields:
        empty = message_type()

        async def nothing(_context: grpc.aio.ServicerContext, _place: Ticket | None) -> Message:
            return empty
        return nothing

    return functools.partial(intake.message, client=client)


def _admitted(behavior: Callable, admit: Callable, door: Callable, read: Callable, streaming: bool,
              writes: bool = False) -> Callable:
    """``behavior(request, context, place)`` after ``admit(context)`` and ``place = door(context)``
    (either aborts a call it refuses), on the request read only then (``read(context, place)``);
    the place is released when the call ends. A server-streaming method is an async generator (or,
    ``writes``, a coroutine that sends its responses with ``context.write``: gRPC forbids mixing
    the two), a unary one a coroutine; all take the request stream gRPC hands a request-streaming
    handler, and ignore it for ``context.read``."""
    if streaming and writes:
        async def written(_requests, context: grpc.aio.ServicerContext) -> None:
            await admit(context)
            with await door(context) or contextlib.nullcontext() as place:
                await behavior(await read(context, place), context, place)
        return written

    if streaming:
        async def stream(_requests, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
            await admit(context)
            with await door(context) or contextlib.nullcontext() as place:
                responses = behavior(await read(context, place), context, place)
                async for response in responses:  # holding no reference to the request: see servicer
                    yield response
        return stream

    async def unary(_requests, context: grpc.aio.ServicerContext) -> Message:
        await admit(context)
        with await door(context) or contextlib.nullcontext() as place:
            request = await read(context, place)
            return await behavior(request, context, place)
    return unary


def _serialize(response: Message | bytes) -> bytes:
    """A method may answer bytes it serialized itself (off the event loop, in pieces)."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def _handlers(service: ServiceDescriptor, behavior: Callable[[str], Callable], admit: Callable,
              door: Callable[[str], Callable], client: Callable, intake: MessageIntake,
              size_check: Callable[[str], Callable[[int], str | None] | None],
              writes: bool = False) -> dict[str, grpc.RpcMethodHandler]:
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise TypeError(f"{method.full_name}: client-streaming methods are not handled here")
        make = grpc.stream_stream_rpc_method_handler if method.server_streaming else grpc.stream_unary_rpc_method_handler
        message_type = GetMessageClass(method.input_type)
        handlers[method.name] = make(
            _admitted(behavior(method.name), admit, door(method.name), _reader(message_type, intake, client),
                      method.server_streaming, writes),
            request_deserializer=lenient_deserializer(message_type, size_check(method.name)),
            response_serializer=_serialize,
        )
    return handlers


def method_handlers(servicer: object, intake: MessageIntake | None = None) -> dict[str, grpc.RpcMethodHandler]:
    """A handler for every method of the Generator service, each calling the servicer's ``admit``
    and ``door(method, context)`` (which abort a call they refuse), then reading the message as
    ``intake`` says (by default: no bounds), then its method of the same name with the place the
    door gave. A servicer's ``size_check(method)`` may bound a method's request bytes before they
    are parsed."""
    return _handlers(SERVICE, functools.partial(getattr, servicer), servicer.admit,
                     lambda name: functools.partial(servicer.door, name), servicer.client, intake or MessageIntake(),
                     getattr(servicer, "size_check", lambda _: None))


def add_generator_to_server(servicer: object, server: grpc.aio.Server, intake: MessageIntake | None = None) -> None:
    """What the generated ``add_GeneratorServicer_to_server`` does, with the door before the body,
    messages read as ``intake`` says, and lenient deserializers."""
    _register(server, SERVICE, method_handlers(servicer, intake))


def add_health_to_server(health_servicer: health.aio.HealthServicer, server: grpc.aio.Server,
                         intake: MessageIntake) -> None:
    """What ``health_pb2_grpc.add_HealthServicer_to_server`` does, with requests read as the
    Generator's are: a health request holds a receiving place of its caller's address until it
    has come (a registration of gRPC's own reads it whole first: 40 unfinished 24 MiB checks held
    +800 MiB), and one that does not parse is INVALID_ARGUMENT. No API key: probes carry none."""

    async def anyone(_context: grpc.aio.ServicerContext) -> None:
        """Every health call is admitted, and holds no place of the door's."""

    def behavior(name: str) -> Callable:
        method = getattr(health_servicer, name)
        return lambda request, context, _place: method(request, context)

    # grpc_health's Watch sends with context.write.
    handlers = _handlers(HEALTH, behavior, anyone, lambda _: anyone,
                         lambda context: client_of("", context.peer() or ""), intake, lambda _: None, writes=True)
    _register(server, HEALTH, handlers)


def _register(server: grpc.aio.Server, service: ServiceDescriptor, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
