"""The hub's decision on a Hello: admit, or refuse with a gRPC status and a message (pure).

Checks run in an order that leaks nothing to strangers: the token first (a foreign peer learns
no settings), then the job id (another job's daemon hitting our port is not our problem), and
only then the settings of a daemon that is provably part of this job.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection
from dataclasses import dataclass

import grpc

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.round.config import PROTOCOL_VERSION, RoundConfig
from odbd.round.fingerprint import fingerprint_mismatch


@dataclass(frozen=True, slots=True)
class Refusal:
    code: grpc.StatusCode
    message: str
    # True when the refused daemon belongs to this job but can never be admitted (its settings
    # differ): the job cannot form, so the hub stops waiting and fails too. False for strangers
    # and rank clashes, which must not let any process that reaches the port stop the job.
    fatal: bool


def check_hello(
    hello: peer_pb2.Hello, config: RoundConfig, joined: Collection[int], formed: bool = False
) -> Refusal | None:
    """None admits the daemon; `joined` holds the node ranks already admitted.

    Once the job formed (`formed`), every node is in and nothing a late Hello says can be
    fatal: refusing it must never stop a running job, whatever its version or settings.
    """
    node = f"node {hello.node_rank}"
    if not hmac.compare_digest(hello.job_token, config.job_token):
        return Refusal(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{node} presented a wrong job token; give every daemon of the job the same token",
            fatal=False,
        )
    if hello.job_id != config.job_id:
        return Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{node} belongs to job {hello.job_id!r}, this hub runs job {config.job_id!r}; "
            "check --peers and --job-id",
            fatal=False,
        )
    if formed:
        return Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{node} tried to join job {config.job_id!r}, which already formed with all "
            f"{config.num_nodes} nodes; a restarted daemon cannot rejoin a running job: "
            "restart the job on all nodes",
            fatal=False,
        )
    if hello.protocol_version != PROTOCOL_VERSION:
        return Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"setting protocol_version differs: the hub (node 0) speaks {PROTOCOL_VERSION}, "
            f"{node} speaks {hello.protocol_version}; run the same odbd release on every node",
            fatal=True,
        )
    if not 1 <= hello.node_rank < config.num_nodes:
        return Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{node} is outside 1..{config.num_nodes - 1}: node 0 is the hub and the job has "
            f"{config.num_nodes} nodes; check --node-rank and --world/--nproc-per-node",
            fatal=False,
        )
    if hello.node_rank in joined:
        return Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{node} has already joined; two daemons were started with --node-rank "
            f"{hello.node_rank}",
            fatal=False,
        )
    mismatch = fingerprint_mismatch(
        config.settings, hello.fingerprint, ours_name="the hub (node 0)", theirs_name=node
    )
    if mismatch is not None:
        return Refusal(grpc.StatusCode.FAILED_PRECONDITION, mismatch, fatal=True)
    return None
