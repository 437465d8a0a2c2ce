"""Metrics overhead: daemon throughput with /metrics scraped every second vs metrics off.

One node, 2 ranks, daemon-spawned producers of the synthetic dataset, trainers that take every
batch at once (no simulated compute), so the daemon's data path is the bottleneck. Each cycle
runs metrics off, scraped every 1 s and every 0.1 s (10x the cost: the dose-response check) in
a rotating order; throughput = samples trained per second over every rank after a warm-up; each
on run is compared with the off run of its cycle. The daemon also measures the CPU its renders
took (odbd_metrics_render_cpu_seconds_total). Target (issue 4): on/off >= 0.98.
Results are appended to docs/bench/metrics.md. Run as a module with `trainer` it is the trainer.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from odbd.demo.cluster import ClusterSpec, LocalCluster

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "docs" / "bench" / "metrics.md"
SIZE, DIST, RANKS, CYCLES = 30000, "llava", 2, 6
SCRAPE_EVERY_S = (1.0, 0.1)  # the Prometheus default-ish interval, and 10x that rate
WARMUP_S = 2.0  # the producer fills the buffer before the trainers attach: skip that burst


def trainer_main(argv: list[str]) -> int:
    rank, socket, out = int(argv[0]), argv[1], argv[2]
    from odbclient import ODBClient

    client = ODBClient(rank=rank, socket=socket, deadline_s=120.0)
    batches = []  # (wall-clock time, samples): compared across processes
    for batch in client:
        batches.append((time.time(), batch.num_samples))
    client.close()
    Path(out).write_text(json.dumps(batches))
    return 0


@dataclass(frozen=True, slots=True)
class RunResult:
    samples_per_s: float  # wall clock: sensitive to any other load on the 2 cores
    daemon_cpu_us_per_sample: float  # the daemon process's own CPU (all threads, no children)
    scrapes_s: list[float]
    render_cpu_share: float | None  # the daemon's own count of its scrape CPU / its total CPU


def steady_window(per_rank: list[list[tuple[float, int]]]) -> tuple[float, float, int]:
    """(start, end, samples) from WARMUP_S after the first batch to the last batch, every rank."""
    start = min(b[0][0] for b in per_rank) + WARMUP_S
    end = max(b[-1][0] for b in per_rank)
    return start, end, sum(n for batches in per_rank for t, n in batches if t > start)


class CpuMonitor(threading.Thread):
    """Samples a process's utime + stime (/proc/PID/stat) every 0.1 s with the wall time."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.path = f"/proc/{pid}/stat"
        self.stop = threading.Event()
        self.readings: list[tuple[float, float]] = []  # (time.time(), cpu seconds)
        self.tick = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                fields = Path(self.path).read_text().rsplit(")", 1)[1].split()
            except OSError:
                return  # the daemon exited
            self.readings.append((time.time(), (int(fields[11]) + int(fields[12])) / self.tick))

    def cpu_between(self, start: float, end: float) -> float:
        times = [t for t, _ in self.readings]
        cpu = [c for _, c in self.readings]
        return _interpolate(times, cpu, end) - _interpolate(times, cpu, start)


def _interpolate(xs: list[float], ys: list[float], x: float) -> float:
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1


class Scraper(threading.Thread):
    """GETs /metrics every `every_s`, as Prometheus would, and times each scrape."""

    def __init__(self, port: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.every_s = every_s
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.stop = threading.Event()
        self.durations_s: list[float] = []
        self.render_cpu_s = 0.0  # odbd_metrics_render_cpu_seconds_total of the last scrape

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:  # noqa: S310
                    text = response.read().decode()
            except OSError:
                continue  # the daemon is starting or gone
            self.durations_s.append(time.perf_counter() - started)
            found = re.search(r"^odbd_metrics_render_cpu_seconds_total (\S+)$", text, re.M)
            if found:
                self.render_cpu_s = float(found.group(1))


def run_once(tmp: Path, scrape_every_s: float | None) -> RunResult:
    metrics = scrape_every_s is not None
    spec = ClusterSpec(
        nodes=1,
        ranks_per_node=RANKS,
        metrics=metrics,
        daemon_args=["--dataset", "odbd.demo.dataset:synthetic", "--workers", "1"]
        + ["--dataset-arg", f"size={SIZE}", "--dataset-arg", f"dist={DIST}"]
        + ["--shm-size", "128M", "--buffer", "64", "--token-budget", "4096"],
    )
    outs = [
        tmp / f"{'on' if metrics else 'off'}-{time.monotonic_ns()}-{r}.json" for r in range(RANKS)
    ]
    with LocalCluster(spec) as cluster:
        cluster.wait_sockets(60)
        scraper = None
        if scrape_every_s is not None:
            scraper = Scraper(cluster.metrics_ports[0], scrape_every_s)
            scraper.start()
        monitor = CpuMonitor(cluster.processes[0].pid)
        monitor.start()
        trainers = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.bench.test_bench_metrics", "trainer"]
                + [str(r), cluster.sockets[0], str(outs[r])],
                cwd=ROOT,
            )
            for r in range(RANKS)
        ]
        for t in trainers:
            assert t.wait(timeout=300) == 0
        assert cluster.wait(60) == [0], cluster.log(0)
        monitor.stop.set()
        monitor.join()
        if scraper is not None:
            scraper.stop.set()
            scraper.join()
    start, end, samples = steady_window([json.loads(p.read_text()) for p in outs])
    cpu_s = monitor.cpu_between(start, end)
    share = None
    if scraper is not None and monitor.readings:
        share = scraper.render_cpu_s / monitor.readings[-1][1]  # both: the daemon's whole run
    return RunResult(
        samples / (end - start),
        cpu_s / samples * 1e6,
        scraper.durations_s if scraper else [],
        share,
    )


@pytest.mark.bench
@pytest.mark.timeout(1800)
def test_bench_metrics_overhead(tmp_path: Path) -> None:
    # One cycle = one run of each variant, in an order rotated every cycle, so a drift in the
    # machine's load does not favour one variant. The 10x scrape rate is the dose-response
    # check: a real cost grows tenfold with it, noise does not.
    variants: list[float | None] = [None, *SCRAPE_EVERY_S]
    runs: dict[float | None, list[RunResult]] = {v: [] for v in variants}
    for cycle in range(CYCLES):
        first = cycle % len(variants)
        for variant in variants[first:] + variants[:first]:
            runs[variant].append(run_once(tmp_path, variant))
    table = [
        "| daemon | samples/s per run | median | daemon CPU us/sample per run | median | "
        "scrapes | scrape p50 ms | render CPU / daemon CPU (median) |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for variant in variants:
        table.append(_row(variant, runs[variant]))
    table.append("")
    for every_s in SCRAPE_EVERY_S:
        on, off = runs[every_s], runs[None]
        throughput = [a.samples_per_s / b.samples_per_s for a, b in zip(on, off, strict=True)]
        cpu = [
            b.daemon_cpu_us_per_sample / a.daemon_cpu_us_per_sample
            for a, b in zip(on, off, strict=True)
        ]
        share = _median_share(on) or 0.0
        table.append(
            f"- scraped every {every_s:g} s / off, per cycle: throughput "
            f"{', '.join(f'{x:.3f}' for x in throughput)} (median "
            f"**{statistics.median(throughput):.3f}**); daemon CPU per sample off / on "
            f"{', '.join(f'{x:.3f}' for x in cpu)} (median **{statistics.median(cpu):.3f}**); "
            f"measured in the daemon: rendering took **{share:.2%}** of its CPU, so on/off >= "
            f"**{1 - share:.3f}** where the daemon is the bottleneck."
        )
    render_s = render_cost_s()
    table.append(
        f"\nUpper bound from the render cost alone: one scrape holds the GIL "
        f"{render_s * 1e3:.2f} ms (median of 200 renders of a 64-rank daemon's stats in this "
        f"process), so a scrape every {SCRAPE_EVERY_S[0]:g} s can delay the event loop by at most "
        f"{render_s / SCRAPE_EVERY_S[0]:.2%} of the time: "
        f"on/off >= {1 - render_s / SCRAPE_EVERY_S[0]:.3f}. Target >= 0.98.\n"
    )
    text = "\n".join(table)
    print("\n" + text)
    append_report(text)
    # End-to-end runs on 2 shared cores vary by more than the 2 % budget, so the assertions are
    # on the costs measured in the daemon and on the render cost, which bound what metrics take.
    at_1s = _median_share(runs[SCRAPE_EVERY_S[0]])
    assert at_1s is not None and at_1s <= 0.02, f"scrapes took {at_1s} of the daemon's CPU"
    assert render_s / SCRAPE_EVERY_S[0] <= 0.02, f"one scrape renders for {render_s * 1e3:.1f} ms"


def _row(every_s: float | None, runs: list[RunResult]) -> str:
    name = "metrics off" if every_s is None else f"metrics on, scraped every {every_s:g} s"
    rates = [r.samples_per_s for r in runs]
    costs = [r.daemon_cpu_us_per_sample for r in runs]
    durations = [d for r in runs for d in r.scrapes_s]
    scrape_ms = f"{statistics.median(durations) * 1000:.2f}" if durations else "-"
    share = _median_share(runs)
    share_text = "-" if share is None else f"{share:.2%}"
    return (
        f"| {name} | {', '.join(f'{v:.0f}' for v in rates)} | {statistics.median(rates):.0f} | "
        f"{', '.join(f'{v:.0f}' for v in costs)} | {statistics.median(costs):.0f} | "
        f"{len(durations)} | {scrape_ms} | {share_text} |"
    )


def _median_share(runs: list[RunResult]) -> float | None:
    """Median of the daemon's own render CPU share over runs that scraped (None: none did)."""
    shares = [r.render_cpu_share for r in runs if r.render_cpu_share is not None]
    return statistics.median(shares) if shares else None


def render_cost_s() -> float:
    """Median wall time of rendering /metrics for a daemon serving 64 ranks (16 nodes)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from odbd.metrics.collector import DaemonCollector
    from odbd.metrics.stats import DaemonStats

    stats = DaemonStats(node_rank=0, dataset_size=10**6, world_size=128, num_nodes=16, epochs=3)
    for rank in range(64):
        stats.rank(rank).padded_tokens = 10**9 + rank
    for i in range(1000):
        stats.round_duration.observe(0.001 * (i % 50))
    live = {"buffered_samples": 1024.0, "shm_used_bytes": 1e9, "shm_capacity_bytes": 4e9}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(stats, lambda: live))
    durations = []
    for _ in range(200):
        started = time.perf_counter()
        generate_latest(registry)
        durations.append(time.perf_counter() - started)
    return statistics.median(durations)


def append_report(table: str) -> None:
    if not REPORT.exists():
        REPORT.write_text(
            "# Metrics overhead\n\n"
            "Daemon throughput with Prometheus metrics on and /metrics scraped every second, vs "
            "metrics off, measured in alternating runs of one session. One node, 2 trainer ranks "
            "that take every batch at once, 1 daemon-spawned producer of the synthetic dataset "
            f"({DIST}, {SIZE} samples, budget 4096): busy processes = daemon + producer + 2 "
            "trainers on 2 cores. Throughput = samples trained per second over every rank, from "
            f"{WARMUP_S:g} s after the first batch (the buffer's prefill) to the last batch. Runs "
            "alternate off/on; the ratio is the median of each on run over the off run before it. "
            "Daemon CPU per sample: the daemon process's own utime + stime (every thread, the "
            "metrics thread included; producers excluded) over the same window, per sample; it "
            "is far less sensitive to other load on the machine than wall-clock throughput. "
            "Target (issue 4): on/off >= 0.98.\n\n"
            "Why it is cheap: the hot path only adds integers to plain dataclasses "
            "(`metrics/stats.py`); families are built from them on the metrics thread when "
            "scraped (`metrics/collector.py`), so a scrape costs the event loop only the GIL "
            "time of one render, once per scrape interval.\n"
        )
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"\n## {stamp}: 2 cores, {CYCLES} cycles of one run per variant\n\n"
        "Command: `make bench-metrics` "
        "(`.venv/bin/python -m pytest -q -m bench -s tests/bench/test_bench_metrics.py`). "
        "Other work on the machine was not controlled.\n\n"
    )
    with REPORT.open("a") as f:
        f.write(header + table)


if __name__ == "__main__":
    if sys.argv[1:2] == ["trainer"]:
        sys.exit(trainer_main(sys.argv[2:]))
    sys.exit("usage: python -m tests.bench.test_bench_metrics trainer RANK SOCKET OUT")
