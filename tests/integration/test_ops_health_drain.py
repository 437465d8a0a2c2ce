"""Health and drain: SERVING once the job formed and producers attached; SIGTERM marks
NOT_SERVING, lets the trainers take the steps already planned within --drain-timeout, and
releases shared memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from odbd.demo.cluster import ClusterSpec, LocalCluster
from tests.integration.harness import poll_until, read_jsonl, scaled, synthetic_args

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(socket: str) -> int:
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=scaled(2)).status


def wait_until(what: str, check, timeout_s: float) -> None:
    timeout_s = scaled(timeout_s)  # given for an idle machine
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} within {timeout_s} s")


def steps(report: Path) -> list[dict]:
    return [r for r in read_jsonl(report) if "step" in r]


def start_trainers(cluster: LocalCluster, tmp: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    trainers, reports = [], []
    for rank in range(cluster.world):
        report = tmp / f"rank{rank}.jsonl"
        command = [sys.executable, "-m", "odbd.demo.trainer", "--rank", str(rank)]
        command += ["--socket", cluster.sockets[0], "--report", str(report)]
        command += ["--seconds-per-token", "1e-5", "--epochs", "1000"]  # ~40 ms per step
        with open(tmp / f"trainer{rank}.log", "wb") as log:
            trainers.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        reports.append(report)
    return trainers, reports


def one_node(drain_timeout_s: float) -> ClusterSpec:
    return ClusterSpec(
        nodes=1,
        ranks_per_node=2,
        daemon_args=[*synthetic_args(600, workers=1), "--shm-size", "64M", "--buffer", "16"]
        + ["--token-budget", "2048", "--drain-timeout", str(drain_timeout_s)]
        # Endless and a short queue: the signal always comes while steps are still planned.
        + ["--epochs", "0", "--steps-ahead", "8"],
    )


@pytest.mark.timeout(120)
def test_sigterm_marks_not_serving_and_drains_in_flight_steps(tmp_path: Path) -> None:
    cluster = LocalCluster(one_node(drain_timeout_s=30))
    trainers: list[subprocess.Popen] = []
    try:
        cluster.start()
        cluster.wait_sockets(scaled(30))
        sock = cluster.sockets[0]
        wait_until("SERVING with the producer attached", lambda: health(sock) == SERVING, 30)
        trainers, reports = start_trainers(cluster, tmp_path)
        wait_until("3 steps trained", lambda: all(len(steps(r)) >= 3 for r in reports), 60)
        at_signal = [len(steps(r)) for r in reports]
        cluster.processes[0].send_signal(signal.SIGTERM)
        wait_until("NOT_SERVING after SIGTERM", lambda: health(sock) == NOT_SERVING, 2)
        assert cluster.wait(scaled(40)) == [0], cluster.log(0)
        for t in trainers:
            t.wait(timeout=scaled(30))
        done = [len(steps(r)) for r in reports]
        # Every rank trained the steps planned before the signal: still aligned, and more
        # than it had when the signal came (the queue is drained, not dropped).
        assert len(set(done)) == 1, done
        assert done[0] > max(at_signal), (at_signal, done)
        assert "stopped (SIGTERM)" in (tmp_path / "trainer0.log").read_text()
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
        cluster.stop()
    assert cluster.leftover_segments() == []


@pytest.mark.timeout(120)
def test_sigterm_with_a_hung_trainer_gives_up_after_the_drain_timeout(tmp_path: Path) -> None:
    cluster = LocalCluster(one_node(drain_timeout_s=1))
    trainers: list[subprocess.Popen] = []
    try:
        cluster.start()
        cluster.wait_sockets(scaled(30))
        wait_until("SERVING", lambda: health(cluster.sockets[0]) == SERVING, 30)
        trainers, reports = start_trainers(cluster, tmp_path)
        wait_until("2 steps trained", lambda: all(len(steps(r)) >= 2 for r in reports), 60)
        for t in trainers:
            os.kill(t.pid, signal.SIGSTOP)  # a hung rank: attached, taking nothing
        signalled = time.monotonic()
        cluster.processes[0].send_signal(signal.SIGTERM)
        # Steps were dropped: the exit says so (status 1, how many steps of which ranks).
        assert cluster.wait(scaled(20)) == [1], cluster.log(0)
        assert time.monotonic() - signalled < scaled(15)
        assert cluster.leftover_segments() == [], "shared memory kept after the drain timeout"
        log = cluster.log(0)
        assert "stopped (SIGTERM) before trainers took everything" in log, log
        assert "steps undelivered: rank 0:" in log and "rank 1:" in log, log
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
                t.wait()
        cluster.stop()


@pytest.mark.timeout(60)
def test_sigterm_while_waiting_for_peers_stops_at_once(tmp_path: Path) -> None:
    spec = ClusterSpec(
        nodes=2, ranks_per_node=1, daemon_args=["--dataset-size", "10", "--shm-size", "16M"]
    )
    cluster = LocalCluster(spec)
    try:
        cluster.start_node(0)  # node 1 never comes: the job cannot form
        poll_until(lambda: os.path.exists(cluster.sockets[0]), "node 0 serves its socket", 30)
        # The socket is served before the daemon waits for its peers (odbd.daemon.app): the
        # SIGTERM lands while the job forms, which is the case under test.
        signalled = time.monotonic()
        cluster.processes[0].send_signal(signal.SIGTERM)
        assert cluster.processes[0].wait(timeout=scaled(20)) == 0, cluster.log(0)
        assert time.monotonic() - signalled < scaled(10)  # not the 120 s join timeout
    finally:
        cluster.stop()
    assert cluster.leftover_segments() == []
