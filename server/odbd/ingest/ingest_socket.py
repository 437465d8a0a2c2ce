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
import logging

from google.protobuf.message import Message

from odbclient.wire.odbd.v1 import ingest_pb2, trainer_pb2
from odbd.framed_socket import FramedConnection, FramedServer
from odbd.ingest.service import IngestService, ProducerSession
from odbd.ingest.validate import MalformedMessage
from odbd.serve.hello import Refusal


class IngestConnection(FramedConnection):
    """One producer's connection (see the module docstring for its lifecycle)."""

    peer = "producer"
    socket_name = "ingest socket"
    hello_name = "ProducerHello"
    log = logging.getLogger("odbd.ingest")

    def __init__(self, service: IngestService, connections: set[FramedConnection]) -> None:
        super().__init__(connections)
        self._service = service
        self._session: ProducerSession | None = None

    def parse(self, payload: bytes) -> ingest_pb2.ProducerMessage:
        return ingest_pb2.ProducerMessage.FromString(payload)

    def refusal_message(self, refusal: Refusal) -> Message:
        return ingest_pb2.IngestMessage(
            refusal=trainer_pb2.Refusal(code=refusal.code, message=refusal.message)
        )

    def on_error(self, error: Exception) -> Refusal | None:
        if not isinstance(error, MalformedMessage):
            return None
        name = self._session.name if self._session is not None else "?"
        self.log.warning("refused producer %s: %s", name, error)
        return Refusal("INVALID_ARGUMENT", str(error))

    def release(self) -> None:
        """Its leases go back to the pool (the supervisor and the fault tests depend on it)."""
        if self._session is not None:
            self._service.detach(self._session)
            self._session = None

    def on_message(self, message: ingest_pb2.ProducerMessage) -> None:
        if self._session is not None:
            self._service.on_message(self._session, message)
            return
        if not message.HasField("hello"):
            self.refuse(Refusal("INVALID_ARGUMENT", "the first message must be a ProducerHello"))
            return
        self.hello_done()
        opened = self._service.open(message.hello)
        if isinstance(opened, Refusal):
            self.refuse(opened)
            return
        if opened is None:  # the job is over: a late producer is told so, as the others were
            self.write([self._service.late_shutdown()])
            self._closed = True
            self.close()
            return
        self._session = opened
        self.write([self._service.welcome_for(opened)])
        self._sender = asyncio.get_running_loop().create_task(self._send(opened))

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
                    self.write(messages)
                if any(m.HasField("shutdown") for m in messages):
                    self._closed = True
                    self.close()
                    return
                await self._writable.wait()  # the socket buffer is full: the producer is behind
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: drop this producer (its leases go back), keep the daemon
            self.log.exception("ingest socket of producer %s failed", session.name)
            self.abort()


class IngestServer(FramedServer):
    """The daemon's ingest socket: a unix stream server at `path`, mode 0600."""

    def __init__(self, service: IngestService, path: str) -> None:
        super().__init__(path, lambda connections: IngestConnection(service, connections))
