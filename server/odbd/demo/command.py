"""`odbd demo`: a local multi-node cluster on loopback with synthetic data.

Starts `--nodes` daemons (each spawning `--workers` producers over a named distribution),
one simulated trainer process per rank, draws progress, and prints the closing table.
The daemons' and trainers' logs go to a temporary directory: removed when the demo succeeds
(unless --keep-logs), kept and named when it fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from odbd import flags
from odbd.demo.cluster import ClusterSpec, LocalCluster
from odbd.demo.summary import read_reports, render, summarize_demo
from odbd.planner.config import CostModel
from odbd.simulate.distributions import NAMES, sample_lengths

_BAR = 30
_POLL_S = 0.25
PLAIN_PROGRESS_EVERY_S = 10.0  # not a terminal (CI logs): a changed line at most this often


def parser() -> argparse.ArgumentParser:
    p = flags.OneLineParser(prog="odbd demo", description=__doc__)
    count = flags.integer
    p.add_argument("--nodes", type=count(1, 64), default=2, help="daemons, one per node")
    p.add_argument("--ranks-per-node", type=count(1, 64), default=4, help="trainer ranks each")
    p.add_argument(
        "--dist",
        type=flags.choice_of(NAMES),
        default="sharegpt4o",
        metavar="{" + ",".join(NAMES) + "}",
        help="length distribution of the synthetic samples",
    )
    p.add_argument("--num-samples", type=count(1), default=4000, help="dataset size")
    p.add_argument("--workers", type=count(1), default=1, help="producers per node")
    p.add_argument("--token-budget", type=count(1), default=12288, help="padded tokens per group")
    p.add_argument("--buffer", type=count(1), default=64, help="samples buffered per rank")
    p.add_argument("--epochs", type=count(1), default=1, help="epochs the trainers run")
    p.add_argument(
        "--join", action=argparse.BooleanOptionalAction, default=True, help="termination mode"
    )
    p.add_argument(
        "--seconds-per-token",
        type=flags.seconds(allow_zero=True),
        default=2e-7,
        help="simulated step time per token-equivalent",
    )
    p.add_argument(
        "--timeout",
        type=flags.seconds(allow_zero=False),
        default=600.0,
        help="give up when the trainers have not finished after this many seconds",
    )
    p.add_argument(
        "--keep-logs", action="store_true", help="keep the log directory after a success too"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cluster = LocalCluster(_spec(args))
    try:
        ok = _run(args, cluster)
    except BaseException:
        print(f"\nodbd demo: interrupted; logs kept in {cluster.tmp}", flush=True)
        raise
    if not ok:
        print(f"odbd demo: failed; logs kept in {cluster.tmp}")
        return 1
    if args.keep_logs:
        print(f"odbd demo: logs kept in {cluster.tmp}")
    else:
        shutil.rmtree(cluster.tmp, ignore_errors=True)
    return 0


def _spec(args: argparse.Namespace) -> ClusterSpec:
    return ClusterSpec(
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        job_id="demo",
        metrics=True,
        daemon_args=[
            "--dataset", "odbd.demo.dataset:synthetic",
            "--dataset-arg", f"dist={args.dist}",
            "--dataset-arg", f"size={args.num_samples}",
            "--workers", str(args.workers),
            "--token-budget", str(args.token_budget),
            "--buffer", str(args.buffer),
            "--epochs", str(args.epochs),
            "--join" if args.join else "--no-join",
            "--shm-size", "256M",
        ],
    )  # fmt: skip


def _run(args: argparse.Namespace, cluster: LocalCluster) -> bool:
    """Runs the cluster and prints the summary; False when a process failed."""
    print(
        f"odbd demo: {args.nodes} daemons x {args.ranks_per_node} ranks on 127.0.0.1, "
        f"{args.num_samples} samples of {args.dist}, {args.workers} producer(s) per node; "
        f"logs in {cluster.tmp} (removed on success unless --keep-logs)"
    )
    reports = [cluster.tmp / f"rank{r}.jsonl" for r in range(cluster.world)]
    trainers: list[subprocess.Popen[bytes]] = []
    try:
        cluster.start()
        cluster.wait_sockets()
        for rank, report in enumerate(reports):
            cmd = [sys.executable, "-m", "odbd.demo.trainer", "--rank", str(rank)]
            cmd += ["--socket", cluster.sockets[cluster.node_of(rank)], "--report", str(report)]
            cmd += ["--epochs", str(args.epochs)]
            cmd += ["--seconds-per-token", str(args.seconds_per_token)]
            log = open(cluster.tmp / f"trainer{rank}.log", "ab")  # noqa: SIM115
            trainers.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        ok = _follow(trainers, reports, args.num_samples * args.epochs, args.timeout)
        # After a trainer failed or the timeout, the daemons would wait for it: do not wait.
        codes = cluster.wait(30.0) if ok else [p.poll() for p in cluster.processes]
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
        cluster.stop()
    print()
    if not ok:
        return False
    if any(c != 0 for c in codes):
        print(f"odbd demo: daemon exit codes {codes} (None = still running after 30 s)")
        return False
    lengths = sample_lengths(args.dist, args.num_samples, 0)
    summary = summarize_demo(read_reports(reports), lengths, CostModel())
    urls = [f"http://127.0.0.1:{p}/metrics" for p in cluster.metrics_ports]
    print(render(summary, urls, cluster.leftover_segments()))
    return True


@dataclass
class ProgressPrinter:
    """Decides when the progress line is printed.

    On a terminal the line is redrawn in place on every poll. Otherwise (a CI log, a pipe) each
    line is a new line, so it is printed only when it changed, at most every `every_s` seconds,
    and always the last one: a stalled or slow demo does not fill the log with copies.
    """

    tty: bool
    every_s: float = PLAIN_PROGRESS_EVERY_S
    _last_line: str = ""
    _last_s: float = float("-inf")

    def due(self, line: str, now_s: float, final: bool) -> bool:
        if self.tty:
            return True
        if line == self._last_line:
            return False
        if not final and now_s - self._last_s < self.every_s:
            return False
        self._last_line, self._last_s = line, now_s
        return True

    def show(self, line: str, now_s: float, final: bool) -> None:
        if self.due(line, now_s, final):
            print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)


def _follow(
    trainers: list[subprocess.Popen[bytes]], reports: list[Path], total: int, timeout_s: float
) -> bool:
    deadline = time.monotonic() + timeout_s
    printer = ProgressPrinter(tty=sys.stdout.isatty())
    while True:
        done = [t.poll() is not None for t in trainers]
        steps, samples = _progress(reports)
        now = time.monotonic()
        printer.show(_progress_line(samples, total, steps), now, final=all(done))
        if all(done):
            failed = {rank: t.returncode for rank, t in enumerate(trainers) if t.returncode}
            if failed:
                print(f"\nodbd demo: trainer exit status by rank: {failed}")
            return not failed
        if now > deadline:
            print(f"\nodbd demo: trainers did not finish within {timeout_s:g} s")
            return False
        time.sleep(_POLL_S)


def _progress_line(samples: int, total: int, steps: str) -> str:
    frac = min(samples / total, 1.0) if total else 1.0
    bar = "#" * int(frac * _BAR) + "." * (_BAR - int(frac * _BAR))
    return f"[{bar}] {frac:6.1%}  samples {samples}/{total}  steps/rank {steps}"


def _progress(reports: list[Path]) -> tuple[str, int]:
    steps, samples = [], 0
    for path in reports:
        lines = path.read_text().splitlines() if path.exists() else []
        records = [json.loads(line) for line in lines if line.startswith('{"epoch":')]
        steps.append(len(records))
        samples += sum(len(r["ids"]) for r in records)
    lo, hi = min(steps, default=0), max(steps, default=0)
    return (f"{lo}" if lo == hi else f"{lo}..{hi}"), samples
