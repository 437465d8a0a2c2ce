"""Security between daemons: job token, foreign jobs, peer mTLS, bounded messages (item 6)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.cli import config_from_args, daemon_parser
from odbd.demo.cluster import ClusterSpec, LocalCluster
from odbd.round import PROTOCOL_VERSION
from odbd.round.config import MAX_MESSAGE_BYTES
from tests.integration import faults_wire as wire
from tests.integration.faults_certs import make_ca, make_leaf, tls_args
from tests.integration.faults_cluster import FaultCluster, synthetic
from tests.integration.harness import scaled

pytestmark = pytest.mark.timeout(120)

SIZE = 64


def _token(directory: Path, name: str, secret: str) -> Path:
    path = directory / name
    path.write_text(secret + "\n")
    os.chmod(path, 0o600)
    return path


def _refused_job(tmp_path: Path, node1_args: list[str], token: Path) -> LocalCluster:
    spec = ClusterSpec(
        nodes=2,
        ranks_per_node=1,
        daemon_args=["--dataset-size", "10", "--shm-size", "16M", "--join-timeout", "10"]
        + ["--job-token-file", str(token)],
        per_node_args=[[], node1_args],
    )
    cluster = LocalCluster(spec).start()
    try:
        codes = cluster.wait(60)
    finally:
        cluster.stop()
    assert codes[0] == 1 and codes[1] == 1, (codes, cluster.log(0), cluster.log(1))
    assert cluster.leftover_segments() == []
    return cluster


def test_daemon_with_a_wrong_token_is_refused_and_logged(tmp_path):
    good = _token(tmp_path, "good", "the-job-secret")
    bad = _token(tmp_path, "bad", "another-secret")
    cluster = _refused_job(tmp_path, ["--job-token-file", str(bad)], good)
    hub, spoke = cluster.log(0), cluster.log(1)
    assert "refused a peer from" in hub and "node 1 failed the job-token challenge" in hub, hub
    assert "never joined the hub" in hub, hub
    assert "could not prove it holds this job's token" in spoke, spoke
    assert "the-job-secret" not in hub + spoke and "another-secret" not in hub + spoke


def test_daemon_of_another_job_is_refused_and_logged(tmp_path):
    token = _token(tmp_path, "token", "shared-secret")
    cluster = _refused_job(tmp_path, ["--job-id", "someone-elses-job"], token)
    hub, spoke = cluster.log(0), cluster.log(1)
    assert "node 1 belongs to job 'someone-elses-job'" in hub, hub
    assert "refused node 1 (FAILED_PRECONDITION)" in spoke, spoke


def test_a_strangers_bad_hellos_never_stop_a_tokenless_loopback_job(tmp_path):
    """Issue 29's must-show: a hub with no token on loopback; a stranger's Hello of another
    protocol (the hub used to exit in 5 ms) or of empty settings (it used to tell the
    stranger the hub's settings one by one) is refused on its own stream; node 1 then joins
    and the job trains its epoch."""
    fc = FaultCluster(nodes=2, ranks_per_node=1, daemon_args=[*synthetic(SIZE), "--buffer", "4"])
    try:
        fc.cluster.start_node(0)  # node 1 comes after the stranger
        channel = grpc.insecure_channel(f"127.0.0.1:{fc.cluster.peer_ports[0]}")
        grpc.channel_ready_future(channel).result(timeout=scaled(30))
        job = fc.cluster.spec.job_id
        version = peer_pb2.Hello(protocol_version=99, job_id=job, node_rank=1)
        answer = wire.stream(channel, wire.JOIN, [peer_pb2.PeerMessage(hello=version)])
        assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer
        session = wire.Session(channel, wire.JOIN)  # the (empty-key) proof right, settings not
        empty = peer_pb2.Hello(protocol_version=PROTOCOL_VERSION, job_id=job, node_rank=1)
        answer = wire.peer_join(session, empty, b"")
        assert isinstance(answer, wire.Answer), answer
        assert answer.code is grpc.StatusCode.FAILED_PRECONDITION, answer
        assert "differ from the hub's" in answer.details and "balance" not in answer.details
        session.cancel()
        channel.close()
        assert fc.daemons[0].poll() is None, fc.log(0)
        fc.cluster.start_node(1)
        fc.cluster.wait_sockets(scaled(60))
        fc.train_to_the_end(90)
        fc.assert_exactly_once(SIZE)
        hub = (fc.cluster.log_dir / "daemon0.log").read_text()
        assert "refused a peer from" in hub and "speaks odbd peer protocol 99" in hub, hub
        assert "setting balance differs" in hub  # the operator still sees the detail
    finally:
        fc.stop()


def test_mtls_job_completes_an_epoch(tmp_path):
    ca = make_ca(tmp_path, "job-ca")
    per_node = [tls_args(make_leaf(tmp_path, ca, f"node{n}")) for n in range(2)]
    args = [*synthetic(SIZE), "--buffer", "4"]
    with FaultCluster(nodes=2, ranks_per_node=1, daemon_args=args, per_node_args=per_node) as fc:
        fc.train_to_the_end(90)
        fc.assert_exactly_once(SIZE)


def test_peers_without_a_certificate_of_the_job_ca_cannot_join(tmp_path):
    ca, foreign = make_ca(tmp_path, "job-ca"), make_ca(tmp_path, "foreign-ca")
    hub_files = make_leaf(tmp_path, ca, "node0")
    good, stranger = make_leaf(tmp_path, ca, "node1"), make_leaf(tmp_path, foreign, "mallory")
    spec = ClusterSpec(
        nodes=2,
        ranks_per_node=1,
        daemon_args=["--dataset-size", "10", "--shm-size", "16M", "--join-timeout", "30"],
        per_node_args=[tls_args(hub_files), tls_args(stranger) + ["--join-timeout", "4"]],
    )
    cluster = LocalCluster(spec)
    try:
        cluster.start_node(0)
        cluster.start_node(1)  # a real daemon, with a certificate of another CA
        address = f"127.0.0.1:{cluster.peer_ports[0]}"
        config = config_from_args(daemon_parser().parse_args(cluster.command(1)[3:]))
        hello = peer_pb2.Hello(
            protocol_version=PROTOCOL_VERSION,
            job_id=spec.job_id,
            node_rank=1,
            fingerprint={"num_nodes": "2", **config.fingerprint(10)},
        )
        attempts = {
            "plaintext": grpc.insecure_channel(address),
            "no client certificate": _tls_channel(address, ca.path.read_bytes()),
            "foreign CA": _tls_channel(address, ca.path.read_bytes(), stranger),
        }
        for what, channel in attempts.items():
            answer = wire.stream(channel, wire.JOIN, [peer_pb2.PeerMessage(hello=hello)])
            assert answer.code is grpc.StatusCode.UNAVAILABLE, (what, answer)
            channel.close()
        assert cluster.processes[1].wait(timeout=30) == 1, cluster.log(1)
        assert "--tls-ca" in cluster.log(1), cluster.log(1)
        # Positive control: a certificate of the job's CA gets through and forms the job.
        channel = _tls_channel(address, ca.path.read_bytes(), good)
        session = wire.Session(channel, wire.JOIN)
        reply = wire.peer_join(session, hello, b"")  # no token: mTLS alone authenticates
        assert not isinstance(reply, wire.Answer), reply
        assert peer_pb2.HubMessage.FromString(reply).HasField("welcome")
        session.cancel()
        channel.close()
    finally:
        cluster.stop()


def _tls_channel(address: str, root: bytes, files: dict[str, Path] | None = None) -> grpc.Channel:
    key = files["--tls-key"].read_bytes() if files else None
    cert = files["--tls-cert"].read_bytes() if files else None
    credentials = grpc.ssl_channel_credentials(root, key, cert)
    return grpc.secure_channel(address, credentials)


def test_oversized_peer_message_is_refused_and_the_hub_stays_up(tmp_path):
    token = _token(tmp_path, "token", "size-secret")
    spec = ClusterSpec(
        nodes=2,
        ranks_per_node=1,
        daemon_args=["--dataset-size", "10", "--shm-size", "16M", "--join-timeout", "30"]
        + ["--job-token-file", str(token)],
    )
    cluster = LocalCluster(spec)
    try:
        cluster.start_node(0)
        channel = grpc.insecure_channel(f"127.0.0.1:{cluster.peer_ports[0]}")
        grpc.channel_ready_future(channel).result(timeout=30)
        hello = peer_pb2.Hello(protocol_version=PROTOCOL_VERSION, job_id=spec.job_id, node_rank=1)
        hello.listen_address = "x" * (MAX_MESSAGE_BYTES + 1024)
        answer = wire.stream(channel, wire.JOIN, [peer_pb2.PeerMessage(hello=hello)])
        assert answer.code is grpc.StatusCode.RESOURCE_EXHAUSTED, answer
        channel.close()
        time.sleep(0.5)
        assert cluster.processes[0].poll() is None, cluster.log(0)
    finally:
        cluster.stop()
