"""The named length distributions match /work/shared/data/distributions.md."""

from __future__ import annotations

import math

import numpy as np
import pytest

from odbd.errors import ConfigError
from odbd.simulate.distributions import NAMES, sample_lengths

N = 200_000

# name -> (low clip, high clip) from the table
CLIPS = {
    "ultrachat": (16, 4471),
    "llava": (16, 1260),
    "sharegpt4o": (16, 12110),
    "mmmix": (16, 12288),
    "uniform-narrow": (64, 512),
    "uniform-wide": (64, 2048),
    "longtail": (32, 2048),
    "bimodal": (64, 2048),
    "all-long": (1800, 2048),
    "all-short": (32, 64),
}


def test_all_ten_distributions_are_named() -> None:
    assert set(NAMES) == set(CLIPS)


@pytest.mark.parametrize("name", NAMES)
def test_lengths_are_seeded_int64_within_the_clip(name: str) -> None:
    lengths = sample_lengths(name, 10_000, seed=3)
    low, high = CLIPS[name]
    assert lengths.dtype == np.int64 and lengths.shape == (10_000,)
    assert low <= lengths.min() and lengths.max() <= high
    assert np.array_equal(lengths, sample_lengths(name, 10_000, seed=3))
    assert not np.array_equal(lengths, sample_lengths(name, 10_000, seed=4))


@pytest.mark.parametrize(
    ("name", "median", "p95"),
    [("ultrachat", 1104, 2239), ("llava", 463, 814), ("sharegpt4o", 977, 4584)],
)
def test_lognormal_median_and_p95_are_the_fitted_ones(name: str, median: int, p95: int) -> None:
    lengths = sample_lengths(name, N, seed=0)
    assert np.median(lengths) == pytest.approx(median, rel=0.02)
    assert np.percentile(lengths, 95) == pytest.approx(p95, rel=0.03)


@pytest.mark.parametrize(
    ("name", "mean", "cv"),
    [
        # The paper's statistics; a lognormal fitted to median and p95 lands near, not on, them.
        ("ultrachat", 1196, 0.48),
        ("llava", 508, 0.29),
        ("sharegpt4o", 1511, 1.00),
        ("mmmix", None, 0.8),
    ],
)
def test_paper_mean_and_cv_are_roughly_reproduced(name: str, mean: float | None, cv: float) -> None:
    lengths = sample_lengths(name, N, seed=0).astype(np.float64)
    if mean is not None:
        assert lengths.mean() == pytest.approx(mean, rel=0.05)
    assert lengths.std() / lengths.mean() == pytest.approx(cv, abs=0.1)


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("uniform-narrow", 64, 512), ("uniform-wide", 64, 2048), ("all-long", 1800, 2048)],
)
def test_uniforms_are_inclusive_integers(name: str, low: int, high: int) -> None:
    lengths = sample_lengths(name, N, seed=0)
    assert lengths.min() == low and lengths.max() == high
    assert lengths.mean() == pytest.approx((low + high) / 2, rel=0.01)


@pytest.mark.parametrize(
    ("name", "split", "share_below"), [("longtail", 512, 0.9), ("bimodal", 1000, 0.5)]
)
def test_uniform_mixture_weights(name: str, split: int, share_below: float) -> None:
    lengths = sample_lengths(name, N, seed=0)
    assert np.mean(lengths < split) == pytest.approx(share_below, abs=0.01)


def _lognormal_cdf(x: float, median: float, p95: float) -> float:
    sigma = math.log(p95 / median) / 1.645
    return 0.5 * (1 + math.erf(math.log(x / median) / (sigma * math.sqrt(2))))


def test_mmmix_is_40_percent_short_60_percent_long() -> None:
    lengths = sample_lengths("mmmix", N, seed=0)
    expected = 0.4 * _lognormal_cdf(700, 250, 480) + 0.6 * _lognormal_cdf(700, 1500, 3300)
    assert np.mean(lengths < 700) == pytest.approx(expected, abs=0.01)


def test_zero_samples_is_an_empty_array() -> None:
    assert sample_lengths("llava", 0, seed=0).shape == (0,)


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="unknown length distribution 'ultra'") as info:
        sample_lengths("ultra", 10, seed=0)
    assert all(name in str(info.value) for name in NAMES)


def test_negative_count_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--num-samples"):
        sample_lengths("llava", -1, seed=0)
