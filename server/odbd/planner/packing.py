"""Grouping under the budgets of packed batches and of vision patches (issue 13).

- `--collate packed`: a rank's batch is one padding-free row, so a group's budget is the sum of
  its lengths (sum l <= L; a sample longer than L is a group of one). Contiguous cuts of the
  length-sorted buffer waste up to a whole sample per group here (a long sample leaves room
  that only a short one fills), so groups are bins of first-fit decreasing: samples longest
  first, each into the first group it fits (one budget: at most 11/9 of the fewest groups
  plus 6/9; with a patch budget too it is a heuristic).
- `--max-patches N`: every group also holds at most N vision patches in total (a sample with
  more goes alone). Packed: the bins check both budgets. Padded: the greedy contiguous cut of
  min-time, stopping a group where either budget would be exceeded.

Groups keep the planner's layout (grouping.Groups): each group is a contiguous range of
`order`, longest first, so its first member is its longest.
"""

from __future__ import annotations

import numpy as np

from odbd.planner.config import Collate
from odbd.planner.grouping import sort_longest_first
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
    budget (0 = none). With `rng` (seeded the same on every daemon; packed only) samples of
    equal length enter the bins in varied order, so epochs do not repeat the same groups."""
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
    # Packed bins only: equal lengths in random order, so epochs over the same buffer vary
    # their groups; the order stays sorted, which first-fit's lookup table needs.
    return np.lexsort((rng.random(len(table)), -table.lengths))


def _first_fit_decreasing(
    order: np.ndarray, lengths: np.ndarray, patches: np.ndarray, budget: int, patch_budget: int
) -> Groups:
    """Bins of first-fit decreasing over rows that arrive longest first, built bin by bin.

    Each bin opens with the longest sample left, then repeatedly takes the longest sample left
    that still fits its room (for one budget this is exactly first-fit decreasing, item by
    item). "Longest left that fits" is a table lookup (the first row no longer than each room,
    from one searchsorted) followed by a jump to the next sample not yet taken (a union-find
    over taken positions, path halving), so a buffer of n samples packs in O(n) amortised
    plain-int steps, not O(n x bins), and equal lengths that fit together enter in one step
    (_run_ends). With a patch budget the candidate must fit both; the next
    PATCH_PROBES candidates are tried before the bin closes. A sample over either budget opens
    a bin whose room is negative, so nothing joins it.
    """
    n = int(lengths.shape[0])
    length_of, patches_of = lengths.tolist(), patches.tolist()
    # first_fitting[r]: the first row of length <= r; a room past cap fits what cap fits.
    cap = max(min(budget, int(lengths[0]) if n else 0), 0)
    first_fitting = np.searchsorted(-lengths, -np.arange(cap + 1), side="left").tolist()
    after = list(range(n + 1))  # union-find: after[i] leads to the first untaken index >= i
    run_end = _run_ends(lengths, patch_budget)
    bin_of = [0] * n
    num_bins = 0
    first = 0
    while first < n:
        after[first] = first + 1
        room, patch_room = budget - length_of[first], patch_budget - patches_of[first]
        bin_of[first] = num_bins
        while room > 0:
            k = first_fitting[room if room < cap else cap]
            while after[k] != k:  # the first untaken row >= k (inlined: the hot loop)
                after[k] = after[after[k]]
                k = after[k]
            if k < n and patches_of[k] > patch_room:
                k = _probe_patches(after, patches_of, patch_room, k, n)
            if k >= n:
                break
            take = min(run_end[k] - k, room // length_of[k])
            if take > 1:  # equal lengths: the next ones would be taken one by one anyway
                bin_of[k : k + take] = [num_bins] * take
                after[k] = k + take
                room -= take * length_of[k]
                continue
            after[k] = k + 1
            room -= length_of[k]
            patch_room -= patches_of[k]
            bin_of[k] = num_bins
        num_bins += 1
        first = _next_free(after, first)
    bins = np.asarray(bin_of, dtype=np.int64)
    by_bin = np.lexsort((-lengths, bins))  # bin by bin, longest first in each
    sizes = np.bincount(bins, minlength=num_bins)
    ends = np.cumsum(sizes).astype(np.int64)
    return Groups(order[by_bin], ends - sizes, ends)


def _run_ends(lengths: np.ndarray, patch_budget: int) -> list[int]:
    """Per row, the end of its run of equal lengths: a bin with room for several takes them at
    once, as it would one by one (rows of a run are taken first to last, and the lookup of the
    smaller room lands on the run again). With a patch budget the probes skip rows inside a
    run, so each row is its own run."""
    n = int(lengths.shape[0])
    if patch_budget < _NO_PATCH_BUDGET:
        return list(range(1, n + 1))
    return np.searchsorted(-lengths, -lengths, side="right").tolist()


def _probe_patches(after: list[int], patches_of: list[int], patch_room: int, k: int, n: int) -> int:
    """The first of the next PATCH_PROBES untaken rows after k whose patches fit; n if none."""
    for _ in range(PATCH_PROBES):
        k = _next_free(after, k + 1)
        if k >= n or patches_of[k] <= patch_room:
            return k
    return n


# Candidates a bin tries past one whose patches do not fit, before it closes (patch budget).
PATCH_PROBES = 8


def _next_free(after: list[int], i: int) -> int:
    """The first index >= i not yet taken (path-halving union-find; `after[n] == n`)."""
    while after[i] != i:
        after[i] = after[after[i]]
        i = after[i]
    return i


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
