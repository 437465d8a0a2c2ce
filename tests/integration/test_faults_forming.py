"""Faults while a job forms (issue 24, item 4): each message says what really happened.

.venv/bin/python -m pytest -q -s tests/integration/test_faults_forming.py
"""

from __future__ import annotations

import os
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
