"""View keys: iteration * views_per_iteration + view (chained sampler iterations never collide)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from odbd.planner.types import IntArray


def by_iteration(
    keys: IntArray, views_per_iteration: int
) -> Iterator[tuple[int, IntArray, IntArray]]:
    """(iteration, mask over keys, views within that iteration) for each iteration present."""
    its, views = np.divmod(keys, views_per_iteration)
    for it in np.unique(its).tolist():
        mask = its == it
        yield it, mask, views[mask]
