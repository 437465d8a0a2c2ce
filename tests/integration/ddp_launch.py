"""Launches DDP trainer ranks the way torchrun does, optionally beside a local odbd cluster.

Every rank is a process with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR=127.0.0.1 and a free MASTER_PORT in its environment, plus ODBD_SOCKET pointing at its
node's daemon; `python` may be another venv's interpreter (the benchmark's paper baseline).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from odbd.demo.cluster import ClusterSpec, LocalCluster, free_ports, wait_all
from tests.integration.harness import read_jsonl

REPO = Path(__file__).resolve().parents[2]
DATASET = Path(__file__).with_name("ddp_data.py")


def rank_environment(
    rank: int, *, world: int, nproc_per_node: int, master_port: int, socket: str | None
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % nproc_per_node),
        LOCAL_WORLD_SIZE=str(nproc_per_node),
        GROUP_RANK=str(rank // nproc_per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        OMP_NUM_THREADS="1",
        ODB_ITERATOR_STARTUP_JITTER_SEC="0",  # the paper package sleeps up to 2 s otherwise
        HF_HUB_OFFLINE="1",  # models are built from configs: nothing may be downloaded
    )
    if socket is not None:
        env["ODBD_SOCKET"] = socket
    return env


@dataclass
class Ranks:
    """The trainer processes of one launch and where they write."""

    out_dir: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def wait(self, timeout_s: float) -> list[int | None]:
        wait_all(self.processes, timeout_s)
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return [p.returncode for p in self.processes]

    def logs(self) -> str:
        parts = [
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.out_dir.glob("trainer*.log"))
        ]
        return "\n".join(parts)


def launch_ranks(
    *,
    world: int,
    nproc_per_node: int,
    trainer_args: Sequence[str],
    out_dir: Path,
    sockets: Sequence[str] | None = None,
    python: str = sys.executable,
    module: str = "tests.integration.ddp_trainer",
) -> Ranks:
    out_dir.mkdir(parents=True, exist_ok=True)
    master_port = free_ports(1)[0]
    ranks = Ranks(out_dir)
    for rank in range(world):
        socket = sockets[rank // nproc_per_node] if sockets else None
        env = rank_environment(
            rank, world=world, nproc_per_node=nproc_per_node, master_port=master_port,
            socket=socket,
        )  # fmt: skip
        cmd = [python, "-m", module, "--out-dir", str(out_dir)]
        log = open(out_dir / f"trainer{rank}.log", "ab")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            [*cmd, *trainer_args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        ranks.processes.append(proc)
    return ranks


def odbd_cluster(
    *,
    nodes: int,
    ranks_per_node: int,
    data: dict[str, object],
    daemon_args: Sequence[str],
    job_id: str | None = None,
    dataset_file: Path = DATASET,
) -> LocalCluster:
    """Daemons whose producers (one per node) serve `make(**data)` of `dataset_file`
    (default `ddp_data.py`)."""
    dataset = ["--dataset", f"{dataset_file}:make", "--workers", "1", "--shm-size", "64M"]
    for key, value in data.items():
        dataset += ["--dataset-arg", f"{key}={value}"]
    spec = ClusterSpec(
        nodes=nodes, ranks_per_node=ranks_per_node, daemon_args=[*dataset, *daemon_args]
    )
    if job_id is not None:
        spec.job_id = job_id  # a restarted job keeps its id (and so its --state-dir)
    return LocalCluster(spec)


@dataclass
class Reports:
    """What every rank wrote: rank -> JSON lines."""

    records: dict[int, list[dict]]

    @classmethod
    def read(cls, out_dir: Path, world: int) -> Reports:
        records = {}
        for rank in range(world):
            records[rank] = read_jsonl(out_dir / f"rank{rank}.jsonl")
        return cls(records)

    def steps(self, rank: int, epoch: int | None = None) -> list[dict]:
        return [r for r in self.records[rank] if "step" in r and epoch in (None, r["epoch"])]

    def done(self, rank: int) -> dict:
        ends = [r for r in self.records[rank] if r.get("done")]
        return ends[-1] if ends else {}

    def ids(self, epoch: int) -> list[int]:
        return [i for rank in self.records for r in self.steps(rank, epoch) for i in r["ids"]]


def data_flags(data: dict[str, object]) -> list[str]:
    """`--data-arg` flags for the trainer (its held-out set and in-process loaders)."""
    return [f"--data-arg={key}={value}" for key, value in data.items()]


def run_odbd_training(
    *,
    nodes: int,
    ranks_per_node: int,
    data: dict[str, object],
    daemon_args: Sequence[str],
    trainer_args: Sequence[str],
    out_dir: Path,
    timeout_s: float = 120.0,
    wait_for_daemons: bool = False,
) -> tuple[LocalCluster, Reports, list[int | None], list[int | None]]:
    """Daemons and torchrun-like ranks to the end: (cluster, reports, daemon codes, rank codes)."""
    cluster = odbd_cluster(
        nodes=nodes, ranks_per_node=ranks_per_node, data=data, daemon_args=daemon_args
    )
    ranks = None
    try:
        cluster.start()
        if wait_for_daemons:  # benchmarks: the daemons' start stays out of the trainers' time
            cluster.wait_sockets(timeout_s)
        # Otherwise ranks import torch meanwhile, and ODBClient waits for its daemon.
        ranks = launch_ranks(
            world=cluster.world, nproc_per_node=ranks_per_node, out_dir=out_dir,
            trainer_args=[*trainer_args, *data_flags(data)], sockets=cluster.sockets,
        )  # fmt: skip
        rank_codes = ranks.wait(timeout_s)
        daemon_codes = cluster.wait(30.0)
    finally:
        if ranks is not None:
            ranks.wait(0.01)
        cluster.stop()
    return cluster, Reports.read(out_dir, cluster.world), daemon_codes, rank_codes
