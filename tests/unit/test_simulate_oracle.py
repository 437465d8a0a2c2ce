"""The offline oracle baseline: global sort, min-time groups, groups dealt W per step by cost."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.errors import ConfigError
from odbd.planner.config import CostModel, Grouping, PlannerConfig
from odbd.planner.epoch import simulate
from odbd.planner.grouping import group_buffer
from odbd.planner.sampler import sampler_identities, views_of_ranks
from odbd.planner.types import StepStats
from odbd.simulate.distributions import sample_lengths
from odbd.simulate.oracle import (
    data_local_lower_bound,
    least_group_costs,
    node_local_bound,
    node_oracle_stats,
    oracle_stats,
)
from odbd.simulate.report import summarize
from odbd.world import World
from tests.unit.planner_factories import make_table

LINEAR = CostModel(a=1.0, b=0.0, c=10.0)


def test_hand_example_deals_the_costliest_groups_together() -> None:
    # Sorted: 900, 600, 500, 400, 300, 200, 100, 100. Min-time cut (L=1000): [900] [600]
    # [500, 400] [300, 200, 100] [100], padded 900, 600, 1000, 900, 100. By cost: 1000, 900,
    # 900, 600, 100, dealt two per step.
    lengths = np.array([100, 900, 300, 600, 100, 500, 200, 400])
    stats = oracle_stats(lengths, world_size=2, budget=1000, cost=LINEAR, shuffle=False)
    assert stats.padded_tokens.tolist() == [[1000, 900], [900, 600], [100, 0]]
    assert stats.num_samples.tolist() == [[2, 1], [3, 1], [1, 0]]
    assert stats.real_tokens.tolist() == [[900, 900], [600, 600], [100, 0]]
    assert stats.loss_scale[2].tolist() == [2.0, 0.0]  # exact scaling; the idle rank gets 0
    summary = summarize(stats, LINEAR, 1000, 2)
    assert summary.simulated_time == 3 * 10 + 1000 + 900 + 100


def test_work_uses_the_cost_models_quadratic_term() -> None:
    cost = CostModel(a=1.0, b=0.5, c=0.0)
    stats = oracle_stats(np.array([30, 20]), world_size=1, budget=100, cost=cost, shuffle=False)
    assert stats.work.tolist() == [[60 + 0.5 * (900 + 400)]]


def test_zero_length_samples_are_rejected_and_n_zero_is_empty() -> None:
    stats = oracle_stats(np.array([0, 5, 0, 7]), world_size=2, budget=100, cost=LINEAR)
    assert int(stats.num_samples.sum()) == 2
    empty = oracle_stats(np.zeros(0, np.int64), world_size=4, budget=100, cost=LINEAR)
    assert empty.work.shape == (0, 4)


def test_epochs_concatenate_and_each_covers_every_view() -> None:
    lengths = np.arange(1, 31) * 37
    stats = oracle_stats(lengths, world_size=4, budget=500, cost=LINEAR, epochs=3, seed=2)
    # 30 samples on 4 ranks: 32 views per epoch (DistributedSampler tail padding).
    assert int(stats.num_samples.sum()) == 3 * 32
    assert int(stats.real_tokens.sum()) == sum(
        int(lengths[sampler_identities(30, 4, seed=2, epoch=e)].sum()) for e in range(3)
    )


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3000), min_size=0, max_size=300),
    world_size=st.integers(1, 9),
    budget=st.integers(100, 4000),
)
def test_oracle_keeps_the_budget_covers_every_view_and_sorts_steps_by_cost(
    lengths: list[int], world_size: int, budget: int
) -> None:
    cost = CostModel()
    arr = np.asarray(lengths, dtype=np.int64)
    stats = oracle_stats(arr, world_size=world_size, budget=budget, cost=cost, shuffle=False)
    views = sampler_identities(len(arr), world_size, seed=0, epoch=0, shuffle=False)
    assert int(stats.num_samples.sum()) == len(views)
    assert int(stats.real_tokens.sum()) == int(arr[views].sum())
    # Budget (DESIGN.md 3.5): padded <= L unless the group is one over-long sample.
    n = stats.num_samples
    assert ((stats.padded_tokens <= budget) | (n == 1) | (n == 0)).all()
    # As many groups as the planner's own greedy cut of the whole epoch, in ceil(G / W) steps.
    groups = group_buffer(make_table(arr[views].tolist()), budget, Grouping.MIN_TIME)
    assert int((n > 0).sum()) == len(groups)
    assert stats.work.shape[0] == -(-len(groups) // world_size)
    # Dealt by cost: every group of a step costs at least as much as any of a later step.
    if stats.work.shape[0] > 1:
        real = np.where(n > 0, stats.work, np.inf)
        assert (real.min(axis=1)[:-1] >= stats.work.max(axis=1)[1:]).all()


@pytest.mark.parametrize(("world", "per_node"), [(16, 4), (64, 8)])
def test_oracle_is_at_least_as_good_as_odbd_in_a_small_run(world: int, per_node: int) -> None:
    lengths = sample_lengths("sharegpt4o", 20_000, 0)
    config = PlannerConfig(world=World(world, per_node), token_budget=12288, buffer_size=128)
    ours = summarize(simulate(lengths, config).stats(), config.cost, 12288, world)
    oracle = summarize(
        oracle_stats(lengths, world_size=world, budget=12288, cost=config.cost),
        config.cost,
        12288,
        world,
    )
    assert oracle.efficiency >= ours.efficiency
    assert oracle.imbalance <= 1.05


def test_node_oracle_deals_each_nodes_runs_by_cost_and_covers_every_view() -> None:
    lengths = sample_lengths("sharegpt4o", 3_000, 1)
    stats = node_oracle_stats(lengths, world_size=8, ranks_per_node=4, budget=12288, cost=LINEAR)
    assert stats.work.shape[1] == 8
    assert int(stats.num_samples.sum()) == 3_000  # 3000 views on 8 ranks: no tail padding
    for node in (slice(0, 4), slice(4, 8)):
        work = stats.work[:, node]
        real = np.where(stats.num_samples[:, node] > 0, work, np.inf)
        assert (real.min(axis=1)[:-1] >= work.max(axis=1)[1:]).all()
    # Keeping data on its node can only cost time against the global oracle.
    glob = oracle_stats(lengths, world_size=8, budget=12288, cost=LINEAR)
    assert (
        summarize(stats, LINEAR, 12288, 8).simulated_time
        >= summarize(glob, LINEAR, 12288, 8).simulated_time
    )
    assert np.allclose(stats.loss_scale.sum(axis=1), 8.0)


def test_node_local_bound_is_the_busiest_nodes_work_plus_its_steps() -> None:
    # Node 0 (ranks 0, 1): three groups of work 10, 6, 4; node 1 (ranks 2, 3): one of work 9.
    work = np.array([[10.0, 6.0, 9.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    samples = (work > 0).astype(np.int64)
    zeros = np.zeros_like(samples)
    stats = StepStats(samples, samples, samples, samples, work, np.zeros_like(work))
    bound = node_local_bound(stats, ranks_per_node=2, cost=LINEAR)
    assert (bound.num_steps, bound.busiest_node_work) == (2, 10.0)  # ceil(3/2); (10+6+4)/2
    assert bound.simulated_time == 2 * LINEAR.c + 10.0
    with pytest.raises(ConfigError, match="ranks per node"):
        node_local_bound(StepStats(*(zeros[:, :3],) * 4, work[:, :3], work[:, :3]),
                         ranks_per_node=2, cost=LINEAR)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=200),
    num_nodes=st.integers(1, 3),
    per_node=st.integers(1, 3),
    budget=st.integers(500, 4000),
)
def test_no_data_local_plan_of_the_same_groups_beats_the_bound(
    lengths: list[int], num_nodes: int, per_node: int, budget: int
) -> None:
    """The node-local oracle and odbd both keep data on its node: each runs at least its own
    groups' bound; the oracle's sorted runs reach it when one node is the slowest in every step."""
    arr = np.asarray(lengths, dtype=np.int64)
    world = num_nodes * per_node
    cost = CostModel()
    oracle = node_oracle_stats(arr, world_size=world, ranks_per_node=per_node, budget=budget,
                               cost=cost)  # fmt: skip
    bound = node_local_bound(oracle, ranks_per_node=per_node, cost=cost)
    oracle_time = summarize(oracle, cost, budget, world).simulated_time
    assert oracle_time >= bound.simulated_time * (1 - 1e-12)
    assert oracle.work.shape[0] == bound.num_steps
    config = PlannerConfig(world=World(world, per_node), token_budget=budget, buffer_size=16)
    ours = simulate(arr, config).stats()
    ours_bound = node_local_bound(ours, ranks_per_node=per_node, cost=cost)
    assert summarize(ours, cost, budget, world).simulated_time >= ours_bound.simulated_time * (
        1 - 1e-12
    )
    if num_nodes == 1 and per_node == 1:  # one rank: every plan is its bound
        assert oracle_time == pytest.approx(bound.simulated_time)
    # Whatever the groups: neither data-local plan beats the bound from the lengths alone, and
    # it needs no more steps than either plan ran.
    tight = data_local_lower_bound(arr, world_size=world, ranks_per_node=per_node, budget=budget,
                                   cost=cost)  # fmt: skip
    assert tight.num_steps <= min(bound.num_steps, ours_bound.num_steps)
    assert tight.simulated_time <= oracle_time * (1 + 1e-12)
    assert tight.simulated_time <= summarize(ours, cost, budget, world).simulated_time * (1 + 1e-12)


def test_data_local_lower_bound_counts_each_nodes_fewest_groups_and_least_work() -> None:
    # W = 2, one rank per node, no shuffle: node 0 gets views 0, 2, 4 (lengths 30, 5, 5), node 1
    # views 1, 3, 5 (25, 8, 0; the 0-length sample is rejected). Budget 20: node 0's best is
    # [30] [5, 5] (2 groups, work 40), node 1's [25] [8] (2 groups, work 33): 2 steps.
    lengths = np.array([30, 25, 5, 8, 5, 0])
    bound = data_local_lower_bound(
        lengths, world_size=2, ranks_per_node=1, budget=20, cost=LINEAR, shuffle=False
    )
    assert (bound.num_steps, bound.binding_node) == (2, 0)
    assert bound.simulated_time == 2 * LINEAR.c + 40.0


def test_data_local_lower_bound_prices_the_padding_of_fewer_groups() -> None:
    # One rank, lengths 10 and 6, budget 20, c = 10: one step pads the 6 to 10 (10 + 20 = 30),
    # two steps pad nothing (20 + 16 = 36). c x fewest steps + least work says only 10 + 16;
    # pricing each group at c finds min(20 + 10, 16 + 20) = 30, the true optimum.
    bound = data_local_lower_bound(
        np.array([10, 6]), world_size=1, ranks_per_node=1, budget=20, cost=LINEAR, shuffle=False
    )
    assert (bound.num_steps, bound.simulated_time) == (1, 30.0)
    assert bound.simulated_time == _best_data_local_time([[10, 6]], 1, 20, LINEAR)


def _partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
        yield [[first], *part]


def _budget_partitions(lengths: list[int], budget: int) -> Iterator[list[list[int]]]:
    for part in _partitions(lengths):
        if all(len(g) == 1 or len(g) * max(g) <= budget for g in part):
            yield part


def _group_work(group: list[int], cost: CostModel) -> float:
    return float(cost.work(len(group) * max(group), sum(x * x for x in group)))


def _best_data_local_time(
    nodes: list[list[int]], per_node: int, budget: int, cost: CostModel
) -> float:
    """Brute force: every partition of every node's samples, every placement of the groups on
    steps (at most per_node groups of a node per step); time = sum over steps (c + costliest)."""
    best = np.inf
    for parts in itertools.product(*(list(_budget_partitions(n, budget)) for n in nodes)):
        groups = [(u, _group_work(g, cost)) for u, part in enumerate(parts) for g in part]
        for steps in itertools.product(range(len(groups)), repeat=len(groups)):
            per_step: dict[int, list[tuple[int, float]]] = {}
            for (u, work), step in zip(groups, steps, strict=True):
                per_step.setdefault(step, []).append((u, work))
            if any(
                sum(v == u for v, _ in cell) > per_node
                for cell in per_step.values()
                for u in range(len(nodes))
            ):
                continue
            time = sum(cost.c + max(w for _, w in cell) for cell in per_step.values())
            best = min(best, time)
    return float(best)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=9),
    budget=st.integers(10, 60),
    a=st.sampled_from([0.0, 0.5, 1.0]),
    b=st.sampled_from([0.0, 0.01]),
    prices=st.lists(st.floats(0, 50), min_size=1, max_size=3),
)
def test_least_group_costs_is_the_cheapest_partition_under_the_budget(
    lengths: list[int], budget: int, a: float, b: float, prices: list[float]
) -> None:
    cost = CostModel(a=a, b=b, c=0.0)
    got = least_group_costs(np.sort(lengths)[::-1], budget, cost, np.asarray(prices))
    want = [
        min(
            sum(_group_work(g, cost) + y for g in part)
            for part in _budget_partitions(lengths, budget)
        )
        for y in prices
    ]
    assert got == pytest.approx(want)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=400), budget=st.integers(100, 4000)
)
def test_min_time_greedy_cut_has_the_fewest_groups(lengths: list[int], budget: int) -> None:
    fewest = least_group_costs(np.sort(lengths)[::-1], budget, CostModel(a=0, b=0, c=0), np.ones(1))
    assert int(fewest[0]) == len(group_buffer(make_table(lengths), budget, Grouping.MIN_TIME))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=4),  # <= 4 views: 4^4 placements
    num_nodes=st.integers(1, 2),
    per_node=st.integers(1, 2),
    budget=st.integers(10, 40),
)
def test_no_data_local_plan_beats_the_data_local_lower_bound(
    lengths: list[int], num_nodes: int, per_node: int, budget: int
) -> None:
    world = num_nodes * per_node
    cost = CostModel(a=1.0, b=0.01, c=7.0)
    arr = np.asarray(lengths, dtype=np.int64)
    identities = sampler_identities(len(arr), world, seed=0, epoch=0, shuffle=False)
    nodes = [
        arr[
            identities[views_of_ranks(len(arr), world, range(u * per_node, (u + 1) * per_node))]
        ].tolist()
        for u in range(num_nodes)
    ]
    bound = data_local_lower_bound(arr, world_size=world, ranks_per_node=per_node, budget=budget,
                                   cost=cost, shuffle=False)  # fmt: skip
    assert bound.simulated_time <= _best_data_local_time(nodes, per_node, budget, cost) * (
        1 + 1e-12
    )
