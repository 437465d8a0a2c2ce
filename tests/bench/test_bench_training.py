"""End-to-end training throughput: odbd vs fixed batches, the paper's ODBDataLoader, and the
batchers users pick instead (HF group_by_length, DataCollatorWithFlattening, Lhotse-style
token-budget buckets, cosmos-rl-style load-balanced pools; see training_user_baselines).

The first test below is the original comparison (tiny custom transformer). Run: `make
bench-training` (= `.venv/bin/python -m pytest -q -m bench -s
tests/bench/test_bench_training.py`). Same run, same tiny causal transformer, same long-tailed
data (every sample once), same DDP world (1 node x 2 gloo ranks on CPU), same training script
(`tests.integration.ddp_trainer`); only the data path differs:

- fixed-B: DataLoader + DistributedSampler, batch B in {1, 2, 4, 8}, num_workers=0;
- paper: `odb.ODBDataLoader` of `online-dynamic-batching==0.1.2` in its own venv (see
  training_paper_env), same token budget and buffer as odbd, its defaults otherwise
  (1 worker + 1 collate process per rank, DDP Join for uneven steps, startup jitter off);
- odbd: one daemon with one producer process, ranks read ODBClient.

Samples/s = samples trained / the training loop's wall time (rank 0, between barriers: process
start-up, imports and daemon start are outside it). Padding = 1 - real / padded tokens over
all rank-steps. Results are appended to docs/bench/training.md; nothing here asserts speed.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.bench import training_user_baselines as user
from tests.bench.training_paper_env import PAPER_PACKAGE, ensure_paper_python
from tests.integration.ddp_data import LongTailTokens
from tests.integration.ddp_launch import Reports, data_flags, launch_ranks, run_odbd_training
from tests.integration.ddp_model import ModelConfig

pytestmark = [pytest.mark.bench, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "docs" / "bench" / "training.md"
COMMAND = "make bench-training"
WORLD = 2
DATA = {"size": 2048, "seed": 0, "vocab": 256}
MODEL = ModelConfig(vocab=256, dim=128, heads=4, layers=2)
TOKEN_BUDGET, BUFFER = 1024, 64
FIXED_BATCHES = (1, 2, 4, 8)
TRAIN_ARGS = ["--lr", "1e-3", *MODEL.to_args()]


@dataclass(frozen=True)
class Measured:
    name: str
    loop_s: float
    samples: int  # views trained (idle fillers have none)
    identities: int  # distinct dataset identities among them
    steps: int  # per rank
    real_tokens: int
    padded_tokens: int

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.loop_s

    @property
    def padding(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens


def summarize(name: str, reports: Reports, lengths: np.ndarray) -> Measured:
    ids = reports.ids(0)
    steps = [r for rank in range(WORLD) for r in reports.steps(rank)]
    done = reports.done(0)
    assert done, f"{name}: rank 0 did not finish"
    return Measured(
        name=name,
        loop_s=done["loop_s"],
        samples=len(ids),
        identities=len(set(ids)),
        steps=len(reports.steps(0)),
        real_tokens=int(lengths[ids].sum()),
        padded_tokens=sum(r["padded"] for r in steps),
    )


def run_ranks(out_dir: Path, args: Sequence[str], python: str | None = None) -> Reports:
    kwargs = {"python": python} if python else {}
    ranks = launch_ranks(
        world=WORLD, nproc_per_node=WORLD, out_dir=out_dir,
        trainer_args=[*TRAIN_ARGS, *args, *data_flags(DATA)], **kwargs,
    )  # fmt: skip
    codes = ranks.wait(1200.0)
    assert codes == [0] * WORLD, ranks.logs()
    return Reports.read(out_dir, WORLD)


def run_odbd(out_dir: Path) -> Reports:
    cluster, reports, daemon_codes, rank_codes = run_odbd_training(
        nodes=1,
        ranks_per_node=WORLD,
        data=DATA,
        daemon_args=["--token-budget", str(TOKEN_BUDGET), "--buffer", str(BUFFER)],
        trainer_args=TRAIN_ARGS,
        out_dir=out_dir,
        timeout_s=1200.0,
        wait_for_daemons=True,
    )
    assert daemon_codes == [0] and rank_codes == [0] * WORLD, cluster.log(0)
    return reports


def measure_all(tmp_path: Path) -> list[Measured]:
    lengths = LongTailTokens(**DATA).lengths
    paper_python = ensure_paper_python()  # before any timing: the venv may need installing
    results = []
    for batch in FIXED_BATCHES:
        out = tmp_path / f"fixed{batch}"
        reports = run_ranks(out, ["--loader", "fixed", "--batch-size", str(batch)])
        results.append(summarize(f"fixed-{batch}", reports, lengths))
    paper_args = ["--loader", "paper", "--token-budget", str(TOKEN_BUDGET)]
    paper_args += ["--buffer", str(BUFFER)]
    reports = run_ranks(tmp_path / "paper", paper_args, python=paper_python)
    results.append(summarize("paper", reports, lengths))
    results.append(summarize("odbd", run_odbd(tmp_path / "odbd"), lengths))
    return results


def table(results: list[Measured], best_fixed: Measured) -> list[str]:
    lines = [
        "| data path | steps/rank | samples (distinct) | loop s | samples/s | padding "
        "| vs best fixed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.steps} | {r.samples} ({r.identities}) | {r.loop_s:.2f} "
            f"| {r.samples_per_s:,.0f} | {100 * r.padding:.1f} % "
            f"| {r.samples_per_s / best_fixed.samples_per_s:.2f}x |"
        )
    return lines


def ratios(results: list[Measured], best_fixed: Measured) -> list[str]:
    by_name = {r.name: r for r in results}
    odbd, paper = by_name["odbd"], by_name["paper"]
    return [
        f"- odbd vs best fixed batch ({best_fixed.name}): "
        f"{odbd.samples_per_s / best_fixed.samples_per_s:.2f}x samples/s",
        f"- odbd vs the paper's ODBDataLoader: {odbd.samples_per_s / paper.samples_per_s:.2f}x "
        "samples/s",
        f"- padding: odbd {100 * odbd.padding:.1f} %, paper {100 * paper.padding:.1f} %, "
        f"{best_fixed.name} {100 * best_fixed.padding:.1f} %",
    ]


def git_revision() -> str:
    result = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    return result.stdout.strip() or "unknown"


def append_report(lines: list[str], load_before: tuple[float, float, float]) -> None:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.1f}" for x in load_before)
    header = [
        "",
        f"## {when}, commit {git_revision()}",
        "",
        f"`{COMMAND}`; {os.cpu_count()} cores, CPython {platform.python_version()}, "
        f"load average before the run {load}. World {WORLD} (1 node x {WORLD} gloo ranks), "
        f"{DATA['size']} samples, model {MODEL}, token budget {TOKEN_BUDGET}, buffer {BUFFER}, "
        f"paper = {PAPER_PACKAGE}.",
        "",
    ]
    with REPORT.open("a") as f:
        f.write("\n".join(header + lines) + "\n")


def test_training_throughput_fixed_vs_paper_vs_odbd(tmp_path: Path) -> None:
    load = os.getloadavg()
    results = measure_all(tmp_path)
    for r in results:  # every path trains every sample of the epoch exactly once
        assert r.identities == DATA["size"], r
    best_fixed = max(
        (r for r in results if r.name.startswith("fixed")), key=lambda r: r.samples_per_s
    )
    lines = table(results, best_fixed) + [""] + ratios(results, best_fixed)
    print(f"\nload average before the run: {load}")
    print("\n".join(lines))
    append_report(lines, load)


USER_START, USER_END = "<!-- user-baselines:start -->", "<!-- user-baselines:end -->"
HEADLINE_START, HEADLINE_END = "<!-- headline:start -->", "<!-- headline:end -->"


def replace_between(text: str, start: str, end: str, lines: list[str]) -> str:
    """`text` with what lies between the markers replaced (markers appended if absent)."""
    block = "\n".join([start, *lines, end])
    if start not in text:
        return text.rstrip("\n") + "\n\n" + block + "\n"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    return head + block + tail


def test_training_vs_user_baselines(tmp_path: Path) -> None:
    load = os.getloadavg()
    setup = user.Setup()
    started = datetime.datetime.now(datetime.UTC)
    m = user.measure(setup, tmp_path)
    minutes = (datetime.datetime.now(datetime.UTC) - started).total_seconds() / 60
    when = started.strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Measured {when} at commit {git_revision()} (`{COMMAND}`, {minutes:.1f} min for this "
        f"part); {os.cpu_count()} cores, CPython {platform.python_version()}, load average "
        f"before {', '.join(f'{x:.1f}' for x in load)}, after "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}. {setup.data['size']} samples, "
        f"{setup.model}, token budget {setup.token_budget} (buffer {setup.buffer} for odbd).",
        "",
    ]
    for world in setup.worlds:
        lines += [*user.table(m, world), ""]
    lines += user.sweep_table(m)
    headline = user.headline(m)
    print("\n".join(["", *lines, "", *headline]))
    text = REPORT.read_text()
    text = replace_between(text, USER_START, USER_END, lines)
    text = replace_between(text, HEADLINE_START, HEADLINE_END, headline)
    REPORT.write_text(text)
