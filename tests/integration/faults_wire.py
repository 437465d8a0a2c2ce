"""Raw gRPC calls for the fuzz and security tests: bytes in, (status, details, replies) out.

No serializers, so a test can send bytes that are not a valid message at all, and see the
daemon's answer exactly as a foreign client would.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError, Message

INGEST = "/odbd.v1.Ingest/Produce"
TRAINER = "/odbd.v1.Trainer/Train"
ADMIN = "/odbd.v1.Admin/Status"
HEALTH = "/grpc.health.v1.Health/Check"
JOIN = "/odbd.v1.Peer/Join"

CALL_TIMEOUT_S = 10.0  # a hang shows up as DEADLINE_EXCEEDED, which every test refuses


@dataclass
class Answer:
    code: grpc.StatusCode
    details: str
    replies: list[bytes] = field(default_factory=list)


def as_bytes(message: Message | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def stream(channel: grpc.Channel, method: str, messages: list[Message | bytes]) -> Answer:
    """Sends `messages` on a bidi stream, half-closes, and reads until the daemon ends it."""
    call = channel.stream_stream(method)(
        iter([as_bytes(m) for m in messages]), timeout=CALL_TIMEOUT_S
    )
    replies: list[bytes] = []
    try:
        replies.extend(call)
    except grpc.RpcError as error:
        return Answer(error.code(), error.details() or "", replies)
    return Answer(grpc.StatusCode.OK, "", replies)


def unary(channel: grpc.Channel, method: str, message: Message | bytes) -> Answer:
    try:
        reply = channel.unary_unary(method)(as_bytes(message), timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        return Answer(error.code(), error.details() or "")
    return Answer(grpc.StatusCode.OK, "", [reply])


def parses(data: bytes, message_type: type[Message]) -> Message | None:
    try:
        return message_type.FromString(data)
    except DecodeError:
        return None


class Session:
    """An interactive bidi stream: send, read replies as they come, then close."""

    _END = object()

    def __init__(self, channel: grpc.Channel, method: str) -> None:
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._call = channel.stream_stream(method)(self._requests(), timeout=CALL_TIMEOUT_S)
        self._replies: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[bytes]:
        while (item := self._outbox.get()) is not self._END:
            yield item  # type: ignore[misc]

    def _read(self) -> None:
        try:
            for reply in self._call:
                self._replies.put(reply)
            self._replies.put(Answer(grpc.StatusCode.OK, ""))
        except grpc.RpcError as error:
            self._replies.put(Answer(error.code(), error.details() or ""))

    def send(self, message: Message | bytes) -> None:
        self._outbox.put(as_bytes(message))

    def read(self, timeout_s: float = CALL_TIMEOUT_S) -> bytes | Answer:
        """The next reply, or the Answer that ended the stream."""
        return self._replies.get(timeout=timeout_s)  # type: ignore[return-value]

    def end(self, timeout_s: float = CALL_TIMEOUT_S) -> Answer:
        """Half-closes and returns how the daemon ended the stream (skipping further replies)."""
        self._outbox.put(self._END)
        while not isinstance(item := self._replies.get(timeout=timeout_s), Answer):
            pass
        return item

    def cancel(self) -> None:
        self._outbox.put(self._END)
        self._call.cancel()
        self._reader.join(timeout=CALL_TIMEOUT_S)  # a test leaves no thread behind (conftest)


def steps_stream(path: str, payloads: list[Message | bytes]) -> Answer:
    """`framed_stream` on a daemon's step socket (TrainerEvent replies)."""
    from odbclient.wire.odbd.v1 import trainer_pb2

    return framed_stream(path, payloads, trainer_pb2.TrainerEvent)


def ingest_stream(path: str, payloads: list[Message | bytes]) -> Answer:
    """`framed_stream` on a daemon's ingest socket (IngestMessage replies)."""
    from odbclient.wire.odbd.v1 import ingest_pb2

    return framed_stream(path, payloads, ingest_pb2.IngestMessage)


def framed_stream(path: str, payloads: list[Message | bytes], reply_type: type[Message]) -> Answer:
    """Sends `payloads` as frames on a daemon's framed socket (odbclient.framing), half-closes,
    and reads frames until the daemon ends the stream: a Refusal is the answer's code and
    details; a stream that ends without one is OK. Every read has a deadline."""
    session = FramedSession(path, reply_type)
    for payload in payloads:
        session.send(payload)
    return session.end()


class FramedSession:
    """An interactive stream on a framed socket: send, read replies as they come, then close.
    No thread: every read is a recv with a deadline."""

    def __init__(self, path: str, reply_type: type[Message]) -> None:
        import socket as socketlib

        from odbclient.framing import FrameBuffer

        self._reply_type = reply_type
        self._frames = FrameBuffer()
        self._replies: list[bytes] = []  # received, not yet read
        self._all: list[bytes] = []
        self._eof = False
        self._sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        self._sock.settimeout(CALL_TIMEOUT_S)  # a hang shows up as TimeoutError: the test fails
        self._sock.connect(path)

    def send(self, message: Message | bytes) -> None:
        from odbclient.framing import frame

        try:
            self._sock.sendall(frame(as_bytes(message)))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused early and closed; its refusal is still readable

    def send_raw(self, data: bytes) -> None:
        """Bytes as they are, not framed (a corrupt or foreign stream)."""
        try:
            self._sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused early and closed; its refusal is still readable

    def read(self) -> bytes | Answer:
        """The next reply, or the Answer that ended the stream."""
        while not self._replies and not self._eof:
            self._receive()
        if self._replies:
            return self._replies.pop(0)
        return self._answer()

    def end(self) -> Answer:
        """Half-closes and returns how the daemon ended the stream (skipping further replies)."""
        import socket as socketlib

        try:
            self._sock.shutdown(socketlib.SHUT_WR)
        except OSError:
            pass  # already closed by the daemon
        while not self._eof:
            self._receive()
        return self._answer()

    def _receive(self) -> None:
        try:
            data = self._sock.recv(1 << 16)
        except ConnectionResetError:
            data = b""
        if not data:
            self._eof = True
            self._sock.close()
            return
        payloads = self._frames.feed(data)
        self._replies.extend(payloads)
        self._all.extend(payloads)

    def _answer(self) -> Answer:
        for reply in self._all:
            event = self._reply_type.FromString(reply)
            if event.HasField("refusal"):
                refusal = event.refusal  # type: ignore[attr-defined]
                return Answer(grpc.StatusCode[refusal.code], refusal.message, self._all)
        return Answer(grpc.StatusCode.OK, "", self._all)


def peer_join(session: Session, hello: Message, token: bytes) -> bytes | Answer:
    """Joins a hub as a spoke would: Hello, then the Proof answering its Challenge (auth.py).

    Returns the hub's next message (the Welcome once the job forms) or the Answer that ended
    the stream. A Hello without a nonce gets a fresh one.
    """
    from odbclient.wire.odbd.v1 import peer_pb2
    from odbd.round import auth

    assert isinstance(hello, peer_pb2.Hello)
    if not hello.nonce:
        hello.nonce = auth.new_nonce()
    session.send(peer_pb2.PeerMessage(hello=hello))
    reply = session.read()
    if isinstance(reply, Answer):
        return reply
    challenge = peer_pb2.HubMessage.FromString(reply)
    assert challenge.HasField("challenge"), challenge
    proof = auth.spoke_proof(token, hello, challenge.challenge.nonce)
    session.send(peer_pb2.PeerMessage(proof=peer_pb2.Proof(spoke_proof=proof)))
    return session.read()
