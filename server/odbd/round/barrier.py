"""RoundBarrier: every daemon contributes round k's payload and gets all nodes' payloads back.

    barrier = RoundBarrier(config)
    await barrier.start()                       # the hub waits for every node; others join it
    payloads = await barrier.exchange(k, offer) # node -> payload, identical on every daemon
    await barrier.close()

Rounds go strictly in order 0, 1, 2, ...; `exchange(k + 1)` may start before `exchange(k)`
returned, so the next round's metadata is in flight while trainers consume this one. Every wait
has a deadline, and a failure (timeout, lost daemon) fails every daemon's pending and later
rounds with the same message.

The daemons form a relay tree (tree.py): a daemon with children serves them like the hub
(a Hub of its subtree) and is a Spoke of its parent; its exchange collects its subtree's
payloads, sends them up in one contribution, and returns the parent's result, which its Spoke
has already passed down to the children.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.errors import InvariantError, OdbdError
from odbd.round.config import RoundConfig, max_payload_bytes
from odbd.round.errors import ParentClosedError, PayloadTooLargeError
from odbd.round.hub import Hub
from odbd.round.server import PeerHealth, join_handler, not_the_hub_handler, serve
from odbd.round.spoke import Spoke
from odbd.round.table import CompletedRound
from odbd.round.traffic import RoundTraffic

_STOP_GRACE_S = 1.0  # lets spokes read the last round's result before the hub's server stops


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """What the last exchange took, for metrics (round duration, barrier straggler)."""

    round_index: int
    duration_s: float  # from this daemon's exchange() call to the result
    last_node: int  # the node whose contribution completed the round


class RoundBarrier:
    def __init__(self, config: RoundConfig) -> None:
        self._config = config
        self._next_round = 0
        self._max_payload_bytes = max_payload_bytes(config.num_nodes)
        self._health = PeerHealth()
        self._server: grpc.aio.Server | None = None
        self._listen_address = ""
        self._hub: Hub | None = None
        self._spoke: Spoke | None = None
        self._started = False
        self.last_round: RoundRecord | None = None
        self.traffic = RoundTraffic()  # bytes of round messages over this daemon's streams
        self._pending_up: set[asyncio.Task[None]] = set()  # a relay's reports to its parent

    @property
    def config(self) -> RoundConfig:
        return self._config

    @property
    def listen_address(self) -> str:
        """The bound "host:port" of the peer listener (port 0 resolved); "" without one."""
        return self._listen_address

    async def start(self) -> None:
        """Serves the listener, then forms the job: raises HandshakeError if it cannot."""
        if self._started:
            raise InvariantError("RoundBarrier.start() called twice")
        self._started = True
        try:
            await self._form()
        except BaseException:
            await self.close()  # a daemon that cannot join must not keep its port bound
            raise

    async def _form(self) -> None:
        config = self._config
        if config.children:
            report_up = self._report_up if config.parent is not None else None
            self._hub = Hub(config, self._health.set_serving, self.traffic, report_up)
            handler = join_handler(self._hub.join)
        else:
            handler = not_the_hub_handler(config.node_rank, config.fanout)
        if config.listen:
            self._server, self._listen_address = await serve(
                config.listen, handler, self._health, config.tls, config.num_nodes
            )
        if self._hub is not None:
            await self._hub.wait_formed()  # a relay: its children joined
        if config.parent is not None:
            hub = self._hub
            self._spoke = Spoke(
                config,
                self._listen_address,
                self.traffic,
                relay=hub.relay_down if hub is not None else None,
                on_failure=hub.fail_from_parent if hub is not None else None,
            )
            try:
                await self._spoke.connect()
            except OdbdError as exc:
                if hub is not None:  # its children learn why the job did not form
                    hub.fail_from_parent(exc, None)
                raise
            if hub is not None:
                hub.welcome()
        if self._server is not None:
            self._health.set_serving(True)

    def _report_up(self, message: peer_pb2.PeerMessage) -> None:
        """A relay's Waiting or Abort about its subtree, to its parent (from sync protocol
        code, so as a task; close() waits for the last ones)."""
        if self._spoke is None:
            return  # not joined yet: a failure to form is this daemon's own error
        task = asyncio.get_running_loop().create_task(self._spoke.send_up(message))
        self._pending_up.add(task)
        task.add_done_callback(self._pending_up.discard)

    async def exchange(self, round_index: int, payload: bytes) -> list[bytes]:
        """All nodes' payloads of round `round_index` in node-rank order.

        Raises RoundTimeoutError (a node did not contribute by the deadline), PeerLostError (a
        daemon's stream broke), and PayloadTooLargeError before sending an oversized payload.
        """
        self._check_round(round_index, payload)
        started_s = time.perf_counter()
        if self._hub is not None and self._spoke is not None:
            done = await self._relay_exchange(round_index, payload)
        elif self._hub is not None:
            done = await self._hub.exchange(round_index, payload)
        elif self._spoke is not None:
            done = await self._spoke.exchange(round_index, payload)
        else:
            done = CompletedRound(round_index, (payload,), last_node=0)  # single node
        self.last_round = RoundRecord(round_index, time.perf_counter() - started_s, done.last_node)
        return list(done.payloads)

    async def _relay_exchange(self, round_index: int, payload: bytes) -> CompletedRound:
        """A relay: its subtree's payloads (its own among them) up in one contribution, once it
        holds them all; the parent's result back (already passed down by the Spoke)."""
        assert self._hub is not None and self._spoke is not None
        subtree = await self._hub.exchange(round_index, payload)
        return await self._spoke.exchange(round_index, b"", subtree.payloads)

    async def exchange_reduced(
        self, round_index: int, payload: bytes, reduce: Callable[[list[bytes]], bytes]
    ) -> bytes:
        """The hub's reduce(every node's payload of round `round_index`, in node order), the
        same bytes on every daemon: reduce runs on the hub only (a spoke's is never called).

        The hub sends one small result instead of every payload to every node, so its
        traffic grows with the node count, not its square (daemon/split_round.py). Raises what
        exchange() raises, and PeerLostError when reduce refused a node's payload.
        """
        self._check_round(round_index, payload)
        started_s = time.perf_counter()
        if self._hub is not None and self._spoke is not None:
            done = await self._relay_exchange(round_index, payload)  # reduce runs at the hub
        elif self._hub is not None:
            done = await self._hub.exchange(round_index, payload, reduce)
        elif self._spoke is not None:
            done = await self._spoke.exchange(round_index, payload)
        else:
            done = CompletedRound(round_index, (reduce([payload]),), last_node=0)
        self.last_round = RoundRecord(round_index, time.perf_counter() - started_s, done.last_node)
        if len(done.payloads) != 1:
            raise InvariantError(
                f"round {round_index}'s result holds {len(done.payloads)} payloads, not the "
                "hub's one reduced result: the hub runs another odbd release"
            )
        return done.payloads[0]

    async def report_waiting(self, round_index: int, reason: str) -> None:
        """Why this daemon has not contributed `round_index` yet, e.g. "rank 3 has not taken
        ...". If the round times out, every daemon's error quotes the latest reason."""
        if self._hub is not None:  # a relay passes it up (Hub.note_waiting)
            self._hub.note_waiting(self._config.node_rank, round_index, reason)
        elif self._spoke is not None:
            await self._spoke.report_waiting(round_index, reason)

    def raise_failure(self) -> None:
        """Raises the job's failure (peer lost, round timeout) if one is known, without a round.

        A daemon waiting for its trainers or producers calls this to learn of a lost peer now
        rather than at its next exchange, which may be many trained steps away.
        """
        if self._hub is not None:
            self._hub.raise_failure()
        if self._spoke is not None:
            self._spoke.raise_failure()

    async def fail_job(self, reason: str) -> None:
        """This daemon failed the job itself (say an end_job() deadline): its reason goes to
        the hub, whose Abort fails every daemon with it, so every log and trainer names the
        cause instead of "node N shut down". Best effort, within a second; nothing if the job
        already failed here (then the reason came from the barrier, and everyone has it)."""
        if self._hub is not None:  # the hub aborts; a relay reports up (Hub._abort)
            self._hub.abort_job(reason)
        elif self._spoke is not None and self._spoke.failure is None:
            abort = peer_pb2.Abort(kind=peer_pb2.ABORT_KIND_JOB_FAILED, reason=reason)
            await self._spoke.send_up(peer_pb2.PeerMessage(abort=abort))

    def raise_loss(self) -> None:
        """After this daemon planned its last round: raises the job's failure if a peer was lost
        or the hub aborted the job, but not for the parent's normal end of the stream (a daemon
        whose trainers finished first shuts down; nobody needs a round from it any more).

        The job-end wait calls this so a node lost after the last round fails the survivors
        at once (its ranks cannot finish the job's steps with them) instead of after
        --attach-timeout."""
        for side in (self._hub, self._spoke):
            failure = side.failure if side is not None else None
            if failure is not None and not isinstance(failure, ParentClosedError):
                raise type(failure)(str(failure))

    def _check_round(self, round_index: int, payload: bytes) -> None:
        if not self._started:
            raise InvariantError("RoundBarrier.exchange() called before start()")
        if round_index != self._next_round:
            raise InvariantError(
                f"exchange({round_index}) called when round {self._next_round} is next; rounds "
                "are exchanged strictly in order 0, 1, 2, ... (a bug in the caller)"
            )
        if len(payload) > self._max_payload_bytes:
            raise PayloadTooLargeError(
                f"round {round_index}'s payload has {len(payload)} bytes, over the "
                f"{self._max_payload_bytes} bytes one node may send when {self._config.num_nodes} "
                "nodes share one 64 MiB round message; lower --buffer to make offers smaller"
            )
        # Claimed before the first await, so concurrent exchanges leave in call order.
        self._next_round += 1

    async def close(self) -> None:
        """Ends the streams (the hub after queued results are written) and the listener."""
        if self._hub is not None:
            # First: a relay's children get their streams' normal end (after the results
            # already queued), not the failure its Spoke's close() would pass down.
            self._hub.close()
        if self._pending_up:
            await asyncio.wait(set(self._pending_up), timeout=1.0)
        if self._spoke is not None:
            await self._spoke.close()
        if self._server is not None:
            await self._health.drain()
            await self._server.stop(_STOP_GRACE_S)
            self._server = None
