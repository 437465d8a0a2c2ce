"""selection.py: a round of few, large groups runs its fullest T x G greedy groups and keeps the
samples that would pad back for the next round."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.planner import company, selection
from odbd.planner.decision import decide_round
from odbd.planner.node_plan import plan_node
from odbd.planner.round import plan_round
from odbd.planner.summary import group_unit, summarize
from odbd.planner.types import SampleTable, UnitOffer
from tests.unit.planner_factories import make_config, make_offers


def _brute_force_most_tokens(lengths: list[int], budget: int, num_groups: int) -> int | None:
    """The most real tokens of `num_groups` disjoint greedy full groups, every choice tried."""

    @cache
    def most(start: int, left: int) -> int | None:
        if left == 0:
            return 0
        found = None
        for j in range(start, len(lengths)):
            end = min(j + max(budget // lengths[j], 1), len(lengths))
            rest = most(end, left - 1)
            if rest is not None:
                total = sum(lengths[j:end]) + rest
                found = total if found is None else max(found, total)
        return found

    return most(0, num_groups)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=14),
    st.integers(10, 60),
    st.integers(1, 5),
)
def test_fullest_groups_is_the_best_choice_of_greedy_full_groups(raw, budget, num_groups):
    lengths = np.sort(np.asarray(raw, dtype=np.int64))[::-1]
    chosen = selection.fullest_groups(lengths, budget, num_groups)
    expected = _brute_force_most_tokens(lengths.tolist(), budget, num_groups)
    if expected is None:
        assert chosen is None
        return
    assert chosen is not None
    starts, ends = chosen
    assert len(starts) == num_groups
    assert (starts[1:] >= ends[:-1]).all()  # disjoint, in sort order
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        assert e == min(s + max(budget // int(lengths[s]), 1), len(lengths))  # greedy, full
        assert e - s == 1 or int(lengths[s]) * (e - s) <= budget  # DESIGN.md 3.5
    assert sum(int(lengths[s:e].sum()) for s, e in zip(starts, ends, strict=True)) == expected


def test_an_old_sample_outweighs_the_padding_it_costs():
    # Budget 12, one group: [4, 4, 4] holds 12 tokens, [5, 5] 10 and [5, 4] 9, so the 5s
    # wait, unless one of them is old.
    lengths = np.array([5, 5, 4, 4, 4], dtype=np.int64)
    starts, ends = selection.fullest_groups(lengths, 12, 1)
    assert (starts.tolist(), ends.tolist()) == ([2], [5])
    bonus = np.array([12.0, 0, 0, 0, 0])
    starts, ends = selection.fullest_groups(lengths, 12, 1, bonus)
    assert (starts.tolist(), ends.tolist()) == ([0], [2])


def test_equally_full_choices_run_the_earlier_start():
    # Budget 11, two groups: [6] + [5, 3] holds 14 tokens with either 6; the earlier one runs
    # (all-short at W = 128 / 1024 measured 0.99420 / 0.99455 with the earlier start on ties,
    # 0.98748 / 0.98742 with the later: docs/bench/planner.md, fifth pass).
    starts, ends = selection.fullest_groups(np.array([6, 6, 5, 3], dtype=np.int64), 11, 2)
    assert (starts.tolist(), ends.tolist()) == ([0, 2], [1, 4])


def test_reserve_steps_only_in_rounds_of_few_large_groups_and_always_leaves_a_step():
    g, large = 8, float(selection.MIN_GROUP_SAMPLES)
    assert selection.reserve_steps(4, g, large) == selection.RESERVE_STEPS
    assert selection.reserve_steps(2, g, large) == 1
    assert selection.reserve_steps(1, g, large) == 0
    assert selection.reserve_steps(4, g, large - 1) == selection.WIDE_RESERVE_STEPS
    wide, too_many = (
        selection.WIDE_MAX_SELECT_GROUPS // g,
        selection.WIDE_MAX_SELECT_GROUPS // g + 1,
    )
    assert selection.reserve_steps(selection.MAX_SELECT_GROUPS // g + 1, g, large) == 1
    assert selection.reserve_steps(wide, g, selection.WIDE_MIN_GROUP_SAMPLES) == 1
    assert selection.reserve_steps(too_many, g, large) == 0
    assert selection.reserve_steps(2, g, selection.WIDE_MIN_GROUP_SAMPLES) == 1
    assert selection.reserve_steps(1, g, selection.WIDE_MIN_GROUP_SAMPLES) == 0
    # groups of few samples pad little
    assert selection.reserve_steps(4, g, selection.WIDE_MIN_GROUP_SAMPLES - 1) == 0


def _short_samples(seed: int, count: int) -> list[int]:
    """all-short's shape: 33 integer lengths, so greedy groups straddle two lengths."""
    return np.random.default_rng(seed).integers(32, 65, count).tolist()


def _padding(draft) -> float:
    return 1 - draft.columns["real_tokens"].sum() / draft.columns["padded_tokens"].sum()


def test_a_round_of_few_groups_runs_fewer_steps_of_fuller_groups_and_loses_nothing():
    # Two nodes of 2 ranks, budget 4096 (~85 samples a group), 2,000 samples each: ~24 greedy
    # groups, 11 full steps; the round reserves 2 and runs the fullest 9 x 2 groups.
    config = replace(make_config(world=4, per_node=2, budget=4096, buffer=2000), fresh_groups=False)
    offers = make_offers(config, [_short_samples(0, 2000), _short_samples(1, 2000)])
    units = [group_unit(o, config, 0) for o in offers]
    decision = decide_round([summarize(u, config.num_units) for u in units], config, 0)
    assert decision.select_fullest
    assert decision.num_steps == min(len(u.groups) for u in units) // 2 - selection.RESERVE_STEPS
    for node, unit in enumerate(units):
        selected = plan_node(node, [unit], decision, config)
        as_cut = plan_node(node, [unit], replace(decision, select_fullest=False), config)
        assert (selected.columns["padded_tokens"] <= config.token_budget).all()
        assert _padding(selected) < 0.7 * _padding(as_cut)  # 0.67 % vs 1.09 % on node 0
        plan = selected.units[0]
        ran = plan.emitted.views.tolist() + plan.leftover.views.tolist()
        assert sorted(ran) == sorted(unit.offer.samples.views.tolist())  # nothing lost or doubled


def test_a_round_of_more_smaller_groups_gives_up_one_step_and_pads_less():
    # The wide band: budget 2048 (~42 samples a group), 6,000 samples a unit: ~143 greedy groups,
    # 71 full steps; the round gives up one and runs the fullest 70 x 2 groups.
    config = replace(make_config(world=4, per_node=2, budget=2048, buffer=6000), fresh_groups=False)
    offers = make_offers(config, [_short_samples(2, 6000), _short_samples(3, 6000)])
    units = [group_unit(o, config, 0) for o in offers]
    decision = decide_round([summarize(u, config.num_units) for u in units], config, 0)
    assert decision.select_fullest
    assert (
        decision.num_steps == min(len(u.groups) for u in units) // 2 - selection.WIDE_RESERVE_STEPS
    )
    for node, unit in enumerate(units):
        selected = plan_node(node, [unit], decision, config)
        as_cut = plan_node(node, [unit], replace(decision, select_fullest=False), config)
        assert (selected.columns["padded_tokens"] <= config.token_budget).all()
        assert _padding(selected) < 0.8 * _padding(as_cut)  # 0.11 % vs 0.17 % on node 0
        plan = selected.units[0]
        ran = plan.emitted.views.tolist() + plan.leftover.views.tolist()
        assert sorted(ran) == sorted(unit.offer.samples.views.tolist())  # nothing lost or doubled


def _selects(config, offers) -> bool:
    summaries = [summarize(group_unit(o, config, 0), config.num_units) for o in offers]
    return decide_round(summaries, config, 0).select_fullest


def test_no_selection_with_a_giant_a_dry_unit_many_groups_or_small_ones():
    config = replace(make_config(world=4, per_node=2, budget=4096, buffer=6000), fresh_groups=False)
    short = [_short_samples(0, 2000), _short_samples(1, 2000)]
    assert _selects(config, make_offers(config, short))
    assert not _selects(config, make_offers(config, [short[0][:-1] + [5000], short[1]]))
    assert not _selects(config, make_offers(config, short, dry=True))
    many = [_short_samples(0, 6000), _short_samples(1, 6000)]  # ~70 groups a unit: the wide band
    units = [group_unit(o, config, 0) for o in make_offers(config, many)]
    decision = decide_round([summarize(u, config.num_units) for u in units], config, 0)
    assert decision.select_fullest
    assert (
        decision.num_steps == min(len(u.groups) for u in units) // 2 - selection.WIDE_RESERVE_STEPS
    )
    small = replace(config, token_budget=1024)  # ~21 samples a group
    assert not _selects(small, make_offers(small, short))
    too_many = replace(config, token_budget=2048, buffer_size=12000)  # ~42 a group, ~290 groups
    lots = [_short_samples(0, 12000), _short_samples(1, 12000)]
    assert not _selects(too_many, make_offers(too_many, lots))
    fewer = [lots[0][:6000], lots[1][:6000]]  # ~143 groups of ~42: the wide band selects
    assert _selects(too_many, make_offers(too_many, fewer))


def test_a_sample_that_waited_max_hold_rounds_runs():
    config = replace(make_config(world=4, per_node=2, budget=4096, buffer=2000), fresh_groups=False)
    offers = make_offers(config, [_short_samples(0, 2000), _short_samples(1, 2000)])
    plain = plan_round(offers, config, 0)
    waiting = plain.units[0].leftover.views
    assert len(waiting) > 0
    table = offers[0].samples
    old = np.isin(table.views, waiting[:3])
    ages = np.where(old, company.MAX_HOLD_ROUNDS, 0).astype(np.int64)
    aged = SampleTable(table.views, table.lengths, table.tokens, ages, table.patches)
    plan = plan_round([UnitOffer(0, aged, False), offers[1]], config, 0)
    assert not np.isin(waiting[:3], plan.units[0].leftover.views).any()
