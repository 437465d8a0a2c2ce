"""A real Prometheus scrapes a 2-node loopback cluster: the dashboard PromQL gives the run's values.

Also: every PromQL expression of ops/ names only metrics a live daemon exports.
Run as `python -m tests.integration.test_prometheus trainer ...` it is the trainer these tests
start: it trains one epoch, reports what it measured, and keeps its stream open until released
(so the daemons stay up, with their final numbers, until Prometheus has scraped them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from odbd.demo.cluster import ClusterSpec, LocalCluster, free_ports
from tests.integration.harness import http_get, scaled

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ops" / "grafana" / "odbd-dashboard.json"
RULES = ROOT / "ops" / "prometheus" / "odbd-alerts.yml"
JOB = "odbd"  # the Prometheus job label in this test's scrape config
SIZE, DIST = 300, "llava"
STEP_S = 0.05  # simulated training time per step

# -- PromQL of ops/ ----------------------------------------------------------------------------

_FUNCTION_OR_AGGREGATION = re.compile(r"\b([a-z_]+)\s*\(")
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "bool", "offset"}


def dashboard_exprs() -> dict[str, list[str]]:
    """Panel title -> its PromQL expressions."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in panels}


def rule_exprs() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"]}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (labels, functions and keywords removed)."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\b(group_left|group_right)\b", " ", text)
    text = _FUNCTION_OR_AGGREGATION.sub("(", text)
    names = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", text)) - _KEYWORDS
    return {n for n in names if not re.fullmatch(r"[eE]\d*|inf|nan|Inf|NaN", n)}


def exported_names(exposition: str) -> set[str]:
    """Series names a /metrics page offers, including families with no sample yet."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    for family in text_string_to_metric_families(exposition):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, [""])}
    return names


# -- processes ---------------------------------------------------------------------------------


def wait_for(what: str, check: Callable[[], object], timeout_s: float, every_s: float = 0.1):
    timeout_s = scaled(timeout_s)  # for an idle machine; follows this one's load
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (OSError, ValueError, KeyError) as error:
            last_error = error
        time.sleep(every_s)
    raise TimeoutError(f"{what} within {timeout_s:.0f} s (last error: {last_error})")


def scrape(port: int) -> str:
    return http_get(f"http://127.0.0.1:{port}/metrics")


def samples(exposition: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    ]


class Prometheus:
    """A real Prometheus server on 127.0.0.1 with its storage in a temporary directory."""

    def __init__(self, binary: str, tmp: Path, targets: list[str]) -> None:
        self.port = free_ports(1)[0]
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": targets}]}],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = tmp / "prometheus.log"
        command = [binary, f"--config.file={tmp / 'prometheus.yml'}"]
        command += [f"--storage.tsdb.path={tmp / 'data'}", "--log.level=warn"]
        command += [f"--web.listen-address=127.0.0.1:{self.port}"]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            return "Ready" in http_get(f"http://127.0.0.1:{self.port}/-/ready", 1.0)

        wait_for("prometheus ready", ready, 30)

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        body = json.loads(http_get(url))
        assert body["status"] == "success", body
        return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]

    def scalar(self, expr: str) -> float:
        result = self.query(expr)
        assert len(result) == 1, f"{expr} gave {result}"
        return result[0][1]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def module_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.integration.test_prometheus", *args]


@contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def start(started: list, command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    started.append(proc)
    return proc


# -- the trainer -------------------------------------------------------------------------------


def trainer_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--release", required=True, help="hold the stream open until this file exists")
    p.add_argument("--step-s", type=float, default=0.0)
    args = p.parse_args(argv)
    from odbclient import ODBClient

    client = ODBClient(rank=args.rank, socket=args.socket, deadline_s=60.0)
    wait_s = compute_s = 0.0
    last_return: float | None = None
    with open(args.report, "w") as report:
        batches = iter(client)
        while True:
            called = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            returned = time.perf_counter()
            wait_s += returned - called
            compute_s += 0.0 if last_return is None else called - last_return
            last_return = returned
            ids = batch["input_ids"]
            padded = 0 if batch.is_idle else int(ids.shape[0] * ids.shape[1])
            report.write(json.dumps({"ids": list(batch.sample_ids), "padded": padded}) + "\n")
            time.sleep(args.step_s)
        report.write(json.dumps({"done": True, "wait_s": wait_s, "compute_s": compute_s}) + "\n")
    deadline = time.monotonic() + 60
    while not os.path.exists(args.release) and time.monotonic() < deadline:
        time.sleep(0.05)
    client.close()
    return 0


def read_report(path: Path) -> tuple[list[dict], dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    steps = [x for x in lines if "ids" in x]
    done = next((x for x in lines if x.get("done")), {})
    return steps, done


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_ops_promql_names_only_metrics_a_live_daemon_exports(tmp_path: Path) -> None:
    spec = ClusterSpec(
        nodes=1,
        ranks_per_node=2,
        metrics=True,
        daemon_args=["--dataset-size", "10", "--shm-size", "16M"],
    )
    with LocalCluster(spec) as cluster:
        cluster.wait_sockets(30)
        exported = exported_names(
            wait_for("/metrics", lambda: scrape(cluster.metrics_ports[0]), 30)
        )
        used: dict[str, set[str]] = {}
        for title, exprs in dashboard_exprs().items():
            for expr in exprs:
                used.setdefault(f"dashboard panel {title!r}", set()).update(metric_names(expr))
        for alert, expr in rule_exprs().items():
            used[f"alert {alert}"] = metric_names(expr)
        assert sum(len(names) for names in used.values()) > 50, "the PromQL parser found nothing"
        unknown = {where: names - exported for where, names in used.items() if names - exported}
        assert not unknown, f"PromQL names metrics the daemon does not export: {unknown}"
        cluster.processes[0].send_signal(signal.SIGTERM)
        assert cluster.wait(20) == [0]
        assert cluster.leftover_segments() == []


def expected_from_daemons(expositions: list[str]) -> dict[str, float]:
    """The run's numbers from the daemons' own final /metrics, per rank and per job."""
    totals: dict[str, float] = {}
    per_rank: dict[tuple[str, str], float] = {}
    job: dict[str, float] = {}
    for text in expositions:
        for name, labels, value in samples(text):
            if "rank" in labels:
                totals[name] = totals.get(name, 0.0) + value
                per_rank[(name, labels["rank"])] = value
            elif not labels:
                job[name] = max(job.get(name, value), value)
    out = {
        "padding": 1 - totals["odbd_real_tokens_total"] / totals["odbd_padded_tokens_total"],
        "overlap": totals["odbd_trainer_compute_seconds_total"]
        / (
            totals["odbd_trainer_compute_seconds_total"] + totals["odbd_trainer_wait_seconds_total"]
        ),
        "quota": job["odbd_global_samples_total"] / job["odbd_job_quota_samples"],
        "quota_samples": job["odbd_job_quota_samples"],
        "epoch_progress": job["odbd_epoch_emitted_samples"] / job["odbd_epoch_quota_samples"],
    }
    for (name, rank), value in per_rank.items():
        out[f"{name}/{rank}"] = value
    return out


def rank_value(values: dict[str, float], name: str, rank: str) -> float:
    return values[f"{name}/{rank}"]


def instant(expr: str) -> str:
    """A dashboard expression as Prometheus evaluates it here: this job, windows over the run."""
    return expr.replace("$job", JOB).replace("$__rate_interval", "5m")


@pytest.mark.timeout(90)
def test_prometheus_evaluates_the_dashboard_padding_overlap_and_quota(tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no `prometheus` binary: `apt-get install -y prometheus` (.ci/run does)")
    spec = ClusterSpec(
        nodes=2,
        ranks_per_node=2,
        metrics=True,
        daemon_args=["--dataset-size", str(SIZE), "--shm-size", "64M", "--buffer", "16"]
        + ["--token-budget", "2048", "--epochs", "1"],
    )
    cluster = LocalCluster(spec)
    prometheus: Prometheus | None = None
    release = tmp_path / "release"
    reports = [tmp_path / f"rank{r}.jsonl" for r in range(cluster.world)]
    try:
        with processes() as started:
            cluster.start()
            cluster.wait_sockets(scaled(30))
            targets = [f"127.0.0.1:{p}" for p in cluster.metrics_ports]
            prometheus = Prometheus(binary, tmp_path, targets)
            prometheus.wait_ready()
            # Every rank's series is scraped at 0 before any sample exists (external producers
            # not started yet), so rate() windows over the run count all of it.
            count = f'count(odbd_padded_tokens_total{{job="{JOB}"}})'
            wait_for("4 rank series scraped", lambda: prometheus.query(count), 30)
            wait_for("4 rank series", lambda: prometheus.scalar(count) == 4, 30)
            assert prometheus.scalar(f'sum(odbd_padded_tokens_total{{job="{JOB}"}})') == 0
            run_job(cluster, started, tmp_path, reports, release)
            finals = [scrape(p) for p in cluster.metrics_ports]
            expected = expected_from_daemons(finals)
            wait_until_scraped(prometheus, expected)
            check_trainer_reports(expected, reports, cluster.world)
            check_dashboard(prometheus, expected, cluster.world)
            release.touch()
            assert cluster.wait(scaled(30)) == [0, 0], cluster.log(0) + cluster.log(1)
    finally:
        release.touch()
        cluster.stop()
        if prometheus is not None:
            prometheus.stop()
    assert cluster.leftover_segments() == []


def run_job(cluster: LocalCluster, started: list, tmp: Path, reports: list[Path], release: Path):
    for node, sock in enumerate(cluster.sockets):
        command = [sys.executable, "-m", "odbclient.producer.producer_main", "--socket", sock]
        command += ["--dataset", "odbd.demo.dataset:synthetic", "--job-id", cluster.spec.job_id]
        command += ["--dataset-arg", f"size={SIZE}", "--dataset-arg", f"dist={DIST}"]
        start(started, command, tmp / f"producer{node}.log")
    for rank in range(cluster.world):
        command = module_command("trainer", "--rank", str(rank), "--report", str(reports[rank]))
        command += ["--socket", cluster.sockets[cluster.node_of(rank)], "--release", str(release)]
        start(started, command + ["--step-s", str(STEP_S)], tmp / f"trainer{rank}.log")
    wait_for("every trainer done", lambda: all(read_report(r)[1] for r in reports), 60)


def wait_until_scraped(prometheus: Prometheus, expected: dict[str, float]) -> None:
    """Prometheus has the final numbers once its latest scrape shows the last Delivered."""
    wait_s = sum(v for k, v in expected.items() if k.startswith("odbd_trainer_wait_seconds"))
    expr = f'sum(odbd_trainer_wait_seconds_total{{job="{JOB}"}})'
    wait_for(
        "Prometheus scraped the final numbers",
        lambda: math.isclose(prometheus.scalar(expr), wait_s, rel_tol=1e-12),
        15,
    )


def check_trainer_reports(expected: dict[str, float], reports: list[Path], world: int) -> None:
    """The daemons' numbers are the run's: the trainers' own counts agree."""
    from odbd.simulate.distributions import sample_lengths

    lengths = sample_lengths(DIST, SIZE, 0)
    emitted = 0
    for rank in range(world):
        steps, done = read_report(reports[rank])
        r = str(rank)
        ids = [i for s in steps for i in s["ids"]]
        emitted += len(ids)
        assert rank_value(expected, "odbd_steps_total", r) == len(steps)
        assert rank_value(expected, "odbd_emitted_samples_total", r) == len(ids)
        assert rank_value(expected, "odbd_padded_tokens_total", r) == sum(
            s["padded"] for s in steps
        )
        assert rank_value(expected, "odbd_real_tokens_total", r) == int(lengths[ids].sum())
        overlap = done["compute_s"] / (done["compute_s"] + done["wait_s"])
        compute = rank_value(expected, "odbd_trainer_compute_seconds_total", r)
        daemon_overlap = compute / (
            compute + rank_value(expected, "odbd_trainer_wait_seconds_total", r)
        )
        # The client's clock runs inside next() (it stops when the batch is taken from its
        # inbox, before sending Delivered); with the reader thread and other processes
        # contending for the CPU the two clocks differ by up to ~1 % of the run here.
        assert daemon_overlap == pytest.approx(overlap, abs=0.03)
    tail = world * math.ceil(SIZE / world) - SIZE
    assert emitted == SIZE + tail
    assert expected["quota"] == pytest.approx(emitted / SIZE, rel=1e-12)


def check_dashboard(prometheus: Prometheus, expected: dict[str, float], world: int) -> None:
    panels = dashboard_exprs()
    ranks = [str(r) for r in range(world)]
    # The three numbers (stat panels): exactly the run's, but for float rounding.
    for title, key in [
        ("Padding (job)", "padding"),
        ("Pipeline overlap (job)", "overlap"),
        ("Sample quota (job)", "quota"),
    ]:
        (expr,) = panels[title]
        assert prometheus.scalar(instant(expr)) == pytest.approx(expected[key], rel=1e-9), title
    assert 0.0 < expected["padding"] < 0.5 and 0.5 < expected["overlap"] <= 1.0
    # Per-rank trend lines over a window that covers the run from its zero samples.
    per_rank = {
        "Padding ratio": lambda r: (
            1
            - rank_value(expected, "odbd_real_tokens_total", r)
            / rank_value(expected, "odbd_padded_tokens_total", r)
        ),
        "Pipeline overlap": lambda r: (
            rank_value(expected, "odbd_trainer_compute_seconds_total", r)
            / (
                rank_value(expected, "odbd_trainer_compute_seconds_total", r)
                + rank_value(expected, "odbd_trainer_wait_seconds_total", r)
            )
        ),
    }
    for title, want in per_rank.items():
        job_expr, rank_expr = panels[title]
        got = {m["rank"]: v for m, v in prometheus.query(instant(rank_expr))}
        assert sorted(got) == ranks, title
        for r in ranks:
            assert got[r] == pytest.approx(want(r), rel=1e-9), (title, r)
        # The job line mixes daemons scraped at different instants, so rate() extrapolates
        # each by its own factor: it is a weighted mean of the ranks' ratios, not their exact
        # pooled ratio.
        job_now = prometheus.scalar(instant(job_expr))
        assert min(got.values()) - 1e-9 <= job_now <= max(got.values()) + 1e-9, title
    quota_job, quota_trained, quota_rank = panels["Job quota"]
    assert prometheus.scalar(instant(quota_job)) == pytest.approx(expected["quota"], rel=1e-9)
    # trained: the samples of the delivered steps over every daemon (the job ran to its end)
    delivered = sum(rank_value(expected, "odbd_delivered_samples_total", r) for r in ranks)
    assert delivered > 0
    trained = prometheus.scalar(instant(quota_trained))
    assert trained == pytest.approx(delivered / expected["quota_samples"], rel=1e-9)
    share = SIZE / world
    for m, v in prometheus.query(instant(quota_rank)):
        want = rank_value(expected, "odbd_emitted_samples_total", m["rank"]) / share
        assert v == pytest.approx(want, rel=1e-9)
    progress, _coverage = panels["Epoch progress and identity coverage"]
    got = prometheus.query(instant(progress))
    assert [v for _, v in got] == pytest.approx([expected["epoch_progress"]], rel=1e-9)


if __name__ == "__main__":
    if sys.argv[1:2] == ["trainer"]:
        sys.exit(trainer_main(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} trainer --rank R --socket S --report F --release F")
