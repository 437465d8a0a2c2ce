"""One run of the real node data path: 1 daemon + its 1 producer + 1 trainer process.

    run = run_datapath(DatapathCase(nbytes=8192, num_samples=30_000, batch_samples=16))

The daemon is `python -m odbd --world 1 --nproc-per-node 1 --dataset
tests/bench/datapath_dataset.py:fixed_size --workers 1` (it spawns the producer); the trainer is
`tests/bench/datapath_trainer.py`, consuming with ODBClient. While they run, this process (the
idle pytest parent) samples the CPU time of all three from /proc, so a result says how busy each
process was during the measured window. Every sample has `nbytes` of payload and
`nbytes // 8` tokens, and the token budget is `batch_samples` of them, so every batch holds
`batch_samples` samples.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from odbd.demo.cluster import ClusterSpec, LocalCluster

DATASET = str(Path(__file__).with_name("datapath_dataset.py")) + ":fixed_size"
TRAINER = str(Path(__file__).with_name("datapath_trainer.py"))
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_CPU_PERIOD_S = 0.05


@dataclass(frozen=True, kw_only=True, slots=True)
class DatapathCase:
    nbytes: int  # payload bytes per sample
    num_samples: int  # dataset size: one epoch
    batch_samples: int  # samples per batch (sets the token budget)
    buffer: int = 256  # --buffer: samples per planning round
    steps_ahead: int = 16  # --steps-ahead
    shm_bytes: int = 512 << 20
    compute_ms: tuple[float, float] = (0.0, 0.0)  # trainer's simulated compute per step
    warmup_steps: int = 20  # steps left out of every measurement (startup, first round)
    metrics: bool = False  # --metrics-port, scraped by the trainer

    def daemon_args(self) -> list[str]:
        tokens = self.nbytes // 8
        args = ["--dataset", DATASET, "--workers", "1", "--epochs", "1"]
        args += [
            "--dataset-arg",
            f"size={self.num_samples}",
            "--dataset-arg",
            f"nbytes={self.nbytes}",
        ]
        args += ["--token-budget", str(tokens * self.batch_samples), "--buffer", str(self.buffer)]
        args += ["--steps-ahead", str(self.steps_ahead), "--shm-size", str(self.shm_bytes)]
        return [*args, "--log-level", "WARNING"]


@dataclass(slots=True)
class DatapathRun:
    case: DatapathCase
    wait_s: list[float]  # per step: time blocked in next()
    compute_s: list[float]  # per step: time since the previous next() returned
    return_s: list[float]  # per step: perf_counter when next() returned
    num_samples: list[int]  # per step
    scrapes: list[dict[str, float]]  # daemon /metrics counters at warmup and at the end
    cpu_s: dict[str, float] = field(default_factory=dict)  # process -> CPU s in the window

    @property
    def window_s(self) -> float:
        """From the return of the last warmup step to the return of the last step."""
        return self.return_s[-1] - self.return_s[self.case.warmup_steps]

    @property
    def window_samples(self) -> int:
        return sum(self.num_samples[self.case.warmup_steps + 1 :])

    @property
    def samples_per_s(self) -> float:
        return self.window_samples / self.window_s

    @property
    def gb_per_s(self) -> float:
        return self.samples_per_s * self.case.nbytes / 1e9

    @property
    def steady_wait_s(self) -> list[float]:
        return self.wait_s[self.case.warmup_steps + 1 :]

    @property
    def trainer_overlap(self) -> float:
        """compute / (compute + wait) over the steps after warmup, from the trainer's clock."""
        k = self.case.warmup_steps + 1
        compute, wait = sum(self.compute_s[k:]), sum(self.wait_s[k:])
        return compute / (compute + wait)

    @property
    def daemon_overlap(self) -> float | None:
        """The same from the daemon's /metrics counters (difference of the two scrapes)."""
        if len(self.scrapes) != 2:
            return None
        first, last = self.scrapes
        wait = last["odbd_trainer_wait_seconds_total"] - first["odbd_trainer_wait_seconds_total"]
        compute = (
            last["odbd_trainer_compute_seconds_total"] - first["odbd_trainer_compute_seconds_total"]
        )
        return compute / (compute + wait)

    def cpu_share(self) -> dict[str, float]:
        """Process -> fraction of one core used during the window."""
        return {name: s / self.window_s for name, s in self.cpu_s.items()}


def run_datapath(case: DatapathCase, timeout_s: float = 120.0) -> DatapathRun:
    spec = ClusterSpec(
        nodes=1, ranks_per_node=1, daemon_args=case.daemon_args(), metrics=case.metrics
    )
    cluster = LocalCluster(spec)
    out = cluster.tmp / "trainer.json"
    cmd = [sys.executable, TRAINER, "--socket", cluster.sockets[0], "--out", str(out)]
    cmd += ["--compute-ms", ",".join(str(ms) for ms in case.compute_ms)]
    cmd += ["--warmup-steps", str(case.warmup_steps)]
    if case.metrics:
        cmd += ["--metrics-url", f"http://127.0.0.1:{cluster.metrics_ports[0]}/metrics"]
    trainer: subprocess.Popen[bytes] | None = None
    try:
        cluster.start()
        trainer = subprocess.Popen(cmd, stderr=subprocess.PIPE)
        sampler = CpuSampler({"daemon": cluster.processes[0].pid, "trainer": trainer.pid})
        sampler.start()
        _, stderr = trainer.communicate(timeout=timeout_s)
        sampler.stop()
        if trainer.returncode != 0:
            raise RuntimeError(f"trainer failed: {stderr.decode()[-2000:]}\n{cluster.log(0)}")
        codes = cluster.wait(30.0)
        if codes != [0]:
            raise RuntimeError(f"daemon exited with {codes}: {cluster.log(0)}")
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        cluster.stop()
    result = json.loads(out.read_text())
    run = DatapathRun(
        case=case,
        wait_s=result["wait_s"],
        compute_s=result["compute_s"],
        return_s=result["return_s"],
        num_samples=result["num_samples"],
        scrapes=result["scrapes"],
    )
    run.cpu_s = sampler.cpu_between(run.return_s[case.warmup_steps], run.return_s[-1])
    return run


class CpuSampler:
    """Samples user+system CPU seconds of some processes (and the daemon's children) from /proc.

    The clock is time.perf_counter (CLOCK_MONOTONIC on Linux), the same clock the trainer
    stamps its steps with, so a window in trainer time maps onto these samples.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = dict(pids)
        self._samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(_CPU_PERIOD_S):
            self._find_producer()
            self._samples.append((time.perf_counter(), self._read_all()))

    def _find_producer(self) -> None:
        # The daemon's child is its producer; the trainer's child, if any, is its reader
        # process (ODBClient(reader="process")), whose CPU is the trainer's too.
        for parent, child in (("daemon", "producer"), ("trainer", "reader")):
            if child not in self._pids and parent in self._pids:
                children = _children(self._pids[parent])
                if children:
                    self._pids[child] = children[0]

    def _read_all(self) -> dict[str, float]:
        found = {}
        for name, pid in self._pids.items():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            found[name] = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime + stime
        return found

    def cpu_between(self, start_s: float, end_s: float) -> dict[str, float]:
        """CPU seconds each process used between two perf_counter times (nearest samples)."""
        inside = [(t, cpu) for t, cpu in self._samples if start_s <= t <= end_s]
        if len(inside) < 2:
            return {}
        (_, first), (_, last) = inside[0], inside[-1]
        scale = (end_s - start_s) / (inside[-1][0] - inside[0][0])
        return {n: (last[n] - first[n]) * scale for n in last if n in first}


def _children(pid: int) -> list[int]:
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return pids


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def median(values: list[float]) -> float:
    return statistics.median(values)
