"""cost_fit.py: the learned cost model recovers known coefficients, is order-free, falls back."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.errors import ConfigError
from odbd.planner.config import CostModel
from odbd.planner.cost_fit import FitConfig, FitState, fit_cost_model

FIXED = CostModel()
TRUE = (2e-6, 4e-9, 3e-3)  # seconds per padded token, per l^2, per step


def make_observations(
    n: int, *, seed: int = 0, noise: float = 0.03, outliers: float = 0.0, coef=TRUE
) -> np.ndarray:
    """Rank-steps of budget-4096 groups over long-tailed lengths: [padded, sum_sq, seconds]."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        longest = int(np.clip(np.exp(rng.normal(np.log(300), 0.9)), 8, 4096))
        count = int(rng.integers(1, max(4096 // longest, 1) + 1))
        lengths = np.minimum(rng.integers(longest // 2, longest + 1, size=count), longest)
        lengths[0] = longest
        padded, sum_sq = longest * count, float((lengths.astype(np.float64) ** 2).sum())
        y = coef[0] * padded + coef[1] * sum_sq + coef[2]
        y *= 1 + noise * rng.normal()
        if rng.random() < outliers:
            y *= rng.uniform(3, 10)  # a step slowed by something else (checkpoint, neighbour)
        rows.append([padded, sum_sq, y])
    return np.asarray(rows, dtype=np.float64)


def test_recovers_known_coefficients_from_noisy_data_with_outliers() -> None:
    obs = make_observations(512, noise=0.03, outliers=0.1)
    fit = fit_cost_model(obs, FIXED, FitConfig())
    assert fit.state is FitState.FITTED
    for got, want in zip(fit.seconds, TRUE, strict=True):
        assert got == pytest.approx(want, rel=0.1)
    assert fit.model.a == 1.0
    assert fit.model.b == pytest.approx(TRUE[1] / TRUE[0], rel=0.1)
    assert fit.model.c == pytest.approx(TRUE[2] / TRUE[0], rel=0.1)
    assert fit.error < 0.05  # the median step: within the noise
    assert fit.fixed_error > 2 * fit.error  # the default's shape is wrong for this "hardware"


def test_outliers_move_the_huber_fit_less_than_least_squares() -> None:
    clean = fit_cost_model(make_observations(512, noise=0.02), FIXED, FitConfig())
    dirty = fit_cost_model(make_observations(512, noise=0.02, outliers=0.15), FIXED, FitConfig())
    ols = fit_cost_model(
        make_observations(512, noise=0.02, outliers=0.15), FIXED, FitConfig(iterations=1)
    )
    assert abs(dirty.seconds[1] / clean.seconds[1] - 1) < 0.1
    assert abs(dirty.seconds[1] / clean.seconds[1] - 1) < abs(ols.seconds[1] / clean.seconds[1] - 1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(64, 300))
def test_identical_bits_whatever_the_row_order(seed: int, n: int) -> None:
    """Daemons concatenate the same rows; the fit must not depend on their order at all."""
    obs = make_observations(n, seed=seed % 1000, outliers=0.05)
    shuffled = obs[np.random.default_rng(seed).permutation(n)]
    a = fit_cost_model(obs, FIXED, FitConfig())
    b = fit_cost_model(shuffled, FIXED, FitConfig())
    assert a.seconds == b.seconds and a.model == b.model
    assert a.error == b.error or (math.isnan(a.error) and math.isnan(b.error))


def test_warmup_keeps_the_fixed_model() -> None:
    fit = fit_cost_model(make_observations(63), FIXED, FitConfig(warmup=64))
    assert fit.state is FitState.WARMUP and fit.model == FIXED and fit.num_observations == 63


def test_idle_steps_and_nonpositive_times_are_not_observations() -> None:
    obs = make_observations(64)
    junk = np.array([[0.0, 0.0, 0.01], [100.0, 1e4, 0.0], [100.0, 1e4, -1.0]])
    fit = fit_cost_model(np.concatenate([obs, junk]), FIXED, FitConfig(warmup=64))
    assert fit.num_observations == 64


def test_equal_lengths_are_ill_conditioned_and_keep_the_fixed_model() -> None:
    length = 128
    counts = np.random.default_rng(0).integers(1, 32, size=200).astype(np.float64)
    y = 1e-6 * length * counts + 1e-9 * length**2 * counts + 1e-3
    obs = np.column_stack([length * counts, length**2 * counts, y])
    fit = fit_cost_model(obs, FIXED, FitConfig())
    assert fit.state is FitState.ILL_CONDITIONED and fit.model == FIXED


@pytest.mark.parametrize(
    "coef",
    [(2e-6, 0.0, 3e-3), (2e-6, 4e-9, 0.0), (0.0, 4e-9, 3e-3)],
    ids=["linear", "no-overhead", "attention-only"],
)
def test_coefficients_stay_sane_when_a_term_is_absent(coef) -> None:
    """Noise would push an absent term below zero; it is clamped at its floor instead."""
    obs = make_observations(512, noise=0.05, coef=coef)
    fit = fit_cost_model(obs, FIXED, FitConfig())
    assert fit.state is FitState.FITTED
    a, b, c = fit.seconds
    assert a > 0 and b >= 0 and c >= 0
    assert fit.model.a == 1.0 and fit.model.b >= 0 and fit.model.c >= 0
    assert fit.error < 0.1


def test_fit_config_refuses_a_window_smaller_than_the_warmup() -> None:
    with pytest.raises(ConfigError, match="warmup"):
        FitConfig(warmup=100, window=50)
