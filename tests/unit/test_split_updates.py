"""--align updates on the split planner (daemon/split_updates.py): the third exchange of a
round, each node's deals -> the hub's step grid. tests/unit/test_split_round.py checks every
node's part against plan_round's under hypothesis; these pin the cases it may not draw."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from odbd.daemon import split_updates
from odbd.daemon.split_exchange import barrier_round
from odbd.errors import InvariantError
from odbd.planner.config import Align
from odbd.planner.round import assemble, plan_round
from odbd.planner.update_align import NodeDeal, UpdateGrid
from tests.unit.planner_factories import make_config, make_offers
from tests.unit.test_split_plan import assert_same_plan
from tests.unit.test_split_round import live_round, offers_of


def test_the_hub_takes_the_whole_plan_when_its_updates_end_sooner():
    """Two nodes of one rank, --accumulate 2 (hypothesis' smallest such case): node 0 holds
    one group of two samples, node 1 nothing. The step plan splits the group to fill the
    update's two steps, each costing the per-step constant; unsplit, node 0's rank runs one
    micro-step and skips the other, and the update ends sooner. The hub's grid takes the
    whole plan (alternative 1), as plan_round does."""
    config = dataclasses.replace(
        make_config(world=2, per_node=1, budget=50, buffer=2, accumulate=2),
        align=Align.UPDATES,
    )
    offers = make_offers(config, [[10, 10], []])
    whole = plan_round(offers, config, 0)
    _, grid, seen, parts = live_round(offers, config, 0)
    chosen, decoded = split_updates.decode_grid(grid)
    assert chosen == 1
    assert decoded.lengths.tolist() == (whole.windows.ends - whole.windows.starts).tolist()
    plan = assemble(parts, seen[0].decision)
    assert_same_plan(plan, whole)
    assert plan.micro_steps is not None and whole.micro_steps is not None
    assert np.array_equal(plan.micro_steps, whole.micro_steps)
    assert plan.micro_steps.tolist() == [[1, 1]] and plan.num_steps == 2
    assert sum(u.num_splits for u in plan.units) == 0  # the group was kept whole


@pytest.mark.parametrize("buffer", [64, 1024])
def test_what_a_node_receives_under_align_updates_does_not_grow_with_the_nodes(buffer):
    """The grid is 36 bytes, 8 per update and 32 per step of the grid, whatever the nodes."""
    for nodes in (2, 8, 32):
        config = dataclasses.replace(
            make_config(world=nodes, per_node=1, budget=4096, buffer=buffer, accumulate=2),
            align=Align.UPDATES,
        )
        _, grid, seen, parts = live_round(offers_of(config, buffer), config, 3)
        steps, windows = parts[0].num_steps, len(parts[0].windows)
        assert len(grid) == 8 + 20 + 8 * windows + 32 * steps, (nodes, len(grid))
        assert steps >= seen[0].decision.num_steps // 2 * 2  # the closed updates, or longer


def a_deal(times=(1.0, 2.0)) -> NodeDeal:
    lengths = np.array([2, 1], dtype=np.int64)
    return NodeDeal(
        (),
        lengths,
        np.array(times, dtype=np.float64),
        np.array([1, 2, 3], dtype=np.int64),
        np.array([10, 20, 30], dtype=np.int64),
        np.array([0.5, 1.5, 2.5]),
        np.array([1.0, 3.0, 5.0]),
    )


def test_deals_and_grids_survive_their_bytes():
    deals = split_updates.decode_deals(split_updates.encode_deals([a_deal(), a_deal()]))
    assert len(deals) == 2
    for d in deals:
        for f in ("lengths", "times", "num_samples", "num_tokens", "max_work", "sum_work"):
            assert getattr(d, f).tobytes() == getattr(a_deal(), f).tobytes(), f
    grid = UpdateGrid(
        np.array([2, 1]), np.array([1, 2, 3]), np.array([4, 5, 6]), np.ones(3), np.ones(3), 7.5
    )
    chosen, again = split_updates.decode_grid(split_updates.encode_grid(1, grid))
    assert chosen == 1 and again.time == 7.5 and again.lengths.tolist() == [2, 1]
    assert again.num_tokens.tolist() == [4, 5, 6]


def test_a_bad_deal_fails_the_round_naming_its_node():
    good = split_updates.encode_deals([a_deal()])
    windows = [plan_round(*_small_round()).windows]
    with pytest.raises(
        InvariantError, match="node 1 sent a round payload that is not an odbd update deals"
    ):
        split_updates.hub_grid([good, good[:-5]], windows)
    bad_time = split_updates.encode_deals([a_deal(times=(1.0, float("nan")))])
    with pytest.raises(InvariantError, match="node 1 .*not finite"):
        split_updates.hub_grid([good, bad_time], windows)
    with pytest.raises(InvariantError, match="trailing"):
        split_updates.decode_deals(good + b"x")


def _small_round():
    config = dataclasses.replace(
        make_config(world=2, per_node=1, budget=1000, buffer=8, accumulate=2),
        align=Align.UPDATES,
    )
    return make_offers(config, [[500, 400, 300, 200], [100, 90]], dry=True), config, 0


def test_align_updates_runs_three_barrier_rounds_per_round():
    config = _small_round()[1]
    assert split_updates.exchanges_per_round(config) == 3
    assert split_updates.exchanges_per_round(dataclasses.replace(config, align=Align.STEPS)) == 2
    assert [barrier_round(4, phase, 3) for phase in range(3)] == [12, 13, 14]
    assert [barrier_round(4, phase) for phase in range(2)] == [8, 9]  # --align steps: as before
