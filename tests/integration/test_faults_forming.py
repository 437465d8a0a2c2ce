"""Faults while a job forms (issue 24, item 4): each message says what really happened.

.venv/bin/python -m pytest -q -s tests/integration/test_faults_forming.py
"""

from __future__ import annotations

import time

from odbd.ingest.arena import reclaim_stale
from tests.integration.faults_cluster import FaultCluster, synthetic
from tests.integration.harness import scaled


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
