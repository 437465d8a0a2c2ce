"""A multi-epoch DDP run stopped in the middle and restarted (issue: real training).

Phase 1 trains two epochs on 2 nodes x 2 ranks and, after step STOP of epoch 1, every trainer
saves its checkpoint (model, optimizer, `ODBClient.state_dict()`) and exits; then every daemon is
stopped too. Phase 2 starts new daemons (same job id, same --state-dir, from whose journal they
resume) and new trainers that load the checkpoints. The run must continue at the next step of
epoch 1 with every identity of that epoch emitted exactly once across both phases: nothing
twice, nothing skipped.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.ddp_launch import Reports, data_flags, launch_ranks, odbd_cluster

pytestmark = pytest.mark.timeout(240)

DATA = {"size": 96, "seed": 5}
WORLD, EPOCHS, STOP = 4, 2, 1  # stop after step 1 of epoch 1


def cluster_job_id() -> str:
    """One job id for both phases, of the form ClusterSpec gives (t<pid>x<n>), so conftest
    removes the phases' cluster directories once the test passed."""
    return f"t{os.getpid()}x{time.monotonic_ns() % 10**9}"


def run_phase(
    tmp_path: Path,
    job_id: str,
    trainer_args: list[str],
    daemon_args: tuple[str, ...] = (),
    *,
    nodes: int = 2,
    data: dict = DATA,
) -> tuple[Reports, str]:
    world = nodes * 2
    cluster = odbd_cluster(
        nodes=nodes,
        ranks_per_node=2,
        data=data,
        job_id=job_id,
        daemon_args=["--token-budget", "256", "--buffer", "8", "--epochs", str(EPOCHS)]
        + ["--drain-timeout", "2"]  # the trainers left after checkpointing: nothing to drain
        + ["--state-dir", str(tmp_path / "state"), *daemon_args],
    )
    try:
        cluster.start()
        # No wait for the sockets: ranks import torch meanwhile; ODBClient waits for the daemon.
        ranks = launch_ranks(
            world=world, nproc_per_node=2, out_dir=tmp_path / "train", sockets=cluster.sockets,
            trainer_args=["--epochs", str(EPOCHS), *trainer_args, *data_flags(data)],
        )  # fmt: skip
        codes = ranks.wait(90.0)
        daemon_logs = "\n".join(cluster.log(n) for n in range(nodes))
        logs = f"ranks {codes}\n{ranks.logs()}\n{daemon_logs}"
    finally:
        cluster.stop()  # every process of the job is down between the phases
    assert codes == [0] * world, logs
    return Reports.read(tmp_path / "train", world), logs


def test_restart_in_the_middle_continues_the_epoch_without_duplicates_or_gaps(tmp_path: Path):
    job_id = cluster_job_id()
    first, _ = run_phase(tmp_path, job_id, ["--stop-at", f"1:{STOP}"])
    before = {rank: len(first.steps(rank)) for rank in range(WORLD)}
    assert all(first.steps(rank)[-1]["epoch"] == 1 for rank in range(WORLD))
    second, logs = run_phase(tmp_path, job_id, ["--resume"])
    for rank in range(WORLD):
        resumed = second.steps(rank)[before[rank] :]  # the report file is appended to
        assert resumed, f"rank {rank} trained nothing after the restart\n{logs}"
        assert (resumed[0]["epoch"], resumed[0]["step"]) == (1, STOP + 1), logs
        epoch1 = second.steps(rank, 1)
        assert [r["step"] for r in epoch1] == list(range(len(epoch1)))
    counts = Counter(second.ids(1))
    assert counts == Counter(range(DATA["size"])), "epoch 1 emitted an identity twice or never"


def test_restart_with_accumulate_resumes_at_an_update_boundary(tmp_path: Path):
    """--accumulate 2: the checkpoint after step 3 of epoch 1 closes update 1, and the restarted
    daemons number the updates on from 2 (the trainers' state_dict carries it), so epoch 1's
    updates stay contiguous and no update is split between the two runs."""
    job_id = cluster_job_id()
    accumulate = ("--accumulate", "2")
    first, _ = run_phase(tmp_path, job_id, ["--stop-at", "1:3"], accumulate)
    before = {rank: len(first.steps(rank)) for rank in range(WORLD)}
    assert all(first.steps(rank)[-1]["update"]["end"] for rank in range(WORLD))
    second, logs = run_phase(tmp_path, job_id, ["--resume"], accumulate)
    for rank in range(WORLD):
        resumed = second.steps(rank)[before[rank] :]
        assert resumed, f"rank {rank} trained nothing after the restart\n{logs}"
        head = resumed[0]
        assert (head["epoch"], head["step"]) == (1, 4), logs
        assert (head["update"]["index"], head["update"]["step"]) == (2, 0), head
        epoch1 = second.steps(rank, 1)
        indices = [r["update"]["index"] for r in epoch1]
        assert indices == sorted(indices) and set(indices) == set(range(indices[-1] + 1))
        sizes = Counter(indices)
        assert all(n == 2 for i, n in sizes.items() if i != indices[-1]), sizes
    assert Counter(second.ids(1)) == Counter(range(DATA["size"])), "epoch 1 twice or never"
