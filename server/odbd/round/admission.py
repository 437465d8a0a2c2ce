"""The hub's admission of its children's Join streams: the handshake under a deadline and a
cap, the token challenge, refusals (logged within a budget), and the join deadline's failure.

Hub (hub.py) is an Admission: these methods read the hub's state (declared below) and call
its _abort, _form and _name. Kept apart from the rounds, which begin once every child joined.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, NoReturn

import grpc

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.errors import InvariantError, OdbdError
from odbd.round import auth
from odbd.round.config import RoundConfig
from odbd.round.errors import HandshakeError
from odbd.round.handshake import Refusal, check_hello, check_version, token_refusal
from odbd.round.log_budget import LogBudget
from odbd.round.tree import TreeLayout, describe_subtree

log = logging.getLogger("odbd.round.hub")  # the hub's log lines, as before the split

# Streams between their start and admission or refusal, at most: a real spoke handshakes in one
# round trip, so these are nearly always strangers (a refused spoke retries, spoke.py).
MAX_HANDSHAKES = 64
MAX_HELLO_BYTES = 64 * 1024  # a real one is ~1 KiB: a few dozen settings
_ABORT_RETURNED = InvariantError("grpc's context.abort returned instead of raising")


@dataclass(frozen=True, slots=True)
class OutboxEnd:
    """Outbox sentinel: finish the stream with this status (OK ends it normally)."""

    code: grpc.StatusCode
    details: str = ""


@dataclass(eq=False, slots=True)
class SpokeStream:
    node: int
    name: str  # "node 2 (10.0.0.3:7070)", used in every message about it
    outbox: asyncio.Queue[bytes | OutboxEnd] = field(default_factory=asyncio.Queue)
    # active -> ending (hub queued the end) | left (closed its side) | lost (stream broke)
    state: Literal["active", "ending", "left", "lost"] = "active"


class Admission:
    """The Join handshake of a Hub (see hub.py for the state these fields hold)."""

    _config: RoundConfig
    _relay: bool
    _layout: TreeLayout
    _children: list[int]
    _spokes: dict[int, SpokeStream]
    _advertised: dict[int, str]
    _refusals: dict[int, str]
    _failure: OdbdError | None
    _formed: asyncio.Future[None]
    _children_joined: asyncio.Future[None]
    _handshaking: int
    _refusal_log: LogBudget
    _loop: asyncio.AbstractEventLoop
    _name: Callable[[int], str]
    _form: Callable[[], None]
    _abort: Callable[[int, int, str, list[int], type[OdbdError]], None]

    def _join_expired(self) -> None:
        missing = [n for n in self._children if n not in self._spokes]
        refused = "".join(
            f"; {self._name(n)} was refused: {self._refusals[n]}"
            for n in missing
            if n in self._refusals
        )
        relays = "".join(
            f"; {self._name(n)} joins once{describe_subtree(self._layout, n)[4:]} joined it"
            for n in missing
            if describe_subtree(self._layout, n)
        )
        me = "the hub" if not self._relay else f"node {self._config.node_rank}"
        reason = (
            f"the job did not form within the {self._config.join_timeout_s:g} s join deadline: "
            f"{names_of(self._name(n) for n in missing)} never joined {me}{refused}{relays}. "
            + (restart_hint(missing) if self._config.from_journal else "Start every daemon "
               "with the same --peers (node 0 first) or raise the join timeout")
        )  # fmt: skip
        self._abort(peer_pb2.ABORT_KIND_JOIN_TIMEOUT, 0, reason, missing, HandshakeError)

    async def _guarded_handshake(self, context: grpc.aio.ServicerContext) -> SpokeStream:
        """The handshake under a deadline and a cap on handshakes in flight: a stranger's stream
        that sends nothing, or a flood of them, holds no memory for long."""
        if self._handshaking >= MAX_HANDSHAKES:
            self._log_refusal(context, f"{MAX_HANDSHAKES} handshakes are already under way")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the hub has {MAX_HANDSHAKES} handshakes under way; retry shortly",
            )
        self._handshaking += 1
        try:
            async with asyncio.timeout(self._config.hello_timeout_s):
                return await self._handshake(context)
        except TimeoutError:
            why = f"no Hello and Proof within the {self._config.hello_timeout_s:g} s deadline"
            self._log_refusal(context, why)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, why)
            raise _ABORT_RETURNED from None
        finally:
            self._handshaking -= 1

    async def _handshake(self, context: grpc.aio.ServicerContext) -> SpokeStream:
        first = await context.read()
        # Undecodable bytes arrive as odbd.grpc_guard.Undecodable, not as a PeerMessage.
        if not isinstance(first, peer_pb2.PeerMessage) or first.WhichOneof("kind") != "hello":
            self._log_refusal(context, "its first message was not a Hello")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first message of a Join must be a Hello"
            )
        hello = first.hello
        if first.ByteSize() > MAX_HELLO_BYTES:  # its strings end up in log lines and errors
            why = f"its Hello has {first.ByteSize()} bytes, over the {MAX_HELLO_BYTES} allowed"
            self._log_refusal(context, why)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        version = check_version(
            hello, "the hub (node 0)" if not self._relay else f"node {self._config.node_rank}"
        )
        if version is not None:
            await self._refuse(context, hello, version, authenticated=False)
        authenticated = await self._challenge(context, hello)
        if self._failure is not None:
            told = str(self._failure) if authenticated else "the job of this hub already failed"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, told)
        refusal = check_hello(
            hello,
            self._config,
            joined=self._spokes.keys(),
            formed=self._formed.done(),
            authenticated=authenticated,
        )
        if refusal is not None:
            await self._refuse(context, hello, refusal, authenticated)
        node = hello.node_rank
        self._advertised[node] = hello.listen_address
        self._refusals.pop(node, None)
        spoke = self._spokes[node] = SpokeStream(node, self._name(node))
        if len(self._spokes) == len(self._children):
            if not self._children_joined.done():
                self._children_joined.set_result(None)
            if not self._relay or self._formed.done():
                self._form()
        return spoke

    async def _challenge(self, context: grpc.aio.ServicerContext, hello: peer_pb2.Hello) -> bool:
        """Runs the token challenge (auth.py); refuses a wrong proof. Returns whether the peer
        is authenticated: it proved the job token, or mTLS vouched for it."""
        token, nonce = self._config.job_token, auth.new_nonce()
        challenge = peer_pb2.Challenge(nonce=nonce, hub_proof=auth.hub_proof(token, hello, nonce))
        await context.write(peer_pb2.HubMessage(challenge=challenge).SerializeToString())
        answer = await context.read()
        if not isinstance(answer, peer_pb2.PeerMessage) or answer.WhichOneof("kind") != "proof":
            self._log_refusal(context, "it did not answer the Challenge with a Proof")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the second message of a Join must be a Proof"
            )
        expected = auth.spoke_proof(token, hello, nonce)
        if not auth.proof_matches(expected, answer.proof.spoke_proof):
            await self._refuse(context, hello, token_refusal(hello), authenticated=False)
        return bool(token) or self._config.tls is not None

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext,
        hello: peer_pb2.Hello,
        refusal: Refusal,
        authenticated: bool,
    ) -> NoReturn:
        """Ends this stream only, unless an authenticated member of the job can never join."""
        self._log_refusal(context, refusal.message)
        if hello.node_rank in self._children:  # bounded: strangers pick any rank
            self._refusals[hello.node_rank] = refusal.message
        if refusal.fatal and authenticated:
            reason = f"the job cannot form: {refusal.message}"
            self._abort(peer_pb2.ABORT_KIND_REFUSED, 0, reason, [hello.node_rank], HandshakeError)
        await context.abort(refusal.code, refusal.told(authenticated))
        raise _ABORT_RETURNED

    def _log_refusal(self, context: grpc.aio.ServicerContext, why: str) -> None:
        logged, left_out = self._refusal_log.admit(self._loop.time())
        if not logged:
            return
        more = f" ({left_out} more refusals were not logged)" if left_out else ""
        log.warning("refused a peer from %s: %s%s", context.peer(), why, more)


def restart_hint(missing: list[int]) -> str:
    """The fix when a hub restarted from --state-dir waits in vain: a spoke that kept running
    never joins again (it planned its steps already, e.g. a whole --max-updates job, and serves
    them without the hub), and the job resumes only when every daemon restarts together."""
    nodes = ("node " if len(missing) == 1 else "nodes ") + ", ".join(str(n) for n in missing)
    return (
        f"This daemon restarted from its --state-dir journal, and a daemon of the job that "
        f"kept running does not join a new incarnation: stop the daemon of {nodes} too "
        "and start it again with its --state-dir (every daemon of the job restarts together), "
        "then resume the trainers from their checkpoints"
    )


def names_of(names: Iterable[str]) -> str:
    items = list(names)
    return ", ".join(items) if items else "no node"
