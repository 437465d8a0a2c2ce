"""sampler_identities must equal torch's DistributedSampler bit for bit, for every rank."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler

from odbd.errors import ConfigError
from odbd.planner.sampler import num_views, sampler_identities, views_of_ranks
from odbd.world import World

SIZES = [0, 1, 2, 3, 7, 10, 100, 1001]
WORLDS = [1, 2, 3, 8, 16, 64]
SEEDS_EPOCHS = [(0, 0), (0, 3), (1234, 1), (-5, 2)]


def torch_rank_sequences(
    num_samples: int, world_size: int, *, seed: int, epoch: int, shuffle: bool
) -> list[list[int]]:
    """What each rank's DistributedSampler yields (the reference)."""
    sequences = []
    for rank in range(world_size):
        sampler: DistributedSampler[int] = DistributedSampler(
            range(num_samples),  # type: ignore[arg-type]  # any sized object is a dataset here
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=False,
        )
        sampler.set_epoch(epoch)
        sequences.append(list(sampler))
    return sequences


def assert_matches_torch(
    num_samples: int, world_size: int, *, seed: int, epoch: int, shuffle: bool
) -> None:
    ours = sampler_identities(num_samples, world_size, seed=seed, epoch=epoch, shuffle=shuffle)
    assert ours.dtype == np.int64
    assert ours.shape == (num_views(num_samples, world_size),)
    expected = torch_rank_sequences(
        num_samples, world_size, seed=seed, epoch=epoch, shuffle=shuffle
    )
    for rank, sequence in enumerate(expected):
        assert ours[rank::world_size].tolist() == sequence, f"rank {rank} differs"


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("seed", "epoch"), SEEDS_EPOCHS)
@pytest.mark.parametrize(("num_samples", "world_size"), list(itertools.product(SIZES, WORLDS)))
def test_identities_equal_distributed_sampler(
    num_samples: int, world_size: int, seed: int, epoch: int, shuffle: bool
) -> None:
    assert_matches_torch(num_samples, world_size, seed=seed, epoch=epoch, shuffle=shuffle)


@settings(max_examples=60, deadline=None)
@given(
    num_samples=st.integers(0, 300),
    world_size=st.integers(1, 70),
    seed=st.integers(-(2**40), 2**40),
    epoch=st.integers(0, 1000),
    shuffle=st.booleans(),
)
def test_identities_equal_distributed_sampler_property(
    num_samples: int, world_size: int, seed: int, epoch: int, shuffle: bool
) -> None:
    assert_matches_torch(num_samples, world_size, seed=seed, epoch=epoch, shuffle=shuffle)


@pytest.mark.parametrize(("num_samples", "world_size"), [(0, 1), (0, 8), (5, 1), (7, 3), (2, 64)])
def test_num_views_pads_to_a_multiple_of_world(num_samples: int, world_size: int) -> None:
    m = num_views(num_samples, world_size)
    assert m % world_size == 0
    assert num_samples <= m < num_samples + world_size


def test_empty_dataset_has_no_views() -> None:
    assert num_views(0, 4) == 0
    assert sampler_identities(0, 4, seed=0, epoch=0).shape == (0,)
    assert views_of_ranks(0, 4, range(0, 2)).shape == (0,)


def test_every_identity_appears_and_padding_repeats_the_order_cyclically() -> None:
    ids = sampler_identities(3, 8, seed=7, epoch=1)  # padding 5 > N: torch repeats the list
    assert sorted(set(ids.tolist())) == [0, 1, 2]
    assert ids.tolist() == [ids[i % 3] for i in range(8)]


def test_epochs_reshuffle_and_seeds_are_deterministic() -> None:
    a = sampler_identities(100, 4, seed=1, epoch=0)
    assert np.array_equal(a, sampler_identities(100, 4, seed=1, epoch=0))
    assert not np.array_equal(a, sampler_identities(100, 4, seed=1, epoch=1))
    # DistributedSampler seeds with seed + epoch, so (seed, epoch) pairs with one sum coincide.
    assert np.array_equal(
        sampler_identities(100, 4, seed=0, epoch=2), sampler_identities(100, 4, seed=2, epoch=0)
    )


@pytest.mark.parametrize(("world_size", "ranks_per_node"), [(1, 1), (8, 4), (6, 3), (16, 8)])
@pytest.mark.parametrize("num_samples", [0, 1, 5, 37, 100])
def test_views_of_node_ranks_are_their_sorted_views(
    num_samples: int, world_size: int, ranks_per_node: int
) -> None:
    world = World(world_size=world_size, ranks_per_node=ranks_per_node)
    all_views = np.arange(num_views(num_samples, world_size))
    seen = []
    for node in range(world.num_nodes):
        ranks = world.ranks_of(node)
        views = views_of_ranks(num_samples, world_size, ranks)
        expected = all_views[np.isin(all_views % world_size, list(ranks))]
        assert np.array_equal(views, expected)  # sorted == interleaved by position
        seen.append(views)
    merged = np.sort(np.concatenate(seen)) if seen else all_views
    assert np.array_equal(merged, all_views)  # nodes partition the views


def test_views_of_ranks_interleaves_positions_in_ranks_order() -> None:
    # rank 2's first view is 2, rank 0's is 0; then position 1: 2 + 4, 0 + 4; then position 2
    assert views_of_ranks(10, 4, range(2, -1, -2)).tolist() == [2, 0, 6, 4, 10, 8]


def test_views_of_ranks_follow_each_rank_sampler_order() -> None:
    ids = sampler_identities(37, 8, seed=3, epoch=2)
    torch_seqs = torch_rank_sequences(37, 8, seed=3, epoch=2, shuffle=True)
    views = views_of_ranks(37, 8, range(4, 8)).reshape(-1, 4)  # (position, rank)
    for column, rank in enumerate(range(4, 8)):
        assert ids[views[:, column]].tolist() == torch_seqs[rank]


@pytest.mark.parametrize(
    ("num_samples", "world_size", "fragment"),
    [(-1, 4, "dataset size must be >= 0"), (10, 0, "world size must be >= 1"), (3, -2, "--world")],
)
def test_invalid_sizes_raise_config_error(num_samples: int, world_size: int, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        sampler_identities(num_samples, world_size, seed=0, epoch=0)
    with pytest.raises(ConfigError, match=fragment):
        num_views(num_samples, world_size)
    with pytest.raises(ConfigError, match=fragment):
        views_of_ranks(num_samples, world_size, range(0))


def test_ranks_outside_world_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"not all in \[0, 4\)"):
        views_of_ranks(10, 4, range(2, 6))


def test_seed_outside_torch_range_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="smaller --seed"):
        sampler_identities(10, 2, seed=2**64, epoch=0)
