"""Producer start-ups of 2-node jobs under two CPU hogs (issue 24, item 3): zero crashes.

Producers once SIGSEGVed at start-up in multi-node jobs (status -11, 7 in 62 worker starts):
the daemon forked them (uvloop's fork) while gRPC's threads ran, and gRPC's fork handlers ran in
the child. The daemons here run with GRPC_ENABLE_FORK_SUPPORT=1, as an operator's environment
may set it (the daemon only sets a default of 0): before the fix this crashed 1 producer in 64
starts, right after gRPC's "skipping fork() handlers" line. Each job here is 2 nodes x
WORKERS producers, waits until every producer attached (so each start counts, none is cut short
by the job's end), then trains to the end. Any producer death fails the test.

    .venv/bin/python -m pytest -q -m soak -s tests/soak/test_soak_producer_starts.py
    ODBD_SOAK_STARTS=40 ...   # a quicker trial

Prints the starts, the deaths, the wall time and the start-to-attach latencies.
"""

from __future__ import annotations

import os
import re
import statistics
import time

import pytest

from tests.integration.faults_cluster import FaultCluster, synthetic
from tests.under_load import start_hogs, stop_hogs

pytestmark = [pytest.mark.soak, pytest.mark.timeout(3600)]

STARTS = int(os.environ.get("ODBD_SOAK_STARTS", "200"))
WORKERS = 4  # per node: 8 starts per job
HOGS = 2
_DIED = re.compile(r"producer worker-\d+ exited with status (-?\d+)")


def test_200_producer_starts_of_2_node_jobs_under_two_cpu_hogs_crash_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "1")  # the daemons inherit it
    jobs = -(-STARTS // (2 * WORKERS))
    hogs = start_hogs(HOGS)
    started = time.monotonic()
    starts, forks, deaths, attach_s = 0, 0, [], []
    try:
        for job in range(jobs):
            with FaultCluster(
                nodes=2, ranks_per_node=1, daemon_args=synthetic(96, workers=WORKERS)
            ) as fc:
                launched = time.monotonic()

                def attached(job: int = job) -> bool:
                    logs = [fc.log(n) for n in range(2)]
                    died = [int(c) for log in logs for c in _DIED.findall(log)]
                    assert not died, f"job {job}: producers died {died}\n{fc.describe()}"
                    return all(log.count(" attached (lane") >= WORKERS for log in logs)

                fc.wait_until(attached, f"job {job}: all {2 * WORKERS} producers attached")
                attach_s.append(time.monotonic() - launched)
                fc.train_to_the_end(timeout_s=120)
                logs = [fc.log(n) for n in range(2)]
                deaths += [int(c) for log in logs for c in _DIED.findall(log)]
                forks += sum(log.count("fork_posix") for log in logs)  # gRPC's at-fork line
                starts += sum(log.count(" attached (lane") for log in logs)
    finally:
        stop_hogs(hogs)
    wall_s = time.monotonic() - started
    print(
        f"\nproducer starts: {starts} in {jobs} 2-node jobs under {HOGS} CPU hogs, "
        f"deaths {deaths}, gRPC fork handler lines {forks}, wall {wall_s:.0f} s; "
        f"daemon start to all {2 * WORKERS} attached: "
        f"median {statistics.median(attach_s):.2f} s, max {max(attach_s):.2f} s"
    )
    assert deaths == []
    assert forks == 0, "a daemon forked: gRPC's fork handler logged"
    assert starts >= STARTS
