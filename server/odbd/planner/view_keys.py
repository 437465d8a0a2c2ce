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
    # The range first: one iteration needs no division per key, and iteration 0 (every key of a
    # one-epoch job, the first epoch of others) not even a subtraction (the views are the keys).
    first = int(keys.min()) // views_per_iteration
    last = int(keys.max()) // views_per_iteration
    if first == last:
        yield first, slice(None), keys - first * views_per_iteration if first else keys
        return
    its, views = np.divmod(keys, views_per_iteration)
    for it in np.unique(its).tolist():
        mask = its == it
        yield it, mask, views[mask]
