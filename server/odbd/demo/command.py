"""`odbd demo`: a local multi-node cluster on loopback with synthetic data.

Starts `--nodes` daemons (each spawning `--workers` producers over a named distribution),
one simulated trainer process per rank, draws progress, and prints the closing table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from odbd.demo.cluster import ClusterSpec, LocalCluster
from odbd.demo.summary import read_reports, render, summarize_demo
from odbd.planner.config import CostModel
from odbd.simulate.distributions import NAMES, sample_lengths

_BAR = 30


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="odbd demo", description=__doc__)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--dist", default="sharegpt4o", choices=NAMES)
    p.add_argument("--num-samples", type=int, default=4000)
    p.add_argument("--workers", type=int, default=1, help="producers per node")
    p.add_argument("--token-budget", type=int, default=12288)
    p.add_argument("--buffer", type=int, default=64, help="samples buffered per rank")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--join", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seconds-per-token", type=float, default=2e-7, help="simulated step time")
    p.add_argument("--timeout", type=float, default=600.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    spec = ClusterSpec(
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
    cluster = LocalCluster(spec)
    print(
        f"odbd demo: {args.nodes} daemons x {args.ranks_per_node} ranks on 127.0.0.1, "
        f"{args.num_samples} samples of {args.dist}, {args.workers} producer(s) per node; "
        f"logs in {cluster.tmp}"
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
        codes = cluster.wait(30.0)
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
        cluster.stop()
    print()
    if not ok or any(c != 0 for c in codes):
        print(f"odbd demo: failed (daemon exit codes {codes}); see logs in {cluster.tmp}")
        return 1
    lengths = sample_lengths(args.dist, args.num_samples, 0)
    summary = summarize_demo(read_reports(reports), lengths, CostModel())
    urls = [f"http://127.0.0.1:{p}/metrics" for p in cluster.metrics_ports]
    print(render(summary, urls))
    leftovers = cluster.leftover_segments()
    print(f"  {'shared memory left':26}  {leftovers or 'none'}")
    return 0


def _follow(
    trainers: list[subprocess.Popen[bytes]], reports: list[Path], total: int, timeout_s: float
) -> bool:
    deadline = time.monotonic() + timeout_s
    tty = sys.stdout.isatty()
    last_print = 0.0
    while True:
        done = [t.poll() is not None for t in trainers]
        steps, samples = _progress(reports)
        now = time.monotonic()
        if tty or now - last_print > 5 or all(done):
            frac = min(samples / total, 1.0) if total else 1.0
            bar = "#" * int(frac * _BAR) + "." * (_BAR - int(frac * _BAR))
            line = f"[{bar}] {frac:6.1%}  samples {samples}/{total}  steps/rank {steps}"
            print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)
            last_print = now
        if all(done):
            return all(t.returncode == 0 for t in trainers)
        if now > deadline:
            print(f"\nodbd demo: trainers did not finish within {timeout_s} s")
            return False
        time.sleep(0.25)


def _progress(reports: list[Path]) -> tuple[str, int]:
    steps, samples = [], 0
    for path in reports:
        lines = path.read_text().splitlines() if path.exists() else []
        records = [json.loads(line) for line in lines if line.startswith('{"epoch":')]
        steps.append(len(records))
        samples += sum(len(r["ids"]) for r in records)
    lo, hi = min(steps, default=0), max(steps, default=0)
    return (f"{lo}" if lo == hi else f"{lo}..{hi}"), samples
