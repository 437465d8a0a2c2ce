"""The edge of the trainer's step channel: a unix stream socket of length-prefixed protobuf
frames (odbclient.framing), served beside the daemon's gRPC socket (protocol 6, issue 15).

Why not gRPC: per message, gRPC aio cost the daemon more CPU than everything odbd does for the
message, and the trainer process two threads of gRPC's sync stack. Here a connection is an
asyncio Protocol: `data_received` cuts every complete frame out of what arrived and handles it
inline (Delivered reports free shared memory at once); one sender task per connection writes
whatever the rank's queue has ready as one write. No task per message, no thread.

Lifecycle of a connection: hello (within HELLO_TIMEOUT_S) -> refusal and close, or welcome and
attach; then steps and markers out, Delivered in; EOF (or an error) from the trainer detaches
the rank; a failed job's end is the one stream the daemon closes itself, after sending it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import cast

from google.protobuf.message import DecodeError

from odbclient.framing import FrameBuffer, FrameError, frame
from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.serve.hello import Refusal
from odbd.serve.trainer_service import Attachment, TrainerService

log = logging.getLogger("odbd.serve")

HELLO_TIMEOUT_S = 30.0  # a connection that says nothing must not hold a socket forever
_CLOSE_WAIT_S = 1.0  # shutdown: how long closing connections may take (like gRPC's grace)


class StepConnection(asyncio.Protocol):
    """One trainer's connection (see the module docstring for its lifecycle)."""

    def __init__(self, service: TrainerService, connections: set[StepConnection]) -> None:
        self._service = service
        self._connections = connections
        self._frames = FrameBuffer()
        self._transport: asyncio.Transport | None = None
        self._attachment: Attachment | None = None
        self._sender: asyncio.Task[None] | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._hello_timer: asyncio.TimerHandle | None = None
        self._closed = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._connections.add(self)
        self._hello_timer = asyncio.get_running_loop().call_later(
            HELLO_TIMEOUT_S,
            self._refuse,
            Refusal("INVALID_ARGUMENT", f"no TrainerHello within {HELLO_TIMEOUT_S:g} s"),
        )

    def data_received(self, data: bytes) -> None:
        try:
            for payload in self._frames.feed(data):
                if self._closed:
                    return
                self._on_message(trainer_pb2.TrainerMessage.FromString(payload))
        except (FrameError, DecodeError) as error:
            self._refuse(
                Refusal("INVALID_ARGUMENT", f"unreadable message on the step socket: {error}")
            )

    def eof_received(self) -> bool:
        return False  # the trainer detached: close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._connections.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self._sender is not None:
            self._sender.cancel()
        if self._attachment is not None:
            self._service.detach(self._attachment)
            self._attachment = None
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- odbd ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Ends the connection after what is buffered (daemon shutdown)."""
        if self._transport is not None:
            self._transport.close()

    def _on_message(self, message: trainer_pb2.TrainerMessage) -> None:
        if self._attachment is not None:
            self._service.on_message(self._attachment, message)
            return
        if not message.HasField("hello"):
            self._refuse(Refusal("INVALID_ARGUMENT", "the first message must be a TrainerHello"))
            return
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        refusal = self._service.admit(message.hello)
        if refusal is not None:
            self._refuse(refusal)
            return
        self._attachment = self._service.attach(message.hello)
        self._write([trainer_pb2.TrainerEvent(welcome=self._service.welcome)])
        self._sender = asyncio.get_running_loop().create_task(self._send(self._attachment))

    def _refuse(self, refusal: Refusal) -> None:
        if self._closed or self._transport is None:
            return
        log.info("trainer refused: %s", refusal.message)
        event = trainer_pb2.TrainerEvent(
            refusal=trainer_pb2.Refusal(code=refusal.code, message=refusal.message)
        )
        self._write([event])
        self._closed = True
        self._transport.close()

    def _write(self, events: list[trainer_pb2.TrainerEvent]) -> None:
        assert self._transport is not None
        self._transport.write(b"".join(frame(event.SerializeToString()) for event in events))

    async def _send(self, attachment: Attachment) -> None:
        """Writes what the queue has ready, all at once; waits for more; ends the stream after
        a failed job's end (next_event returns None)."""
        service = self._service
        try:
            while not self._closed:
                event = service.take_event(attachment)
                if event is None:
                    event = await service.next_event(attachment)
                    if event is None:
                        self.close()
                        return
                events = [event]
                while (more := service.take_event(attachment)) is not None:
                    events.append(more)
                self._write(events)
                await self._writable.wait()  # the socket buffer is full: the trainer is behind
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: drop this trainer (it reconnects), keep the daemon
            log.exception("step socket of trainer rank %d failed", attachment.rank)
            if self._transport is not None:
                self._transport.abort()


class StepServer:
    """The daemon's step socket: a unix stream server at `path`, mode 0600."""

    def __init__(self, service: TrainerService, path: str) -> None:
        self._service = service
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[StepConnection] = set()
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the file we bound

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # created 0600: only this user connects (like the gRPC one)
        try:
            self._server = await loop.create_unix_server(
                lambda: StepConnection(self._service, self._connections), self.path
            )
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        info = os.stat(self.path)
        self._socket_id = (info.st_dev, info.st_ino)

    async def close(self) -> None:
        """Stops accepting, ends every connection (what is buffered is still sent), removes
        the socket file."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), _CLOSE_WAIT_S)
        self.unlink()

    def unlink(self) -> None:
        """Removes the socket file only if it is still the one this server bound."""
        if self._socket_id is None:
            return
        with contextlib.suppress(FileNotFoundError):
            info = os.stat(self.path)
            if (info.st_dev, info.st_ino) == self._socket_id:
                os.unlink(self.path)
        self._socket_id = None
