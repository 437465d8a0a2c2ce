"""planner/migration_deal.py: a round's ordinary samples cut into the world's groups and dealt
round-robin (issue 26, --migrate auto), and plan_migration taking that deal."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.planner.config import Collate, CostModel
from odbd.planner.grouping import fill_cuts
from odbd.planner.migration import LinkModel, plan_migration
from odbd.planner.migration_deal import cut_work, deal, fewest_moves
from odbd.planner.migration_digest import plan_digested
from tests.unit.planner_factories import make_config, make_offers

FREE_LINK = LinkModel(bytes_per_s=1e30)


def greedy_groups(lengths: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """The lengths of every group a longest-first greedy cut makes."""
    ordered = np.sort(lengths)[::-1]
    starts, ends = fill_cuts(ordered, budget)
    return [tuple(ordered[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5000), max_size=400),
    units=st.integers(2, 7),
    budget=st.integers(500, 5000),
)
def test_every_unit_cuts_again_exactly_the_groups_dealt_to_it(
    lengths: list[int], units: int, budget: int
) -> None:
    # A greedy group's size is set by its first (longest) sample alone, so a unit that cuts
    # what it was dealt starts each group where the world's cut did and takes the same group.
    as_array = np.asarray(lengths, dtype=np.int64)
    unit = deal(as_array, budget, units)
    world = greedy_groups(as_array, budget)
    for u in range(units):
        assert greedy_groups(as_array[unit == u], budget) == world[u::units]


def test_a_step_of_every_unit_holds_one_block_of_the_worlds_groups() -> None:
    # Group j goes to unit j mod N: each block of G x N groups (a step's worth) gives every
    # unit G of them, spread over the block rather than a run of it.
    lengths = np.repeat(np.arange(1000, 100, -1), 3)  # descending: group k = rows [k*s, ...)
    unit = deal(lengths, budget=1000, num_units=4)
    sizes = [len(g) for g in greedy_groups(lengths, 1000)]
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    assert unit[first].tolist() == [j % 4 for j in range(len(sizes))]
    counts = np.bincount(unit[first], minlength=4)
    assert counts.max() - counts.min() <= 1


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 3)), max_size=200)
)
def test_fewest_moves_reaches_the_dealt_counts_moving_only_the_surplus(
    rows: list[tuple[int, int, int]],
) -> None:
    classes = np.asarray([c for c, _, _ in rows], dtype=np.int64)
    holder = np.asarray([h for _, h, _ in rows], dtype=np.int64)
    dealt = np.asarray([d for _, _, d in rows], dtype=np.int64)
    out = fewest_moves(classes, holder, dealt, 4)

    def counts(units: np.ndarray) -> np.ndarray:
        return np.bincount(classes * 4 + units, minlength=24)

    assert counts(out).tolist() == counts(dealt).tolist()
    surplus = np.maximum(counts(holder) - counts(dealt), 0)
    assert int((out != holder).sum()) == int(surplus.sum())


def test_cut_work_sums_each_units_greedy_groups() -> None:
    cost = CostModel(c=10.0, a=1.0, b=0.001, p=0.5)
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 900, size=500)
    patches = rng.integers(0, 40, size=500)
    unit = rng.integers(0, 3, size=500)
    work, count = cut_work(unit, lengths, patches, 4, 2000, cost)
    for u in range(4):
        mine = np.flatnonzero(unit == u)
        order = mine[np.lexsort((-lengths[mine],))]
        starts, ends = fill_cuts(lengths[order], 2000)
        expected = sum(
            cost.work(
                float(lengths[order[a]]) * (b - a),
                float((lengths[order[a:b]].astype(float) ** 2).sum()),
                float(patches[order[a:b]].sum()),
            )
            for a, b in zip(starts, ends, strict=True)
        )
        assert count[u] == len(starts)
        assert abs(work[u] - expected) <= 1e-9 * max(expected, 1.0)
    assert count[3] == 0 and work[3] == 0.0


def padded(tables, budget: int = 4096) -> int:
    """The padded area of every table's greedy groups."""
    return sum(sum(g[0] * len(g) for g in greedy_groups(t.lengths, budget)) for t in tables)


def spread_offers(config, units: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return make_offers(config, [rng.integers(20, 1500, size=300).tolist() for _ in range(units)])


def test_a_padded_round_is_dealt_when_the_padding_saved_pays_for_the_link() -> None:
    # Four nodes each cut their own 300 samples of spread lengths; dealt, each holds every
    # fourth group of the world's cut, which pads less than any node's own.
    config = make_config(world=8, per_node=2, budget=4096, buffer=300)
    offers = spread_offers(config, 4)
    plan = plan_migration(offers, config, FREE_LINK)

    before = padded(o.samples for o in offers)
    after = padded(o.samples for o in plan.offers)
    assert after < before
    groups = [len(greedy_groups(o.samples.lengths, 4096)) for o in plan.offers]
    assert max(groups) - min(groups) <= 1
    assert plan.gain_s > plan.move_s


def test_packed_rounds_are_not_dealt() -> None:
    # A packed row does not pad, so cutting the world's groups saves nothing a move pays for:
    # only the cost levels are balanced, which moves a fraction of what the deal does.
    padded = make_config(world=8, per_node=2, budget=4096, buffer=300)
    packed = make_config(world=8, per_node=2, budget=4096, buffer=300, collate=Collate.PACKED)
    dealt = plan_migration(spread_offers(padded, 4), padded, FREE_LINK).num_moved
    balanced = plan_migration(spread_offers(packed, 4), packed, FREE_LINK).num_moved
    assert balanced < dealt / 4


def test_the_live_decision_deals_from_digests_with_every_sample_once() -> None:
    # The hub deals stand-ins of each node's buckets; each node then sends its cheapest of a
    # bucket: the counts, not the samples, are dealt, and the groups follow within a bucket.
    config = make_config(world=8, per_node=2, budget=4096, buffer=300)
    offers = spread_offers(config, 4, seed=1)
    live = plan_digested(offers, config, FREE_LINK)
    pooled = plan_migration(offers, config, FREE_LINK)
    views = np.sort(np.concatenate([o.samples.views for o in live.offers]))
    assert views.tolist() == list(range(sum(len(o.samples) for o in offers)))
    assert live.bins == pooled.bins  # both took the deal
    # A bucket's stand-ins share one length; a node's real samples of it may cut one group
    # more or less than the stand-ins did.
    groups = [len(greedy_groups(o.samples.lengths, 4096)) for o in live.offers]
    assert max(groups) - min(groups) <= 2
    assert padded(o.samples for o in live.offers) < padded(o.samples for o in offers)
