"""The hub (node 0): admits every daemon's Join stream, collects each round, broadcasts the result.

In a relay tree (tree.py) the same class serves a relay's children: it admits only them,
collects its subtree's rounds and hands each complete one to the relay's own exchange (which
sends it up, barrier.py) instead of broadcasting; the parent's results and aborts come back
down through relay_down() and fail_from_parent(), and the relay's own failures go up through
`report_up`. "Spoke" below is any child stream; admission.py admits them (the handshake).

Each spoke stream is served by two coroutines: the RPC handler writes what the protocol queued
in the spoke's outbox, and a reader task feeds contributions to the round table. Protocol
decisions (admit, complete, expire, abort) are synchronous, so a round's completion and its
broadcast happen in one step of the event loop and can never interleave with another round's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from odbclient.wire.odbd.v1 import common_pb2, peer_pb2
from odbd.errors import InvariantError, OdbdError
from odbd.round.admission import (
    Admission,
    OutboxEnd,
    SpokeStream,
    names_of,
)
from odbd.round.config import PROTOCOL_VERSION, RoundConfig, max_payload_bytes
from odbd.round.errors import (
    ERROR_OF_ABORT_KIND,
    HandshakeError,
    ParentClosedError,
    PeerFailedError,
    PeerLostError,
    RoundTimeoutError,
)
from odbd.round.log_budget import LogBudget
from odbd.round.missing import why_all_missing
from odbd.round.spoke import grace_s
from odbd.round.stall import TICK_S, StallWatch
from odbd.round.table import CompletedRound, ProtocolViolation, RoundTable
from odbd.round.traffic import RoundTraffic
from odbd.round.tree import SubtreeMismatch, describe_subtree, unpack_subtree

log = logging.getLogger(__name__)


class Hub(Admission):
    def __init__(
        self,
        config: RoundConfig,
        on_serving: Callable[[bool], None],
        traffic: RoundTraffic | None = None,
        report_up: Callable[[peer_pb2.PeerMessage], None] | None = None,
    ) -> None:
        self._config = config
        self.traffic = traffic if traffic is not None else RoundTraffic()
        self._on_serving = on_serving
        # A relay (not node 0): what it says to its parent about its subtree (aborts, waiting).
        self._report_up = report_up
        self._relay = config.parent is not None
        self._layout = config.layout
        self._children = config.children
        self._table = RoundTable(
            config.num_nodes,
            max_payload_bytes(config.num_nodes),
            members=self._layout.subtree(config.node_rank),
        )
        self._spokes: dict[int, SpokeStream] = {}  # node -> admitted spoke
        self._advertised: dict[int, str] = {}  # node -> listener address from its Hello
        self._refusals: dict[int, str] = {}  # node -> why its last Hello was refused
        self._waiters: dict[int, asyncio.Future[CompletedRound]] = {}  # the hub's own rounds
        # round -> what the hub sends instead of every payload (exchange(reduce=...)): set by
        # the hub's own contribution, so before the round can complete
        self._reducers: dict[int, Callable[[list[bytes]], bytes]] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}  # round -> its deadline
        self._sent_early: dict[int, int] = {}  # round -> the spoke that got its result early
        self._failure: OdbdError | None = None
        self._waiting: dict[int, tuple[int, str]] = {}  # node -> (round, why it has not sent it)
        self._loop = asyncio.get_running_loop()
        self._formed: asyncio.Future[None] = self._loop.create_future()
        self._reported_up = False  # a relay told its parent of a failure (_abort)
        self._verdict_timer: asyncio.TimerHandle | None = None  # ... and awaits its verdict
        # every child joined (at the hub the same moment as _formed; a relay then joins its
        # parent, and welcomes its children with the parent's Welcome)
        self._children_joined: asyncio.Future[None] = self._loop.create_future()
        self._watch = StallWatch(self._loop.time())
        self._ticker = self._loop.create_task(self._tick())
        self._handshaking = 0  # streams between their start and admission or refusal
        self._refusal_log = LogBudget()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._watch.tick(self._loop.time())

    # -- the job's formation ------------------------------------------------------------------

    async def wait_formed(self) -> None:
        """Returns once every node joined; raises HandshakeError on a join timeout or refusal.
        A relay's returns once its children joined (then it joins its parent and welcome()s)."""
        timer = self._loop.call_later(self._config.join_timeout_s, self._join_expired)
        try:
            await (self._children_joined if self._relay else self._formed)
        finally:
            timer.cancel()

    def welcome(self) -> None:
        """A relay: its parent welcomed it (the whole tree joined), so it welcomes its children."""
        lost = [n for n in self._children if n not in self._spokes]
        if lost:
            reason = (
                f"{names_of(self._name(n) for n in lost)} left node {self._config.node_rank} "
                "while the job formed; restart it and the job on all nodes"
            )
            self._abort(peer_pb2.ABORT_KIND_JOIN_TIMEOUT, 0, reason, lost, HandshakeError)
            self.raise_failure()
        self._form()

    def _form(self) -> None:
        if self._formed.done():
            return
        welcome = peer_pb2.Welcome(
            protocol_version=PROTOCOL_VERSION, num_nodes=self._config.num_nodes
        )
        data = peer_pb2.HubMessage(welcome=welcome).SerializeToString()
        for spoke in self._spokes.values():
            spoke.outbox.put_nowait(data)
        self._formed.set_result(None)
        self._on_serving(True)
        log.info("all %d nodes joined the round barrier", self._config.num_nodes)

    # -- one spoke's stream -------------------------------------------------------------------

    async def join(self, _requests: object, context: grpc.aio.ServicerContext) -> None:
        """The Peer/Join handler: handshake, then write the outbox until the stream ends."""
        spoke = await self._guarded_handshake(context)
        reader = asyncio.create_task(self._read(spoke, context))
        try:
            while not isinstance(item := await spoke.outbox.get(), OutboxEnd):
                await context.write(item)
            if item.code is not grpc.StatusCode.OK:
                await context.abort(item.code, item.details)
        finally:
            reader.cancel()
            if spoke.state == "active":
                # Cancelled by gRPC: the spoke's process or connection went away.
                self._lost(
                    spoke, "its stream to the hub broke (the daemon exited or the network failed)"
                )

    async def _read(self, spoke: SpokeStream, context: grpc.aio.ServicerContext) -> None:
        _lost_without_leave = (
            "its stream ended without a Leave (the daemon was killed, crashed, or its "
            "connection broke)"
        )
        try:
            while (msg := await context.read()) is not grpc.aio.EOF:
                if not isinstance(msg, peer_pb2.PeerMessage):
                    raise ProtocolViolation(f"{spoke.name} sent bytes that are not a PeerMessage")
                kind = msg.WhichOneof("kind")
                if kind == "leave":
                    self._left(spoke)
                    return
                if kind == "waiting":
                    waiter = self._of_subtree(spoke, msg.waiting.node_rank, "Waiting")
                    self.note_waiting(waiter, msg.waiting.round, msg.waiting.reason)
                    continue
                if kind == "abort":
                    self._abort_from_child(spoke, msg.abort)
                    return
                contribution = msg.contribution
                if kind != "contribution" or contribution.node_rank != spoke.node:
                    raise ProtocolViolation(
                        f"{spoke.name} sent a {kind} for node {contribution.node_rank} after "
                        "its handshake"
                    )
                self.traffic.received += msg.ByteSize()
                try:
                    nodes = unpack_subtree(
                        self._layout,
                        spoke.node,
                        contribution.payload,
                        contribution.subtree_payloads,
                    )
                except SubtreeMismatch as exc:
                    raise ProtocolViolation(str(exc)) from None
                for node, payload in nodes:
                    self._contribute(node, contribution.round, payload)
            # A killed process reads as a plain end of stream here, which is why a deliberate
            # shutdown says Leave first.
            self._lost(spoke, _lost_without_leave)
        except ProtocolViolation as exc:
            self._refuse_stream(spoke, str(exc))
        except grpc.aio.AioRpcError as exc:
            self._lost(spoke, f"its stream failed with {exc.code().name}: {exc.details()}")

    def _of_subtree(self, spoke: SpokeStream, node: int, what: str) -> int:
        if node not in self._layout.subtree(spoke.node):
            raise ProtocolViolation(
                f"{spoke.name} sent a {what} about node {node}, which is not in its subtree"
            )
        return node

    def _abort_from_child(self, spoke: SpokeStream, abort: peer_pb2.Abort) -> None:
        """A relay below failed its subtree: the job fails everywhere with its reason."""
        missing = [self._of_subtree(spoke, ref.node_rank, "Abort") for ref in abort.missing]
        error = ERROR_OF_ABORT_KIND.get(abort.kind, PeerLostError)
        if abort.kind == peer_pb2.ABORT_KIND_JOB_FAILED and self._failure is None:
            log.error("%s failed the job; every node stops with its reason", spoke.name)
        self._abort(abort.kind, abort.round, abort.reason[:_MAX_ABORT_CHARS], missing, error)

    def _refuse_stream(self, spoke: SpokeStream, why: str) -> None:
        log.error("refusing %s: %s", spoke.name, why)
        if spoke.state == "active":
            spoke.outbox.put_nowait(OutboxEnd(grpc.StatusCode.INVALID_ARGUMENT, why))
            spoke.state = "ending"
        round_index = self._table.next_round(spoke.node)
        reason = f"{spoke.name} broke the round protocol and was refused: {why}"
        missing = self._layout.subtree(spoke.node)
        self._abort(peer_pb2.ABORT_KIND_PEER_LOST, round_index, reason, missing, PeerLostError)

    def _lost(self, spoke: SpokeStream, why: str) -> None:
        if spoke.state != "active":
            return
        spoke.state = "lost"
        if not self._formed.done():
            # Before the job formed nothing depends on it yet: let a restarted daemon rejoin.
            del self._spokes[spoke.node]
            return
        round_index = self._table.next_round(spoke.node)
        cut_off = describe_subtree(self._layout, spoke.node)
        if cut_off:
            cut_off += ", which the loss cut off from the job"
        reason = (
            f"lost {spoke.name}{cut_off} before round {self._config.round_name(round_index)}: "
            f"{why}. The job cannot continue without every node; restart it on all nodes "
            "(resume from --state-dir)"
        )
        missing = self._layout.subtree(spoke.node)
        self._abort(peer_pb2.ABORT_KIND_PEER_LOST, round_index, reason, missing, PeerLostError)

    def _left(self, spoke: SpokeStream) -> None:
        """The spoke said Leave (shutdown): fine, unless a round still needs it."""
        if spoke.state != "active":
            return
        spoke.state = "left"
        spoke.outbox.put_nowait(OutboxEnd(grpc.StatusCode.OK))
        if not self._formed.done():
            del self._spokes[spoke.node]
            return
        self._check_departed(max(self._table.open_rounds(), default=-1))

    def _check_departed(self, round_index: int) -> None:
        """Aborts if a node that closed its stream would be needed for `round_index`."""
        for spoke in self._spokes.values():
            if spoke.state == "left" and self._table.next_round(spoke.node) <= round_index:
                reason = (
                    f"{spoke.name} shut down (said Leave) before contributing round "
                    f"{round_index}; every node must run the same number of rounds. Restart "
                    "the job on all nodes"
                )
                self._abort(
                    peer_pb2.ABORT_KIND_PEER_LOST, round_index, reason, [spoke.node], PeerLostError
                )
                return

    # -- rounds -------------------------------------------------------------------------------

    async def exchange(
        self,
        round_index: int,
        payload: bytes,
        reduce: Callable[[list[bytes]], bytes] | None = None,
    ) -> CompletedRound:
        """The hub's own contribution; resolves when the round completes or the job aborts.

        With `reduce`, every node (the hub too) gets the one payload reduce(every payload in
        node order) instead of every payload: the split round (daemon/split_round.py). If it
        raises, a node sent a payload the job cannot use and the job fails with its message."""
        self.raise_failure()
        waiter: asyncio.Future[CompletedRound] = self._loop.create_future()
        self._waiters[round_index] = waiter
        if reduce is not None:
            self._reducers[round_index] = reduce
        try:
            self._contribute(self._config.node_rank, round_index, payload)
        except ProtocolViolation as exc:
            raise InvariantError(f"the hub's own contribution broke the protocol: {exc}") from None
        return await waiter

    def note_waiting(self, node: int, round_index: int, reason: str) -> None:
        """Why `node` has not contributed `round_index` yet; quoted if that round times out.
        A relay passes it on to its parent, so the hub can quote it too."""
        self._waiting[node] = (round_index, reason[:_MAX_REASON_CHARS])
        if self._report_up is not None:
            waiting = peer_pb2.Waiting(
                round=round_index, reason=reason[:_MAX_REASON_CHARS], node_rank=node
            )
            self._report_up(peer_pb2.PeerMessage(waiting=waiting))

    def _contribute(self, node: int, round_index: int, payload: bytes) -> None:
        if self._failure is not None:
            return  # the job is over; late contributions change nothing
        self._waiting.pop(node, None)
        done = self._table.add(node, round_index, payload)
        if done is None:
            if round_index not in self._timers:
                self._timers[round_index] = self._loop.call_later(
                    self._config.round_timeout_s, self._round_expired, round_index
                )
                if self._relay:  # halfway: tell the hub who below holds the round up
                    self._loop.call_later(
                        0.5 * self._config.round_timeout_s, self._report_missing, round_index
                    )
            self._check_departed(round_index)
            self._send_early(round_index)
            return
        timer = self._timers.pop(round_index, None)
        if timer is not None:
            timer.cancel()
        if self._relay:
            # The subtree's round, for the relay's own exchange to send up (barrier.py); the
            # parent's result comes back down through relay_down().
            waiter = self._waiters.pop(round_index, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(done)
            return
        reduce = self._reducers.pop(round_index, None)
        if reduce is not None:
            try:
                reduced = reduce(list(done.payloads))
            except Exception as exc:  # noqa: BLE001 (a hostile payload must not crash the hub)
                name = self._config.round_name(round_index)
                reason = (
                    f"{exc}"
                    if isinstance(exc, OdbdError)  # names the node and the round itself
                    else f"round {name} cannot be planned: {exc}"
                )
                self._abort(peer_pb2.ABORT_KIND_PEER_LOST, round_index, reason, [], PeerLostError)
                return
            done = CompletedRound(round_index, (reduced,), done.last_node)
        result = peer_pb2.RoundResult(
            round=round_index, payloads=done.payloads, last_node_rank=done.last_node
        )
        data = peer_pb2.HubMessage(result=result).SerializeToString()
        has_it = self._sent_early.pop(round_index, None)
        for spoke in self._spokes.values():
            if spoke.state == "active" and spoke.node != has_it:
                spoke.outbox.put_nowait(data)
                self.traffic.sent += len(data)
        waiter = self._waiters.pop(round_index, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(done)
        # The node that just completed this round may be the only one missing from the next.
        self._send_early(round_index + 1)

    def _send_early(self, round_index: int) -> None:
        """Sends a round's result to its one missing spoke before it contributes (peer.proto)."""
        if round_index in self._reducers or self._relay:
            # A reduced round's result needs every payload, the straggler's too; a relay's
            # results are its parent's.
            return
        node = self._table.straggler(round_index)
        spoke = self._spokes.get(node) if node else None  # never node 0: the hub itself
        if spoke is None or spoke.state != "active" or round_index in self._sent_early:
            return
        result = peer_pb2.RoundResult(
            round=round_index,
            payloads=self._table.partial(round_index),
            last_node_rank=spoke.node,
            recipient_payload_omitted=True,
        )
        data = peer_pb2.HubMessage(result=result).SerializeToString()
        spoke.outbox.put_nowait(data)
        self.traffic.sent += len(data)
        self._sent_early[round_index] = spoke.node

    def relay_down(self, message: peer_pb2.HubMessage) -> None:
        """A relay: its parent's result of a round, passed to every child unchanged."""
        if self._failure is not None:
            return
        data = message.SerializeToString()
        for spoke in self._spokes.values():
            if spoke.state == "active":
                spoke.outbox.put_nowait(data)
                self.traffic.sent += len(data)

    def fail_from_parent(self, error: OdbdError, abort: peer_pb2.Abort | None) -> None:
        """A relay: the job failed above it (the hub's Abort, or the parent's stream broke);
        its children get the same Abort, or one naming the parent. A parent that ended the
        stream normally (it shut down) ends the children's streams normally too: each of them
        decides, as this relay does, whether its job still needed a round (a spoke after its
        last round must not read the hub's normal end as a failure)."""
        if self._failure is not None:
            return
        if self._verdict_timer is not None:
            self._verdict_timer.cancel()
        self._failure = type(error)(str(error))
        if isinstance(error, ParentClosedError):
            self._end_streams()
        else:
            log.error("%s", error)
            if abort is None:
                abort = peer_pb2.Abort(
                    kind=peer_pb2.ABORT_KIND_PEER_LOST, reason=str(error), round=0
                )
            self._end_children(peer_pb2.HubMessage(abort=abort).SerializeToString(), str(error))
        self._fail_local(type(error), str(error))
        self._on_serving(False)

    def _round_expired(self, round_index: int) -> None:
        self._timers.pop(round_index, None)
        missing = self._table.missing(round_index)
        why = why_all_missing(
            missing, round_index, self._waiting, self._layout, self._children, self._name
        )
        reason = (
            f"round {self._config.round_name(round_index)} did not complete within the "
            f"{self._config.round_timeout_s:g} s round deadline"
            f"{'' if not self._relay else f' at node {self._config.node_rank}, a relay'}: "
            f"{why}. "
            "Every daemon stops this job; check why that daemon stalled (its log, producers and "
            "trainers) or raise the round timeout"
        )
        self._abort(
            peer_pb2.ABORT_KIND_ROUND_TIMEOUT, round_index, reason, missing, RoundTimeoutError
        )

    # -- failure and shutdown -----------------------------------------------------------------

    def _abort(
        self,
        kind: int,
        round_index: int,
        reason: str,
        missing: list[int],
        error: type[OdbdError],
    ) -> None:
        """Fails the job everywhere: every stream gets an Abort, every local wait the error.

        A joined relay does not decide: it reports the failure to the hub, whose Abort (this
        one, or the hub's own if it failed first) comes back down to every node, so every
        daemon fails with the same message. If no verdict comes within a grace (the hub
        hangs), the relay fails its subtree itself."""
        if self._failure is not None or self._reported_up:
            return
        if kind in (peer_pb2.ABORT_KIND_ROUND_TIMEOUT, peer_pb2.ABORT_KIND_PEER_LOST):
            reason = self._blame_own_stall(round_index, reason, missing)
        refs = [common_pb2.NodeRef(node_rank=n, address=self._address(n)) for n in missing]
        abort = peer_pb2.Abort(kind=kind, round=round_index, reason=reason, missing=refs)  # type: ignore[arg-type]
        if self._report_up is not None and self._formed.done():
            log.error("reporting to node %s: %s", self._config.parent, reason)
            self._reported_up = True
            self._report_up(peer_pb2.PeerMessage(abort=abort))
            grace = grace_s(self._config.round_timeout_s)
            self._verdict_timer = self._loop.call_later(
                grace, self._fail_alone, error, reason, abort
            )
            return
        log.error("%s", reason)
        self._failure = error(reason)
        self._end_children(peer_pb2.HubMessage(abort=abort).SerializeToString(), reason)
        self._fail_local(error, reason)
        self._on_serving(False)

    def abort_job(self, reason: str) -> None:
        """This daemon failed the job itself: every node fails with `reason` (the hub aborts
        everyone; a relay reports it up, as its subtree's failures, and the hub's Abort comes
        back down). Nothing if the job already failed here."""
        self._abort(peer_pb2.ABORT_KIND_JOB_FAILED, 0, reason, [], PeerFailedError)

    def _report_missing(self, round_index: int) -> None:
        """A relay, half a deadline into a round its subtree has not completed: why it has not
        sent the round up, for the hub to quote should the round time out (a node stopped
        without a word, say SIGSTOP, has sent no Waiting of its own)."""
        if self._failure is not None or round_index not in self._timers:
            return
        missing = self._table.missing(round_index)
        if not missing or self._config.node_rank in missing:
            return  # complete, or the relay's own reason (its round loop's) stands
        names = names_of(self._name(n) for n in missing)
        self.note_waiting(
            self._config.node_rank, round_index, f"{names} below it did not contribute yet"
        )

    def _fail_alone(self, error: type[OdbdError], reason: str, abort: peer_pb2.Abort) -> None:
        """A relay whose report got no verdict from above within the grace."""
        grace = grace_s(self._config.round_timeout_s)
        reason = (
            f"{reason} (node {self._config.node_rank} reported this to node "
            f"{self._config.parent} and got no verdict within {grace:g} s)"
        )
        abort.reason = reason
        self.fail_from_parent(error(reason), abort)

    def _end_children(self, abort_data: bytes, reason: str) -> None:
        for spoke in self._spokes.values():
            if spoke.state == "active":
                spoke.outbox.put_nowait(abort_data)
                spoke.outbox.put_nowait(OutboxEnd(grpc.StatusCode.ABORTED, reason))
                spoke.state = "ending"

    def _blame_own_stall(self, round_index: int, reason: str, missing: list[int]) -> str:
        """The hub's own freeze, not the peers, when this process did not run long enough that
        a peer's contribution or its patience ran out unheard (peers give up after the round
        deadline plus a grace). Half the deadline frozen is enough to make the peers' timing
        meaningless."""
        timeout = self._config.round_timeout_s
        now = self._loop.time()
        stall = self._watch.longest_since(now - timeout - grace_s(timeout) - 1.0, now)
        if stall is None or stall.duration_s < 0.5 * timeout:
            return reason
        peers = names_of(self._name(n) for n in missing if n != 0)
        return (
            f"round {self._config.round_name(round_index)} failed because this daemon "
            f"({self._me()}) itself did not "
            f"run for {stall.duration_s:.1f} s, against a {timeout:g} s round deadline: the "
            "process was stopped or starved (SIGSTOP, a paused VM or container, swapping, CPU "
            f"starvation), so it could not hear the other daemons in time; {peers} is not to "
            "blame. Every daemon stops this job; find what froze this host's odbd, then "
            "restart the job on all nodes (resume from --state-dir). What the hub saw on "
            f"resuming: {reason}"
        )

    def _fail_local(self, error: type[OdbdError], reason: str) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(error(reason))
        self._waiters.clear()
        forming = self._children_joined if self._relay else self._formed  # what start() awaits
        if not forming.done():
            forming.set_exception(error(reason))

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure))

    @property
    def failure(self) -> OdbdError | None:
        """The job's failure as this daemon's hub side knows it (None while it goes on)."""
        return self._failure

    def _end_streams(self) -> None:
        """Ends every active child's stream normally, after what is already queued for it."""
        for spoke in self._spokes.values():
            if spoke.state == "active":
                spoke.outbox.put_nowait(OutboxEnd(grpc.StatusCode.OK))
                spoke.state = "ending"

    def close(self) -> None:
        """Ends every stream normally after what is already queued (results of past rounds)."""
        self._ticker.cancel()
        self._end_streams()
        if self._failure is None:
            reason = (
                f"the round barrier of node {self._config.node_rank} was closed; no more rounds "
                "can be exchanged"
            )
            self._failure = PeerLostError(reason)
            self._fail_local(PeerLostError, reason)
        for forming in (self._formed, self._children_joined):
            if not forming.done():
                forming.cancel()

    def _me(self) -> str:
        node = self._config.node_rank
        return "node 0, the hub" if node == 0 else f"node {node}, a relay of the round tree"

    def _address(self, node: int) -> str:
        configured = self._config.peers[node] if node < len(self._config.peers) else ""
        if configured and not configured.endswith(":0"):
            return configured
        return self._advertised.get(node) or configured

    def _name(self, node: int) -> str:
        address = self._address(node)
        return f"node {node} ({address})" if address else f"node {node}"


_MAX_REASON_CHARS = 1024
_MAX_ABORT_CHARS = 16 * 1024  # a relay's abort reason quotes a few nodes' waiting reasons
