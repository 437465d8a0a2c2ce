"""The edge of the producers' ingest stream: a unix stream socket of length-prefixed protobuf
frames (odbclient.framing), served at SOCKET + ".ingest" beside the daemon's gRPC socket
(protocol 7, issue 15), like the trainers' step socket (odbd.serve.step_socket).

Why not gRPC: an ingest stream carries ~45 messages per 1000 samples (commits, lease requests
and grants, frees), and per message gRPC cost the daemon more CPU in its aio C code than the
service logic, and the producer process gRPC's sync-stack threads. Here a connection is an
asyncio Protocol: `data_received` cuts every complete frame out of what arrived and hands each
to the service inline; one sender task per connection writes whatever the producer's outbox
holds as one write. No task per message, no thread.

Lifecycle of a connection: hello (within HELLO_TIMEOUT_S) -> refusal and close, Shutdown and
close (the job is over), or welcome; then lease grants, frees and Shutdown out, leases,
commits, rejections and LaneFull in. The end of the connection for any reason (EOF, a
refusal, the producer's death, Shutdown sent) detaches the producer: its leases go back to
the pool (the supervisor and the fault tests depend on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import cast

from google.protobuf.message import DecodeError

from odbclient.framing import FrameBuffer, FrameError, frame
from odbclient.wire.odbd.v1 import ingest_pb2, trainer_pb2
from odbd.ingest.service import IngestService, ProducerSession
from odbd.ingest.validate import MalformedMessage
from odbd.serve.hello import Refusal

log = logging.getLogger("odbd.ingest")

HELLO_TIMEOUT_S = 30.0  # a connection that says nothing must not hold a socket forever
_CLOSE_WAIT_S = 1.0  # shutdown: how long closing connections may take (like gRPC's grace)


class IngestConnection(asyncio.Protocol):
    """One producer's connection (see the module docstring for its lifecycle)."""

    def __init__(self, service: IngestService, connections: set[IngestConnection]) -> None:
        self._service = service
        self._connections = connections
        self._frames = FrameBuffer()
        self._transport: asyncio.Transport | None = None
        self._session: ProducerSession | None = None
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
            Refusal("INVALID_ARGUMENT", f"no ProducerHello within {HELLO_TIMEOUT_S:g} s"),
        )

    def data_received(self, data: bytes) -> None:
        try:
            for payload in self._frames.feed(data):
                if self._closed:
                    return
                self._on_message(ingest_pb2.ProducerMessage.FromString(payload))
        except (FrameError, DecodeError) as error:
            self._refuse(
                Refusal("INVALID_ARGUMENT", f"unreadable message on the ingest socket: {error}")
            )
        except MalformedMessage as error:
            name = self._session.name if self._session is not None else "?"
            log.warning("refused producer %s: %s", name, error)
            self._refuse(Refusal("INVALID_ARGUMENT", str(error)))
        except (
            Exception
        ) as error:  # a bug: drop this producer (its leases go back), keep the daemon
            log.exception("ingest socket: a producer's message failed")
            self._refuse(Refusal("INTERNAL", f"odbd failed on this message (a bug): {error!r}"))

    def eof_received(self) -> bool:
        return False  # the producer is done: close our side too (connection_lost detaches)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._connections.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self._sender is not None:
            self._sender.cancel()
        if self._session is not None:
            self._service.detach(self._session)
            self._session = None
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

    def _on_message(self, message: ingest_pb2.ProducerMessage) -> None:
        if self._session is not None:
            self._service.on_message(self._session, message)
            return
        if not message.HasField("hello"):
            self._refuse(Refusal("INVALID_ARGUMENT", "the first message must be a ProducerHello"))
            return
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        opened = self._service.open(message.hello)
        if isinstance(opened, Refusal):
            self._refuse(opened)
            return
        if opened is None:  # the job is over: a late producer is told so, as the others were
            self._write([self._service.late_shutdown()])
            self._closed = True
            self.close()
            return
        self._session = opened
        self._write([self._service.welcome_for(opened)])
        self._sender = asyncio.get_running_loop().create_task(self._send(opened))

    def _refuse(self, refusal: Refusal) -> None:
        if self._closed or self._transport is None:
            return
        log.info("producer refused: %s", refusal.message)
        message = ingest_pb2.IngestMessage(
            refusal=trainer_pb2.Refusal(code=refusal.code, message=refusal.message)
        )
        self._write([message])
        self._closed = True
        self._transport.close()

    def _write(self, messages: list[ingest_pb2.IngestMessage]) -> None:
        assert self._transport is not None
        self._transport.write(b"".join(frame(m.SerializeToString()) for m in messages))

    async def _send(self, session: ProducerSession) -> None:
        """Writes what the outbox holds, all at once; waits for more; ends the stream after
        a Shutdown (the producer commits nothing more that the daemon would keep)."""
        outbox = session.outbox
        try:
            while not self._closed:
                first = await outbox.get()
                messages = [first] if first is not None else []
                while not outbox.empty():
                    more = outbox.get_nowait()
                    if more is not None:
                        messages.append(more)
                if messages:
                    self._write(messages)
                if any(m.HasField("shutdown") for m in messages):
                    self._closed = True
                    self.close()
                    return
                await self._writable.wait()  # the socket buffer is full: the producer is behind
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: drop this producer (its leases go back), keep the daemon
            log.exception("ingest socket of producer %s failed", session.name)
            if self._transport is not None:
                self._transport.abort()


class IngestServer:
    """The daemon's ingest socket: a unix stream server at `path`, mode 0600."""

    def __init__(self, service: IngestService, path: str) -> None:
        self._service = service
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[IngestConnection] = set()
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the file we bound

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # created 0600: only this user connects (like the gRPC one)
        try:
            self._server = await loop.create_unix_server(
                lambda: IngestConnection(self._service, self._connections), self.path
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
