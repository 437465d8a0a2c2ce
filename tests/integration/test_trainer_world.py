"""A trainer whose own world differs from the daemon's --world is refused (issue 10:
`accelerate launch --num_processes 2 --cpu` started one process, which trained alone with loss
scales meant for two), and `accelerate launch` flags that do start N CPU ranks train."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist

from odbclient import ODBClient
from odbclient.errors import RankRefusedError
from odbd.demo.cluster import ClusterSpec, LocalCluster, free_ports
from tests.integration.ddp_launch import REPO, Reports, odbd_cluster, rank_environment

pytestmark = pytest.mark.timeout(180)

# Accelerate's launcher, beside the interpreter (the venv's console script).
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
DATA = {"size": 24, "seed": 1, "label_shift": 0}


@pytest.fixture
def daemon_of_two() -> LocalCluster:
    """One daemon of a world of 2, no producers: refusals happen at the hello."""
    spec = ClusterSpec(
        nodes=1,
        ranks_per_node=2,
        daemon_args=["--dataset-size", "10", "--epochs", "0", "--shm-size", "16M"],
    )
    with LocalCluster(spec) as cluster:
        cluster.wait_sockets()
        yield cluster
    assert cluster.leftover_segments() == []


def first_batch(cluster: LocalCluster, rank: int = 0) -> None:
    with ODBClient(rank=rank, socket=cluster.sockets[0], connect_timeout_s=30) as client:
        next(iter(client))


def test_launcher_world_that_differs_from_world_is_refused(
    daemon_of_two: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(
        RankRefusedError,
        match=r"world of 1 processes \(from \$WORLD_SIZE=1, \$RANK=0\) but this job's --world is"
        r" 2: every loss_scale assumes 2 ranks; launch 2 trainer processes",
    ):
        first_batch(daemon_of_two)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RankRefusedError, match="asked for rank 0 but its launcher made it rank 1"):
        first_batch(daemon_of_two, rank=0)


def test_initialised_process_group_that_differs_from_world_is_refused(
    daemon_of_two: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # the process group wins over the environment
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", world_size=1, rank=0)
    try:
        with pytest.raises(RankRefusedError, match=r"world of 1 processes \(from torch.distr"):
            first_batch(daemon_of_two)
    finally:
        dist.destroy_process_group()


def accelerate_launch(
    flags: list[str], out_dir: Path, socket: str, script_args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    env = rank_environment(0, world=1, nproc_per_node=1, master_port=0, socket=socket)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT"):  # fmt: skip
        env.pop(key)  # accelerate launch sets what it starts
    # A free port per launch, not accelerate's default 29500, which another job may hold.
    cmd = [ACCELERATE, "launch", *flags, "--num_machines", "1", "--mixed_precision", "no",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_ports(1)[0]),
           "--dynamo_backend", "no", "-m", "tests.integration.ddp_hf_trainer",
           "--framework", "accelerate", "--out-dir", str(out_dir), *script_args]  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)


@pytest.mark.skipif(not os.path.exists(ACCELERATE), reason="accelerate's launcher not installed")
def test_accelerate_launch_cpu_starting_one_process_is_refused_not_trained(
    tmp_path: Path,
) -> None:
    cluster = odbd_cluster(nodes=1, ranks_per_node=2, data=DATA, daemon_args=["--epochs", "1"])
    try:
        cluster.start()
        run = accelerate_launch(["--cpu", "--num_processes", "2"], tmp_path, cluster.sockets[0])
    finally:
        cluster.stop()
    assert run.returncode != 0, run.stdout + run.stderr
    assert "world of 1 processes (from accelerate) but this job's --world is 2" in run.stderr
    assert Reports.read(tmp_path, 1).steps(0) == [], "rank 0 trained alone"


@pytest.mark.skipif(not os.path.exists(ACCELERATE), reason="accelerate's launcher not installed")
def test_accelerate_launch_multi_gpu_starts_two_cpu_ranks_that_train(tmp_path: Path) -> None:
    """On a machine without GPUs `--multi_gpu --num_processes 2` starts 2 gloo CPU ranks."""
    cluster = odbd_cluster(nodes=1, ranks_per_node=2, data=DATA, daemon_args=["--epochs", "1"])
    try:
        cluster.start()
        run = accelerate_launch(["--multi_gpu", "--num_processes", "2"], tmp_path,
                                cluster.sockets[0])  # fmt: skip
        codes = cluster.wait(30.0)
    finally:
        cluster.stop()
    assert run.returncode == 0, run.stdout + run.stderr + cluster.log(0)
    reports = Reports.read(tmp_path, 2)
    assert reports.done(0)["world"] == 2 and reports.done(1)["world"] == 2
    assert len(reports.steps(0)) == len(reports.steps(1)) > 0
    assert Counter(reports.ids(0)) == Counter(range(DATA["size"]))
    assert codes == [0], cluster.log(0)


@pytest.mark.skipif(not os.path.exists(ACCELERATE), reason="accelerate's launcher not installed")
def test_a_bare_accelerator_on_cpus_under_multi_gpu_is_named_with_the_fix(tmp_path: Path) -> None:
    """Found by hand with the docs' `Accelerator()` and `accelerate launch --config_file`
    (MULTI_GPU, 2 machines x 2): without GPUs every process ran as Accelerate rank 0 of 1 and
    the daemon's refusal asked for the `--num_processes` that had been passed."""
    cluster = odbd_cluster(nodes=1, ranks_per_node=2, data=DATA, daemon_args=["--epochs", "1"])
    try:
        cluster.start()
        run = accelerate_launch(["--multi_gpu", "--num_processes", "2"], tmp_path,
                                cluster.sockets[0], ("--accelerator-default",))  # fmt: skip
    finally:
        cluster.stop()
    assert run.returncode != 0, run.stdout + run.stderr
    assert "Accelerate runs this process alone (process 0 of 1" in run.stderr, run.stderr
    assert "started it as rank 1 of 2 (torch.distributed)" in run.stderr, run.stderr
    assert "build it with Accelerator(cpu=True)" in run.stderr, run.stderr
    assert "RankRefusedError" not in run.stderr, run.stderr
    assert Reports.read(tmp_path, 2).steps(0) == [], "a rank trained"
