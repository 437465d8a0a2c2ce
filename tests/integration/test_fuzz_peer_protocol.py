"""Adversarial peers that hold the job token: the test itself joins a real hub as node 1.

A member that breaks the round protocol (replays a round, sends a payload that is not an
offer) must fail the job cleanly, naming itself; a late Hello, whatever it claims, must never
stop a job that already formed.
"""

from __future__ import annotations

import os
import struct
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.cli import config_from_args, daemon_parser
from odbd.daemon import summary_codec
from odbd.demo.cluster import ClusterSpec, LocalCluster
from odbd.planner.types import UnitSummary
from odbd.round import PROTOCOL_VERSION
from tests.integration import faults_wire as wire
from tests.integration.faults_cluster import synthetic
from tests.integration.harness import scaled

pytestmark = pytest.mark.timeout(120)

SIZE = 60
TOKEN = b"peer-protocol-token"


@pytest.fixture
def hub(tmp_path):
    """Node 0 of a 2-node job, started alone: the test plays node 1."""
    token = tmp_path / "token"
    token.write_bytes(TOKEN)
    os.chmod(token, 0o600)

    def start(*daemon_args: str) -> tuple[LocalCluster, wire.Session]:
        spec = ClusterSpec(
            nodes=2,
            ranks_per_node=1,
            daemon_args=["--shm-size", "16M", "--job-token-file", str(token), *daemon_args],
        )
        cluster = LocalCluster(spec)
        started.append(cluster)
        cluster.start_node(0)
        config = config_from_args(daemon_parser().parse_args(cluster.command(1)[3:]))
        channel = grpc.insecure_channel(f"127.0.0.1:{cluster.peer_ports[0]}")
        grpc.channel_ready_future(channel).result(timeout=scaled(30))
        session = wire.Session(channel, wire.JOIN)
        hello = peer_pb2.Hello(
            protocol_version=PROTOCOL_VERSION,
            job_id=spec.job_id,
            node_rank=1,
            fingerprint={"num_nodes": "2", **config.fingerprint(SIZE)},
        )
        reply = wire.peer_join(session, hello, TOKEN)
        assert not isinstance(reply, wire.Answer), reply
        welcome = peer_pb2.HubMessage.FromString(reply)
        assert welcome.HasField("welcome"), welcome
        return cluster, session

    started: list[LocalCluster] = []
    yield start
    for cluster in started:
        cluster.stop()


def _contribution(round_index: int, payload: bytes) -> peer_pb2.PeerMessage:
    contribution = peer_pb2.Contribution(round=round_index, node_rank=1, payload=payload)
    return peer_pb2.PeerMessage(contribution=contribution)


def test_replayed_round_is_refused_and_fails_the_job_naming_the_node(hub):
    cluster, session = hub("--dataset-size", str(SIZE))  # no producers: the hub never plans
    session.send(_contribution(0, b"x"))
    session.send(_contribution(0, b"x"))
    answer = session.end()
    assert answer.code is grpc.StatusCode.INVALID_ARGUMENT, answer
    assert "replayed round 0" in answer.details
    assert cluster.wait(scaled(30)) == [1], cluster.log(0)
    log = cluster.log(0)
    assert "node 1" in log and "replayed round 0" in log and "Traceback" not in log, log
    assert cluster.leftover_segments() == []


@pytest.mark.parametrize(
    "payload",
    [
        b"short",
        struct.pack("<IHHI", 0x4F444253, 1, 1, 1) + b"\x00" * 5,  # a summary's prefix, cut
        struct.pack("<IHHIIHHI", 0x4F444253, 1, 1, 1, 0, 1, 0, 0),  # its unit record missing
        # an offer of the release before (protocol 2)
        struct.pack("<IHHI", 0x4F444252, 3, 0, 27) + b'{"units":[[0,false,99999]]}',
    ],
    ids=["short", "cut-header", "rows-missing", "old-offer"],
)
def test_garbage_round_payload_fails_the_job_naming_the_node(hub, payload):
    cluster, session = hub(*synthetic(SIZE), "--buffer", "4")  # the hub contributes round 0
    session.send(_contribution(0, payload))
    assert cluster.wait(scaled(60)) == [1], cluster.log(0)
    log = cluster.log(0)
    assert "Traceback" not in log, log
    assert "node 1 sent a round 0 payload that is not an odbd summary" in log, log
    session.cancel()
    assert cluster.leftover_segments() == []


@pytest.mark.parametrize(
    ("rejected", "observations", "needle"),
    [
        ({"preprocess_error": "x"}, [], "count of preprocess_error rejections, 'x'"),
        ({}, [[1e308, 1.0, 1.0]], "padded tokens is outside"),
        ({}, [[float("nan"), 1.0, 1.0]], "not a finite number"),
    ],
    ids=["string-count", "1e308", "nan"],
)
def test_out_of_range_offer_fails_the_job_naming_the_node(hub, rejected, observations, needle):
    """Issue 29: these crashed every daemon with TypeError / OverflowError, reported as an
    internal error (a bug in odbd)."""
    cluster, session = hub(*synthetic(SIZE), "--buffer", "4")
    summary = summary_codec.NodeSummary(
        1,
        0,
        (UnitSummary(1, False, 0, 0, 0, np.zeros(0)),),
        rejected,
        None,
        np.array(observations, dtype=np.float64).reshape(-1, 3),
    )
    session.send(_contribution(0, summary_codec.encode_summary(summary)))
    assert cluster.wait(scaled(60)) == [1], cluster.log(0)
    log = cluster.log(0)
    assert "Traceback" not in log and "internal error" not in log, log
    assert "node 1 sent a round 0 summary with a value out of range" in log and needle in log, log
    session.cancel()
    assert cluster.leftover_segments() == []


def test_late_hello_of_another_version_never_stops_a_formed_job(hub):
    cluster, session = hub("--dataset-size", str(SIZE))
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.peer_ports[0]}")
    other = PROTOCOL_VERSION - 1  # the release before the split round (protocol 2)
    hello = peer_pb2.Hello(protocol_version=other, job_id=cluster.spec.job_id, node_rank=1)
    answer = wire.stream(channel, wire.JOIN, [peer_pb2.PeerMessage(hello=hello)])
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer
    assert f"protocol {other}, the hub (node 0) speaks {PROTOCOL_VERSION}" in answer.details
    late = wire.Session(channel, wire.JOIN)  # one of us, with the token: the job formed already
    hello = peer_pb2.Hello(
        protocol_version=PROTOCOL_VERSION, job_id=cluster.spec.job_id, node_rank=1
    )
    answer = wire.peer_join(late, hello, TOKEN)
    assert isinstance(answer, wire.Answer), answer
    assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer
    assert "already formed" in answer.details
    late.cancel()
    time.sleep(scaled(1.0))  # no event to poll for: a fatal refusal would abort the job at once
    assert cluster.processes[0].poll() is None, cluster.log(0)
    check = wire.unary(channel, wire.HEALTH, health_pb2.HealthCheckRequest())
    status = health_pb2.HealthCheckResponse.FromString(check.replies[0]).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    session.cancel()
