"""Runs a real local cluster (daemons, producers, trainer processes) and reads what trainers got."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from odbclient.wire.odbd.v1 import admin_pb2, admin_pb2_grpc
from odbd.demo.cluster import ClusterSpec, LocalCluster

SLOWDOWN_ENV = "ODBD_TEST_SLOWDOWN"
_MAX_LOAD_SLOWDOWN = 8.0  # a runaway load average must not turn a hang into an hour-long wait


def slowdown() -> float:
    """How much slower than an idle machine the tests should expect this one to be: the
    1-minute load average per core, at least 1 and at least $ODBD_TEST_SLOWDOWN when set (the
    load average lags a load that just started, such as tests/under_load.py's hogs). Read at
    each call, so a wait started under load gets the deadline of that moment.
    """
    floor = 1.0
    value = os.environ.get(SLOWDOWN_ENV, "")
    if value:
        try:
            floor = float(value)
        except ValueError:
            floor = 0.0
        if not floor >= 1.0:
            raise ValueError(
                f"${SLOWDOWN_ENV}={value!r} is not a number >= 1; unset it to follow the load "
                "average alone, or set e.g. 3 for a machine at least three times slower than "
                "an idle one"
            )
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return max(floor, min(per_core, _MAX_LOAD_SLOWDOWN))


def scaled(seconds: float) -> float:
    """A deadline (or how long something must last) of `seconds` on an idle machine, scaled
    to this machine now (see slowdown)."""
    return seconds * slowdown()


def poll_until(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> float:
    """Polls `predicate` until true; returns the seconds it took, or raises TimeoutError naming
    `what`. `timeout_s` is for an idle machine and scaled to this one (a sleep is no sync)."""
    timeout_s = scaled(timeout_s)
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting until {what}")
        time.sleep(0.05)
    return time.monotonic() - started


def admin_status(socket: str, timeout_s: float = 5.0) -> admin_pb2.StatusReply:
    """`odbd status` of the daemon on `socket` (Admin.Status over its unix socket)."""
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        return stub.Status(admin_pb2.StatusRequest(), timeout=scaled(timeout_s))


@dataclass
class RunResult:
    cluster: LocalCluster
    records: dict[int, list[dict]]  # rank -> report lines
    daemon_codes: list[int | None]
    trainer_codes: list[int | None]

    def steps(self, rank: int, epoch: int | None = None) -> list[dict]:
        return [
            r for r in self.records[rank] if "step" in r and (epoch is None or r["epoch"] == epoch)
        ]

    def epoch_ends(self, rank: int) -> list[dict]:
        return [r for r in self.records[rank] if "epoch_end" in r]

    def emitted_ids(self, epoch: int) -> list[int]:
        return [i for rank in self.records for r in self.steps(rank, epoch) for i in r["ids"]]


def synthetic_args(
    size: int, *, workers: int = 1, dist: str = "llava", **extra: object
) -> list[str]:
    args = ["--dataset", "odbd.demo.dataset:synthetic", "--workers", str(workers)]
    args += ["--dataset-arg", f"size={size}", "--dataset-arg", f"dist={dist}"]
    for key, value in extra.items():
        args += ["--dataset-arg", f"{key}={value}"]
    return args


def run_cluster(
    *,
    nodes: int,
    ranks_per_node: int,
    daemon_args: Sequence[str],
    per_node_args: Sequence[Sequence[str]] = (),
    epochs: int = 1,
    timeout_s: float = 120.0,
    trainer_args: dict[int, Sequence[str]] | None = None,
    trainer_module: str = "odbd.demo.trainer",  # takes --rank, --socket, --report, --epochs
) -> RunResult:
    timeout_s = scaled(timeout_s)  # given for an idle machine
    spec = ClusterSpec(
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        daemon_args=["--shm-size", "64M", "--epochs", str(epochs), *daemon_args],
        per_node_args=per_node_args,
    )
    cluster = LocalCluster(spec)
    trainers: list[subprocess.Popen[bytes]] = []
    reports = [cluster.tmp / f"rank{r}.jsonl" for r in range(cluster.world)]
    try:
        cluster.start()
        cluster.wait_sockets(timeout_s)
        for rank in range(cluster.world):
            cmd = [sys.executable, "-m", trainer_module, "--rank", str(rank)]
            cmd += ["--socket", cluster.sockets[cluster.node_of(rank)]]
            cmd += ["--report", str(reports[rank]), "--epochs", str(epochs)]
            cmd += list((trainer_args or {}).get(rank, ()))
            log = open(cluster.tmp / f"trainer{rank}.log", "ab")  # noqa: SIM115
            trainers.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        for t in trainers:
            t.wait(timeout=timeout_s)
        codes = cluster.wait(timeout_s)
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
        cluster.stop()
    records = {r: read_jsonl(p) for r, p in enumerate(reports)}
    return RunResult(cluster, records, codes, [t.poll() for t in trainers])


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a report a trainer may still be writing: a last line without
    its newline is half-written, not malformed, and is left for the next read."""
    if not path.exists():
        return []
    *complete, _partial = path.read_text().split("\n")
    return [json.loads(line) for line in complete if line.strip()]


def describe(result: RunResult) -> str:
    """Logs of every process, for assertion messages."""
    parts = []
    for node in range(result.cluster.spec.nodes):
        parts.append(f"--- daemon {node}\n{result.cluster.log(node)}")
    for path in sorted(result.cluster.tmp.glob("trainer*.log")):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
    return "\n".join(parts)


class HttpStatusError(OSError):
    """An HTTP error status, its response already closed. An OSError, as urllib's HTTPError is, so
    retry loops that wait out a server's start-up (Prometheus answers 503 until it is ready) keep
    retrying it."""


def http_get(url: str, timeout_s: float = 5.0) -> str:
    """GETs a loopback URL. An HTTP error status is closed here and raised as HttpStatusError: an
    HTTPError holds the open response socket, and one kept alive by a retry loop's traceback cycle
    is only freed by a later garbage collection, as a ResourceWarning in some other test."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (loopback)
            return response.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            body = error.read()[:200].decode(errors="replace")
        raise HttpStatusError(f"GET {url} answered HTTP {error.code}: {body}") from None
