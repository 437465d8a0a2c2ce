"""planner/migration.py: cross-node post-balancing (issue 26, --migrate auto)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odbd.errors import ConfigError
from odbd.planner.config import Balance
from odbd.planner.epoch import simulate
from odbd.planner.migration import HOLD_ROUNDS, LinkModel, plan_migration
from odbd.planner.sampler import num_views
from odbd.planner.types import SampleTable, UnitOffer
from odbd.simulate.report import summarize
from tests.unit.planner_factories import make_config, make_offers

FREE_LINK = LinkModel(bytes_per_s=1e30)


def where(offers: Iterable[UnitOffer]) -> dict[int, tuple[int, int]]:
    """view -> (unit, length) over every offer."""
    return {
        v: (o.unit, int(n))
        for o in offers
        for v, n in zip(o.samples.views.tolist(), o.samples.lengths, strict=True)
    }


def offers_of(per_unit: list[list[int]], dry: bool = False) -> list[UnitOffer]:
    offers, start = [], 0
    for unit, lengths in enumerate(per_unit):
        views = np.arange(start, start + len(lengths))
        start += len(lengths)
        offers.append(UnitOffer(unit, SampleTable.of(views, lengths), dry))
    return offers


def skewed() -> list[list[int]]:
    """Node 0 holds every long sample, node 1 only short ones."""
    return [[3000] * 16 + [100] * 16, [100] * 32]


def test_a_node_holding_every_long_sample_sends_half_of_them() -> None:
    config = make_config(world=4, per_node=2, budget=4000, buffer=16)
    offers = offers_of(skewed())
    plan = plan_migration(offers, config, FREE_LINK)
    assert plan.num_moved > 0
    longs = [int((o.samples.lengths == 3000).sum()) for o in plan.offers]
    assert longs == [8, 8]  # the long level dealt evenly
    lengths = {int(v): n for v, (_, n) in where(offers).items()}
    moved = list(zip(plan.views, plan.sources, plan.targets, strict=True))
    assert {(int(s), int(t)) for v, s, t in moved if lengths[int(v)] == 3000} == {(0, 1)}
    # The short samples only even out the counts.
    assert {(int(s), int(t)) for v, s, t in moved if lengths[int(v)] == 100} <= {(1, 0)}
    # Moved samples are on their new unit, every other sample where it was, none lost or doubled.
    for view, target in zip(plan.views.tolist(), plan.targets.tolist(), strict=True):
        assert view in plan.offers[target].samples.views.tolist()
    before = sorted(v for o in offers for v in o.samples.views.tolist())
    after = sorted(v for o in plan.offers for v in o.samples.views.tolist())
    assert before == after
    assert plan.bytes_moved == sum(4 * lengths[int(v)] for v, _, _ in moved)
    assert plan.bytes_offered == sum(int(o.samples.lengths.sum()) * 4 for o in offers)
    assert plan.gain_s > plan.move_s >= 0


def test_nothing_moves_when_the_link_costs_more_than_the_gain() -> None:
    config = make_config(world=4, per_node=2, budget=4000, buffer=16)
    slow = LinkModel(bytes_per_s=1.0)  # a byte per second: no balancing pays
    plan = plan_migration(offers_of(skewed()), config, slow)
    assert plan.num_moved == 0 and plan.bins == 0


def test_nothing_moves_within_one_node_or_with_balance_rank() -> None:
    one_node = make_config(world=2, per_node=2, budget=4000, buffer=16)
    assert plan_migration(offers_of([[3000] * 4 + [10] * 4]), one_node, FREE_LINK).num_moved == 0
    rank = make_config(world=2, per_node=1, budget=4000, buffer=16, balance=Balance.RANK)
    assert plan_migration(offers_of(skewed()), rank, FREE_LINK).num_moved == 0


def test_the_payload_sizes_given_are_the_bytes_moved() -> None:
    config = make_config(world=4, per_node=2, budget=4000, buffer=16)
    offers = offers_of(skewed())
    sizes = [np.full(len(o.samples), 1000 + o.unit, dtype=np.int64) for o in offers]
    plan = plan_migration(offers, config, FREE_LINK, sizes)
    assert plan.num_moved > 0
    assert plan.bytes_moved == sum(1000 + int(u) for u in plan.sources)
    with pytest.raises(Exception, match="sizes"):
        plan_migration(offers, config, FREE_LINK, [s[:-1] for s in sizes])


def test_a_link_of_zero_bytes_per_second_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="--link-gbps"):
        LinkModel(bytes_per_s=0)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(2, 5),
    st.data(),
)
def test_moves_conserve_samples_and_balance_each_level(nodes: int, data: st.DataObject) -> None:
    per_unit = [
        data.draw(st.lists(st.integers(1, 9000), max_size=40), label=f"unit {u}")
        for u in range(nodes)
    ]
    config = make_config(world=2 * nodes, per_node=2, budget=4000, buffer=20)
    offers = offers_of(per_unit)
    plan = plan_migration(offers, config, FREE_LINK)
    before, after = where(offers), where(plan.offers)
    waiting = where(UnitOffer(u, t, False) for u, t in enumerate(plan.held))
    # No loss, no duplication: every sample is offered once or waits once, on one unit.
    assert sorted(before) == sorted([*after, *waiting])
    assert sum(len(o.samples) for o in plan.offers) + len(waiting) == len(before)
    # Only groups of one wait (samples over L/2), and only in a round with a giant (over L).
    giant = any(length > config.token_budget for _, length in before.values())
    assert giant or not waiting
    for view, (unit, length) in waiting.items():
        assert before[view] == (unit, length) and length > config.token_budget // 2  # not moved
        assert view not in plan.views.tolist()
    moved = dict(zip(plan.views.tolist(), plan.targets.tolist(), strict=True))
    for view, (unit, length) in after.items():
        assert length == before[view][1]
        assert unit == moved.get(view, before[view][0])  # moved: on its target; else unchanged
    for view, source in zip(plan.views.tolist(), plan.sources.tolist(), strict=True):
        assert before[view][0] == source != moved[view]
    # Deterministic: every daemon computes the same moves.
    again = plan_migration(offers, config, FREE_LINK)
    assert np.array_equal(again.views, plan.views) and np.array_equal(again.targets, plan.targets)


def test_simulate_with_migration_beats_data_local_on_a_skewed_dataset() -> None:
    # Node 0's views hold every long sample (DistributedSampler without shuffle deals view i to
    # rank i % W, ranks 0-1 are node 0): kept local, node 0 sets every round's length.
    world = 4
    lengths = np.array([3000 if i % world < 2 else 100 for i in range(4000)], dtype=np.int64)
    config = make_config(world=world, per_node=2, budget=4000, buffer=64)
    off = simulate(lengths, config, shuffle=False)
    on = simulate(lengths, config, shuffle=False, migration=FREE_LINK)
    eff_off = summarize(off.stats(), config.cost, config.token_budget, world).efficiency
    eff_on = summarize(on.stats(), config.cost, config.token_budget, world).efficiency
    assert eff_on > eff_off * 1.2
    assert on.moved_samples.sum() > 0 and on.moved_bytes.sum() > 0
    assert len(on.moved_bytes) == len(on.rounds) == len(on.ingested_bytes)
    assert on.ingested_bytes.sum() == lengths.sum() * 4
    assert off.moved_bytes.size == 0
    # Every view of the epoch emitted exactly once, moved or not.
    emitted = np.concatenate([u.emitted.views for r in on.rounds for u in r.units])
    assert sorted(emitted.tolist()) == list(range(len(lengths)))


def test_samples_over_the_budget_of_mixed_cost_wait_for_company_and_run_by_the_flush() -> None:
    # 2 nodes x 2 ranks: a step runs 4 groups of one. Four giants of very different cost wait
    # (their block spreads far beyond HOLD_SPREAD); four equal ones run at once.
    config = make_config(world=4, per_node=2, budget=1000, buffer=16)
    spread = [[5000, 3000, 100, 100], [2000, 1200, 100, 100]]
    plan = plan_migration(offers_of(spread), config, FREE_LINK)
    assert sum(len(t) for t in plan.held) > 0
    assert all((t.ages == 1).all() for t in plan.held)  # one recirculation older
    equal = [[4000, 4000, 100, 100], [4000, 4000, 100, 100]]
    assert sum(len(t) for t in plan_migration(offers_of(equal), config, FREE_LINK).held) == 0
    # Every unit dry: the epoch flushes, nothing may wait.
    flush = plan_migration(offers_of(spread, dry=True), config, FREE_LINK)
    assert sum(len(t) for t in flush.held) == 0


def test_in_a_round_with_a_giant_groups_of_one_within_the_budget_wait_for_company_too() -> None:
    # 2 nodes x 2 ranks, budget 1000: four equal giants run as one block; the four groups of
    # one within the budget (over L/2) spread 900 vs 520, so the costliest waits, and the last
    # partial block (700, 600, 520) waits too since a whole block ran beside it. Without a giant
    # in the round nothing waits, however wide the spread.
    config = make_config(world=4, per_node=2, budget=1000, buffer=16)
    with_giant = [[4000, 4000, 900, 700, 100], [4000, 4000, 600, 520, 100]]
    plan = plan_migration(offers_of(with_giant), config, FREE_LINK)
    waiting = sorted(int(n) for t in plan.held for n in t.lengths)
    assert waiting == [520, 600, 700, 900]
    without = [[900, 700, 100], [600, 520, 100]]
    assert sum(len(t) for t in plan_migration(offers_of(without), config, FREE_LINK).held) == 0


def test_a_last_partial_block_of_groups_of_one_waits_only_beside_a_whole_block() -> None:
    # 2 nodes x 2 ranks (W = 4), budget 1000. Four giants of equal cost run as a block, so the
    # three left (900, 700, 600; fewer than W) wait for next round's company. With no whole
    # block in the round, the same partial block runs: a round never holds all it was offered.
    config = make_config(world=4, per_node=2, budget=1000, buffer=16)
    beside = [[4000, 4000, 900, 700, 100], [4000, 4000, 600, 100]]
    plan = plan_migration(offers_of(beside), config, FREE_LINK)
    assert sorted(int(n) for t in plan.held for n in t.lengths) == [600, 700, 900]
    alone = [[4000, 900, 100], [600, 100]]
    assert sum(len(t) for t in plan_migration(offers_of(alone), config, FREE_LINK).held) == 0
    # Aged HOLD_ROUNDS, the partial block runs beside a whole block too.
    old = offers_of(beside)
    for _ in range(HOLD_ROUNDS):
        old = [UnitOffer(o.unit, o.samples.aged(), o.dry) for o in old]
    aged = plan_migration(old, config, FREE_LINK)
    assert sum(len(t) for t in aged.held) == 0


def test_a_group_of_one_aged_out_of_waiting_runs_with_its_block() -> None:
    # W = 4, budget 1000, groups of one 4000 (waited HOLD_ROUNDS), 3000, 2900, 2800, 2700. The
    # aged one takes its block (4000-2800) along, so step 1 cuts whole blocks below it; the
    # last partial block (2700) waits beside it. Run alone, it left the block 3000-2700 to
    # spread 10 %: 3000 waited and 2900, 2800, 2700 ran as a ragged partial block.
    config = make_config(world=4, per_node=2, budget=1000, buffer=16)
    offers = offers_of([[4000, 2900, 2700, 100], [3000, 2800, 100]])
    t = offers[0].samples
    ages = np.zeros(len(t), dtype=np.int64)
    ages[0] = HOLD_ROUNDS
    offers[0] = UnitOffer(0, SampleTable(t.views, t.lengths, t.tokens, ages, t.patches), False)
    plan = plan_migration(offers, config, FREE_LINK)
    assert sorted(int(n) for t in plan.held for n in t.lengths) == [2700]


def test_waiting_partial_blocks_keep_the_round_bound() -> None:
    # DESIGN.md section 3.3 (test_planner_properties's envelope: ceil(views per node / rate) +
    # 2 x buffer + 2 rounds): 24 ranks in 12 nodes of buffer 1, 4 groups of one among 153
    # samples, so never a whole block of W = 24. A partial block held unconditionally waited
    # round after round while a node's one-sample buffer held nothing else: 13 rounds here.
    config = make_config(world=24, per_node=2, budget=1000, buffer=1, seed=0)
    rng = np.random.default_rng(0)
    lengths = np.concatenate([[1500, 1500, 1500, 700], rng.integers(1, 120, 149)])
    result = simulate(lengths.astype(np.int64), config, migration=FREE_LINK)
    per_node = num_views(len(lengths), 24) // config.num_units
    assert len(result.rounds) <= math.ceil(per_node / config.ranks_per_unit) + 2 * 1 + 2


def test_a_heavy_tail_reaches_the_global_oracle_only_with_migration() -> None:
    # The bench's heavy tail (Pareto 1.3 from 200 tokens, to 2.7 L), 40,000 samples, 2 nodes x 8:
    # kept on their nodes 0.955x the offline oracle when measured, moved 0.992x.
    from odbd.planner.config import PlannerConfig
    from odbd.simulate.oracle import oracle_stats
    from odbd.world import World

    rng = np.random.default_rng(0)
    budget = 12288
    lengths = np.clip(np.rint(200 * (1 + rng.pareto(1.3, 40_000))), 16, int(2.7 * budget))
    lengths = lengths.astype(np.int64)
    config = PlannerConfig(world=World(16, 8), token_budget=budget, buffer_size=1024)

    def efficiency(stats) -> float:
        return summarize(stats, config.cost, budget, 16).efficiency

    oracle = efficiency(oracle_stats(lengths, world_size=16, budget=budget, cost=config.cost))
    off = efficiency(simulate(lengths, config).stats()) / oracle
    on = efficiency(simulate(lengths, config, migration=LinkModel()).stats()) / oracle
    assert off < 0.97
    assert on >= 0.99


def test_the_flush_moves_cheap_samples_until_every_node_holds_the_same_work():
    # Every unit dry: all a node holds runs in the flush's T steps, so its total work, not
    # only its share of each cost level, sets them. Balancing the levels' counts left these
    # four nodes 5.9 % apart; moving the cheapest samples from nodes over the mean to nodes
    # under it brings them within 0.2 %.
    config = make_config(world=8, per_node=2, budget=4096)
    rng = np.random.default_rng(0)
    per = [rng.integers(20, 1500, size=int(rng.integers(150, 250))).tolist() for _ in range(4)]
    offers = make_offers(config, per, dry=True)
    plan = plan_migration(offers, config, LinkModel())

    def work(o):
        n = o.samples.lengths.astype(np.float64)
        return float(config.cost.work(n, n**2, 0).sum())

    totals = np.asarray([work(o) for o in plan.offers])
    assert (totals.max() - totals.min()) / totals.mean() < 0.01
    views = np.sort(np.concatenate([o.samples.views for o in plan.offers]))
    assert views.tolist() == list(range(sum(len(p) for p in per)))
