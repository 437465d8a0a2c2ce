"""A non-hub daemon's side of the barrier: one Join stream to its parent for the job's lifetime.

The parent is the hub, or a relay of the tree (tree.py) that forwards this node's contributions
and passes the hub's results and aborts down; "the hub" below means whichever it is. A relay's
own Spoke hands every result and failure to its children too (`relay`, `on_failure`).

A reader task turns the hub's messages into the outcome of each pending round: a RoundResult
resolves that round, an Abort or a broken stream fails every pending and later round. A local
backstop deadline (round timeout plus a grace for the hub's own message to arrive) makes sure
`exchange` returns even when the hub hangs without closing the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

import grpc

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.errors import OdbdError
from odbd.round import auth
from odbd.round.config import CHANNEL_OPTIONS, PROTOCOL_VERSION, RoundConfig
from odbd.round.errors import (
    ERROR_OF_ABORT_KIND,
    HandshakeError,
    ParentClosedError,
    PeerLostError,
    RoundTimeoutError,
)
from odbd.round.server import JOIN_METHOD
from odbd.round.stall import TICK_S, StallWatch, frozen_past_deadline
from odbd.round.table import CompletedRound
from odbd.round.traffic import RoundTraffic

_LEAVE_WRITE_S = 5.0
# Reconnect quickly while the hub is still starting, instead of gRPC's 1 s..120 s backoff.
_CONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)

_BUSY_RETRY_S = 0.5  # after RESOURCE_EXHAUSTED: the hub had too many handshakes under way


def grace_s(timeout_s: float) -> float:
    """How much longer than the hub's deadline a spoke waits for the hub's verdict."""
    return min(5.0, max(0.5, 0.25 * timeout_s))


async def _tick(watch: StallWatch, loop: asyncio.AbstractEventLoop) -> None:
    while True:
        await asyncio.sleep(TICK_S)
        watch.tick(loop.time())


def error_of_abort(abort: peer_pb2.Abort) -> OdbdError:
    return ERROR_OF_ABORT_KIND.get(abort.kind, PeerLostError)(abort.reason)


class Spoke:
    def __init__(
        self,
        config: RoundConfig,
        listen_address: str,
        traffic: RoundTraffic | None = None,
        relay: Callable[[peer_pb2.HubMessage], None] | None = None,
        on_failure: Callable[[OdbdError, peer_pb2.Abort | None], None] | None = None,
    ) -> None:
        self._config = config
        self.traffic = traffic if traffic is not None else RoundTraffic()
        self._listen_address = listen_address
        self._relay = relay
        self._on_failure = on_failure
        address = config.parent_address
        if config.parent == 0:
            self._hub = f"the hub node 0 ({address})"
        else:
            self._hub = f"node {config.parent} ({address}), its relay to the hub"
        options = CHANNEL_OPTIONS + _CONNECT_OPTIONS
        if config.tls is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            credentials = config.tls.channel_credentials()
            self._channel = grpc.aio.secure_channel(address, credentials, options)
        self._join = self._channel.stream_stream(
            JOIN_METHOD,
            request_serializer=peer_pb2.PeerMessage.SerializeToString,
            response_deserializer=peer_pb2.HubMessage.FromString,
        )
        # wait_for_ready: daemons start in any order, so keep trying until the hub listens.
        self._call = self._join(wait_for_ready=True)
        self._write_lock = asyncio.Lock()  # FIFO, so contributions leave in call order
        self._waiters: dict[int, asyncio.Future[peer_pb2.RoundResult]] = {}  # round -> result
        self._early: dict[int, peer_pb2.RoundResult] = {}  # results sent before we asked
        self._failure: OdbdError | None = None
        self._reader: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        """Hello, the token challenge both ways (auth.py), then waits for Welcome (every node
        joined); raises HandshakeError. A hub busy with other handshakes is retried."""
        config = self._config
        loop = asyncio.get_running_loop()
        watch = StallWatch(started_s := loop.time())  # was this process itself frozen?
        ticker = loop.create_task(_tick(watch, loop))
        try:
            async with asyncio.timeout(config.join_timeout_s + grace_s(config.join_timeout_s)):
                while not await self._handshake():
                    await asyncio.sleep(_BUSY_RETRY_S)
                    self._call = self._join(wait_for_ready=True)
        except TimeoutError:
            now_s = loop.time()
            stall = watch.longest_since(started_s, now_s)
            if frozen_past_deadline(stall, now_s - started_s, config.join_timeout_s):
                assert stall is not None
                raise HandshakeError(self._frozen_message(stall.duration_s)) from None
            raise HandshakeError(self._no_welcome_message()) from None
        finally:
            ticker.cancel()
        self._reader = asyncio.create_task(self._read())

    async def _handshake(self) -> bool:
        """True once welcomed; False if the hub was too busy to handshake (retry)."""
        config = self._config
        hello = peer_pb2.Hello(
            protocol_version=PROTOCOL_VERSION,
            job_id=config.job_id,
            node_rank=config.node_rank,
            fingerprint=config.settings,
            listen_address=self._listen_address,
            nonce=auth.new_nonce(),
        )
        try:
            await self._call.write(peer_pb2.PeerMessage(hello=hello))
            challenge = self._first_of(await self._call.read(), "challenge").challenge
            expected = auth.hub_proof(config.job_token, hello, challenge.nonce)
            if not auth.proof_matches(expected, challenge.hub_proof):
                # An empty proof tells a real hub why this node quits (its join-timeout error
                # names it) and gives an impostor nothing to guess the token from.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await self._call.write(peer_pb2.PeerMessage(proof=peer_pb2.Proof()))
                        await self._call.read()  # the hub's refusal: the proof arrived
                self._call.cancel()
                raise HandshakeError(
                    f"{self._hub} could not prove it holds this job's token, so node "
                    f"{config.node_rank} sent it nothing more: its --job-token-file differs "
                    "(or one of them has none), or another process holds the hub's address"
                )
            proof = peer_pb2.Proof(
                spoke_proof=auth.spoke_proof(config.job_token, hello, challenge.nonce)
            )
            await self._call.write(peer_pb2.PeerMessage(proof=proof))
            self._first_of(await self._call.read(), "welcome")
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                return False
            raise HandshakeError(
                f"{self._hub} refused node {config.node_rank} ({exc.code().name}): {exc.details()}"
            ) from None
        return True

    def _first_of(self, message: object, kind: str) -> peer_pb2.HubMessage:
        """`message` if it is a `kind`; raises the hub's Abort, or HandshakeError otherwise."""
        if not isinstance(message, peer_pb2.HubMessage) or message.WhichOneof("kind") not in (
            kind,
            "abort",
        ):
            raise HandshakeError(f"{self._hub} ended the handshake without a {kind.title()}")
        if message.WhichOneof("kind") == "abort":
            raise error_of_abort(message.abort)
        return message

    def _frozen_message(self, stalled_s: float) -> str:
        timeout = self._config.join_timeout_s
        return (
            f"node {self._config.node_rank} was not running for {stalled_s:.1f} s of its "
            f"{timeout:g} s join deadline (this daemon was stopped: SIGSTOP, a debugger, a "
            f"paused VM or a starved host), so the deadline passed before it could join "
            f"{self._hub}, reachable or not; the hub may still wait for it or may have given "
            "up (see its log). Start the job again on every node, and keep this daemon "
            "running while the job forms"
        )

    def _no_welcome_message(self) -> str:
        timeout = self._config.join_timeout_s
        if self._channel.get_state() is grpc.ChannelConnectivity.READY:
            return (
                f"{self._hub} accepted the connection but did not welcome node "
                f"{self._config.node_rank} within {timeout:g} s; see its log"
                + (
                    ""
                    if self._config.parent == 0
                    else " (a relay joins the hub once every node it relays for joined it)"
                )
            )
        tls = (
            "; with --tls-*, also that both certificates come from the same --tls-ca and name "
            "the hosts in --peers"
            if self._config.tls
            else ""
        )
        return (
            f"could not reach {self._hub} within the {timeout:g} s join deadline; start node "
            f"{self._config.parent}'s daemon, and check --peers (node 0 first) and that its "
            f"--listen is reachable{tls}"
        )

    async def _read(self) -> None:
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                kind = msg.WhichOneof("kind")
                if kind == "result":
                    self.traffic.received += msg.ByteSize()
                    if self._relay is not None:
                        self._relay(msg)
                    self._deliver(msg.result)
                elif kind == "abort":
                    self._fail(error_of_abort(msg.abort), msg.abort)
                    return
            self._fail(ParentClosedError(f"{self._hub} ended the round stream (it shut down)"))
        except grpc.aio.AioRpcError as exc:
            self._fail(
                PeerLostError(
                    f"lost the stream to {self._hub} ({exc.code().name}: {exc.details()}); "
                    f"{'the hub' if self._config.parent == 0 else 'that'} daemon exited or the "
                    "network failed, and the job cannot continue without it: restart the job on "
                    "all nodes"
                )
            )

    def _deliver(self, result: peer_pb2.RoundResult) -> None:
        waiter = self._waiters.pop(result.round, None)
        if waiter is None:
            # An early result (peer.proto): this node has not asked for the round yet.
            self._early[result.round] = result
        elif not waiter.done():
            waiter.set_result(result)

    def _fail(self, error: OdbdError, abort: peer_pb2.Abort | None = None) -> None:
        if self._failure is not None:
            return
        self._failure = error
        if self._on_failure is not None:
            self._on_failure(error, abort)
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(type(error)(str(error)))
        self._waiters.clear()

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))

    @property
    def failure(self) -> OdbdError | None:
        """The job's failure as this stream knows it (None while it goes on)."""
        return self._failure

    async def exchange(
        self, round_index: int, payload: bytes, subtree: Sequence[bytes] = ()
    ) -> CompletedRound:
        """This node's contribution, or a relay's: `subtree` holds one payload per node of its
        subtree (tree.py) and `payload` is empty."""
        self.raise_failure()
        waiter: asyncio.Future[peer_pb2.RoundResult] = asyncio.get_running_loop().create_future()
        early = self._early.pop(round_index, None)
        if early is not None:
            waiter.set_result(early)
        else:
            self._waiters[round_index] = waiter
        contribution = peer_pb2.Contribution(
            round=round_index,
            node_rank=self._config.node_rank,
            payload=payload,
            subtree_payloads=subtree,
        )
        async with self._write_lock:
            # A failed write means the stream is gone; the reader reports why, so wait for it.
            # InvalidStateError: the hub already finished the call (say it aborted the job at
            # the round deadline while this daemon was frozen), and this write ran before the
            # reader saw the verdict: it failed the job as "an internal error" instead of the
            # hub's reason.
            with contextlib.suppress(
                grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError
            ):
                message = peer_pb2.PeerMessage(contribution=contribution)
                self.traffic.sent += message.ByteSize()
                await self._call.write(message)
        timeout = self._config.round_timeout_s
        try:
            async with asyncio.timeout(timeout + grace_s(timeout)):
                result = await waiter
        except TimeoutError:
            self._fail(
                RoundTimeoutError(
                    f"round {self._config.round_name(round_index)} did not complete within the "
                    f"{timeout:g} s round "
                    f"deadline and {self._hub} sent no verdict; it may be hung or overloaded"
                )
            )
            self.raise_failure()
            raise
        payloads = list(result.payloads)
        if result.recipient_payload_omitted:
            payloads[self._config.node_rank] = payload
        return CompletedRound(round_index, tuple(payloads), result.last_node_rank)

    async def report_waiting(self, round_index: int, reason: str) -> None:
        """Tells the hub why this node has not contributed `round_index` yet (best effort:
        a broken stream is reported by the reader, and the hub's deadline holds regardless)."""
        waiting = peer_pb2.Waiting(
            round=round_index, reason=reason, node_rank=self._config.node_rank
        )
        await self.send_up(peer_pb2.PeerMessage(waiting=waiting))

    async def send_up(self, message: peer_pb2.PeerMessage) -> None:
        """A Waiting or a relay's Abort to the parent, best effort (within 1 s): the parent's
        own deadlines hold regardless."""
        if self._reader is None:
            return  # not joined yet: the parent knows nothing of this node's subtree
        with contextlib.suppress(Exception):
            async with self._write_lock, asyncio.timeout(1.0):
                await self._call.write(message)

    async def close(self) -> None:
        """Says Leave, then waits briefly for the hub to end the stream cleanly."""
        self._fail(PeerLostError("the round barrier of this node was closed"))
        if self._reader is None:  # never joined: nothing to say goodbye to
            self._call.cancel()
            await self._channel.close()
            return
        leave = peer_pb2.PeerMessage(leave=peer_pb2.Leave(reason="shutdown"))
        # A Leave that does not reach the parent reads there as a lost node, which fails a job
        # still waiting for its end: give the write room on a loaded machine.
        with contextlib.suppress(Exception):
            async with self._write_lock, asyncio.timeout(_LEAVE_WRITE_S):
                await self._call.write(leave)
                await self._call.done_writing()
        if self._reader is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._reader, 1.0)
        self._call.cancel()
        await self._channel.close()
