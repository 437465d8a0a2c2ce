"""company.py: each unit runs its costly groups only as deep as the round's shared cap profile
allows; the rest wait (recirculated), at most MAX_HOLD_ROUNDS rounds."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.planner import company
from odbd.planner.config import Collate, CostModel
from odbd.planner.round import RoundTrace, plan_round
from odbd.planner.types import SampleTable, UnitOffer
from tests.unit.planner_factories import make_config, make_offers, make_table


def _walk(cost: np.ndarray, cap: np.ndarray) -> int:
    """The rule as written in the module docstring, one group at a time (cap: as deep as the
    unit's profile)."""
    held, position = 0, 0
    for c in sorted(cost.tolist(), reverse=True)[: len(cap)]:
        if c > cap[position]:
            held += 1
        else:
            position += 1
    return held


def test_the_cap_is_the_quantile_unit_at_the_end_of_each_run() -> None:
    # Five units, G = 2: the quantile row is the int(0.25 * 4) = 1st smallest of each column,
    # then every position takes the value at the end of its run of 2; zeros end the cap.
    profiles = [
        np.array([9.0, 8, 7, 6, 5]),
        np.array([9.0, 9, 9, 9]),
        np.array([4.0, 3, 2]),
        np.array([8.0, 8, 8, 8, 8]),
        np.array([7.0, 6, 6, 5, 4]),
    ]
    # column (2nd smallest per position): [7, 6, 6, 5, 0]; run ends at 1, 1, 3, 3, 4; where the
    # quantile unit has no 5th group, nothing costlier than its last capped one (5) may run.
    matrix, lengths = company.profile_matrix(profiles)
    assert lengths.tolist() == [5, 4, 3, 5, 5]
    assert company.cap_profile(matrix, 2, threshold=1.0).tolist() == [6.0, 6.0, 5.0, 5.0, 5.0]
    # No unit shows a profile (no outsized group): nothing outsized may run, and none is seen.
    empty, none = company.profile_matrix([np.zeros(0)] * 3)
    assert none.tolist() == [0, 0, 0] and company.cap_profile(empty, 2, 1.0).tolist() == []


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.lists(st.integers(1, 30), min_size=0, max_size=40), min_size=1, max_size=6),
    ranks_per_unit=st.integers(1, 4),
)
def test_every_daemon_counts_the_holds_each_unit_makes(costs, ranks_per_unit):
    """held_counts (every daemon, from profiles) == unit_holds (the unit, from its groups) ==
    the one-by-one walk, whenever nothing is too old to wait."""
    arrays = [np.asarray(c, dtype=np.float64) for c in costs]
    threshold = 10.0  # costs above it are outsized; a unit without one shows no profile
    profiles = [company.cost_profile(c, threshold) for c in arrays]
    matrix, lengths = company.profile_matrix(profiles)
    cap = company.cap_profile(matrix, ranks_per_unit, threshold)
    assert (np.diff(cap) <= 0).all()
    counts = company.held_counts(matrix, lengths, cap)
    for cost, profile, count in zip(arrays, profiles, counts, strict=True):
        young = np.zeros(len(cost), dtype=np.int64)
        hold = company.unit_holds(cost, young, cap, len(profile))
        shown = min(len(cap), len(profile))
        assert int(hold.sum()) == int(count) == _walk(cost, cap[:shown])
        # Only the groups the profile shows may wait.
        assert not hold[np.argsort(-cost, kind="stable")[shown:]].any()


def test_groups_recirculated_max_hold_rounds_times_run_whatever_the_cap() -> None:
    cost = np.array([50.0, 40.0, 10.0, 10.0])
    cap = np.array([10.0, 10.0, 10.0, 10.0])
    young = np.zeros(4, dtype=np.int64)
    assert company.unit_holds(cost, young, cap, 4).tolist() == [True, True, False, False]
    old = np.array([company.MAX_HOLD_ROUNDS, 0, 0, 0])
    assert company.unit_holds(cost, old, cap, 4).tolist() == [False, True, False, False]
    assert not company.unit_holds(cost, young, cap, 0).any()  # a unit showing no profile


# The implementations before the scale8k speed-up (issue 14 part 2 follow-up), kept as the
# reference the faster ones must equal value for value: plans stay bit-identical.
def _cap_profile_whole_matrix(matrix: np.ndarray, ranks_per_unit: int, threshold: float):
    units, depth = matrix.shape
    if units == 0:
        return np.zeros(0)
    column = np.partition(matrix, int(company.CAP_QUANTILE * (units - 1)), axis=0)
    g = max(ranks_per_unit, 1)
    run_end = np.minimum(np.arange(depth) // g * g + g - 1, depth - 1)
    cap = column[int(company.CAP_QUANTILE * (units - 1))][run_end]
    positive = np.flatnonzero(cap > 0)
    return np.where(cap > 0, cap, cap[positive[-1]] if positive.size else threshold)


def _held_counts_per_position(matrix: np.ndarray, lengths: np.ndarray, cap: np.ndarray):
    units, depth = len(lengths), len(cap)
    if units == 0 or depth == 0:
        return np.zeros(units, dtype=np.int64)
    seen = np.minimum(lengths, depth)
    levels, level_of = np.unique(cap, return_inverse=True)
    above = np.empty((units, len(levels)), dtype=np.int64)
    for u in range(units):
        above[u] = np.searchsorted(-matrix[u, : seen[u]], -levels, side="left")
    position = np.arange(depth)
    runs_at = position + np.maximum.accumulate(above[:, level_of] - position, axis=1)
    return seen - (runs_at < seen[:, None]).sum(axis=1)


def _unit_holds_walk(cost: np.ndarray, ages: np.ndarray, cap: np.ndarray, depth: int):
    hold = np.zeros(len(cost), dtype=bool)
    position = 0
    for group in np.argsort(-cost, kind="stable")[: min(len(cap), depth)].tolist():
        if cost[group] > cap[position] and ages[group] < company.MAX_HOLD_ROUNDS:
            hold[group] = True
        else:
            position += 1
    return hold


# Few distinct costs, so ties between groups and between the cap and a group are common.
_costs = st.lists(st.integers(1, 12).map(float), min_size=0, max_size=60)


@settings(max_examples=300, deadline=None)
@given(
    costs=st.lists(_costs, min_size=1, max_size=80),
    ranks_per_unit=st.integers(1, 9),
    threshold=st.sampled_from([0.5, 6.0, 20.0]),
)
def test_cap_and_held_counts_equal_the_whole_matrix_versions(costs, ranks_per_unit, threshold):
    profiles = [company.cost_profile(np.asarray(c), threshold, always=True) for c in costs]
    matrix, lengths = company.profile_matrix(profiles)
    cap = company.cap_profile(matrix, ranks_per_unit, threshold)
    assert np.array_equal(cap, _cap_profile_whole_matrix(matrix, ranks_per_unit, threshold))
    counts = company.held_counts(matrix, lengths, cap)
    assert counts.dtype == np.int64
    assert np.array_equal(counts, _held_counts_per_position(matrix, lengths, cap))


@settings(max_examples=300, deadline=None)
@given(
    costs=st.lists(_costs, min_size=1, max_size=8),
    cap=st.lists(st.integers(1, 12).map(float), min_size=0, max_size=70),
    shorter=st.integers(0, 70),
    sort_cap=st.booleans(),
)
def test_held_counts_equal_the_per_position_version_for_any_cap(costs, cap, shorter, sort_cap):
    """Caps not from cap_profile: as long or longer than the profiles, long runs, any order."""
    matrix, lengths = company.profile_matrix([-np.sort(-np.asarray(c)) for c in costs])
    lengths = np.minimum(lengths, shorter)  # profiles that end early (zeros past their end)
    for u, n in enumerate(lengths.tolist()):
        matrix[u, n:] = 0.0
    levels = -np.sort(-np.asarray(cap)) if sort_cap else np.asarray(cap)
    counts = company.held_counts(matrix, lengths, levels)
    assert np.array_equal(counts, _held_counts_per_position(matrix, lengths, levels))


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    cost=st.lists(st.integers(1, 12).map(float), min_size=0, max_size=80),
    cap=st.lists(st.integers(1, 12).map(float), min_size=0, max_size=90),
    depth=st.integers(0, 90),
    old_share=st.sampled_from([0.0, 0.1, 0.5]),
    sort_cap=st.booleans(),
)
def test_unit_holds_equals_the_group_by_group_walk(data, cost, cap, depth, old_share, sort_cap):
    """Any costs (ties included), any cap (in any order), any depth, with and without groups
    too old to wait."""
    groups = np.asarray(cost)
    draws = st.floats(0.0, 1.0, allow_nan=False)
    old = [data.draw(draws) < old_share for _ in cost]
    ages = np.where(old, company.MAX_HOLD_ROUNDS, 0).astype(np.int64)
    levels = -np.sort(-np.asarray(cap)) if sort_cap else np.asarray(cap)
    hold = company.unit_holds(groups, ages, levels, depth)
    assert np.array_equal(hold, _unit_holds_walk(groups, ages, levels, depth))


def _three_nodes():
    # Three nodes of one rank, budget 1000, exact sort. Node 0 has two 5000-token giants, the
    # others one: each cuts its giants, four groups of 4 x 250 and two singles of 900.
    config = replace(make_config(world=3, per_node=1, budget=1000, buffer=64), fresh_groups=False)
    node0 = [5000, 5000] + [250] * 16 + [900] * 2
    other = [5000] + [250] * 16 + [900] * 2
    return config, make_offers(config, [node0, other, other])


def test_plan_round_holds_the_extra_giant_and_takes_t_without_it():
    config, offers = _three_nodes()
    plan = plan_round(offers, config, 0)
    # The cap is the others' profile (giant, 4 x 1003, 2 x 910): node 0's second giant waits
    # for company rather than run beside the others' ordinary groups; T = 7 without it.
    assert plan.num_steps == 7
    assert plan.units[0].leftover.lengths.tolist() == [5000]
    assert plan.units[0].leftover.ages.tolist() == [1]
    giant_steps = (plan.stats.padded_tokens > 1000).any(axis=1)
    assert int(giant_steps.sum()) == 1  # the three kept giants share one step


def test_a_giant_that_waited_max_hold_rounds_runs_and_dry_rounds_hold_nothing():
    config, offers = _three_nodes()
    table = offers[0].samples
    ages = np.where(np.arange(len(table)) == 1, company.MAX_HOLD_ROUNDS, 0)
    aged = SampleTable(table.views, table.lengths, table.tokens, ages, table.patches)
    plan = plan_round([UnitOffer(0, aged, False), *offers[1:]], config, 0)
    assert 5000 not in plan.units[0].leftover.lengths.tolist()  # it ran
    assert int((plan.stats.padded_tokens > 1000).any(axis=1).sum()) == 2
    dry = [UnitOffer(o.unit, o.samples, True) for o in offers]
    flushed = plan_round(dry, config, 0)
    assert all(len(u.leftover) == 0 for u in flushed.units)


def test_past_cap_sample_units_every_kth_unit_sets_the_cap_and_the_others_never_split():
    assert company.sampled_units(company.CAP_SAMPLE_UNITS) == slice(None, None, 1)
    assert company.sampled_units(company.CAP_SAMPLE_UNITS + 1) == slice(None, None, 2)
    # 2 x CAP_SAMPLE_UNITS one-rank units (every 2nd sampled): the odd ones have three giants
    # and only three ordinary groups, so T (from the sampled units, which hold their extra
    # giants) leaves them too little room to hold theirs: they run the cheapest held giant,
    # split nothing.
    num_units = 2 * company.CAP_SAMPLE_UNITS
    assert [company.is_sampled(u, num_units) for u in range(4)] == [True, False, True, False]
    config = replace(
        make_config(world=num_units, per_node=1, budget=1000, buffer=64), fresh_groups=False
    )
    sampled = [5000] + [250] * 16 + [900] * 2  # giant, 4 x (4 x 250), 2 x 900: 7 groups
    odd = [5200, 5100, 5000] + [250] * 12  # 3 giants + 3 x (4 x 250): 6 groups
    offers = make_offers(config, [odd if u % 2 else sampled for u in range(num_units)])
    plan = plan_round(offers, config, 0)
    # Only the sampled units' summaries carry their profile (the payload phase 1 reads).
    trace = RoundTrace()
    plan_round(offers, config, 0, trace)
    assert [len(s.profile) > 0 for s in trace.summaries[0][:4]] == [True, False, True, False]
    assert plan.num_steps == 6  # min(7 sampled, 6 odd): every unit fills it
    assert all(u.num_splits == 0 for u in plan.units)
    # A sampled unit recirculates its surplus (a 900 single, the least full group) as always.
    assert all(u.leftover.lengths.tolist() == [900] for u in plan.units[::2])
    # An odd unit would hold two giants (costlier than the cap's 5000) but runs all 6 groups:
    # the others did not count its holds, and it has no room for them.
    assert all(len(u.leftover) == 0 for u in plan.units[1::2])


@settings(max_examples=60, deadline=None)
@given(
    per_node=st.integers(1, 4),
    nodes=st.integers(1, 5),
    budget=st.integers(50, 2000),
    data=st.data(),
)
def test_a_capped_round_splits_nothing_and_recirculates_what_it_holds(
    per_node, nodes, budget, data
):
    """While every unit still fills, holding lowers T instead of splitting a group, and every
    buffered sample is run or recirculated (none lost, none twice). Each unit starts with G
    giants, so it has the G groups a step needs (fewer would split whatever the cap)."""
    config = make_config(world=nodes * per_node, per_node=per_node, budget=budget, buffer=24)
    lengths = [
        [budget + 1] * per_node
        + data.draw(
            st.lists(
                st.one_of(st.integers(1, 3 * budget), st.integers(1, max(budget // 6, 1))),
                max_size=config.unit_capacity - per_node,
            )
        )
        for _ in range(config.num_units)
    ]
    offers = make_offers(config, lengths)
    plan = plan_round(offers, config, data.draw(st.integers(0, 5)))
    assert all(u.num_splits == 0 for u in plan.units)
    for offer, unit in zip(offers, plan.units, strict=True):
        seen = np.concatenate([unit.emitted.views, unit.leftover.views])
        assert sorted(seen.tolist()) == sorted(offer.samples.views.tolist())


def test_a_round_in_which_every_group_would_wait_holds_nothing() -> None:
    """Found by hypothesis (test_non_join_reaches_the_sample_quota): packed groups whose patch
    work (p = 10) puts every one over the cap with a giant in the round; holding them all gave
    T = 0 round after round, and a round without steps ages nothing, so nothing ever ran."""
    config = replace(
        make_config(world=6, per_node=3, budget=1135, buffer=2, collate=Collate.PACKED),
        cost=CostModel(a=0.01, b=0.0, c=0.0, p=10.0),
    )
    first = make_table([1, 630, 1], 0)
    second = make_table([1831, 55, 94], 3)  # the giant (> 1135)
    offers = [
        UnitOffer(0, replace(first, patches=np.array([1, 1, 3])), False),
        UnitOffer(1, replace(second, patches=np.array([0, 0, 3])), False),
    ]
    plan = plan_round(offers, config, 0)
    assert plan.num_steps >= 1
    assert sum(len(u.leftover) for u in plan.units) < 6  # something ran


def _ordinary_nodes(num_units: int):
    # One-rank units, budget 1000, exact sort, no sample over the budget. Unit 0 cuts two
    # singles of 1000 (work 1012 each, by b * l^2) and four groups of 4 x 250 (1003); every
    # other unit the four 4 x 250 groups and two singles of 900 (910).
    config = replace(
        make_config(world=num_units, per_node=1, budget=1000, buffer=64), fresh_groups=False
    )
    heavy = [1000] * 2 + [250] * 16
    light = [250] * 16 + [900] * 2
    return config, make_offers(config, [heavy] + [light] * (num_units - 1))


def test_with_enough_units_every_filling_round_is_capped_not_only_giant_ones() -> None:
    config, offers = _ordinary_nodes(company.CAP_EVERY_ROUND_UNITS)
    assert company.caps_every_round(config)
    plan = plan_round(offers, config, 0)
    # The cap is the other units' profile (4 x 1003, then 910): unit 0's two 1000s wait, T = 4
    # without them, and every step runs four ranks of 1003; the others keep their 900s.
    assert plan.num_steps == 4
    assert plan.units[0].leftover.lengths.tolist() == [1000, 1000]
    assert plan.units[0].leftover.ages.tolist() == [1, 1]
    assert all(u.leftover.lengths.tolist() == [900, 900] for u in plan.units[1:])
    assert np.ptp(plan.stats.work) == 0.0
    # Fewer units keep the giant-only rule: no cap, every group runs in T = 6.
    few_config, few_offers = _ordinary_nodes(company.CAP_EVERY_ROUND_UNITS - 1)
    assert not company.caps_every_round(few_config)
    few = plan_round(few_offers, few_config, 0)
    assert few.num_steps == 6 and all(len(u.leftover) == 0 for u in few.units)


def test_ordinary_groups_within_the_pacing_slack_of_the_cap_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Unit 0 cuts four groups of 4 x 250 (work 1003), every other unit four of 5 x 200
    # (1002.4): 0.06 % over the cap, within PACING_SLACK, so nothing waits and T = 4.
    config = replace(make_config(world=4, per_node=1, budget=1000, buffer=64), fresh_groups=False)
    offers = make_offers(config, [[250] * 16] + [[200] * 20] * 3)
    assert company.caps_every_round(config) and company.PACING_SLACK > 0.0006
    plan = plan_round(offers, config, 0)
    assert plan.num_steps == 4 and all(len(u.leftover) == 0 for u in plan.units)
    # The exact cap holds unit 0's groups for that difference, and T falls to what it runs.
    monkeypatch.setattr(company, "PACING_SLACK", 0.0)
    exact = plan_round(offers, config, 0)
    assert exact.num_steps < 4 and len(exact.units[0].leftover) > 0
