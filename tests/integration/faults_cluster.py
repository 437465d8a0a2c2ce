"""A local cluster for fault tests: real daemons, producers and trainer processes on loopback,
plus the handles a fault needs (producer pids, Admin status, trainer reports, timings).

    with FaultCluster(nodes=2, ranks_per_node=2, daemon_args=[...]) as fc:
        fc.start_trainers()
        fc.wait_until(lambda: fc.steps_seen(0) >= 5, "rank 0 trained 5 steps")
        os.kill(fc.producer_pids(0)[0], signal.SIGKILL)
        fc.wait_done()
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from odbclient.wire.odbd.v1 import admin_pb2, admin_pb2_grpc
from odbd.demo.cluster import ClusterSpec, LocalCluster
from tests.integration.harness import read_jsonl, scaled

TRAINER = Path(__file__).with_name("faults_trainer.py")
REPO = Path(__file__).resolve().parents[2]


def synthetic(size: int, *, workers: int = 1, dist: str = "llava", **extra: object) -> list[str]:
    args = ["--dataset", "odbd.demo.dataset:synthetic", "--workers", str(workers)]
    args += ["--dataset-arg", f"size={size}", "--dataset-arg", f"dist={dist}"]
    for key, value in extra.items():
        args += ["--dataset-arg", f"{key}={value}"]
    return args


class FaultCluster:
    def __init__(
        self,
        *,
        nodes: int,
        ranks_per_node: int,
        daemon_args: Sequence[str],
        per_node_args: Sequence[Sequence[str]] = (),
        epochs: int = 1,
        shm_size: str = "64M",
        metrics: bool = False,
        make_cluster: Callable[[ClusterSpec], LocalCluster] = LocalCluster,
    ) -> None:
        spec = ClusterSpec(
            nodes=nodes,
            ranks_per_node=ranks_per_node,
            daemon_args=["--shm-size", shm_size, "--epochs", str(epochs), *daemon_args],
            per_node_args=per_node_args,
            metrics=metrics,
        )
        self.epochs = epochs
        self.cluster = make_cluster(spec)  # a NetnsCluster puts each daemon in its own netns
        self.trainers: list[subprocess.Popen[bytes]] = []
        self.producers: list[subprocess.Popen[bytes]] = []  # external ones (start_producer)
        self.reports = self.cluster.tmp / "reports"
        self.reports.mkdir()

    # -- processes ---------------------------------------------------------------------------

    @property
    def world(self) -> int:
        return self.cluster.world

    @property
    def daemons(self) -> list[subprocess.Popen[bytes]]:
        return self.cluster.processes

    def start(self, timeout_s: float = 60.0) -> FaultCluster:
        self.cluster.start()
        self.cluster.wait_sockets(scaled(timeout_s))
        return self

    def start_trainer(self, ranks: Sequence[int], *extra: str) -> subprocess.Popen[bytes]:
        node = self.cluster.node_of(ranks[0])
        cmd = [sys.executable, str(TRAINER), "--socket", self.cluster.sockets[node]]
        cmd += ["--ranks", ",".join(map(str, ranks)), "--report-dir", str(self.reports)]
        cmd += ["--epochs", str(self.epochs), *extra]
        name = "-".join(map(str, ranks))
        log = open(self.cluster.tmp / f"trainer{name}.log", "ab")  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": with_repo_path(os.environ.get("PYTHONPATH", ""))}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.trainers.append(proc)
        return proc

    def start_trainers(self, *extra: str, skip: Sequence[int] = ()) -> None:
        """One trainer process per node, hosting that node's ranks (except `skip`)."""
        per_node = self.cluster.spec.ranks_per_node
        for node in range(self.cluster.spec.nodes):
            ranks = [r for r in range(node * per_node, (node + 1) * per_node) if r not in skip]
            if ranks:
                self.start_trainer(ranks, *extra)

    def start_producer(self, node: int, *dataset_args: str) -> subprocess.Popen[bytes]:
        """An external producer (for daemons run with --dataset-size) of the synthetic dataset."""
        cmd = [sys.executable, "-m", "odbclient.producer.producer_main", "--socket"]
        cmd += [self.cluster.sockets[node], "--dataset", "odbd.demo.dataset:synthetic"]
        cmd += ["--job-id", self.cluster.spec.job_id]
        for arg in dataset_args:
            cmd += ["--dataset-arg", arg]
        log = open(self.cluster.tmp / f"producer{node}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.producers.append(proc)
        return proc

    def producer_pids(self, node: int) -> list[int]:
        """Live producer processes the daemon of `node` spawned."""
        return children(self.daemons[node].pid, "odbclient.producer.producer_main")

    def status(self, node: int, timeout_s: float = 5.0) -> admin_pb2.StatusReply:
        with grpc.insecure_channel(f"unix:{self.cluster.sockets[node]}") as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            return stub.Status(admin_pb2.StatusRequest(), timeout=scaled(timeout_s))

    def wait_until(
        self, predicate: Callable[[], bool], what: str, timeout_s: float = 60.0
    ) -> float:
        """Polls `predicate`; returns the seconds it took, or fails naming `what`. `timeout_s`
        is for an idle machine: it is scaled to the load (harness.scaled)."""
        timeout_s = scaled(timeout_s)
        started = time.monotonic()
        while not predicate():
            if time.monotonic() - started > timeout_s:
                message = f"timed out after {timeout_s:g} s waiting until {what}"
                raise AssertionError(f"{message}\n{self.describe()}")
            time.sleep(0.05)
        return time.monotonic() - started

    def wait_done(self, timeout_s: float = 120.0) -> tuple[list[int | None], list[int | None]]:
        """(daemon exit codes, trainer exit codes) once everything exited or the timeout (for an
        idle machine, scaled to the load)."""
        deadline = time.monotonic() + scaled(timeout_s)
        for proc in [*self.trainers, *self.daemons, *self.producers]:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.daemons], [p.poll() for p in self.trainers]

    def stop(self) -> None:
        for proc in [*self.trainers, *self.producers]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for proc in self.daemons:
            if proc.poll() is None:
                os.kill(proc.pid, 18)  # SIGCONT, in case a test left it stopped
        self.cluster.stop()

    def __enter__(self) -> FaultCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what the trainers got ---------------------------------------------------------------

    def records(self, rank: int) -> list[dict]:
        return read_jsonl(self.reports / f"rank{rank}.jsonl")

    def steps(self, rank: int, epoch: int | None = None) -> list[dict]:
        return [
            r for r in self.records(rank) if "step" in r and (epoch is None or r["epoch"] == epoch)
        ]

    def steps_seen(self, rank: int) -> int:
        return len(self.steps(rank))

    def errors(self, rank: int) -> list[dict]:
        return [r for r in self.records(rank) if "error" in r]

    def emitted_ids(self, epoch: int) -> list[int]:
        return [i for rank in range(self.world) for r in self.steps(rank, epoch) for i in r["ids"]]

    def log(self, node: int) -> str:
        path = self.cluster.log_dir / f"daemon{node}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def describe(self) -> str:
        parts = [f"--- daemon {n}\n{self.log(n)[-3000:]}" for n in range(len(self.daemons))]
        for path in sorted(self.cluster.tmp.glob("[tp]r*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    # -- the invariants every fault test checks ----------------------------------------------

    def assert_clean_exit(self, daemon_codes: list[int | None], trainer_codes: list) -> None:
        assert daemon_codes == [0] * len(daemon_codes), self.describe()
        assert all(c == 0 for c in trainer_codes), (trainer_codes, self.describe())
        assert self.cluster.leftover_segments() == [], "shared memory left behind"

    def assert_aligned(self) -> int:
        """Every rank got steps 0..n-1 of every epoch exactly once; returns n of epoch 0."""
        first = 0
        for epoch in range(self.epochs):
            seqs = {r: [s["step"] for s in self.steps(r, epoch)] for r in range(self.world)}
            lengths = {len(s) for s in seqs.values()}
            assert len(lengths) == 1, f"epoch {epoch}: step counts differ {seqs}"
            for rank, seq in seqs.items():
                assert seq == list(range(len(seq))), f"rank {rank} epoch {epoch}: steps {seq}"
            first = first or lengths.pop()
        return first

    def train_to_the_end(self, timeout_s: float) -> None:
        """Starts every trainer and waits for the job's end: every process exits 0, nothing is
        left in /dev/shm, and every rank got the same steps of every epoch."""
        self.start_trainers()
        daemon_codes, trainer_codes = self.wait_done(timeout_s)
        self.assert_clean_exit(daemon_codes, trainer_codes)
        self.assert_aligned()

    def assert_exactly_once(self, size: int) -> None:
        """Join mode: every identity of every epoch once, plus DistributedSampler tail padding."""
        tail = self.world * math.ceil(size / self.world) - size
        for epoch in range(self.epochs):
            ids = self.emitted_ids(epoch)
            counts = Counter(ids)
            assert set(counts) == set(range(size)), f"epoch {epoch}: identities missing"
            assert len(ids) == size + tail, f"epoch {epoch}: {len(ids)} views, not {size + tail}"


def with_repo_path(pythonpath: str) -> str:
    """$PYTHONPATH with the repository root first (for `tests.`), keeping the caller's entries:
    a worktree run with PYTHONPATH=server:client must give its trainers the same odbclient as
    its daemons, not the installed one."""
    return os.pathsep.join([str(REPO), *filter(None, pythonpath.split(os.pathsep))])


def children(pid: int, needle: str) -> list[int]:
    """Child processes of `pid` whose command line contains `needle`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z" and needle in cmdline:
            found.append(int(entry))
    return found
