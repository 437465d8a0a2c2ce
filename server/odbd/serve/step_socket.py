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
import logging

from google.protobuf.message import Message

from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.framed_socket import FramedConnection, FramedServer
from odbd.serve.hello import Refusal
from odbd.serve.trainer_service import Attachment, TrainerService


class StepConnection(FramedConnection):
    """One trainer's connection (see the module docstring for its lifecycle)."""

    peer = "trainer"
    socket_name = "step socket"
    hello_name = "TrainerHello"
    log = logging.getLogger("odbd.serve")

    def __init__(self, service: TrainerService, connections: set[FramedConnection]) -> None:
        super().__init__(connections)
        self._service = service
        self._attachment: Attachment | None = None

    def parse(self, payload: bytes) -> trainer_pb2.TrainerMessage:
        return trainer_pb2.TrainerMessage.FromString(payload)

    def refusal_message(self, refusal: Refusal) -> Message:
        return trainer_pb2.TrainerEvent(
            refusal=trainer_pb2.Refusal(code=refusal.code, message=refusal.message)
        )

    def release(self) -> None:
        if self._attachment is not None:
            self._service.detach(self._attachment)
            self._attachment = None

    def on_message(self, message: trainer_pb2.TrainerMessage) -> None:
        if self._attachment is not None:
            self._service.on_message(self._attachment, message)
            return
        if not message.HasField("hello"):
            self.refuse(Refusal("INVALID_ARGUMENT", "the first message must be a TrainerHello"))
            return
        self.hello_done()
        refusal = self._service.admit(message.hello)
        if refusal is not None:
            self.refuse(refusal)
            return
        self._attachment = self._service.attach(message.hello)
        self.write([trainer_pb2.TrainerEvent(welcome=self._service.welcome)])
        self._sender = asyncio.get_running_loop().create_task(self._send(self._attachment))

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
                self.write_payloads(events)
                await self._writable.wait()  # the socket buffer is full: the trainer is behind
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: drop this trainer (it reconnects), keep the daemon
            self.log.exception("step socket of trainer rank %d failed", attachment.rank)
            self.abort()


class StepServer(FramedServer):
    """The daemon's step socket: a unix stream server at `path`, mode 0600."""

    def __init__(self, service: TrainerService, path: str) -> None:
        super().__init__(path, lambda connections: StepConnection(service, connections))
