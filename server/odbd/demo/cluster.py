"""A local multi-node odbd cluster on loopback: N daemon processes, one per "node".

Used by `odbd demo`, the integration tests and the benchmarks. Daemons are real processes
(`python -m odbd ...`) with their own unix sockets, peer ports on 127.0.0.1 and shm arenas.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


def free_ports(count: int) -> list[int]:
    """Ports the kernel reports free on 127.0.0.1 (bound then released, so a race is possible)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_all(processes: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> list[int | None]:
    """Waits for every process within one shared deadline; exit codes (None = still running)."""
    deadline = time.monotonic() + timeout_s
    for proc in processes:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            break
    return [p.poll() for p in processes]


@dataclass(kw_only=True)
class ClusterSpec:
    nodes: int = 2
    ranks_per_node: int = 2
    job_id: str = field(default_factory=lambda: f"t{os.getpid()}x{time.monotonic_ns() % 10**9}")
    daemon_args: Sequence[str] = ()  # flags shared by every daemon
    per_node_args: Sequence[Sequence[str]] = ()  # extra flags of node i
    metrics: bool = False
    log_dir: Path | None = None


class LocalCluster:
    """Starts the daemons; `sockets[i]` is node i's unix socket."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.tmp = Path(tempfile.mkdtemp(prefix=f"odbd-{spec.job_id}-"))
        self.log_dir = spec.log_dir or self.tmp
        self.sockets = [str(self.tmp / f"node{i}.sock") for i in range(spec.nodes)]
        ports = free_ports(spec.nodes * (2 if spec.metrics else 1))
        self.peer_ports = ports[: spec.nodes]
        self.metrics_ports = ports[spec.nodes :] if spec.metrics else []
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def world(self) -> int:
        return self.spec.nodes * self.spec.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.spec.ranks_per_node

    def command(self, node: int) -> list[str]:
        spec = self.spec
        peers = ",".join(f"127.0.0.1:{p}" for p in self.peer_ports)
        args = [sys.executable, "-m", "odbd", "--world", str(self.world)]
        args += ["--nproc-per-node", str(spec.ranks_per_node), "--node-rank", str(node)]
        args += ["--socket", self.sockets[node], "--job-id", spec.job_id]
        if spec.nodes > 1:
            args += ["--peers", peers, "--listen", f"127.0.0.1:{self.peer_ports[node]}"]
        if self.metrics_ports:
            args += ["--metrics-port", str(self.metrics_ports[node])]
        args += list(spec.daemon_args)
        if node < len(spec.per_node_args):
            args += list(spec.per_node_args[node])
        return args

    def start(self) -> LocalCluster:
        for node in range(self.spec.nodes):
            self.start_node(node)
        return self

    def start_node(self, node: int) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"daemon{node}.log", "ab")  # noqa: SIM115 (closed with proc)
        proc = subprocess.Popen(self.command(node), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if node < len(self.processes):
            self.processes[node] = proc
        else:
            self.processes.append(proc)
        return proc

    def wait_sockets(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        for node, path in enumerate(self.sockets):
            while not os.path.exists(path):
                proc = self.processes[node]
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"daemon {node} exited with {proc.returncode}: {self.log(node)}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"daemon {node} did not open {path} in {timeout_s} s")
                time.sleep(0.05)

    def log(self, node: int) -> str:
        path = self.log_dir / f"daemon{node}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def wait(self, timeout_s: float) -> list[int | None]:
        return wait_all(self.processes, timeout_s)

    def stop(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def leftover_segments(self) -> list[str]:
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"odbd-{self.spec.job_id}-")]

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
