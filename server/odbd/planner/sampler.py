"""DistributedSampler views as numpy arrays (glossary: DESIGN.md section 7, "view").

A *view* is one position of the global sampler order of an epoch. torch's
`DistributedSampler(N, num_replicas=W, rank=r, shuffle, seed, drop_last=False)` with
`set_epoch(epoch)` builds one list of M = W * ceil(N / W) dataset identities (a permutation of
range(N), cyclically repeated to pad the tail) and gives rank r the positions r, r + W, r + 2W, ...
We number those positions 0..M-1: view v is read by rank v % W at its position v // W. Keeping
the exact torch order means a job moved onto odbd sees the same identities per rank and epoch.
"""

from __future__ import annotations

import numpy as np
import torch

from odbd.errors import ConfigError

IntArray = np.ndarray  # int64, 1-D

# torch.Generator.manual_seed accepts exactly this range (negatives are remapped to uint64).
_MIN_TORCH_SEED = -(2**63)
_MAX_TORCH_SEED = 2**64 - 1


def _validate(num_samples: int, world_size: int) -> None:
    if num_samples < 0:
        raise ConfigError(
            f"dataset size must be >= 0, got {num_samples}; pass the number of samples in the "
            "dataset (--dataset-size N)"
        )
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}; pass --world W")


def num_views(num_samples: int, world_size: int) -> int:
    """M = W * ceil(N / W): the views of one epoch, DistributedSampler tail padding included."""
    _validate(num_samples, world_size)
    return world_size * -(-num_samples // world_size)


def sampler_identities(
    num_samples: int, world_size: int, *, seed: int, epoch: int, shuffle: bool = True
) -> IntArray:
    """(M,) int64, M = W * ceil(N / W): view v -> dataset identity. Rank r's DistributedSampler
    sequence is exactly sampler_identities(...)[r::W] (global view ids r, r+W, r+2W, ...).

    N = 0 gives an empty array (torch's sampler yields nothing on every rank, too).
    """
    total = num_views(num_samples, world_size)
    if num_samples == 0:
        return np.zeros(0, dtype=np.int64)
    if shuffle:
        order = _torch_permutation(num_samples, seed + epoch)
    else:
        order = np.arange(num_samples, dtype=np.int64)
    # torch pads with `indices[:pad]`, or with the list repeated when pad > N (N < W - 1): both
    # are the cyclic continuation of the list, i.e. position i holds order[i % N].
    if total == num_samples:
        return order
    return order[np.arange(total, dtype=np.int64) % num_samples]


def _torch_permutation(num_samples: int, generator_seed: int) -> IntArray:
    """torch.randperm as DistributedSampler.__iter__ draws it, so orders match bit for bit."""
    if not _MIN_TORCH_SEED <= generator_seed <= _MAX_TORCH_SEED:
        raise ConfigError(
            f"seed + epoch = {generator_seed} is outside the range torch generators accept "
            f"[{_MIN_TORCH_SEED}, {_MAX_TORCH_SEED}]; pass a smaller --seed"
        )
    generator = torch.Generator()
    generator.manual_seed(generator_seed)
    return torch.randperm(num_samples, generator=generator).numpy().astype(np.int64, copy=False)


def views_of_ranks(num_samples: int, world_size: int, ranks: range) -> IntArray:
    """Global view ids fed to these ranks, in the order their samplers yield them, interleaved by
    position: position 0 of every rank in `ranks`, then position 1, ... (so a node's pooled
    pending queue is simply sorted view ids of its ranks).

    Shape (len(ranks) * M / W,) int64; ranks appear within a position in `ranks` order.
    """
    total = num_views(num_samples, world_size)
    rank_ids = np.asarray(ranks, dtype=np.int64)
    if rank_ids.size and (rank_ids.min() < 0 or rank_ids.max() >= world_size):
        raise ConfigError(
            f"ranks {ranks} are not all in [0, {world_size}); a node's ranks must be global "
            "trainer ranks of this world (World.ranks_of(node))"
        )
    positions = np.arange(total // world_size, dtype=np.int64) * world_size
    return (positions[:, None] + rank_ids[None, :]).reshape(-1)
