"""Live daemons at 2, 8, 32 (64) nodes: round barrier, round bytes, CPU, RSS vs Gloo (issue 25).

    make bench-scale   # .venv/bin/python -m pytest -q -m bench -s tests/bench/test_bench_scale.py

For each N, N real daemons (`python -m odbd`, 1 rank per node, `--buffer 1024`, synthetic
samples from one producer worker per node) run a job on 127.0.0.1; light trainer stand-ins
(tests/bench/scale_trainer.py, up to RANKS_PER_TRAINER ranks per process, one thread each) take
every step. After WARMUP rounds the bench reads every daemon twice, MEASURE rounds apart:
- round barrier: `odbd_round_duration_seconds` of every daemon (the time from a daemon's offer
  to its plan, so it includes waiting for the slowest node); p50/p99 are interpolated in the
  histogram's buckets, pooled over the daemons, as Prometheus' histogram_quantile does;
- bytes per round: `odbd_round_payload_bytes_total{direction}` when the daemon has it (round
  protocol payloads); otherwise the kernel's TCP counters of each daemon's peer connections
  (`ss -tip`: bytes_sent/bytes_received, HTTP/2 and gRPC framing included, /metrics excluded);
- planning: `odbd_round_planning_seconds` when present; always the daemon's CPU time per round
  (utime + stime from /proc, everything the daemon did in the round: an upper bound);
- RSS: VmRSS - RssShmem of each daemon process (not the arena; not its producer worker), and
  RssAnon, its private part;
then Gloo `all_gather` among N processes of a uint8 tensor as large as a spoke's mean bytes
sent per round (`tests/bench/test_bench_round.py`'s worker), after the daemons stopped.
A projection to 128 and 1024 nodes fits the measured hub bytes and hub CPU per round over N and
extrapolates: it is a projection, not a measurement. Results are appended to docs/bench/scale.md.
Knobs: ODBD_BENCH_SCALE_NODES (e.g. "2,8,32,64"), ODBD_BENCH_SCALE_ROUNDS (MEASURE).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from odbd.demo.cluster import ClusterSpec, LocalCluster
from tests.bench.reports import append_to_report, run_stamp
from tests.bench.test_bench_round import measure_gloo
from tests.integration.harness import http_get, scaled, synthetic_args

NODES = tuple(int(n) for n in os.environ.get("ODBD_BENCH_SCALE_NODES", "2,8,32").split(","))
MEASURE = int(os.environ.get("ODBD_BENCH_SCALE_ROUNDS", "40"))  # rounds between the two reads
WARMUP = 5
GLOO_ROUNDS = 100
RANKS_PER_TRAINER = 16
BUFFER = 1024
# An endless job (--epochs 0) over a small dataset: the bench stops it. A 1,000,000-sample
# dataset took every daemon and producer 6 s of CPU to build, 64 processes at once at 32 nodes.
DATASET_SIZE = 20_000
REPORT = Path(__file__).resolve().parents[2] / "docs" / "bench" / "scale.md"
COMMAND = "make bench-scale"
TRAINER = Path(__file__).with_name("scale_trainer.py")
REPO = Path(__file__).resolve().parents[2]
PROJECT_TO = (128, 1024)


# -- reading a daemon --------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", re.M)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {"name{labels}": value} (labels as written)."""
    return {m[1] + (m[2] or ""): float(m[3]) for m in _SAMPLE.finditer(text)}


def buckets(metrics: dict[str, float], name: str) -> list[tuple[float, float]]:
    """[(upper bound, cumulative count)] of histogram `name`, +Inf last."""
    found = []
    for key, value in metrics.items():
        m = re.fullmatch(rf'{name}_bucket\{{le="([^"]+)"\}}', key)
        if m:
            found.append((math.inf if m[1] == "+Inf" else float(m[1]), value))
    return sorted(found)


def quantile(q: float, cumulative: list[tuple[float, float]]) -> float:
    """histogram_quantile: linear interpolation inside the bucket holding the q-th sample."""
    total = cumulative[-1][1] if cumulative else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in cumulative:
        if count >= rank:
            if math.isinf(upper):
                return lower  # beyond the last finite bound: its bound is all we know
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = upper, count
    return lower


def tcp_bytes(pids: set[int], exclude_ports: set[int]) -> dict[int, tuple[int, int]]:
    """pid -> (bytes sent, bytes received) over its open TCP connections (kernel counters)."""
    out = subprocess.run(
        ["ss", "-tinpH", "state", "established"], capture_output=True, text=True, timeout=60
    ).stdout
    totals = {pid: [0, 0] for pid in pids}
    lines = out.splitlines()
    for head, info in zip(lines[::2], lines[1::2], strict=False):
        owners = {int(p) for p in re.findall(r"pid=(\d+)", head)} & pids
        local, peer = head.split()[2:4]
        if (
            not owners
            or {int(local.rsplit(":", 1)[1]), int(peer.rsplit(":", 1)[1])} & exclude_ports
        ):
            continue
        sent = re.search(r"bytes_sent:(\d+)", info)
        received = re.search(r"bytes_received:(\d+)", info)
        for pid in owners:
            totals[pid][0] += int(sent[1]) if sent else 0
            totals[pid][1] += int(received[1]) if received else 0
    return {pid: (s, r) for pid, (s, r) in totals.items()}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS without RssShmem, RssAnon) in MiB: the daemon's memory without the shm arena pages
    it touched, and of that its private part (the rest are library pages every daemon shares)."""
    status = Path(f"/proc/{pid}/status").read_text()
    kib = {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", status, re.M)}
    return (kib["VmRSS"] - kib.get("RssShmem", 0)) / 1024, kib.get("RssAnon", 0) / 1024


@dataclass
class Reading:
    metrics: list[dict[str, float]]
    tcp: dict[int, tuple[int, int]]
    cpu: list[float]
    at: float = field(default_factory=time.monotonic)

    def rounds(self, node: int) -> float:
        return self.metrics[node].get("odbd_rounds_total", 0.0)


def read_all(cluster: LocalCluster) -> Reading:
    pids = [p.pid for p in cluster.processes]
    metrics = [
        parse_metrics(http_get(_url(cluster, n), timeout_s=scaled(30))) for n in range(len(pids))
    ]
    tcp = tcp_bytes(set(pids), set(cluster.metrics_ports))
    return Reading(metrics, tcp, [cpu_seconds(pid) for pid in pids])


def _url(cluster: LocalCluster, node: int) -> str:
    return f"http://127.0.0.1:{cluster.metrics_ports[node]}/metrics"


# -- one N ---------------------------------------------------------------------------------------


@dataclass
class Row:
    nodes: int
    rounds: float
    seconds: float
    barrier_p50_ms: float
    barrier_p99_ms: float
    bytes_source: str  # "metric" or "tcp"
    spoke_sent: float  # per round, mean over spokes
    spoke_received: float
    hub_sent: float
    hub_received: float
    planning_ms: float  # mean per round per daemon, nan without the metric
    cpu_ms_spoke: float  # daemon CPU per round, mean over spokes
    cpu_ms_hub: float
    rss_mib_max: float
    rss_mib_mean: float
    anon_mib_mean: float
    gloo_p50_ms: float = math.nan
    gloo_p99_ms: float = math.nan


def run_nodes(num_nodes: int) -> Row:
    spec = ClusterSpec(
        nodes=num_nodes,
        ranks_per_node=1,
        metrics=True,
        daemon_args=[
            *synthetic_args(DATASET_SIZE, workers=1, dist="sharegpt4o"),
            "--buffer", str(BUFFER), "--shm-size", "48M", "--epochs", "0",
            "--round-timeout", "600", "--join-timeout", "600",
        ],
    )  # fmt: skip
    cluster = LocalCluster(spec)
    trainers: list[subprocess.Popen[bytes]] = []
    try:
        cluster.start()
        cluster.wait_sockets(scaled(120 + 3 * num_nodes))
        for first in range(0, num_nodes, RANKS_PER_TRAINER):
            cmd = [sys.executable, str(TRAINER)]
            for rank in range(first, min(first + RANKS_PER_TRAINER, num_nodes)):
                cmd += ["--rank-socket", f"{rank}={cluster.sockets[rank]}"]
            log = open(cluster.tmp / f"trainer{first}.log", "ab")  # noqa: SIM115
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            }
            trainers.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
            log.close()
        _wait_rounds(cluster, WARMUP, scaled(300 + 10 * num_nodes))
        before = read_all(cluster)
        _wait_rounds(cluster, before.rounds(0) + MEASURE, scaled(600 + 10 * num_nodes))
        after = read_all(cluster)
        rss = [rss_mib(p.pid) for p in cluster.processes]
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
                t.wait()
        cluster.stop()
    return summarize(num_nodes, before, after, rss, [p.pid for p in cluster.processes])


def _wait_rounds(cluster: LocalCluster, rounds: float, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for node, proc in enumerate(cluster.processes):
            assert proc.poll() is None, (
                f"daemon {node} exited {proc.returncode}: {cluster.log(node)}"
            )
        try:
            text = http_get(_url(cluster, 0), timeout_s=scaled(30))
        except OSError:
            text = ""  # /metrics opens after the socket: not yet
        if parse_metrics(text).get("odbd_rounds_total", 0.0) >= rounds:
            return
        assert time.monotonic() < deadline, (
            f"the hub did not reach round {rounds}: {cluster.log(0)}"
        )
        time.sleep(0.5)


def _delta_buckets(
    before: dict[str, float], after: dict[str, float], name: str
) -> list[tuple[float, float]]:
    old = dict(buckets(before, name))
    return [(le, count - old.get(le, 0.0)) for le, count in buckets(after, name)]


def summarize(
    n: int, before: Reading, after: Reading, rss: list[tuple[float, float]], pids: list[int]
) -> Row:
    rounds = [after.rounds(i) - before.rounds(i) for i in range(n)]
    assert min(rounds) > 0, f"a daemon did no round while measured: {rounds}"
    pooled: dict[float, float] = {}
    for i in range(n):
        for le, count in _delta_buckets(
            before.metrics[i], after.metrics[i], "odbd_round_duration_seconds"
        ):
            pooled[le] = pooled.get(le, 0.0) + count
    cumulative = sorted(pooled.items())

    def delta(i: int, key: str) -> float:
        return after.metrics[i][key] - before.metrics[i].get(key, 0.0)

    sent_key = 'odbd_round_payload_bytes_total{direction="sent"}'
    received_key = 'odbd_round_payload_bytes_total{direction="received"}'
    if all(sent_key in m for m in after.metrics):
        source = "metric"
        sent = [delta(i, sent_key) / rounds[i] for i in range(n)]
        received = [delta(i, received_key) / rounds[i] for i in range(n)]
    else:
        source = "tcp"
        sent = [(after.tcp[p][0] - before.tcp[p][0]) / rounds[i] for i, p in enumerate(pids)]
        received = [(after.tcp[p][1] - before.tcp[p][1]) / rounds[i] for i, p in enumerate(pids)]
    planning = math.nan
    if all("odbd_round_planning_seconds_sum" in m for m in after.metrics):
        per = [
            delta(i, "odbd_round_planning_seconds_sum")
            / delta(i, "odbd_round_planning_seconds_count")
            for i in range(n)
            if delta(i, "odbd_round_planning_seconds_count") > 0
        ]
        planning = 1e3 * _mean(per)
    cpu = [1e3 * (after.cpu[i] - before.cpu[i]) / rounds[i] for i in range(n)]
    spokes = range(1, n)
    return Row(
        nodes=n,
        rounds=rounds[0],
        seconds=after.at - before.at,
        barrier_p50_ms=1e3 * quantile(0.5, cumulative),
        barrier_p99_ms=1e3 * quantile(0.99, cumulative),
        bytes_source=source,
        spoke_sent=_mean([sent[i] for i in spokes]),
        spoke_received=_mean([received[i] for i in spokes]),
        hub_sent=sent[0],
        hub_received=received[0],
        planning_ms=planning,
        cpu_ms_spoke=_mean([cpu[i] for i in spokes]),
        cpu_ms_hub=cpu[0],
        rss_mib_max=max(r for r, _ in rss),
        rss_mib_mean=_mean([r for r, _ in rss]),
        anon_mib_mean=_mean([a for _, a in rss]),
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def gloo(row: Row, store_dir: Path) -> None:
    import statistics

    payload = max(1, int(row.spoke_sent))
    samples = measure_gloo(row.nodes, store_dir, payload_bytes=payload, rounds=GLOO_ROUNDS)
    cuts = statistics.quantiles(samples, n=100)
    row.gloo_p50_ms, row.gloo_p99_ms = statistics.median(samples) * 1e3, cuts[98] * 1e3


# -- projection ----------------------------------------------------------------------------------


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares a + b x (a, b >= 0: a cost per message does not shrink as N grows)."""
    import numpy as np

    b, a = np.polyfit(np.array(xs), np.array(ys), 1)
    return max(0.0, float(a)), max(0.0, float(b))


@dataclass(frozen=True)
class Projection:
    nodes: int
    hub_sent: float  # bytes per round
    hub_received: float
    spoke_received: float
    cpu_ms_hub: float
    cpu_ms_spoke: float


def project(rows: list[Row], n: int) -> Projection:
    """Per-message costs measured at each N, fitted linearly over N, times the messages at `n`.

    In a star round the hub receives one offer from and sends one result to each of the N-1
    spokes: bytes per result (what a spoke receives), bytes per offer and hub CPU per message
    are measured at each N; each may itself grow with N (a result that carries every node's
    offer grows linearly, which makes the hub's total quadratic), so each is fitted a + b N and
    multiplied by the messages at `n`. A spoke's CPU per round is fitted the same way."""
    xs = [float(r.nodes) for r in rows]

    def at(values: list[float]) -> float:
        a, b = fit_line(xs, values)
        return a + b * n

    per_result = at([r.hub_sent / (r.nodes - 1) for r in rows])
    per_offer = at([r.hub_received / (r.nodes - 1) for r in rows])
    cpu_per_message = at([r.cpu_ms_hub / (2 * (r.nodes - 1)) for r in rows])
    return Projection(
        nodes=n,
        hub_sent=(n - 1) * per_result,
        hub_received=(n - 1) * per_offer,
        spoke_received=per_result,
        cpu_ms_hub=2 * (n - 1) * cpu_per_message,
        cpu_ms_spoke=at([r.cpu_ms_spoke for r in rows]),
    )


# -- report --------------------------------------------------------------------------------------


def _kib(b: float) -> str:
    return f"{b / 1024:.1f}"


def write_report(rows: list[Row]) -> None:
    intro = (
        "# Live daemons at scale\n\n"
        "`make bench-scale` (tests/bench/test_bench_scale.py): N real daemons on one machine "
        "(127.0.0.1), 1 rank per node, `--buffer 1024`, synthetic sharegpt4o samples from one "
        "producer worker per node, trainer stand-ins taking every step at once. Barrier = "
        "`odbd_round_duration_seconds` of every daemon (offer to plan, waiting for the "
        "slowest node included), quantiles interpolated in its buckets. Bytes per round "
        "from `odbd_round_payload_bytes_total` where the daemons have it, else from the "
        "kernel's TCP counters of the peer connections (framing included). Gloo = "
        "`all_gather` of a spoke's mean bytes per round among N processes on loopback, "
        "run after the daemons stopped. See the module docstring for the method.\n"
    )
    stamp = run_stamp()
    load = os.getloadavg()
    lines = [
        "",
        f"## {stamp}: {os.cpu_count()} cores shared with other work (load average "
        f"{load[0]:.1f} at the end), {MEASURE} measured rounds after {WARMUP} warm-up",
        "",
        f"Command: `{COMMAND}`. The machine was shared and noisy: every daemon, producer and "
        "trainer thread of an N ran on these cores at once, so barrier times above 2 nodes "
        "are largely a scheduler measurement; bytes per round and CPU per round are not.",
        "",
        "| nodes | rounds/s | barrier p50 ms | barrier p99 ms | gloo p50 ms | gloo p99 ms | "
        "bytes from | spoke sent KiB/round | spoke received KiB/round | hub sent KiB/round | "
        "hub received KiB/round | planning ms/round | CPU ms/round spoke | CPU ms/round hub | "
        "RSS MiB mean / max (no shm) | private MiB mean |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        planning = "n/a" if math.isnan(r.planning_ms) else f"{r.planning_ms:.2f}"
        lines.append(
            f"| {r.nodes} | {r.rounds / r.seconds:.2f} | {r.barrier_p50_ms:.1f} | "
            f"{r.barrier_p99_ms:.1f} | {r.gloo_p50_ms:.2f} | {r.gloo_p99_ms:.2f} | "
            f"{r.bytes_source} | {_kib(r.spoke_sent)} | {_kib(r.spoke_received)} | "
            f"{_kib(r.hub_sent)} | {_kib(r.hub_received)} | {planning} | {r.cpu_ms_spoke:.1f} | "
            f"{r.cpu_ms_hub:.1f} | {r.rss_mib_mean:.0f} / {r.rss_mib_max:.0f} | "
            f"{r.anon_mib_mean:.0f} |"
        )
    if len(rows) >= 2:
        lines += [
            "",
            "Projection, not a measurement: per-message costs measured at each N (bytes per "
            "result a spoke receives, bytes per offer the hub receives, hub CPU per message, "
            "2 (N-1) messages per round at the hub), each fitted a + b N over the measured N, "
            "times the messages at the larger N. CPU here is the daemon's whole round on a "
            "shared machine, planning included; the hub's CPU per round bounds its barrier from "
            "below once the hub is the bottleneck.",
            "",
            "| nodes | hub sent MiB/round | hub received MiB/round | spoke received KiB/round | "
            "CPU ms/round hub | CPU ms/round spoke |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for n in PROJECT_TO:
            p = project(rows, n)
            lines.append(
                f"| {n} (projected) | {p.hub_sent / 2**20:.1f} | {p.hub_received / 2**20:.1f} | "
                f"{_kib(p.spoke_received)} | {p.cpu_ms_hub:.0f} | {p.cpu_ms_spoke:.0f} |"
            )
    append_to_report(REPORT, intro, lines)


@pytest.mark.bench
@pytest.mark.timeout(7200)
def test_bench_scale_live_daemons_vs_gloo(tmp_path: Path) -> None:
    rows = []
    for n in NODES:
        row = run_nodes(n)
        print(f"\n{row}")  # before Gloo: a failure there must not lose what the daemons did
        gloo(row, tmp_path / f"gloo{n}")
        print(f"gloo p50 {row.gloo_p50_ms:.2f} ms p99 {row.gloo_p99_ms:.2f} ms")
        rows.append(row)
    write_report(rows)
