"""Length-prefixed protobuf frames: the wire of the trainer's step socket (protocol 6) and of
the producer's ingest socket (protocol 7).

A frame is a 4-byte little-endian payload length, then the payload: one serialized
TrainerMessage (trainer -> daemon) or TrainerEvent (daemon -> trainer), ProducerMessage
(producer -> daemon) or IngestMessage (daemon -> producer); trainer.proto and ingest.proto say
what flows when. Both ends read whatever bytes arrived and cut every complete frame out of them at
once (`FrameBuffer`), so many frames cost one read, and no side runs a task or a thread per
message. Shared by odbclient and the daemon; imports neither grpc nor odbd.
"""

from __future__ import annotations

import struct

STEPS_SOCKET_SUFFIX = ".steps"
INGEST_SOCKET_SUFFIX = ".ingest"
# A StepBatches message stays near 1 MiB (odbd.serve.trainer_service); a frame announcing more
# than this is corrupt or from something that is not odbd, and ends the connection.
MAX_FRAME_BYTES = 64 << 20
_LENGTH = struct.Struct("<I")


class FrameError(ValueError):
    """The bytes on a step or ingest socket are not frames of this protocol."""


def steps_socket_path(socket: str) -> str:
    """Where a daemon whose gRPC socket is `socket` serves its trainers' step channel."""
    return socket + STEPS_SOCKET_SUFFIX


def ingest_socket_path(socket: str) -> str:
    """Where a daemon whose gRPC socket is `socket` serves its producers' ingest stream."""
    return socket + INGEST_SOCKET_SUFFIX


def frame(payload: bytes) -> bytes:
    """One frame around a serialized message."""
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"a {len(payload)}-byte message exceeds the {MAX_FRAME_BYTES}-byte frame")
    return _LENGTH.pack(len(payload)) + payload


class FrameBuffer:
    """Bytes received so far; `feed` returns the payloads of every frame they complete."""

    def __init__(self, *, first_frame_limit: int | None = None, first_frame: str = "") -> None:
        """`first_frame_limit`: a smaller bound for the first frame only (the daemon's for a
        peer's hello: a peer must not make it buffer megabytes before saying who it is);
        `first_frame` names that message in the error."""
        self._pending = bytearray()
        self._first_limit = first_frame_limit
        self._first_name = first_frame

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        pending = self._pending
        pending += data
        payloads, pos, end = [], 0, len(pending)
        while end - pos >= 4:
            (length,) = _LENGTH.unpack_from(pending, pos)
            if self._first_limit is not None:
                if length > self._first_limit:
                    raise FrameError(
                        f"the first frame ({self._first_name}) announces {length} bytes (at "
                        f"most {self._first_limit} before the peer's hello): the peer is not "
                        "an odbd client of this protocol, or the stream is corrupt"
                    )
                if end - pos - 4 < length:
                    break
                self._first_limit = None  # the first frame is complete: the usual bound follows
            if length > MAX_FRAME_BYTES:
                raise FrameError(
                    f"a frame announces {length} bytes (at most {MAX_FRAME_BYTES}): the peer "
                    "is not an odbd step or ingest channel of this protocol, or the stream "
                    "is corrupt"
                )
            if end - pos - 4 < length:
                break
            payloads.append(bytes(pending[pos + 4 : pos + 4 + length]))
            pos += 4 + length
        if pos:
            del pending[:pos]
        return payloads

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete frame (nonzero at EOF: the peer died mid-message)."""
        return len(self._pending)
