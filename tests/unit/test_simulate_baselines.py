"""Fixed-batch baseline: DistributedSampler (drop_last=False) views, bs at a time, padded."""

from __future__ import annotations

import numpy as np
import pytest

from odbd.errors import ConfigError
from odbd.planner.config import CostModel
from odbd.planner.sampler import sampler_identities
from odbd.simulate.baselines import fixed_batch_stats

COST = CostModel(a=1.0, b=0.5, c=10.0)


def test_hand_example_without_shuffle() -> None:
    # N=5, W=2: views 0..5 = ids 0,1,2,3,4,0 (tail padding); rank 0 reads 0,2,4; rank 1 reads 1,3,0.
    lengths = np.array([10, 20, 30, 40, 50])
    stats = fixed_batch_stats(lengths, world_size=2, batch_size=2, cost=COST, shuffle=False)
    assert stats.num_samples.tolist() == [[2, 2], [1, 1]]
    assert stats.real_tokens.tolist() == [[40, 60], [50, 10]]
    assert stats.padded_tokens.tolist() == [[60, 80], [50, 10]]
    assert stats.work.tolist() == [
        [60 + 0.5 * (100 + 900), 80 + 0.5 * (400 + 1600)],
        [50 + 0.5 * 2500, 10 + 0.5 * 100],
    ]
    assert stats.loss_scale.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert stats.num_tokens.tolist() == stats.real_tokens.tolist()


@pytest.mark.parametrize("num_samples", [0, 1, 7, 16, 33, 100])
@pytest.mark.parametrize("world_size", [1, 4, 16])
@pytest.mark.parametrize("batch_size", [1, 3, 4])
def test_every_rank_runs_the_same_steps_over_its_sampler_views(
    num_samples: int, world_size: int, batch_size: int
) -> None:
    lengths = np.arange(1, num_samples + 1, dtype=np.int64) * 7
    stats = fixed_batch_stats(
        lengths, world_size=world_size, batch_size=batch_size, cost=COST, seed=5
    )
    per_rank = -(-num_samples // world_size)
    assert stats.num_samples.shape == (-(-per_rank // batch_size), world_size)
    assert (stats.num_samples.sum(axis=0) == per_rank).all()
    ids = sampler_identities(num_samples, world_size, seed=5, epoch=0)
    assert stats.real_tokens.sum() == lengths[ids].sum()
    # Only the last batch of a rank may be short.
    assert (stats.num_samples[:-1] == batch_size).all()


def test_rank_batches_are_consecutive_views_of_its_shard() -> None:
    lengths = np.random.default_rng(0).integers(1, 1000, size=50)
    stats = fixed_batch_stats(lengths, world_size=4, batch_size=3, cost=COST, seed=1)
    ids = sampler_identities(50, 4, seed=1, epoch=0)
    for rank in range(4):
        shard = lengths[ids[rank::4]]
        for step in range(stats.num_samples.shape[0]):
            batch = shard[3 * step : 3 * step + 3]
            assert stats.real_tokens[step, rank] == batch.sum()
            assert stats.padded_tokens[step, rank] == batch.max() * len(batch)


def test_zero_length_samples_count_as_samples() -> None:
    stats = fixed_batch_stats(np.array([0, 0, 5]), world_size=1, batch_size=2, cost=COST)
    assert stats.num_samples.sum() == 3 and stats.real_tokens.sum() == 5


def test_epochs_reshuffle_and_concatenate() -> None:
    lengths = np.random.default_rng(0).integers(1, 1000, size=40)
    two = fixed_batch_stats(lengths, world_size=4, batch_size=2, cost=COST, seed=2, epochs=2)
    one = fixed_batch_stats(lengths, world_size=4, batch_size=2, cost=COST, seed=2)
    assert two.num_samples.shape == (10, 4)
    assert np.array_equal(two.padded_tokens[:5], one.padded_tokens)
    assert not np.array_equal(two.padded_tokens[5:], one.padded_tokens)


def test_custom_loss_tokens() -> None:
    stats = fixed_batch_stats(
        np.array([10, 20]), world_size=1, batch_size=2, cost=COST, tokens=np.array([3, 4])
    )
    assert stats.num_tokens.tolist() == [[7]]


def test_batch_size_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="--compare-batch-sizes"):
        fixed_batch_stats(np.array([1]), world_size=1, batch_size=0, cost=COST)
