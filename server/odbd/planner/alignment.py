"""Cross-rank alignment (the paper's DGAP): every unit ends a round with exactly T steps of groups.

Pure functions over Groups. A unit owns `ranks_per_unit` ranks, so T steps need
T * ranks_per_unit slots. Too many groups: the surplus overflows back to the buffer (recirculated,
nothing dropped). Too few: groups are split; when even singletons cannot fill the slots, the
remaining slots are idle fillers.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from odbd.planner.types import FloatArray, Groups, IntArray

# flush_cuts' bisection on the largest group's work: at most this many halvings, stopping once
# the bracket is within FLUSH_TOLERANCE of the threshold (a thousandth of a group's work)
FLUSH_BISECTIONS = 30
FLUSH_TOLERANCE = 1e-3


@dataclass(frozen=True, slots=True)
class FittedGroups:
    """A unit's groups after alignment: exactly `num_slots` ranges (idle ones are empty)."""

    order: IntArray  # as Groups.order
    starts: IntArray  # (num_slots,); idle slots have starts == ends
    ends: IntArray
    leftover_rows: IntArray  # table rows recirculated to the next round
    num_splits: int


def paper_target_steps(
    group_counts: Sequence[int],
    sample_counts: Sequence[int],
    ranks_per_unit: int,
    max_steps: int,
) -> int:
    """Eq. 3: T = max(min(max_active G_r, C_min+, S_min+), 1), per rank of each unit.

    Only active units (with groups) count; capacity C is `max_steps` (0 = unbounded). With
    ranks_per_unit > 1 a unit's G_r and S_r are per rank (rounded up and down respectively).
    """
    active = [i for i, g in enumerate(group_counts) if g > 0]
    if not active:
        return 0
    g_max = max(math.ceil(group_counts[i] / ranks_per_unit) for i in active)
    s_positive = [sample_counts[i] // ranks_per_unit for i in active]
    s_min = min((s for s in s_positive if s > 0), default=g_max)
    c_min = max_steps if max_steps > 0 else g_max
    return max(min(g_max, c_min, s_min), 1)


def min_time_target_steps(
    group_counts: Sequence[int],
    dry: Sequence[bool],
    ranks_per_unit: int,
    max_steps: int,
) -> int:
    """Steps this round for the min-time planner.

    While more data is coming, T is the fewest full steps any still-filling unit can make, so no
    unit has to split (splitting only makes under-filled groups); surplus groups recirculate and
    are regrouped with new arrivals. Once every unit is dry, the round flushes: T is the most steps
    any unit needs, the others split or idle (join-mode's unavoidable tail).
    """
    if sum(group_counts) == 0:
        return 0
    if all(dry):
        t = max((math.ceil(g / ranks_per_unit) for g in group_counts), default=0)
    else:
        filling = [g for g, d in zip(group_counts, dry, strict=True) if not d]
        t = max(1, min(g // ranks_per_unit for g in filling))
    return min(t, max_steps) if max_steps > 0 else t


def fit_groups(
    groups: Groups, num_slots: int, keep_priority: np.ndarray, split: bool = True
) -> FittedGroups:
    """Keeps the `num_slots` highest-priority groups, or splits groups until there are enough.

    Kept groups stay in their original order. Splitting halves the largest group (largest
    first keeps the split groups as full as possible); slots still missing after every group is a
    singleton become idle fillers (empty ranges). `split` False (--align updates, where a rank
    skips its idle slots rather than run them): no split, the missing slots are idle.
    """
    count = len(groups)
    if count >= num_slots:
        keep = np.sort(np.argsort(-keep_priority, kind="stable")[:num_slots])
        leftover = rows_of(groups, _others(count, keep))
        return FittedGroups(groups.order, groups.starts[keep], groups.ends[keep], leftover, 0)
    if not split:
        padded = _pad_idle(groups.starts.tolist(), groups.ends.tolist(), num_slots)
        return FittedGroups(
            groups.order, np.asarray(padded[0], np.int64), np.asarray(padded[1], np.int64),
            np.zeros(0, dtype=np.int64), 0,
        )  # fmt: skip
    starts, ends, num_splits = _split_to(groups, num_slots)
    return FittedGroups(groups.order, starts, ends, np.zeros(0, dtype=np.int64), num_splits)


def flush_cuts(
    lengths: IntArray, row_work: FloatArray, a: float, budget: int, num_slots: int
) -> tuple[IntArray, IntArray, int] | None:
    """A flushing unit's samples (in its grouping order, `lengths` nearly longest first) cut
    into exactly `num_slots` contiguous ranges whose costliest costs least, within the budget
    (longest x size <= L); a range's work is a x its longest x its size + its rows' `row_work`
    (the cost model's b x l^2 + p x patches). Idle fillers for slots still missing once every
    range is one sample; None when even the greedy fill needs more than `num_slots` ranges.

    Why: in the flush every unit runs all it holds in T steps, T set by the unit with the most
    greedy groups, so the others had to split; halving their largest groups by count left
    pieces of half a step beside other nodes' full groups (longtail W = 1024: one of the
    flush's 19 steps ran at 0.44 of the budget on average, 0.88 at its slowest rank). Cut into
    T x G ranges of least largest work, each node's steps sit near its own mean
    (docs/bench/migration.md). The order is the unit's jittered one (grouping.py), not the
    exact sort, so a buffer holding the whole dataset still cuts new groups every epoch.

    Bisection on the largest work: a cut of at most `num_slots` ranges under a threshold is
    found greedily (each range takes the longest run under it and the budget; greedy gives
    the fewest ranges of any contiguous cut, as grouping.fill_cuts does for the budget
    alone); the few missing ranges are then the costliest ones halved at their balanced
    point."""
    n = int(lengths.shape[0])
    if n == 0 or num_slots < 1:
        return None
    csum = np.concatenate([[0.0], np.cumsum(row_work)])
    window = min(n, max(budget // max(int(lengths.min()), 1), 1))

    def works(s: int, width: int) -> tuple[FloatArray, IntArray]:
        """Work and padded tokens of [s, s + k) for k = 1..width."""
        sizes = np.arange(1, width + 1)
        padded = np.maximum.accumulate(lengths[s : s + width]) * sizes
        return a * padded + csum[s + 1 : s + width + 1] - csum[s], padded

    def greedy(cap: float) -> list[int] | None:
        starts: list[int] = []
        s = 0
        while s < n:
            starts.append(s)
            if len(starts) > num_slots:
                return None
            work, padded = works(s, min(window, n - s))
            fits = int(np.searchsorted(padded, budget, side="right"))
            s += max(min(fits, int(np.searchsorted(work, cap, side="right"))), 1)
        return starts

    def work(s: int, e: int) -> float:
        return float(works(s, e - s)[0][-1])

    best = greedy(math.inf)
    if best is None:
        return None
    lo, hi = 0.0, max(work(s, e) for s, e in _ranges(best, n))
    for _ in range(FLUSH_BISECTIONS):
        if hi - lo <= FLUSH_TOLERANCE * hi:
            break
        mid = (lo + hi) / 2
        cut = greedy(mid)
        if cut is None:
            lo = mid
        else:
            hi, best = mid, cut
    pieces = [(-work(s, e), s, e) for s, e in _ranges(best, n)]
    heapq.heapify(pieces)
    singles: list[tuple[float, int, int]] = []  # costliest pieces that cannot split
    num_splits = 0
    while len(pieces) + len(singles) < num_slots and pieces:
        piece = heapq.heappop(pieces)
        _, s, e = piece
        if e - s < 2:
            singles.append(piece)
            continue
        left = works(s, e - s - 1)[0]
        right = np.asarray([work(m, e) for m in range(s + 1, e)])
        mid = s + 1 + int(np.argmin(np.maximum(left, right)))
        heapq.heappush(pieces, (-work(s, mid), s, mid))
        heapq.heappush(pieces, (-work(mid, e), mid, e))
        num_splits += 1
    ranges = sorted((s, e) for _, s, e in pieces + singles)
    starts, ends = _pad_idle([s for s, _ in ranges], [e for _, e in ranges], num_slots)
    return np.asarray(starts, np.int64), np.asarray(ends, np.int64), num_splits


def _ranges(starts: list[int], n: int) -> list[tuple[int, int]]:
    return list(zip(starts, starts[1:] + [n], strict=True))


def fit_groups_paper(groups: Groups, num_slots: int) -> FittedGroups:
    """Algorithm 1: overflow keeps the largest groups (by size); split extracts singletons.

    Split: scanning from the last group backward, the first group with >= 2 samples gives up its
    last sample as a new singleton group inserted right after it; repeat. The reference stores a
    group as a slice of the ascending sort, so its "last" sample is its *longest*; here a group is
    a range of the longest-first order, so that is the range's first row. Paper groups come short
    to long, and the singleton is no shorter than what stays, so the order stays short to long.
    """
    count = len(groups)
    if count >= num_slots:
        keep = np.sort(np.argsort(-groups.sizes(), kind="stable")[:num_slots])
        leftover = rows_of(groups, _others(count, keep))
        return FittedGroups(groups.order, groups.starts[keep], groups.ends[keep], leftover, 0)
    starts = groups.starts.tolist()
    ends = groups.ends.tolist()
    num_splits = 0
    while len(starts) < num_slots:
        victim = next((g for g in range(len(starts) - 1, -1, -1) if ends[g] - starts[g] >= 2), None)
        if victim is None:
            break
        longest = starts[victim]
        starts[victim] += 1
        starts.insert(victim + 1, longest)
        ends.insert(victim + 1, longest + 1)
        num_splits += 1
    starts, ends = _pad_idle(starts, ends, num_slots)
    return FittedGroups(
        groups.order,
        np.asarray(starts, dtype=np.int64),
        np.asarray(ends, dtype=np.int64),
        np.zeros(0, dtype=np.int64),
        num_splits,
    )


def _split_to(groups: Groups, num_slots: int) -> tuple[IntArray, IntArray, int]:
    ranges = list(zip(groups.starts.tolist(), groups.ends.tolist(), strict=True))
    heap = [(-(e - s), s, e) for s, e in ranges]  # largest group first; ties by position
    heapq.heapify(heap)
    num_splits = 0
    while len(heap) < num_slots and heap and -heap[0][0] >= 2:
        _, s, e = heapq.heappop(heap)
        mid = s + (e - s + 1) // 2
        heapq.heappush(heap, (-(mid - s), s, mid))
        heapq.heappush(heap, (-(e - mid), mid, e))
        num_splits += 1
    pieces = sorted((s, e) for _, s, e in heap)  # back to sorted-length order
    starts, ends = _pad_idle([s for s, _ in pieces], [e for _, e in pieces], num_slots)
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64), num_splits


def _pad_idle(starts: list[int], ends: list[int], num_slots: int) -> tuple[list[int], list[int]]:
    missing = num_slots - len(starts)
    return starts + [0] * missing, ends + [0] * missing


def _others(count: int, keep: IntArray) -> IntArray:
    """Group indices in range(count) not in `keep` (a mask: cheaper than setdiff1d)."""
    mask = np.ones(count, dtype=bool)
    mask[keep] = False
    return np.flatnonzero(mask)


def rows_of(groups: Groups, which: IntArray) -> IntArray:
    """Table rows of the given groups, concatenated."""
    if which.size == 0:
        return np.zeros(0, dtype=np.int64)
    return groups.order[concat_ranges(groups.starts[which], groups.ends[which])]


def concat_ranges(starts: IntArray, ends: IntArray) -> IntArray:
    """np.concatenate([np.arange(s, e) for s, e in ranges]) without a Python loop."""
    sizes = ends - starts
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    nonempty = sizes > 0
    s, z = starts[nonempty], sizes[nonempty]
    shifts = s - np.concatenate([[0], np.cumsum(z)[:-1]])
    return np.arange(total, dtype=np.int64) + np.repeat(shifts, z)
