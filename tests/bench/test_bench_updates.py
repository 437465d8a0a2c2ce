"""`--align updates` against aligned steps on every named distribution (issue 26), written to
docs/bench/updates.md: the same samples planned both ways and timed under the cost model
(odbd.simulate.update_align), as `odbd simulate --align updates` prints it."""

from __future__ import annotations

import dataclasses
import re
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from odbd.planner.config import Align, PlannerConfig
from odbd.planner.epoch import simulate
from odbd.simulate.distributions import NAMES, sample_lengths
from odbd.simulate.report import summarize
from odbd.simulate.update_align import AlignComparison, compare_align
from odbd.world import World

DOC = Path(__file__).resolve().parents[2] / "docs" / "bench" / "updates.md"
COMMAND = ".venv/bin/python -m pytest -q -m bench -s tests/bench/test_bench_updates.py"

WORLD = World(world_size=16, ranks_per_node=8)
BUDGET = 12288
BUFFER = 1024
NUM_SAMPLES = 200_000
SEED = 0
ACCUMULATE = 4
TOKENS_PER_UPDATE = 4 * WORLD.world_size * BUDGET  # about 4 full steps


# (buffer per rank, windows): the default buffer with both ways to size updates, then small
# buffers, whose rounds leave units short of groups more often (splits and idle fillers)
RUNS = (
    (BUFFER, {"accumulate": ACCUMULATE}),
    (BUFFER, {"tokens_per_update": TOKENS_PER_UPDATE}),
    (64, {"accumulate": ACCUMULATE}),
    (16, {"accumulate": ACCUMULATE}),
)


def compare(lengths, buffer: int, **windows: int) -> tuple[AlignComparison, float]:
    config = PlannerConfig(world=WORLD, token_budget=BUDGET, buffer_size=buffer, **windows)
    started = time.perf_counter()
    steps = simulate(lengths, config)
    aligned = simulate(lengths, dataclasses.replace(config, align=Align.UPDATES))
    elapsed = time.perf_counter() - started
    ideal = summarize(steps.stats(), config.cost, BUDGET, WORLD.world_size).ideal_time
    return compare_align(steps, aligned, config.cost, ideal), elapsed


@pytest.mark.bench
def test_bench_align_updates_on_every_distribution() -> None:
    lines = [
        "| distribution | updates | time steps | time updates | speedup | efficiency steps "
        "| efficiency updates | rank micro-steps steps | rank micro-steps updates "
        "| updates with uneven micro-steps |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    speedups = []
    for buffer, windows in RUNS:
        flag = next(f"--{k.replace('_', '-')} {v}" for k, v in windows.items())
        flag += f", --buffer {buffer}"
        for dist in NAMES:
            lengths = sample_lengths(dist, NUM_SAMPLES, SEED)
            c, elapsed = compare(lengths, buffer, **windows)
            j = c.as_json()
            speedups.append(c.speedup)
            lines.append(
                f"| {dist} ({flag}) | {c.updates:,} | {c.steps_time:,.0f} | "
                f"{c.updates_time:,.0f} | {c.speedup:.4f}x | {j['steps_efficiency']:.3f} | "
                f"{j['updates_efficiency']:.3f} | {c.rank_steps_steps:,} | "
                f"{c.rank_steps_updates:,} | {c.updates_with_uneven_micro_steps:,} |"
            )
            print(lines[-1], f"({elapsed:.1f} s)")
            # the planner takes the unsplit plan only when its updates end sooner
            assert c.updates_time <= c.steps_time * (1 + 1e-12)
    body = (
        f"{NUM_SAMPLES:,} samples per distribution (seed {SEED}), world {WORLD.world_size} "
        f"({WORLD.num_nodes} nodes x {WORLD.ranks_per_node}), token budget {BUDGET}, buffer "
        "per rank as listed, join mode, 1 epoch, default cost model (a=1, b=1.2e-5, c=1800). "
        "Each distribution is planned twice over the same samples, with --align steps and "
        "--align updates; times are token-equivalents: an update takes the sum over its steps "
        "of the slowest rank's step (steps) or the slowest rank's sum over its own micro-steps "
        "(updates). Efficiency = simulate's ideal bound / time. Rank micro-steps = micro-steps "
        "summed over ranks (idle fillers included; skipped slots excluded).\n\n"
        + "\n".join(lines)
        + f"\n\nSpeedup: min {min(speedups):.4f}x, max {max(speedups):.4f}x.\n"
    )
    print("\n" + body)
    write_section(body)


def write_section(body: str) -> None:
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    key = "align-updates"
    section = (
        f"<!-- bench:{key} -->\n## --align updates vs aligned steps\n\nMeasured {stamp}; "
        f"reproduce with `{COMMAND}`.\n\n{body}<!-- /bench:{key} -->\n"
    )
    header = (
        "# Update alignment benchmarks\n\nWritten by `tests/bench/test_bench_updates.py`; "
        "each section is replaced by its latest run.\n"
    )
    text = DOC.read_text(encoding="utf-8") if DOC.exists() else header
    pattern = re.compile(rf"<!-- bench:{key} -->.*?<!-- /bench:{key} -->\n", re.DOTALL)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text + "\n" + section
    DOC.write_text(text, encoding="utf-8")
