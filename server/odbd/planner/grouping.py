"""Grouping strategies: cut one unit's buffer into groups that respect the token budget.

Both strategies sort the buffer longest first and cut contiguous ranges, so a group's padded area
is its first member's length times its size. Budget rule (DESIGN.md section 3.5): padded area <= L,
except one sample longer than L, which is a group of one.

Fresh groups every epoch: sorted exactly, a buffer holding the same samples again (a large buffer,
a later epoch) is cut into the same groups. Given a seeded generator, min-time sorts by a key
jittered by up to SORT_JITTER of each length instead, so samples within ~1 % of each other trade
places, then orders each group longest first again (`_jittered_cuts`); where that finds nothing to
trade (a sparse buffer), swaps across random cuts vary the groups (`swap_across_cuts`).
"""

from __future__ import annotations

import array

import numpy as np

from odbd.errors import InvariantError
from odbd.planner.config import Grouping
from odbd.planner.types import Groups, SampleTable


def sort_longest_first(table: SampleTable) -> np.ndarray:
    """Row order by length descending; equal lengths keep their row order.

    Rows arrive in the same order on every daemon (the round payload fixes it, and daemons
    send their units sorted by view), so the order is the same everywhere. Lengths below 2^16
    (nearly always) sort with numpy's O(n) radix sort, ~10x faster than a comparison sort.
    """
    lengths = table.lengths
    if len(lengths) == 0 or int(lengths.max()) < (1 << 16):
        return np.argsort((0xFFFF - lengths).astype(np.uint16), kind="stable")
    return np.argsort(-lengths, kind="stable")


# How far the jittered sort may move a sample: past at most SORT_JITTER_RANKS neighbours, and by
# at most SORT_JITTER of its length (compare with `odbd simulate --epochs 2 --no-fresh-groups`).
SORT_JITTER = 0.01
SORT_JITTER_RANKS = 8


def group_buffer(
    table: SampleTable, budget: int, strategy: Grouping, rng: np.random.Generator | None = None
) -> Groups:
    """Cuts the buffer into groups with the named strategy.

    With `rng` (seeded identically on every daemon), min-time groups vary with the seed; without,
    the exact sort and greedy cut (deterministic for a given buffer).
    """
    if len(table) and int(table.lengths.min()) < 1:
        raise InvariantError("0-length samples must be rejected at ingest, before grouping")
    order = sort_longest_first(table)
    lengths = table.lengths[order]
    if strategy is Grouping.PAPER:
        starts, ends = _paper_cuts(lengths.tolist(), budget)
        return Groups(order, np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64))
    starts, ends = fill_cuts(lengths, budget)
    exact = Groups(order, np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64))
    if rng is None:
        return exact
    varied = _jittered_cuts(table.lengths, order, budget, rng)
    if len(varied) > len(exact):  # never more groups (steps) than the exact sort
        varied = exact
    return swap_across_cuts(varied, table.lengths, budget, rng)


def batch_size_for(length: int, budget: int) -> int:
    """The paper's B(l) = max(floor(L / l), 1): how many samples of this length fit the budget."""
    return max(budget // length, 1)


def fill_cuts(lengths: np.ndarray, budget: int) -> tuple[list[int], list[int]]:
    """min-time: each group takes as many of the next-longest samples as the budget admits.

    With lengths sorted descending, this greedy cut gives the fewest groups of any contiguous cut
    (each greedy group ends at or after any other cut's group), and fewest groups means the least
    per-step overhead; the sort keeps padding low because neighbours have similar lengths.
    """
    n = int(lengths.shape[0])
    # Where a group starting at i ends, for every i at once; the walk then only hops.
    ends_at = np.minimum(np.arange(n) + np.maximum(budget // np.maximum(lengths, 1), 1), n)
    jump = array.array("q")  # indexed lazily: only ~n / group size entries become ints
    jump.frombytes(ends_at.astype(np.int64).tobytes())
    starts: list[int] = []
    i = 0
    while i < n:
        starts.append(i)
        i = jump[i]
    return starts, starts[1:] + [n] if starts else []


def _jittered_cuts(
    lengths: np.ndarray, exact: np.ndarray, budget: int, rng: np.random.Generator
) -> Groups:
    """min-time's greedy fill over a jittered sort (`exact` = the rows sorted longest first).

    Each sample's key is its length plus u * min(SORT_JITTER * length, the gap to the sample
    SORT_JITTER_RANKS places longer), u uniform in [0, 1): in a dense buffer samples trade places
    with a few neighbours of nearly the same length, in a sparse one by at most 1 %, so padding
    barely changes. Sorted by key descending, every later sample is no longer than the key of a
    group's first sample, so ceil(key) * size <= L keeps the budget without looking inside the
    group; where the first sample's own capacity is larger the group grows while its true
    longest * size stays within L. Each group is then ordered longest first, as the rest of the
    planner assumes.
    """
    n = int(lengths.shape[0])
    exact_lengths = lengths[exact]
    longer = exact_lengths[np.maximum(np.arange(n) - SORT_JITTER_RANKS, 0)]
    jitter = np.minimum(SORT_JITTER * exact_lengths, longer - exact_lengths)
    key = exact_lengths + jitter * rng.random(n)
    by_key = np.argsort(-key, kind="stable")
    order = exact[by_key]
    sorted_lengths = lengths[order]
    bound = np.ceil(key[by_key]).astype(np.int64)
    bound_end = np.minimum(np.arange(n) + np.maximum(budget // bound, 1), n)
    may_grow = ((budget // np.maximum(sorted_lengths, 1)) > (budget // bound)).tobytes()
    jump = array.array("q")  # plain ints for the walk, as in fill_cuts
    jump.frombytes(bound_end.astype(np.int64).tobytes())
    as_ints = sorted_lengths.tolist()  # _grow reads a few entries per group: plain ints
    starts: list[int] = []
    i = 0
    while i < n:
        starts.append(i)
        end = jump[i]
        if may_grow[i] and end < n:
            end = _grow(as_ints, i, end, budget)
        i = end
    start_arr = np.asarray(starts, dtype=np.int64)
    end_arr = np.append(start_arr[1:], n) if starts else start_arr
    return Groups(
        longest_first_in_each(order, sorted_lengths, start_arr, end_arr), start_arr, end_arr
    )


def swap_across_cuts(
    groups: Groups, lengths: np.ndarray, budget: int, rng: np.random.Generator
) -> Groups:
    """Swaps the shortest sample of a group with the longest of the next where both stay within
    the budget, at a random half of every other cut (so no group takes part in two swaps).

    The jittered sort only moves samples within ~1 % of each other's length; in a sparse buffer
    (few samples that close) it cuts the same groups every epoch, and so does the exact sort it
    falls back to. These swaps vary membership there too, at no cost in groups.
    """
    k = np.arange(int(rng.integers(2)), len(groups) - 1, 2)  # the group left of each cut
    k = k[rng.random(len(k)) < 0.5]
    if len(k) == 0:
        return groups
    size_a = groups.ends[k] - groups.starts[k]
    size_b = groups.ends[k + 1] - groups.starts[k + 1]
    order = groups.order.copy()
    last_a, first_b = groups.ends[k] - 1, groups.starts[k + 1]
    longest_a = lengths[order[groups.starts[k]]]
    second_b = lengths[order[np.minimum(first_b + 1, groups.ends[k + 1] - 1)]]
    moved_in, moved_out = lengths[order[first_b]], lengths[order[last_a]]
    fits_a = (size_a == 1) | (np.maximum(longest_a, moved_in) * size_a <= budget)
    fits_b = (size_b == 1) | (np.maximum(second_b, moved_out) * size_b <= budget)
    swap = fits_a & fits_b
    a, b = last_a[swap], first_b[swap]
    order[a], order[b] = groups.order[b], groups.order[a]
    order = longest_first_in_each(order, lengths[order], groups.starts, groups.ends)
    return Groups(order, groups.starts, groups.ends)


def longest_first_in_each(
    order: np.ndarray, lengths_in_order: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> np.ndarray:
    """`order` with each group's rows [starts[g], ends[g]) longest first (ties keep their
    place), as the rest of the planner assumes of a group; `lengths_in_order[i]` is the length
    of row `order[i]`, and the groups cover `order` in turn."""
    group_of_row = np.repeat(np.arange(len(starts)), ends - starts)
    return order[np.lexsort((-lengths_in_order, group_of_row))]


def _grow(sorted_lengths: list[int], start: int, end: int, budget: int) -> int:
    """Extends the group [start, end) while its longest * size stays within the budget."""
    longest = max(sorted_lengths[start:end])
    n = len(sorted_lengths)
    while end < n:
        longest = max(longest, sorted_lengths[end])
        if longest * (end + 1 - start) > budget:
            break
        end += 1
    return end


def _paper_cuts(lengths: list[int], budget: int) -> tuple[list[int], list[int]]:
    """The paper's rule (section 2.2, App. D): threshold carry-over, longest to shortest.

    Each sample joins the current group; once the group's size reaches the threshold t
    (initially 1) it is finalized and t becomes B(l) of its last-added (shortest) sample. A
    trailing group that never reached its threshold is kept as is. Groups are returned short to
    long, as in App. D's table.
    """
    starts: list[int] = []
    ends: list[int] = []
    threshold = 1
    start = 0
    for i, length in enumerate(lengths):
        if i + 1 - start >= threshold:
            starts.append(start)
            ends.append(i + 1)
            threshold = batch_size_for(length, budget)
            start = i + 1
    if start < len(lengths):
        starts.append(start)
        ends.append(len(lengths))
    return starts[::-1], ends[::-1]
