"""The fixed-batch baseline: torch DistributedSampler (drop_last=False) + a batch size bs.

Every rank reads its ceil(N / W) sampler views in order, bs at a time, and pads each batch to its
longest sample. All ranks therefore run ceil(ceil(N / W) / bs) steps per epoch and only the last
batch may be short. The result is the planner's own StepStats, so one report serves both.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from odbd.errors import ConfigError
from odbd.planner.config import CostModel
from odbd.planner.sampler import sampler_identities
from odbd.planner.types import StepStats


def fixed_batch_stats(
    lengths: np.ndarray,
    *,
    world_size: int,
    batch_size: int,
    cost: CostModel,
    seed: int = 0,
    epochs: int = 1,
    shuffle: bool = True,
    tokens: np.ndarray | None = None,
) -> StepStats:
    """StepStats of shape (epochs * steps_per_epoch, W) for fixed batch size `batch_size`.

    `tokens` are the loss-bearing tokens per sample (default: the lengths). 0-length samples
    simply count as samples here; loss_scale is 1.0 everywhere (plain DDP averaging).
    """
    if batch_size < 1:
        raise ConfigError(
            f"fixed batch size must be >= 1, got {batch_size}; pass positive integers to "
            "--compare-batch-sizes"
        )
    lengths = np.asarray(lengths, dtype=np.int64)
    tokens = lengths if tokens is None else np.asarray(tokens, dtype=np.int64)
    epoch_stats = [
        _epoch_stats(
            sampler_identities(len(lengths), world_size, seed=seed, epoch=e, shuffle=shuffle),
            lengths,
            tokens,
            world_size=world_size,
            batch_size=batch_size,
            cost=cost,
        )
        for e in range(epochs)
    ]
    if not epoch_stats:
        return _epoch_stats(
            np.zeros(0, np.int64), lengths, tokens, world_size=world_size, batch_size=1, cost=cost
        )
    return concat_stats(epoch_stats)


def concat_stats(parts: list[StepStats]) -> StepStats:
    """Steps of several StepStats one after the other (all with the same world size)."""
    return StepStats(
        **{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(StepStats)}
    )


def _epoch_stats(
    identities: np.ndarray,
    lengths: np.ndarray,
    tokens: np.ndarray,
    *,
    world_size: int,
    batch_size: int,
    cost: CostModel,
) -> StepStats:
    """One epoch. identities: (M,) view -> dataset id; view v is rank v % W's position v // W."""
    per_rank = identities.shape[0] // world_size
    num_steps = -(-per_rank // batch_size)
    slots = num_steps * batch_size
    # (slots, W): position p of rank r; positions past the rank's quota are absent (-1).
    grid = np.full((slots, world_size), -1, dtype=np.int64)
    grid[:per_rank] = identities.reshape(per_rank, world_size)
    grid = grid.reshape(num_steps, batch_size, world_size)
    present = grid >= 0
    safe = np.where(present, grid, 0)
    batch_lengths = np.where(present, lengths[safe] if len(lengths) else 0, 0)
    batch_tokens = np.where(present, tokens[safe] if len(tokens) else 0, 0)

    num_samples = present.sum(axis=1)
    real = batch_lengths.sum(axis=1)
    padded = num_samples * batch_lengths.max(axis=1, initial=0)
    squares = (batch_lengths.astype(np.float64) ** 2).sum(axis=1)
    return StepStats(
        num_samples=num_samples.astype(np.int64),
        num_tokens=batch_tokens.sum(axis=1).astype(np.int64),
        real_tokens=real.astype(np.int64),
        padded_tokens=padded.astype(np.int64),
        work=cost.a * padded + cost.b * squares,
        loss_scale=np.ones((num_steps, world_size), dtype=np.float64),
    )
