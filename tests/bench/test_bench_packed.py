"""Packed vs padded batches in simulation, on every named distribution (issue 13).

`odbd simulate --collate packed` beside `--collate padded`, same samples, world, budget and cost
model as the efficiency table; and plan_round latency of the packed grouping (first-fit
decreasing) beside the padded one. Both sections replace theirs in docs/bench/planner.md.
Nothing asserts on speed.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest

from odbd.planner.config import Balance, Collate, Grouping
from odbd.planner.epoch import simulate
from odbd.planner.round import plan_round
from odbd.simulate.distributions import NAMES, sample_lengths
from odbd.simulate.report import Summary, summarize
from odbd.world import World
from tests.bench.test_bench_planner import (
    BUDGET,
    BUFFER,
    NUM_SAMPLES,
    SEED,
    WORLD,
    _cpu_count,
    make_offers,
    planner_config,
    timed_ms,
    write_section,
)

COMMAND = ".venv/bin/python -m pytest -q -m bench -s tests/bench/test_bench_packed.py"


def run(lengths: np.ndarray, collate: Collate) -> Summary:
    config = dataclasses.replace(planner_config(Grouping.MIN_TIME, Balance.NODE), collate=collate)
    stats = simulate(lengths, config).stats()
    return summarize(stats, config.cost, BUDGET, WORLD.world_size)


def tokens_per_step(s: Summary, lengths: np.ndarray) -> float:
    return float(lengths.sum()) / s.steps


@pytest.mark.bench
def test_bench_packed_vs_padded_on_every_distribution() -> None:
    lines = [
        "| distribution | batches | steps | padding % | samples/step | tokens/step | imbalance "
        "| efficiency | padded time / packed |",
        "|" + " --- |" * 9,
    ]
    gains = []
    for dist in NAMES:
        lengths = sample_lengths(dist, NUM_SAMPLES, SEED)
        padded, packed = run(lengths, Collate.PADDED), run(lengths, Collate.PACKED)
        gains.append(padded.simulated_time / packed.simulated_time)
        for i, (name, s) in enumerate((("padded", padded), ("packed", packed))):
            lines.append(
                f"| {dist if i == 0 else ''} | {name} | {s.steps:,} | {100 * s.padding_ratio:.2f} "
                f"| {s.samples_per_step:.1f} | {tokens_per_step(s, lengths):,.0f} "
                f"| {s.imbalance:.3f} | {s.efficiency:.3f} "
                f"| {f'{gains[-1]:.3f}x' if i == 1 else ''} |"
            )
        assert packed.padding_ratio == 0.0
    body = (
        f"{NUM_SAMPLES:,} samples per distribution (seed {SEED}), world {WORLD.world_size} "
        f"({WORLD.num_nodes} nodes x {WORLD.ranks_per_node}), token budget {BUDGET} (padded: "
        f"longest x count <= L; packed: sum of lengths <= L), buffer {BUFFER}/rank, min-time, "
        "node balance, join mode, 1 epoch, default cost model (a=1, b=1.2e-5, c=1800; packed "
        "counts its real tokens where padded counts padded ones, and both pay b per sample's "
        "l^2, as varlen attention does). Efficiency = ideal bound / simulated time. Reproduce "
        f"one row with `odbd simulate --dist NAME --world 16 --nproc-per-node 8 --num-samples "
        f"{NUM_SAMPLES} --collate packed`; the whole table with `{COMMAND}`.\n\n"
        + "\n".join(lines)
        + f"\n\nPacked is {min(gains):.3f}x-{max(gains):.3f}x faster than padded under the cost "
        "model (simulated time).\n"
    )
    print("\n" + body)
    write_section("packed", "Packed vs padded batches (--collate packed)", body)


@pytest.mark.bench
def test_bench_packed_plan_round_latency() -> None:
    world = World(world_size=128, ranks_per_node=8)
    lengths = sample_lengths("sharegpt4o", world.world_size * BUFFER, SEED)
    offers = make_offers(lengths, 16)
    lines = ["| plan_round, 16 offers x 8192 | median ms | p90 ms |", "| --- | --- | --- |"]
    for collate in Collate:
        config = dataclasses.replace(
            planner_config(Grouping.MIN_TIME, Balance.NODE, world), collate=collate
        )
        ms = timed_ms(partial(plan_round, offers, config, 0), 10)
        lines.append(f"| {collate.value} | {np.median(ms):.1f} | {np.percentile(ms, 90):.1f} |")
    body = (
        f"One round of W={world.world_size} ({world.num_nodes} nodes x {world.ranks_per_node}), "
        f"buffer {BUFFER}/rank ({len(lengths):,} sharegpt4o lengths), token budget {BUDGET}; "
        f"10 repetitions after one warm-up, one process, {_cpu_count()} cores (shared with "
        f"other jobs). Reproduce with `{COMMAND}`.\n\n" + "\n".join(lines) + "\n"
    )
    print("\n" + body)
    write_section("packed-latency", "Planning latency of packed groups", body)
