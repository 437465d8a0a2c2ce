"""Grouping under the budgets of packed batches and of vision patches (issue 13).

- `--collate packed`: a rank's batch is one padding-free row, so a group's budget is the sum of
  its lengths (sum l <= L; a sample longer than L is a group of one). Contiguous cuts of the
  length-sorted buffer waste up to a whole sample per group here (a long sample leaves room
  that only a short one fills), so groups are bins of first-fit decreasing: samples longest
  first, each into the first group it fits (at most 11/9 of the fewest groups plus one).
- `--max-patches N`: every group also holds at most N vision patches in total (a sample with
  more goes alone). Packed: the bins check both budgets. Padded: the greedy contiguous cut of
  min-time, stopping a group where either budget would be exceeded.

Groups keep the planner's layout (grouping.Groups): each group is a contiguous range of
`order`, longest first, so its first member is its longest.
"""

from __future__ import annotations

import numpy as np

from odbd.planner.config import Collate
from odbd.planner.grouping import SORT_JITTER, sort_longest_first
from odbd.planner.types import Groups, SampleTable

# A patch budget of 0 means none: larger than any sum of patches a buffer can hold.
_NO_PATCH_BUDGET = np.iinfo(np.int64).max // 4


def group_with_budgets(
    table: SampleTable,
    budget: int,
    max_patches: int,
    collate: Collate,
    rng: np.random.Generator | None = None,
) -> Groups:
    """Groups of `table` within the token budget (area or sum, per `collate`) and the patch
    budget (0 = none). With `rng` (seeded the same on every daemon) samples within SORT_JITTER
    of each other's length trade places, so later epochs do not repeat the same groups."""
    order = _longest_first(table, rng if collate is Collate.PACKED else None)
    patch_budget = max_patches if max_patches > 0 else _NO_PATCH_BUDGET
    lengths, patches = table.lengths[order], table.patches[order]
    if collate is Collate.PACKED:
        return _first_fit_decreasing(order, lengths, patches, budget, patch_budget)
    starts = _contiguous_cuts(lengths.tolist(), patches.tolist(), budget, patch_budget)
    start_arr = np.asarray(starts, dtype=np.int64)
    end_arr = np.asarray(starts[1:] + [len(order)] if starts else [], dtype=np.int64)
    return Groups(order, start_arr, end_arr)


def _longest_first(table: SampleTable, rng: np.random.Generator | None) -> np.ndarray:
    if rng is None or len(table) == 0:
        return sort_longest_first(table)
    # Packed bins only: the order of arrival into first-fit varies, each bin is re-sorted.
    key = table.lengths * (1.0 + SORT_JITTER * rng.random(len(table)))
    return np.argsort(-key, kind="stable")


def _first_fit_decreasing(
    order: np.ndarray, lengths: np.ndarray, patches: np.ndarray, budget: int, patch_budget: int
) -> Groups:
    """Bins of first-fit decreasing over (length, patches); rows arrive longest first.

    A sample over either budget opens a bin whose room is negative, so nothing joins it.
    """
    n = int(lengths.shape[0])
    room = np.empty(n, dtype=np.int64)  # token room of bin b (first num_bins entries used)
    patch_room = np.empty(n, dtype=np.int64)
    bin_of = np.empty(n, dtype=np.int64)
    num_bins = 0
    for i, (length, count) in enumerate(zip(lengths.tolist(), patches.tolist(), strict=True)):
        fits = np.flatnonzero((room[:num_bins] >= length) & (patch_room[:num_bins] >= count))
        if fits.size:
            b = int(fits[0])
            room[b] -= length
            patch_room[b] -= count
        else:
            b = num_bins
            room[b], patch_room[b] = budget - length, patch_budget - count
            num_bins += 1
        bin_of[i] = b
    by_bin = np.lexsort((-lengths, bin_of))  # bin by bin, longest first in each
    sizes = np.bincount(bin_of, minlength=num_bins)
    ends = np.cumsum(sizes).astype(np.int64)
    return Groups(order[by_bin], ends - sizes, ends)


def _contiguous_cuts(
    lengths: list[int], patches: list[int], budget: int, patch_budget: int
) -> list[int]:
    """min-time's greedy cut (longest x size <= L) that also stops at the patch budget."""
    starts: list[int] = []
    n, i = len(lengths), 0
    while i < n:
        starts.append(i)
        longest, held = lengths[i], patches[i]
        i += 1
        while (
            i < n
            and longest * (i + 1 - starts[-1]) <= budget
            and held + patches[i] <= (patch_budget)
        ):
            held += patches[i]
            i += 1
    return starts
