"""The hub's decision on a Hello: admit, or refuse with a gRPC status and a message (pure).

The hub checks the protocol version first (check_version), then runs the token challenge
(auth.py), and only then decides on the Hello's claims here. A peer is authenticated when it
answered the challenge of a hub that has a job token, or came through mTLS; anything else
(a loopback job without a token, a failed proof) is a stranger that:
  - never stops the job: its refusal ends its own stream only (`fatal` is False);
  - learns only the kind of refusal (`public`), never the hub's settings or job id; the hub's
    own log and join-timeout error carry the details (`message`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import grpc

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.round.config import PROTOCOL_VERSION, RoundConfig
from odbd.round.fingerprint import fingerprint_mismatch


@dataclass(frozen=True, slots=True)
class Refusal:
    code: grpc.StatusCode
    message: str  # for the hub's log and errors: every detail
    # True when the refused daemon provably belongs to this job but can never be admitted (its
    # settings differ): the job cannot form, so the hub stops waiting and fails too. Never for
    # strangers or rank clashes: no process that merely reaches the port may stop the job.
    fatal: bool
    public: str = ""  # what an unauthenticated peer is told ("" = the message itself)

    def told(self, authenticated: bool) -> str:
        return self.message if authenticated or not self.public else self.public


def check_version(hello: peer_pb2.Hello, me: str = "the hub (node 0)") -> Refusal | None:
    """Before the challenge, which a daemon of another protocol would not understand."""
    if hello.protocol_version == PROTOCOL_VERSION:
        return None
    return Refusal(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"node {hello.node_rank} speaks odbd peer protocol {hello.protocol_version}, {me} "
        f"speaks {PROTOCOL_VERSION}; run the same odbd release on every node",
        fatal=False,
    )


def _me(config: RoundConfig) -> str:
    """How refusals name the daemon that refuses: the hub, or a relay of the tree."""
    if config.node_rank == 0:
        return "the hub (node 0)"
    return f"node {config.node_rank} (a relay of the round tree)"


def token_refusal(hello: peer_pb2.Hello) -> Refusal:
    return Refusal(
        grpc.StatusCode.UNAUTHENTICATED,
        f"node {hello.node_rank} failed the job-token challenge: its --job-token-file differs "
        "from the hub's (or one of them has none); give every daemon of the job the same token",
        fatal=False,
    )


def check_hello(
    hello: peer_pb2.Hello,
    config: RoundConfig,
    joined: Collection[int],
    formed: bool = False,
    authenticated: bool = True,
) -> Refusal | None:
    """None admits the daemon; `joined` holds the node ranks already admitted.

    Once the job formed (`formed`), every node is in and nothing a late Hello says can be
    fatal: refusing it must never stop a running job, whatever its settings.
    """
    node = f"node {hello.node_rank}"
    if hello.job_id != config.job_id:
        return Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{node} belongs to job {hello.job_id!r}, this hub runs job {config.job_id!r}; "
            "check --peers and --job-id",
            fatal=False,
            public=f"{node} does not belong to the job this hub runs; check --peers and --job-id",
        )
    if formed:
        return Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{node} tried to join job {config.job_id!r}, which already formed with all "
            f"{config.num_nodes} nodes; a restarted daemon cannot rejoin a running job: "
            "restart the job on all nodes",
            fatal=False,
            public=f"{node} tried to join a job that already formed with all its nodes; a "
            "restarted daemon cannot rejoin a running job: restart the job on all nodes",
        )
    if not 1 <= hello.node_rank < config.num_nodes:
        return Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{node} is outside 1..{config.num_nodes - 1}: node 0 is the hub and the job has "
            f"{config.num_nodes} nodes; check --node-rank and --world/--nproc-per-node",
            fatal=False,
            public=f"{node} is not a spoke of the job this hub runs; check --node-rank and "
            "--world/--nproc-per-node",
        )
    if hello.node_rank in joined:
        return Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{node} has already joined; two daemons were started with --node-rank "
            f"{hello.node_rank}",
            fatal=False,
        )
    mismatch = fingerprint_mismatch(
        config.settings, hello.fingerprint, ours_name=_me(config), theirs_name=node
    )
    if mismatch is not None:
        return Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            mismatch,
            fatal=authenticated,
            public=f"the settings of {node} differ from the hub's; the hub's log names the "
            "setting (a daemon without the job token or mTLS is not told which)",
        )
    if hello.node_rank not in config.children:
        parent = config.layout.parent(hello.node_rank)
        return Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{node} joined {_me(config)}, but its parent in the round relay tree of fan-out "
            f"{config.fanout} is node {parent}; check --peers (every node in node-rank order)",
            fatal=False,
        )
    return None
