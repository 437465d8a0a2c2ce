"""summarize(): DESIGN.md section 4 semantics, the table and the JSON object."""

from __future__ import annotations

import json

import numpy as np
import pytest

from odbd.planner.config import CostModel
from odbd.planner.types import StepStats
from odbd.simulate.baselines import fixed_batch_stats
from odbd.simulate.report import Summary, render_table, report_json, summarize

COST = CostModel(a=1.0, b=0.01, c=100.0)


def make_stats(
    num_samples: list[list[int]],
    real: list[list[int]],
    padded: list[list[int]],
    sum_sq: list[list[float]],
) -> StepStats:
    padded_a = np.array(padded, dtype=np.int64)
    return StepStats(
        num_samples=np.array(num_samples, dtype=np.int64),
        num_tokens=np.array(real, dtype=np.int64),
        real_tokens=np.array(real, dtype=np.int64),
        padded_tokens=padded_a,
        work=COST.a * padded_a + COST.b * np.array(sum_sq, dtype=np.float64),
        loss_scale=np.ones(padded_a.shape),
    )


def test_hand_computed_summary() -> None:
    # Two steps, two ranks; rank 1 is idle at step 1. work = [[325, 200], [56, 0]].
    stats = make_stats(
        num_samples=[[2, 1], [1, 0]],
        real=[[150, 100], [40, 0]],
        padded=[[200, 100], [40, 0]],
        sum_sq=[[12500, 10000], [1600, 0]],
    )
    s = summarize(stats, COST, budget=200, world_size=2)
    assert s.steps == 2
    assert s.padding_ratio == pytest.approx(1 - 290 / 340)
    assert s.samples_per_step == pytest.approx(2.0)
    assert s.imbalance == pytest.approx((325 + 56) / ((325 + 200) / 2 + 56 / 2))
    assert s.simulated_time == pytest.approx(2 * 100 + 325 + 56)
    steps_min = 290 / (2 * 200)
    ideal = steps_min * 100 + (290 + 0.01 * (12500 + 10000 + 1600)) / 2
    assert s.ideal_time == pytest.approx(ideal)
    assert s.efficiency == pytest.approx(ideal / (200 + 381))


def test_perfect_plan_reaches_the_bound() -> None:
    # Every rank fills the budget with equal lengths and no padding: simulated == ideal.
    stats = make_stats([[4, 4]] * 3, [[400, 400]] * 3, [[400, 400]] * 3, [[40000, 40000]] * 3)
    s = summarize(stats, COST, budget=400, world_size=2)
    assert s.efficiency == pytest.approx(1.0)
    assert s.imbalance == pytest.approx(1.0)
    assert s.padding_ratio == 0.0


def test_zero_b_needs_no_division() -> None:
    cost = CostModel(a=1.0, b=0.0, c=5.0)
    stats = fixed_batch_stats(np.array([3, 5, 7]), world_size=1, batch_size=3, cost=cost)
    s = summarize(stats, cost, budget=15, world_size=1)
    assert s.ideal_time == pytest.approx(15 / 15 * 5 + 15)
    assert s.simulated_time == pytest.approx(5 + 21)


def test_empty_run() -> None:
    stats = fixed_batch_stats(np.zeros(0, np.int64), world_size=4, batch_size=2, cost=COST)
    s = summarize(stats, COST, budget=10, world_size=4)
    assert (s.steps, s.padding_ratio, s.imbalance, s.efficiency) == (0, 0.0, 1.0, 1.0)


def summary(time: float) -> Summary:
    return Summary(
        steps=10,
        padding_ratio=0.1,
        samples_per_step=3.0,
        imbalance=1.01,
        efficiency=0.9,
        simulated_time=time,
        ideal_time=0.9 * time,
    )


def test_json_object_has_exactly_the_documented_keys() -> None:
    out = report_json(summary(100.0), {"fixed-1": summary(300.0), "paper": summary(110.0)})
    keys = {
        "steps",
        "padding_ratio",
        "samples_per_step",
        "imbalance",
        "efficiency",
        "simulated_time",
        "ideal_time",
    }
    assert set(out) == keys | {"baselines"}
    assert set(out["baselines"]) == {"fixed-1", "paper"}
    assert all(set(b) == keys for b in out["baselines"].values())
    assert json.loads(json.dumps(out)) == out


def test_table_lists_every_run_with_speedup_of_ours() -> None:
    table = render_table(("odbd", summary(100.0)), [("fixed-1", summary(300.0))])
    lines = table.splitlines()
    assert lines[0].split()[0] == "run" and len(lines) == 4
    assert lines[2].startswith("odbd") and lines[2].endswith("1.00x")
    assert lines[3].startswith("fixed-1") and lines[3].endswith("3.00x")


def test_repeated_groups_counts_multi_sample_groups_an_epoch_formed_again():
    from odbd.simulate.report import repeated_groups

    steps = [
        (0, 0, [[(1, 5), (2, 5)], [(3, 9)]]),
        (0, 1, [[(4, 5), (5, 5)], []]),
        (1, 0, [[(2, 5), (1, 5)], [(3, 9)]]),  # {1, 2} again; a lone sample does not count
        (1, 1, [[(4, 5), (6, 5)], [(5, 9)]]),
    ]
    freshness = repeated_groups(steps)
    assert (freshness.repeated, freshness.groups) == (1, 2)
