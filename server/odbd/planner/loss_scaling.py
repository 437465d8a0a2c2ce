"""Per (step, rank) loss scales (DESIGN.md section 3.4, paper App. B).

DDP averages gradients over W ranks, so a rank that pre-multiplies its mean loss by
loss_scale_r = W * w_r makes the step's gradient sum_r w_r * mean_r. Exact token-level weighting
w_r = t_r / sum_r t_r turns that into the per-token mean over the whole step.
"""

from __future__ import annotations

import numpy as np

from odbd.planner.config import LossScaling
from odbd.planner.types import FloatArray, IntArray


def loss_scales(
    mode: LossScaling,
    num_samples: IntArray,
    num_tokens: IntArray,
    tokens_per_sample_estimate: FloatArray,
    window_of_step: IntArray | None = None,
    *,
    step_totals: FloatArray | None = None,
    world: int | None = None,
) -> FloatArray:
    """(steps, ranks) loss scales; idle fillers (no samples) always get 0.

    `tokens_per_sample_estimate` is (ranks,): each rank's unit's pre-alignment mean loss tokens
    per sample, used only by `approx` (the paper's estimate without a second exchange).
    `window_of_step` (steps,) groups steps into optimizer updates (planner/windows.py): the
    weights are then normalised over the whole update, so the sum over its micro-steps of
    loss_scale * mean loss, averaged by DDP, is the per-token mean over the update. None: every
    step is its own update.

    The arrays cover every rank unless `step_totals` (steps,) gives the sum of step_weights over
    every rank of the world of `world` ranks: then they may be one node's ranks only (the split
    planner, where each daemon scales its own ranks with the totals every node sent).
    """
    if mode is LossScaling.NONE:
        return (num_samples > 0).astype(np.float64)
    weights = step_weights(mode, num_samples, num_tokens, tokens_per_sample_estimate)
    if step_totals is None:
        step_totals = weights.sum(axis=1)
        world = num_samples.shape[1] if num_samples.ndim == 2 else 0
    assert world is not None, "loss_scales: step_totals come with the world size"
    return _normalize(weights, step_totals, world, window_of_step)


def step_weights(
    mode: LossScaling,
    num_samples: IntArray,
    num_tokens: IntArray,
    tokens_per_sample_estimate: FloatArray,
) -> FloatArray:
    """(steps, ranks) each rank's weight w_r before normalisation (1 per sample with `none`)."""
    if mode is LossScaling.EXACT:
        return num_tokens.astype(np.float64)
    if mode is LossScaling.APPROX:
        return num_samples * tokens_per_sample_estimate[None, :]
    return num_samples.astype(np.float64)


def _normalize(
    weights: FloatArray, step_totals: FloatArray, world: int, window_of_step: IntArray | None
) -> FloatArray:
    totals = np.asarray(step_totals, dtype=np.float64)[:, None]
    if window_of_step is not None and totals.size:
        per_window = np.bincount(window_of_step, weights=totals[:, 0])
        totals = per_window[window_of_step][:, None]
    safe = np.where(totals > 0, totals, 1.0)
    return np.where(totals > 0, world * weights / safe, 0.0)
