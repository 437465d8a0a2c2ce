"""Learned vs fixed cost model on real DDP: per-step spread of rank compute times.

Run: `make bench-cost-model` (= `.venv/bin/python -m pytest -q -m bench -s
tests/bench/test_bench_cost_model.py`). One daemon x 2 gloo ranks on CPU train the tiny
transformer with `ddp_trainer --timed --quadratic-dim D`: each rank times its own forward,
backward and explicit O(sum l^2) work (a D-wide score matrix per sample, like attention's),
reports it (`ODBClient.report_compute`) and only then all-reduces the gradients. So the true
step cost has a strong quadratic term, which the fixed default (b/a = 1.2e-5) nearly ignores.

Runs alternate `--cost-model fixed` and `auto`, REPEATS each, same data and seed. Per run:
spread = max / mean of the ranks' compute times of a step, its median over the steps of the
second epoch (planned after auto's warm-up) and over all steps; the training loop's wall time
(rank 0, between barriers). The section `cost-model` of docs/bench/planner.md is replaced with
the measured table; nothing here asserts speed.
"""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from tests.integration.ddp_data import LongTailTokens
from tests.integration.ddp_launch import Reports, run_odbd_training
from tests.integration.ddp_model import ModelConfig

pytestmark = [pytest.mark.bench, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "bench" / "planner.md"
COMMAND = "make bench-cost-model"
RANKS = 2
DATA = {"size": 3000, "seed": 3, "median_len": 48, "max_len": 512, "sigma": 1.0}
MODEL = ModelConfig()
QUADRATIC_DIM = 1024
TOKEN_BUDGET, BUFFER, EPOCHS = 1024, 32, 2
REPEATS = 3
FIT_LINE = re.compile(r"cost model fitted to .*")


@dataclass(frozen=True)
class Run:
    mode: str
    steps: int
    spread_all: float  # median over steps of max/mean rank compute time
    spread_late: float  # the same over the last epoch's steps
    mean_step_max_s: float  # mean over steps of the slowest rank's compute
    total_compute_s: float  # every rank-step's compute: the same work in both modes
    sq_imbalance: float  # sum over steps of max_r sum l^2 / of mean_r: the planned quadratic work
    loop_s: float
    last_fit: str


def spread(records: list[list[dict]]) -> list[float]:
    out = []
    for per_rank in records:
        times = [r["compute_s"] for r in per_rank]
        out.append(max(times) / (sum(times) / len(times)))
    return out


def sq_imbalance(steps: list[tuple[dict, ...]]) -> float:
    lengths = LongTailTokens(**DATA).lengths.astype(np.float64)
    sq = np.array([[float((lengths[r["ids"]] ** 2).sum()) for r in s] for s in steps])
    return float(sq.max(axis=1).sum() / sq.mean(axis=1).sum())


def measure(mode: str, out_dir: Path) -> Run:
    cluster, reports, daemon_codes, rank_codes = run_odbd_training(
        nodes=1,
        ranks_per_node=RANKS,
        data=DATA,
        daemon_args=["--epochs", str(EPOCHS), "--token-budget", str(TOKEN_BUDGET),
                     "--buffer", str(BUFFER), "--cost-model", mode],
        trainer_args=["--timed", "--quadratic-dim", str(QUADRATIC_DIM), "--epochs",
                      str(EPOCHS), *MODEL.to_args()],
        out_dir=out_dir,
        timeout_s=1200.0,
        wait_for_daemons=True,
    )  # fmt: skip
    assert daemon_codes == [0] and rank_codes == [0] * RANKS, cluster.log(0)[-3000:]
    steps = list(zip(*(reports.steps(r) for r in range(RANKS)), strict=True))
    late = [s for s in steps if s[0]["epoch"] == EPOCHS - 1]
    fits = FIT_LINE.findall(cluster.log(0))
    return Run(
        mode=mode,
        steps=len(steps),
        spread_all=statistics.median(spread(steps)),
        spread_late=statistics.median(spread(late)),
        mean_step_max_s=statistics.mean(max(r["compute_s"] for r in s) for s in steps),
        total_compute_s=sum(r["compute_s"] for s in steps for r in s),
        sq_imbalance=sq_imbalance(steps),
        loop_s=float(Reports.done(reports, 0)["loop_s"]),
        last_fit=fits[-1] if fits else "(no fit)",
    )


def table(runs: list[Run]) -> list[str]:
    lines = [
        "| run | --cost-model | steps/rank | median spread, epoch 2 | median spread, all "
        "| mean slowest-rank compute (ms) | all ranks' compute (s) | sum l^2 max/mean "
        "| loop (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(runs):
        lines.append(
            f"| {i} | {r.mode} | {r.steps} | {r.spread_late:.3f} | {r.spread_all:.3f} "
            f"| {1e3 * r.mean_step_max_s:.1f} | {r.total_compute_s:.2f} | {r.sq_imbalance:.3f} "
            f"| {r.loop_s:.1f} |"
        )
    return lines


def summary(runs: list[Run]) -> list[str]:
    def med(mode: str, key: str) -> float:
        return statistics.median(getattr(r, key) for r in runs if r.mode == mode)

    lines = []
    for key, what in (
        ("spread_late", "median per-step spread (max/mean rank compute), epoch 2"),
        ("spread_all", "median per-step spread, all steps"),
        ("mean_step_max_s", "mean slowest-rank compute per step (s)"),
        ("total_compute_s", "all ranks' compute, same samples (s)"),
        ("sq_imbalance", "planned sum l^2: sum over steps of max/mean over ranks"),
        ("loop_s", "training loop wall time (s)"),
    ):
        fixed, auto = med("fixed", key), med("auto", key)
        lines.append(
            f"- {what}: fixed {fixed:.4g}, auto {auto:.4g} (auto/fixed {auto / fixed:.3f})"
        )
    fits = [r.last_fit for r in runs if r.mode == "auto"]
    lines.append(f"- last fit of the last auto run: {fits[-1]}")
    return lines


def write_section(body: str) -> None:
    """Replaces this benchmark's section of docs/bench/planner.md, keeping the others."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    key = "cost-model"
    section = (
        f"<!-- bench:{key} -->\n## Learned vs fixed cost model (DDP, real step times)\n\n"
        f"Measured {stamp}; reproduce with `{COMMAND}`.\n\n{body}<!-- /bench:{key} -->\n"
    )
    text = DOC.read_text(encoding="utf-8")
    pattern = re.compile(rf"<!-- bench:{key} -->.*?<!-- /bench:{key} -->\n", re.DOTALL)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text + "\n" + section
    DOC.write_text(text, encoding="utf-8")


def test_learned_cost_model_narrows_the_per_step_spread(tmp_path: Path) -> None:
    load = os.getloadavg()
    runs = []
    for i in range(REPEATS):
        for mode in ("fixed", "auto"):
            runs.append(measure(mode, tmp_path / f"{mode}-{i}"))
    lines = table(runs) + [""] + summary(runs)
    setup = (
        f"{os.cpu_count()} cores, load average before {load[0]:.1f}; 1 daemon (1 producer) x "
        f"{RANKS} gloo ranks = 4 busy processes. {DATA['size']} samples (log-normal lengths, "
        f"median {DATA['median_len']}, max {DATA['max_len']}), {EPOCHS} epochs, token budget "
        f"{TOKEN_BUDGET}, buffer {BUFFER}, model {MODEL}, `--quadratic-dim {QUADRATIC_DIM}`; "
        f"runs alternate fixed/auto, {REPEATS} each. Spread = max/mean over the ranks of their "
        "own timed compute of a step (forward, backward, quadratic work; no collective).\n\n"
    )
    print("\n" + "\n".join(lines))
    write_section(setup + "\n".join(lines) + "\n")
