"""torchrun restarts every rank of a job whose trainers saved no `state_dict` (issue: real
training jobs, start to end; faults an operator meets).

`torchrun --max-restarts` restarts all ranks after one fails. The daemon continues each rank
at the first step it has no Delivered report for, and reports leave in batches, so ranks that
die together can have reported different steps. Before, the restarted ranks continued at those
different steps: one rank had steps more than the other, and its last all_reduce waited for a
rank that had finished (a hang until the process group's timeout). Now the clients agree at
their first event (one all_gather on the default process group) and every rank continues where
the furthest one does: DDP had kept the ranks in step, so the steps the others skip were
trained. The neighbours: a rank that had finished its epoch, or the whole job, and two
failures in a row.

What must hold: torchrun, the daemon and both ranks exit 0; both ranks take the same steps in
the same epoch loops; the last epoch is complete (unless the job had ended).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from odbd.demo.cluster import free_ports
from tests.integration.ddp_data import dataset_args
from tests.integration.ddp_launch import DATASET, REPO
from tests.integration.harness import scaled
from tests.integration.resume_job import stop_launcher

SCRIPT = "tests.integration.restart_align_train"

pytestmark = pytest.mark.timeout(300)

WORLD, EPOCHS, SIZE = 2, 2, 64


def start_daemon(tmp: Path, socket: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "odbd", "--world", str(WORLD), "--nproc-per-node", str(WORLD)]
    cmd += ["--dataset", f"{DATASET}:make", *dataset_args(size=SIZE, seed=3), "--workers", "1"]
    cmd += ["--epochs", str(EPOCHS), "--token-budget", "256", "--buffer", "8"]
    cmd += ["--shm-size", "32M", "--socket", socket, "--job-id", f"restart{tmp.name[-10:]}"]
    log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 (closed right after the spawn)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    log.close()
    return proc


def start_torchrun(tmp: Path, socket: str, fail_runs: list[list[int | str]]):
    torchrun = Path(sys.executable).with_name("torchrun")
    # Static rendezvous: its store at --master-port is where the ranks' process group meets
    # (restart_align_train.init_process_group).
    cmd = [str(torchrun), "--nnodes", "1", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_ports(1)[0]), "--nproc-per-node", str(WORLD)]
    cmd += ["--max-restarts", str(len(fail_runs))]
    cmd += ["-m", SCRIPT, "--out-dir", str(tmp)]
    cmd += ["--epochs", str(EPOCHS), "--fail-runs", json.dumps(fail_runs)]
    cmd += ["--pg-timeout-s", str(scaled(60))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "ODBD_SOCKET": socket, "OMP_NUM_THREADS": "1"}
    log = open(tmp / "torchrun.log", "wb")  # noqa: SIM115 (closed right after the spawn)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    log.close()
    return proc


def logs(tmp: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(tmp.glob("*.log"))
    )


def run_job(tmp: Path, fail_runs: list[list[int | str]]) -> list[list[list[int]]]:
    """Runs the job to its end; every rank's [epoch loop, epoch, step, *sample ids] of the
    last run."""
    socket = str(tmp / "odbd.sock")
    daemon = start_daemon(tmp, socket)
    torchrun = None
    try:
        torchrun = start_torchrun(tmp, socket, fail_runs)
        assert torchrun.wait(timeout=scaled(200)) == 0, logs(tmp)
        assert daemon.wait(timeout=scaled(60)) == 0, logs(tmp)
    finally:
        if torchrun is not None:
            stop_launcher(torchrun, tmp, SCRIPT)
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize(
    ("fail_runs", "continues_at"),
    [
        pytest.param([[3, 5]], (0, 5), id="mid-epoch"),
        pytest.param([["epoch", 5]], (1, 0), id="one-rank-at-the-epochs-end"),
        pytest.param([[3, 5], [1, 2]], (1, 0), id="twice-in-a-row"),
        pytest.param([["job", 5]], None, id="one-rank-at-the-jobs-end"),
    ],
)
def test_torchrun_restart_without_a_state_dict_keeps_the_ranks_on_the_same_steps(
    tmp_path: Path, fail_runs: list[list[int | str]], continues_at: tuple[int, int] | None
) -> None:
    taken = run_job(tmp_path, fail_runs)
    steps = [[tuple(row[:3]) for row in rank] for rank in taken]
    assert steps[0] == steps[1], logs(tmp_path)
    if continues_at is None:  # a rank had taken the job's end: nothing is left to train
        assert steps[0] == []
        return
    # (epoch loop, epoch, step): whether the first loop is empty (an epoch's end delivered
    # before the failure is not sent again) may differ by run, but never between the ranks
    assert steps[0][0][1:] == continues_at, logs(tmp_path)
    last = Counter(i for rank in taken for _, e, _, *ids in rank if e == EPOCHS - 1 for i in ids)
    assert sorted(last) == list(range(SIZE)), "the last epoch must train every sample"
    assert set(last.values()) == {1}, "the last epoch must train every sample once"
