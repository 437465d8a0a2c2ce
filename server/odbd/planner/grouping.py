"""Grouping strategies: cut one unit's buffer into groups that respect the token budget.

Both strategies sort the buffer longest first and cut contiguous ranges, so a group's padded area
is its first member's length times its size. Budget rule (DESIGN.md section 3.5): padded area <= L,
except one sample longer than L, which is a group of one.
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


def group_buffer(table: SampleTable, budget: int, strategy: Grouping) -> Groups:
    """Cuts the buffer into groups with the named strategy."""
    if len(table) and int(table.lengths.min()) < 1:
        raise InvariantError("0-length samples must be rejected at ingest, before grouping")
    order = sort_longest_first(table)
    lengths = table.lengths[order]
    if strategy is Grouping.PAPER:
        starts, ends = _paper_cuts(lengths.tolist(), budget)
    else:
        starts, ends = _fill_cuts(lengths, budget)
    return Groups(order, np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64))


def batch_size_for(length: int, budget: int) -> int:
    """The paper's B(l) = max(floor(L / l), 1): how many samples of this length fit the budget."""
    return max(budget // length, 1)


def _fill_cuts(lengths: np.ndarray, budget: int) -> tuple[list[int], list[int]]:
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
