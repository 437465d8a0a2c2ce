"""The first message of a local stream (producer or trainer): shape, protocol and job checks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from odbclient.connect import PROTOCOL_VERSION  # one number for both ends of a socket


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a stream is refused: a gRPC status code name (the client maps it to an error class,
    odbclient.connect) and the message with the fix."""

    code: str  # e.g. "FAILED_PRECONDITION"
    message: str


def hello_refusal(hello: Any, *, who: str, job_id: str) -> Refusal | None:
    """A hello of another protocol version or job is refused; else None."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return Refusal(
            "FAILED_PRECONDITION",
            f"{who} protocol version {hello.protocol_version}, daemon speaks "
            f"{PROTOCOL_VERSION}: install the same odbd release for {who}s and daemon",
        )
    if hello.job_id and hello.job_id != job_id:
        return Refusal(
            "FAILED_PRECONDITION",
            f"this daemon serves job {job_id!r}, the {who} asked for {hello.job_id!r}: "
            "check ODBD_SOCKET / the socket path",
        )
    return None


async def read_hello(
    request_iterator: AsyncIterator[Any],
    context: grpc.aio.ServicerContext,
    *,
    who: str,  # "producer" or "trainer", for the messages
    hello_type: str,  # "ProducerHello" or "TrainerHello"
    job_id: str,
) -> Any:
    """The hello of a new gRPC stream, or an abort with the precise status and the fix."""
    first = await anext(request_iterator, None)
    if first is None or not first.HasField("hello"):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"the first message must be a {hello_type}"
        )
        raise AssertionError("context.abort() raises")
    hello = first.hello
    refusal = hello_refusal(hello, who=who, job_id=job_id)
    if refusal is not None:
        await context.abort(grpc.StatusCode[refusal.code], refusal.message)
    return hello
