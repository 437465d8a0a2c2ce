"""What the daemon's two framed unix sockets share (protocol 7, issue 15): the trainers' step
socket (odbd.serve.step_socket) and the producers' ingest socket (odbd.ingest.ingest_socket).

Both carry length-prefixed protobuf frames (odbclient.framing). A `FramedConnection` is an
asyncio Protocol that cuts every complete frame out of what arrived and hands each message to
its subclass inline (no task or thread per message); it refuses a peer that sends no hello in
time or bytes that are not frames, and it stops writing while the peer's socket buffer is full.
A `FramedServer` binds the socket mode 0600 and removes it at close only if it is still the file
it bound (a newer daemon may have taken the path over).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, cast

from google.protobuf.message import DecodeError, Message

from odbclient.framing import FrameBuffer, FrameError, frame
from odbclient.local_trust import peer_credentials, trusted_uid
from odbd.serve.hello import Refusal

HELLO_TIMEOUT_S = 30.0  # a connection that says nothing must not hold a socket forever
# Before its hello a peer is nobody: it may make the daemon buffer at most one hello frame
# (a hello is under 200 bytes; the usual 64 MiB frame bound let 8 silent connections hold
# +505 MB: tests/bench/prehello_rss.py), and at most this many connections of a server may
# wait for their hello at once (a node runs a few ranks and producers; reconnects come one at
# a time).
HELLO_MAX_BYTES = 64 << 10
MAX_UNGREETED = 64
_CLOSE_WAIT_S = 1.0  # shutdown: how long closing connections may take (like gRPC's grace)


class FramedConnection(asyncio.Protocol):
    """One peer's connection. Subclasses say what a message is (`parse`), what to do with it
    (`on_message`), how a refusal is worded on their wire (`refusal_message`) and what the end
    of the connection releases (`release`)."""

    peer = "peer"  # for log lines: "trainer", "producer"
    socket_name = "socket"  # for refusals: "step socket", "ingest socket"
    hello_name = "Hello"  # the first message's type, for the hello timeout's refusal
    log = logging.getLogger("odbd")

    def __init__(self, connections: set[FramedConnection]) -> None:
        self._connections = connections
        self._frames = FrameBuffer(first_frame_limit=HELLO_MAX_BYTES, first_frame=self.hello_name)
        self._greeted = False  # the hello arrived (hello_done)
        self._transport: asyncio.Transport | None = None
        self._sender: asyncio.Task[None] | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._hello_timer: asyncio.TimerHandle | None = None
        self._closed = False

    # -- what a subclass says --------------------------------------------------------------

    def parse(self, payload: bytes) -> Message:
        raise NotImplementedError

    def on_message(self, message: Any) -> None:
        raise NotImplementedError

    def refusal_message(self, refusal: Refusal) -> Message:
        raise NotImplementedError

    def release(self) -> None:
        """The connection ended: give back what the peer held (called once)."""

    def on_error(self, error: Exception) -> Refusal | None:
        """A refusal for an exception of on_message that is the peer's fault, else None."""
        return None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        ungreeted = sum(1 for c in self._connections if not c._greeted)
        self._connections.add(self)
        refusal = self._peer_refusal(transport)
        if refusal is None and ungreeted >= MAX_UNGREETED:
            refusal = Refusal(
                "RESOURCE_EXHAUSTED",
                f"{ungreeted} connections of the {self.socket_name} are waiting for their "
                f"{self.hello_name} (at most {MAX_UNGREETED}); retry once they said it or left",
            )
        if refusal is not None:
            self.refuse(refusal)
            return
        self._hello_timer = asyncio.get_running_loop().call_later(
            HELLO_TIMEOUT_S,
            self.refuse,
            Refusal("INVALID_ARGUMENT", f"no {self.hello_name} within {HELLO_TIMEOUT_S:g} s"),
        )

    def _peer_refusal(self, transport: asyncio.BaseTransport) -> Refusal | None:
        """A peer of another user than the daemon's (or root) is refused before it sends a
        byte: the socket is 0600, so one only gets here through a file-mode mistake."""
        sock = transport.get_extra_info("socket")
        if sock is None:  # not a unix socket (unit tests' fake transports)
            return None
        try:
            peer = peer_credentials(sock)
        except OSError as error:
            return Refusal("PERMISSION_DENIED", f"the peer's credentials are unreadable: {error}")
        own = os.getuid()
        if trusted_uid(peer.uid, own):
            return None
        self.log.warning(
            "%s refused: pid %d runs as uid %d, not as the daemon's user (uid %d) or root; "
            "check the modes of %s and of its directory",
            self.peer,
            peer.pid,
            peer.uid,
            own,
            self.socket_name,
        )
        return Refusal(
            "PERMISSION_DENIED",
            f"uid {peer.uid} may not use this daemon (it serves uid {own} and root); run the "
            f"{self.peer} as the daemon's user",
        )

    def data_received(self, data: bytes) -> None:
        try:
            for payload in self._frames.feed(data):
                if self._closed:
                    return
                self.on_message(self.parse(payload))
        except (FrameError, DecodeError) as error:
            what = f"unreadable message on the {self.socket_name}: {error}"
            self.refuse(Refusal("INVALID_ARGUMENT", what))
        except Exception as error:
            refusal = self.on_error(error)
            if refusal is None:  # a bug: drop this peer (what it held goes back), keep the daemon
                self.log.exception("a %s's message failed", self.peer)
                refusal = Refusal("INTERNAL", f"odbd failed on this message (a bug): {error!r}")
            self.refuse(refusal)

    def eof_received(self) -> bool:
        return False  # the peer is done: close our side too (connection_lost releases)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._connections.discard(self)
        self.hello_done()
        if self._sender is not None:
            self._sender.cancel()
        self.release()
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- for subclasses --------------------------------------------------------------------

    def close(self) -> None:
        """Ends the connection after what is buffered (daemon shutdown)."""
        if self._transport is not None:
            self._transport.close()

    def hello_done(self) -> None:
        self._greeted = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()

    def refuse(self, refusal: Refusal) -> None:
        """Sends the refusal, then ends the connection."""
        if self._closed or self._transport is None:
            return
        self.log.info("%s refused: %s", self.peer, refusal.message)
        self.write([self.refusal_message(refusal)])
        self._closed = True
        self._transport.close()

    def write(self, messages: list[Message]) -> None:
        self.write_payloads([m.SerializeToString() for m in messages])

    def write_payloads(self, payloads: list[bytes]) -> None:
        """Writes serialized messages, one frame each, in one write."""
        assert self._transport is not None
        self._transport.write(b"".join([frame(p) for p in payloads]))

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


class FramedServer:
    """A unix stream server at `path`, mode 0600, one `FramedConnection` per peer."""

    def __init__(
        self, path: str, make_connection: Callable[[set[FramedConnection]], FramedConnection]
    ) -> None:
        self.path = path
        self._make_connection = make_connection
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[FramedConnection] = set()
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the file we bound

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        old_umask = os.umask(0o177)  # created 0600: only this user connects (like the gRPC one)
        try:
            self._server = await loop.create_unix_server(
                lambda: self._make_connection(self._connections), self.path
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
