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
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from kvshare.v1 import generator_pb2 as pb
from services.api.message_intake import MessageIntake, Oversized, Unparseable

SERVICE = pb.DESCRIPTOR.services_by_name["Generator"]


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


def _admitted(behavior: Callable, admit: Callable, door: Callable, client: Callable, streaming: bool,
              intake: MessageIntake) -> Callable:
    """``behavior(request, context, place)`` after ``admit(context)`` and ``place = door(context)``
    (either aborts a call it refuses), on the request read only then (``MessageIntake.message``);
    the place is released when the call ends. A server-streaming method is an async generator, a unary one a
    coroutine; both take the request stream gRPC hands a request-streaming handler, and ignore it
    for ``context.read``."""
    if streaming:
        async def stream(_requests, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
            await admit(context)
            with await door(context) or contextlib.nullcontext() as place:
                responses = behavior(await intake.message(context, place, client), context, place)
                async for response in responses:  # holding no reference to the request: see servicer
                    yield response
        return stream

    async def unary(_requests, context: grpc.aio.ServicerContext) -> Message:
        await admit(context)
        with await door(context) or contextlib.nullcontext() as place:
            request = await intake.message(context, place, client)
            return await behavior(request, context, place)
    return unary


def _serialize(response: Message | bytes) -> bytes:
    """A method may answer bytes it serialized itself (off the event loop, in pieces)."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def method_handlers(servicer: object, intake: MessageIntake | None = None) -> dict[str, grpc.RpcMethodHandler]:
    """A handler for every method of the Generator service, each calling the servicer's ``admit``
    and ``door(method, context)`` (which abort a call they refuse), then reading the message as
    ``intake`` says (by default: no bounds), then its method of the same name with the place the
    door gave. A servicer's ``size_check(method)`` may bound a method's request bytes before they
    are parsed."""
    intake = intake or MessageIntake()
    handlers = {}
    for method in SERVICE.methods:
        if method.client_streaming:
            raise TypeError(f"{method.full_name}: client-streaming methods are not handled here")
        make = grpc.stream_stream_rpc_method_handler if method.server_streaming else grpc.stream_unary_rpc_method_handler
        handlers[method.name] = make(
            _admitted(getattr(servicer, method.name), servicer.admit, functools.partial(servicer.door, method.name),
                      servicer.client, method.server_streaming, intake),
            request_deserializer=lenient_deserializer(GetMessageClass(method.input_type),
                                                      getattr(servicer, "size_check", lambda _: None)(method.name)),
            response_serializer=_serialize,
        )
    return handlers


def add_generator_to_server(servicer: object, server: grpc.aio.Server, intake: MessageIntake | None = None) -> None:
    """What the generated ``add_GeneratorServicer_to_server`` does, with the door before the body,
    messages read as ``intake`` says, and lenient deserializers."""
    handlers = method_handlers(servicer, intake)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
