"""The benchmark's baseline batchers (tests/bench/training_batchers.py) do what their docstring
says: every sample once, budgets kept, and each one's defining property."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bench import training_batchers as b

pytest.importorskip("transformers")

LENGTHS = np.random.default_rng(0).lognormal(np.log(30), 1.0, size=500).clip(2, 512).astype(int)


def every_sample_once(plan: b.Plan) -> bool:
    ids = [i for batches in plan for batch in batches for i in batch]
    return sorted(ids) == list(range(len(LENGTHS)))


def area(batch: list[int]) -> int:
    return len(batch) * int(LENGTHS[batch].max())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fixed_and_length_grouped_deal_batches_round_robin(world: int) -> None:
    for planner in (b.fixed, b.length_grouped):
        plan = planner(LENGTHS, batch=4, world=world, seed=0)
        assert every_sample_once(plan)
        assert all(len(batch) == 4 for batches in plan for batch in batches[:-1])
        assert max(map(len, plan)) - min(map(len, plan)) <= 1


def test_length_grouped_pads_far_less_than_a_shuffled_sampler() -> None:
    def padding(plan: b.Plan) -> float:
        padded = sum(area(batch) for batches in plan for batch in batches)
        return 1 - LENGTHS.sum() / padded

    grouped = padding(b.length_grouped(LENGTHS, batch=8, world=2, seed=0))
    shuffled = padding(b.fixed(LENGTHS, batch=8, world=2, seed=0))
    assert grouped < 0.5 * shuffled


def test_bucket_edges_split_the_tokens_evenly() -> None:
    edges = b.bucket_edges(LENGTHS, 4)
    assert edges[-1] == LENGTHS.max() and len(edges) == 4
    mass = [LENGTHS[np.searchsorted(edges, LENGTHS) == k].sum() for k in range(4)]
    assert max(mass) < 2 * min(mass)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bucketed_keeps_the_budget_and_syncs_the_bucket_across_ranks(world: int) -> None:
    plan = b.bucketed(LENGTHS, budget=2048, buckets=6, world=world, seed=1)
    assert every_sample_once(plan)
    assert all(area(batch) <= 2048 for batches in plan for batch in batches)
    edges = b.bucket_edges(LENGTHS, 6)
    synced = 0
    for step in range(min(map(len, plan))):
        buckets = {int(np.searchsorted(edges, LENGTHS[batches[step]].max())) for batches in plan}
        synced += len(buckets) == 1
    assert synced >= min(map(len, plan)) - 6  # not only where one of 6 buckets ran dry


@pytest.mark.parametrize("packed", [False, True])
def test_load_balanced_pools_keep_the_budget_per_rank_shard(packed: bool) -> None:
    plan = b.load_balanced(LENGTHS, budget=1024, pool=32, world=2, seed=0, packed=packed)
    assert every_sample_once(plan)
    for batches in plan:
        for batch in batches:
            cost = int(LENGTHS[batch].sum()) if packed else area(batch)
            assert cost <= 1024 or len(batch) == 1
    order = b._permutation(len(LENGTHS), 0)  # each rank trains only its shard
    assert {i for batch in plan[1] for i in batch} == set(order[1::2])


def test_prefer_closest_picks_the_pool_sample_nearest_the_longest() -> None:
    lengths = np.asarray([100, 10, 95, 50, 99])
    pool = [0, 1, 2, 3, 4]
    assert b._pool_batch(pool, lengths, budget=300, packed=False) == [0, 4, 2]
    assert pool == [1, 3]


def test_idle_share_counts_a_joined_rank_as_idle() -> None:
    from tests.bench.training_user_baselines import idle_share

    assert idle_share([[10.0, 10.0]]) == 0.0
    assert idle_share([[10.0, 0.0]]) == 0.5  # one rank already in DDP's Join
    assert idle_share([[4.0, 2.0], [0.0, 0.0]]) == 0.25  # an all-idle step is not a step
