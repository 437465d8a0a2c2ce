"""Named sample-length distributions of `/work/shared/data/distributions.md`, seeded and exact.

Each distribution is a tree of three shapes: a clipped lognormal fitted to a median and a 95th
percentile, inclusive integer uniforms, and weighted mixtures of those. `sample_lengths` draws
them with one `numpy.random.Generator(seed)`, so the same (name, n, seed) always gives the same
lengths on every machine that runs the same numpy bit generator (PCG64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from odbd.errors import ConfigError

# z of the standard normal's 95th percentile, as distributions.md fixes it (not 1.6449).
_Z95 = 1.645


@dataclass(frozen=True, kw_only=True, slots=True)
class Lognormal:
    """Lognormal with the given median and p95, rounded to integers and clipped to [low, high]."""

    median: float
    p95: float
    low: int
    high: int

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        sigma = math.log(self.p95 / self.median) / _Z95
        values = rng.lognormal(mean=math.log(self.median), sigma=sigma, size=n)
        return np.clip(np.rint(values), self.low, self.high).astype(np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class Uniform:
    """Integers uniform on [low, high], both ends included."""

    low: int
    high: int

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)


Component = Lognormal | Uniform


@dataclass(frozen=True, kw_only=True, slots=True)
class Mixture:
    """Each sample comes from component i with probability weights[i]."""

    weights: tuple[float, ...]
    components: tuple[Component, ...]

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        choice = rng.choice(len(self.components), size=n, p=np.asarray(self.weights))
        out = np.empty(n, dtype=np.int64)
        # Components are drawn in a fixed order from the same generator, so results stay seeded.
        for i, component in enumerate(self.components):
            mask = choice == i
            out[mask] = component.draw(rng, int(mask.sum()))
        return out


Distribution = Lognormal | Uniform | Mixture

_TABLE: dict[str, Distribution] = {
    "ultrachat": Lognormal(median=1104, p95=2239, low=16, high=4471),
    "llava": Lognormal(median=463, p95=814, low=16, high=1260),
    "sharegpt4o": Lognormal(median=977, p95=4584, low=16, high=12110),
    "mmmix": Mixture(
        weights=(0.4, 0.6),
        components=(
            Lognormal(median=250, p95=480, low=16, high=2048),
            Lognormal(median=1500, p95=3300, low=64, high=12288),
        ),
    ),
    "uniform-narrow": Uniform(low=64, high=512),
    "uniform-wide": Uniform(low=64, high=2048),
    "longtail": Mixture(
        weights=(0.9, 0.1), components=(Uniform(low=32, high=256), Uniform(low=1024, high=2048))
    ),
    "bimodal": Mixture(
        weights=(0.5, 0.5), components=(Uniform(low=64, high=256), Uniform(low=1536, high=2048))
    ),
    "all-long": Uniform(low=1800, high=2048),
    "all-short": Uniform(low=32, high=64),
}

NAMES: tuple[str, ...] = tuple(_TABLE)


def distribution(name: str) -> Distribution:
    """The spec of a named distribution; ConfigError listing the valid names if unknown."""
    try:
        return _TABLE[name]
    except KeyError:
        raise ConfigError(
            f"unknown length distribution {name!r}; nothing was simulated. "
            f"Pass --dist with one of: {', '.join(NAMES)} (or --lengths FILE)"
        ) from None


def sample_lengths(name: str, n: int, seed: int) -> np.ndarray:
    """(n,) int64 token lengths drawn from the named distribution with Generator(seed)."""
    spec = distribution(name)
    if n < 0:
        raise ConfigError(f"number of samples must be >= 0, got {n}; pass --num-samples N")
    return spec.draw(np.random.default_rng(seed), n)
