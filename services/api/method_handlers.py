"""Registers the Generator service's methods so that a request that does not parse is answered
INVALID_ARGUMENT.

grpc's generated ``add_GeneratorServicer_to_server`` deserializes with ``FromString``; when that
raises (invalid UTF-8 in a string field, a truncated message, a wrong wire type) the client gets
UNKNOWN, "Exception deserializing request!", which reads like a server fault. Here the deserializer
never raises: it returns an ``Unparseable`` marker, and every method answers it INVALID_ARGUMENT
before the servicer sees it, once the servicer's ``admit`` let the caller in (so a caller without
a valid API key learns UNAUTHENTICATED, not how its bytes parsed). The handlers are made from the
service descriptor, one rule for all methods.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from kvshare.v1 import generator_pb2 as pb

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


def _refusing_unparseable(behavior: Callable, admit: Callable, streaming: bool) -> Callable:
    """``behavior`` after ``admit(context)``, answering an Unparseable request INVALID_ARGUMENT instead
    of calling it (a server-streaming method is an async generator, a unary one a coroutine)."""
    if streaming:
        async def stream(request, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
            await admit(context)
            if isinstance(request, Unparseable | Oversized):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
            async for response in behavior(request, context):
                yield response
        return stream

    async def unary(request, context: grpc.aio.ServicerContext) -> Message:
        await admit(context)
        if isinstance(request, Unparseable | Oversized):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        return await behavior(request, context)
    return unary


def _serialize(response: Message | bytes) -> bytes:
    """A method may answer bytes it serialized itself (off the event loop, in pieces)."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def method_handlers(servicer: object) -> dict[str, grpc.RpcMethodHandler]:
    """A handler for every method of the Generator service, each calling the servicer's ``admit``
    (which aborts a call it refuses), then its method of the same name. A servicer's
    ``size_check(method)`` may bound a method's request bytes before they are parsed."""
    handlers = {}
    for method in SERVICE.methods:
        if method.client_streaming:
            raise TypeError(f"{method.full_name}: client-streaming methods are not handled here")
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            _refusing_unparseable(getattr(servicer, method.name), servicer.admit, method.server_streaming),
            request_deserializer=lenient_deserializer(GetMessageClass(method.input_type),
                                                      getattr(servicer, "size_check", lambda _: None)(method.name)),
            response_serializer=_serialize,
        )
    return handlers


def add_generator_to_server(servicer: object, server: grpc.aio.Server) -> None:
    """What the generated ``add_GeneratorServicer_to_server`` does, with lenient deserializers."""
    handlers = method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
