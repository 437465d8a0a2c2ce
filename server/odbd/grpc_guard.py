"""A server interceptor that answers undecodable request bytes with INVALID_ARGUMENT.

Without it, gRPC raises the protobuf DecodeError inside its own request reader: the client
sees UNKNOWN and the daemon logs a traceback per bad message, so anyone who can reach a socket
could flood the log. With it, the request deserializer returns an `Undecodable` marker and the
handler's request stream (or unary request) ends the call with a precise status before any
service code sees it. Handlers that read with `context.read()` (the Peer hub) get the marker
itself and must refuse it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True, slots=True)
class Undecodable:
    """Request bytes that are not a valid message of the method's request type."""

    method: str
    error: str

    def message(self) -> str:
        return f"the request to {self.method} is not a valid protobuf message ({self.error})"


def _lenient(deserialize: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except (DecodeError, ValueError) as error:
            return Undecodable(method, str(error))

    return decode


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
    async for request in requests:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
        yield request


def _guard(behavior: Callable[..., Any], *, stream_request: bool) -> Callable[..., Any]:
    """Wraps a handler, keeping its kind: gRPC tells async generators and coroutines apart."""

    def prepare(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return _checked(request, context) if stream_request else request

    async def refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
        if not stream_request and isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())

    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await refuse_undecodable(request, context)
            async for response in behavior(prepare(request, context), context):
                yield response

        return guarded_stream

    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse_undecodable(request, context)
        return await behavior(prepare(request, context), context)

    return guarded


class DecodeGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        decode = _lenient(handler.request_deserializer, method)
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            behavior = _guard(handler.unary_unary, stream_request=False)
            return grpc.unary_unary_rpc_method_handler(behavior, decode, serialize)
        if handler.unary_stream is not None:
            behavior = _guard(handler.unary_stream, stream_request=False)
            return grpc.unary_stream_rpc_method_handler(behavior, decode, serialize)
        if handler.stream_unary is not None:
            behavior = _guard(handler.stream_unary, stream_request=True)
            return grpc.stream_unary_rpc_method_handler(behavior, decode, serialize)
        behavior = _guard(handler.stream_stream, stream_request=True)
        return grpc.stream_stream_rpc_method_handler(behavior, decode, serialize)
