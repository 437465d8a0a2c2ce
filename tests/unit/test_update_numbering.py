"""The daemon's StepBatch.update facts (daemon/updates.py) from a windowed plan."""

from __future__ import annotations

from odbd.daemon.updates import UpdateNumbering
from odbd.metrics.stats import DaemonStats
from odbd.planner.round import plan_round
from tests.unit.planner_factories import make_config, make_offers


def test_updates_are_numbered_on_across_rounds_of_an_epoch():
    config = make_config(world=4, per_node=2, budget=1000, buffer=8, accumulate=2)
    stats = DaemonStats(node_rank=0, dataset_size=100)
    numbering = UpdateNumbering(config, stats)
    offers = make_offers(config, [[300, 200, 120, 80] * 4, [120, 700, 50] * 5])
    plan = plan_round(offers, config, 0)
    first = numbering.of_round(plan, [0] * plan.num_steps, 0)
    again = numbering.of_round(plan, [0] * plan.num_steps, 1)
    n = len(plan.windows)
    assert [u.index for u in first] == [i // 2 for i in range(plan.num_steps)]
    assert [u.index for u in again] == [n + i // 2 for i in range(plan.num_steps)]
    assert [u.end for u in first] == [i % 2 == 1 for i in range(plan.num_steps)]
    assert {u.num_tokens for u in first[:2]} == {int(plan.windows.num_tokens[0])}
    assert stats.updates == 2 * n and stats.epoch_updates == 2 * n
    numbering.restore(1, 7)
    assert numbering.of_round(plan, [1] * plan.num_steps, 2)[0].index == 7


def test_without_windows_no_update_is_sent():
    config = make_config(world=4, per_node=2, budget=1000, buffer=8)
    numbering = UpdateNumbering(config, DaemonStats(node_rank=0, dataset_size=100))
    plan = plan_round(make_offers(config, [[300] * 8, [120] * 8]), config, 0)
    assert numbering.of_round(plan, [0] * plan.num_steps, 0) == [None] * plan.num_steps
