"""View keys: iteration * views_per_iteration + view (chained sampler iterations never collide)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from odbd.planner.types import IntArray


def by_iteration(
    keys: IntArray, views_per_iteration: int
) -> Iterator[tuple[int, IntArray | slice, IntArray]]:
    """(iteration, rows of keys, views within that iteration) for each iteration present.

    The rows are a boolean mask, or `slice(None)` when every key lies in one iteration: the
    usual case (a commit, a step, a round), where np.unique's sort and the mask would be the
    costliest calls of the daemon's per-message bookkeeping."""
    if keys.size == 0:
        return
    its, views = np.divmod(keys, views_per_iteration)
    first, last = int(its.min()), int(its.max())
    if first == last:
        yield first, slice(None), views
        return
    for it in np.unique(its).tolist():
        mask = its == it
        yield it, mask, views[mask]
