import numpy as np

from odbd.planner import alignment
from odbd.planner.config import Balance, Grouping
from odbd.planner.grouping import group_buffer
from odbd.planner.round import plan_round
from tests.unit.planner_factories import make_config, make_offers, make_table


def test_paper_target_is_max_groups_capped_by_capacity_and_samples():
    # Eq. 3 over active ranks only: an empty rank does not collapse T to 0.
    assert alignment.paper_target_steps([3, 5, 0], [10, 12, 0], 1, 0) == 5
    assert alignment.paper_target_steps([3, 5, 0], [10, 12, 0], 1, 4) == 4
    assert alignment.paper_target_steps([3, 5], [2, 12], 1, 0) == 2
    assert alignment.paper_target_steps([0, 0], [0, 0], 1, 0) == 0


def test_min_time_target_uses_the_poorest_filling_unit():
    assert alignment.min_time_target_steps([10, 7], [False, False], 2, 0) == 3
    # A dry unit does not hold the others back; it splits or idles instead.
    assert alignment.min_time_target_steps([10, 1], [False, True], 2, 0) == 5
    assert alignment.min_time_target_steps([1, 1], [False, False], 2, 0) == 1
    assert alignment.min_time_target_steps([10, 7], [False, False], 2, 2) == 2


def test_min_time_flush_covers_the_richest_unit():
    assert alignment.min_time_target_steps([9, 2], [True, True], 2, 0) == 5
    assert alignment.min_time_target_steps([0, 0], [True, True], 2, 0) == 0


def test_fit_overflow_keeps_high_priority_groups_and_returns_the_rest():
    table = make_table([100] * 10)
    groups = group_buffer(table, 300, Grouping.MIN_TIME)  # sizes 3, 3, 3, 1
    fitted = alignment.fit_groups(groups, 2, np.array([0.0, 2.0, 1.0, 3.0]))
    kept = sorted(int(e - s) for s, e in zip(fitted.starts, fitted.ends, strict=True))
    assert kept == [1, 3]
    assert len(fitted.leftover_rows) == 6
    covered = set(fitted.order[np.r_[fitted.starts[0] : fitted.ends[0]]].tolist())
    assert covered.isdisjoint(fitted.leftover_rows.tolist())


def test_fit_split_halves_largest_groups_then_idles():
    table = make_table([100] * 4)
    groups = group_buffer(table, 1000, Grouping.MIN_TIME)  # one group of 4
    fitted = alignment.fit_groups(groups, 3, np.zeros(1))
    assert sorted((fitted.ends - fitted.starts).tolist()) == [1, 1, 2]
    assert fitted.num_splits == 2
    fitted = alignment.fit_groups(groups, 6, np.zeros(1))
    assert sorted((fitted.ends - fitted.starts).tolist()) == [0, 0, 1, 1, 1, 1]


def test_paper_split_extracts_singletons_from_the_last_multi_sample_group():
    table = make_table([100, 200, 500, 800])
    groups = group_buffer(table, 1000, Grouping.PAPER)  # [200,100], [500], [800]
    fitted = alignment.fit_groups_paper(groups, 4)
    sizes = (fitted.ends - fitted.starts).tolist()
    assert sizes == [1, 1, 1, 1]
    assert fitted.num_splits == 1


def test_paper_overflow_keeps_the_largest_groups():
    table = make_table([100, 200, 500, 800])
    groups = group_buffer(table, 1000, Grouping.PAPER)
    fitted = alignment.fit_groups_paper(groups, 1)
    assert (fitted.ends - fitted.starts).tolist() == [2]
    assert sorted(table.lengths[fitted.leftover_rows].tolist()) == [500, 800]


def test_concat_ranges_matches_python():
    starts = np.array([5, 0, 3, 9])
    ends = np.array([7, 0, 5, 10])
    expected = [5, 6, 3, 4, 9]
    assert alignment.concat_ranges(starts, ends).tolist() == expected


def test_paper_split_takes_the_longest_sample_and_inserts_it_after_its_group():
    # Issue 14's example, checked against the reference implementation: rank 0 groups as
    # [50, 100, 150], [200] and must split to rank 1's 4 singletons; the reference extracts the
    # *longest* member (150, then 100) and inserts it right after its group, so groups stay short
    # to long and step k pairs rank 0's k-th shortest with rank 1's k-th shortest.
    config = make_config(
        world=2, per_node=1, budget=1000, buffer=4, grouping=Grouping.PAPER, balance=Balance.RANK
    )
    offers = make_offers(config, [[50, 100, 150, 200], [900, 800, 700, 600]])
    plan = plan_round(offers, config, 0)
    assert plan.stats.global_num_tokens.tolist() == [650, 800, 950, 1100]
    assert plan.units[0].num_splits == 2


def test_paper_split_keeps_singletons_right_after_their_group():
    table = make_table([100, 200, 500, 800])
    groups = group_buffer(table, 1000, Grouping.PAPER)  # [200,100], [500], [800]
    fitted = alignment.fit_groups_paper(groups, 4)
    lengths = [
        table.lengths[fitted.order[s:e]].tolist()
        for s, e in zip(fitted.starts, fitted.ends, strict=True)
    ]
    assert lengths == [[100], [200], [500], [800]]


def _piece_lengths(table, fitted):
    return [
        table.lengths[fitted.order[s:e]].tolist()
        for s, e in zip(fitted.starts, fitted.ends, strict=True)
    ]


def test_the_flush_cuts_a_unit_short_of_groups_into_groups_of_least_largest_work():
    # Two nodes of one rank, every unit dry (the flush): unit 1's 16 samples of 250 are four
    # full groups, so T = 4 and unit 0's 12 samples (three full groups) need a fourth. Halving a
    # full group left pieces of 2 beside groups of 4 (a step as long as 4 samples, the other
    # rank running 2); cut into four groups of 3, unit 0's costliest runs 3.
    config = make_config(world=2, per_node=1, budget=1000)
    offers = make_offers(config, [[250] * 12, [250] * 16], dry=True)
    plan = plan_round(offers, config, round_index=0)
    assert plan.num_steps == 4
    assert plan.stats.num_samples[:, 0].tolist() == [3, 3, 3, 3]
    assert sorted(plan.units[0].emitted.views.tolist()) == list(range(12))
    assert len(plan.units[0].leftover) == 0


def test_flush_cuts_keep_the_budget_and_every_sample_and_never_cost_more_than_halving():
    rng = np.random.default_rng(7)
    config = make_config(budget=4096)
    cost = config.cost
    for _ in range(20):
        table = make_table(rng.integers(30, 3000, size=int(rng.integers(20, 120))).tolist())
        groups = group_buffer(table, config.token_budget, Grouping.MIN_TIME)
        slots = len(groups) + int(rng.integers(1, 6))
        lengths = table.lengths[groups.order]
        row_work = cost.work(0.0, lengths.astype(np.float64) ** 2)

        def work(s, e, lengths=lengths, row_work=row_work):
            return cost.a * lengths[s:e].max() * (e - s) + row_work[s:e].sum()

        cuts = alignment.flush_cuts(lengths, row_work, cost.a, config.token_budget, slots)
        assert cuts is not None
        starts, ends, _ = cuts
        assert len(starts) == slots
        rows = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        assert sorted(rows.tolist()) == list(range(len(lengths)))
        busy = [(s, e) for s, e in zip(starts, ends, strict=True) if e > s]
        assert all(lengths[s:e].max() * (e - s) <= config.token_budget for s, e in busy)
        halved = alignment.fit_groups(groups, slots, np.zeros(len(groups)))
        pieces = [(s, e) for s, e in zip(halved.starts, halved.ends, strict=True) if e > s]
        assert max(work(s, e) for s, e in busy) <= max(work(s, e) for s, e in pieces) * 1.001
