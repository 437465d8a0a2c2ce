"""Packed groups (sum of lengths <= L) and patch budgets (issue 13), planner/packing.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.errors import ConfigError
from odbd.planner.config import Collate, CostModel, Grouping
from odbd.planner.grouping import group_buffer, sort_longest_first
from odbd.planner.packing import group_with_budgets
from odbd.planner.round import plan_round
from odbd.planner.types import SampleTable, UnitOffer
from tests.unit.planner_factories import make_config


def groups_as_lengths(table: SampleTable, groups) -> list[list[int]]:
    return [table.lengths[groups.members(g)].tolist() for g in range(len(groups))]


def test_packed_groups_fill_the_room_a_long_sample_leaves():
    # Sorted contiguous cuts pair 600 with 500 (1100 > 1000: alone) and waste 400 per group;
    # first-fit decreasing puts a 400 beside every 600.
    table = SampleTable.of(range(6), [600, 600, 600, 400, 400, 400])
    groups = group_with_budgets(table, 1000, 0, Collate.PACKED)
    assert sorted(groups_as_lengths(table, groups)) == [[600, 400]] * 3


def test_packed_groups_keep_the_sum_budget_and_are_longest_first():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 900, size=500)
    table = SampleTable.of(range(500), lengths)
    groups = group_with_budgets(table, 1000, 0, Collate.PACKED, np.random.default_rng(1))
    members = groups_as_lengths(table, groups)
    assert sorted(x for g in members for x in g) == sorted(lengths.tolist())
    assert all(sum(g) <= 1000 for g in members)
    assert all(g == sorted(g, reverse=True) for g in members)
    # Near the lower bound: at most a few groups over ceil(sum / L).
    assert len(groups) <= int(np.ceil(lengths.sum() / 1000)) * 1.1 + 1


def test_a_sample_over_either_budget_goes_alone():
    table = SampleTable.of(range(4), [1500, 10, 10, 10], patches=[0, 50, 2, 2])
    for collate in Collate:
        groups = group_with_budgets(table, 1000, 20, collate)
        members = sorted(groups_as_lengths(table, groups))
        assert members == [[10], [10, 10], [1500]], collate


def test_padded_cuts_stop_at_the_patch_budget():
    table = SampleTable.of(range(6), [10] * 6, patches=[4, 4, 4, 0, 0, 4])
    groups = group_with_budgets(table, 1000, 8, Collate.PADDED)
    patches = [table.patches[groups.members(g)].sum() for g in range(len(groups))]
    assert max(patches) <= 8 and len(groups) == 2
    # Without a patch budget the same samples are one group, as min-time cuts them.
    assert len(group_buffer(table, 1000, Grouping.MIN_TIME)) == 1


def test_packed_plan_counts_real_tokens_as_padded_and_the_patch_term_in_work():
    config = make_config(world=2, per_node=2, budget=1000, collate=Collate.PACKED, max_patches=9)
    table = SampleTable.of(range(4), [600, 400, 300, 300], patches=[0, 3, 5, 5])
    plan = plan_round([UnitOffer(0, table, dry=True)], config, 0)
    stats = plan.stats
    assert np.array_equal(stats.padded_tokens, stats.real_tokens)
    assert int(stats.num_samples.sum()) == 4
    cost = CostModel()
    real = stats.real_tokens
    assert np.all(stats.work >= cost.a * real)  # plus quadratic and patch terms
    total_patches = 0.0
    for step in range(plan.num_steps):
        for rank in range(2):
            views = plan.group_views(step, rank, 2)
            total_patches += float(table.patches[views].sum())
            assert table.patches[views].sum() <= 9
    sum_sq = float((table.lengths.astype(float) ** 2).sum())
    assert stats.work.sum() == pytest.approx(real.sum() + cost.b * sum_sq + total_patches)


def test_paper_grouping_refuses_packed_and_patch_budgets():
    with pytest.raises(ConfigError, match="--grouping paper"):
        make_config(grouping=Grouping.PAPER, collate=Collate.PACKED)
    with pytest.raises(ConfigError, match="--grouping paper"):
        make_config(grouping=Grouping.PAPER, max_patches=10)
    with pytest.raises(ConfigError, match="--max-patches"):
        make_config(max_patches=-1)


def first_fit_decreasing_item_by_item(table: SampleTable, budget: int) -> list[list[int]]:
    """Textbook first-fit decreasing: each sample, longest first, into the first bin it fits."""
    bins: list[list[int]] = []
    rooms: list[int] = []
    for row in sort_longest_first(table).tolist():
        length = int(table.lengths[row])
        fit = next((b for b, room in enumerate(rooms) if room >= length), None)
        if fit is None:
            bins.append([])
            rooms.append(budget)
            fit = len(bins) - 1
        bins[fit].append(row)
        rooms[fit] -= length
    return [sorted(b) for b in bins]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 400),
    st.lists(
        st.one_of(st.integers(1, 60), st.integers(1, 900), st.sampled_from([5, 50])), max_size=120
    ),
)
def test_packed_bins_are_first_fit_decreasing_item_by_item(budget, lengths):
    # The bin-by-bin build (lookup table, union-find, runs of equal lengths taken at once) must
    # give exactly the bins of first-fit decreasing, ties in the longest-first order included.
    table = SampleTable.of(np.arange(len(lengths)), lengths)
    groups = group_with_budgets(table, budget, 0, Collate.PACKED)
    bins = [sorted(groups.members(g).tolist()) for g in range(len(groups))]
    assert bins == first_fit_decreasing_item_by_item(table, budget)
