"""Faults while a job forms (issue 24, item 4): each message says what really happened.

.venv/bin/python -m pytest -q -s tests/integration/test_faults_forming.py
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from odbd.demo.cluster import ClusterSpec, LocalCluster
from odbd.ingest.arena import reclaim_stale
from tests.integration.faults_cluster import FaultCluster, synthetic
from tests.integration.harness import poll_until, scaled


def test_a_rank_late_to_a_killed_daemon_is_told_at_once_that_it_ran_and_died() -> None:
    """The hub SIGKILLed before its trainer attached: its socket files stay, refused. The late
    rank waited out its 60 s connect timeout, then was told to start odbd on this node."""
    with FaultCluster(nodes=2, ranks_per_node=1, daemon_args=synthetic(64)) as fc:
        fc.daemons[0].kill()
        fc.daemons[0].wait()
        started = time.monotonic()
        fc.start_trainer([0])
        fc.wait_until(lambda: bool(fc.errors(0)), "the late rank 0 failed", timeout_s=20)
        took_s = time.monotonic() - started
        message = fc.errors(0)[0]["message"]
        assert "ran and is gone" in message, message
        assert "killed" in message and "start odbd on this node" not in message, message
        print(f"\nFAULT hub SIGKILLed before its trainer: rank 0 told in {took_s:.1f} s: {message}")
        assert took_s < scaled(20)
        assert reclaim_stale(fc.cluster.spec.job_id, node_rank=0)  # what a restart would do


_CLASH = "another job runs on this host with the same --job-id"


def test_two_jobs_started_at_once_with_one_job_id_are_told_of_the_clash() -> None:
    """Each node rank's arena goes to one of the two jobs; a job that lost a node cannot form.
    Its survivors blamed --peers (the hub: "node 1 never joined"; a spoke: "could not reach
    the hub") and its losers said only that a running odbd holds the arena."""
    job_id = f"clash{os.getpid()}"
    args = [*synthetic(64), "--shm-size", "16M", "--join-timeout", f"{scaled(3):g}"]
    jobs = [LocalCluster(ClusterSpec(nodes=2, ranks_per_node=1, job_id=job_id, daemon_args=args))
            for _ in range(2)]  # fmt: skip
    try:
        for node in range(2):
            for job in jobs:
                job.start_node(node)
        daemons = [(job, node) for job in jobs for node in range(2)]

        def settled() -> bool:  # each daemon exited, or its job formed
            return all(
                job.processes[node].poll() is not None or "serving ranks" in job.log(node)
                for job, node in daemons
            )

        poll_until(settled, "every daemon exited or served", timeout_s=60)
        failed = [(job, node) for job, node in daemons if job.processes[node].poll() is not None]
        assert failed, "two jobs with one --job-id on one host both formed"
        for job, node in failed:
            [error] = [line for line in job.log(node).splitlines() if "ERROR odbd:" in line]
            assert _CLASH in error, error
            assert error.index(_CLASH) < error.index("What this daemon saw"), error
        print(f"\nFAULT job-id clash: {len(failed)} of 4 daemons failed, each naming it: {error}")
    finally:
        for job in jobs:
            job.stop()


JOIN_TIMEOUT_S = 2.0  # the spoke's; the hub's is long: it still waits when the spoke resumes


def test_a_spoke_stopped_past_its_join_deadline_says_it_was_not_running() -> None:
    """SIGSTOPped while it waited for the hub's Welcome, resumed after its join deadline: it
    said "could not reach the hub ... start node 0's daemon" while the hub ran and waited."""
    spec = ClusterSpec(
        nodes=2,
        ranks_per_node=1,
        daemon_args=[*synthetic(64), "--shm-size", "16M", "--join-timeout", f"{JOIN_TIMEOUT_S:g}"],
        per_node_args=[["--join-timeout", "600"]],
    )
    cluster = LocalCluster(spec)
    hub_port = socket.create_server(("127.0.0.1", cluster.peer_ports[0]))  # not the hub yet
    spoke: subprocess.Popen[bytes] | None = None
    try:
        log = open(cluster.tmp / "daemon1.log", "ab")  # noqa: SIM115
        spoke = subprocess.Popen(cluster.command(1), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        hub_port.settimeout(scaled(60))
        knock, _ = hub_port.accept()  # the spoke is in its join: it connects to the hub
        os.kill(spoke.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        knock.close()
        hub_port.close()
        cluster.start_node(0)
        poll_until(lambda: os.path.exists(cluster.sockets[0]), "the hub serves its socket")
        # The fault itself: stopped past the spoke's deadline (its join timeout plus grace).
        time.sleep(max(0.0, JOIN_TIMEOUT_S + 1.5 - (time.monotonic() - stopped)))
        os.kill(spoke.pid, signal.SIGCONT)
        spoke.wait(timeout=scaled(30))
        assert spoke.returncode == 1, cluster.log(1)
        [error] = [line for line in cluster.log(1).splitlines() if "ERROR odbd:" in line]
        assert "node 1 was not running for" in error and "could not reach" not in error, error
        assert cluster.processes[0].poll() is None, "the hub still waits for node 1"
        print(f"\nFAULT spoke SIGSTOPped past its join deadline: {error}")
    finally:
        hub_port.close()
        if spoke is not None and spoke.poll() is None:
            os.kill(spoke.pid, signal.SIGCONT)
            spoke.kill()
            spoke.wait()
        cluster.stop()
