"""Evening a step's ranks: swaps samples between the groups one unit runs in the same step.

A step lasts as long as its slowest rank. assignment.py gives a step G groups of similar cost,
but a node's round holds only a few thousand samples, so neighbouring groups still differ by
about a percent of a step's work (docs/bench/migration.md, "Where the remaining gaps go"). Here,
for each step, the costliest group trades one sample with (or gives one to) a cheaper group of
the same step when that lowers the costlier of the two and both stay within the token budget
(longest x size <= L); repeated until no trade lowers the step's costliest group.

Padded batches without a patch budget only (the caller checks): a packed group's cost is its
sum of lengths, which first-fit decreasing already fills. Pure and deterministic: the same
groups give the same trades on every daemon (ties go to the lowest index).
"""

from __future__ import annotations

import numpy as np

from odbd.planner.config import CostModel
from odbd.planner.types import IntArray

# At most this many trades per step: each lowers the step's costliest group, and a handful
# reach what the grain of the samples allows; the cap bounds a round's planning time.
MAX_TRADES_PER_STEP = 16
# A trade must lower the costliest group by at least this share of the token budget: smaller
# gains are noise against the cost model and would only spend planning time.
MIN_GAIN = 1e-4


def even_steps(
    order: IntArray,
    starts: IntArray,
    ends: IntArray,
    group_of_slot: IntArray,
    lengths: IntArray,
    ranks_per_unit: int,
    budget: int,
    cost: CostModel,
) -> tuple[IntArray, IntArray, IntArray]:
    """(order, starts, ends) with slot s holding range s, after the trades.

    `order[starts[k]:ends[k]]` are group k's rows, `lengths` the table's lengths (by row),
    `group_of_slot` as assignment.slots_by_cost (slot = step * G + local rank). Each output
    range is ordered longest first, as SortedBuffer.range_stats assumes.
    """
    g = ranks_per_unit
    num_slots = len(group_of_slot)
    members: list[np.ndarray] = []
    for s in range(num_slots):
        k = group_of_slot[s]
        rows = order[starts[k] : ends[k]]
        members.append(rows[np.argsort(-lengths[rows], kind="stable")])
    for step in range(num_slots // g):
        _even_step(members, step * g, g, lengths, budget, cost)
    sizes = np.array([len(m) for m in members], dtype=np.int64)
    new_ends = np.cumsum(sizes).astype(np.int64)
    new_order = np.concatenate(members).astype(np.int64) if members else order[:0]
    return new_order, new_ends - sizes, new_ends


def _work(rows: np.ndarray, lengths: IntArray, cost: CostModel) -> float:
    if len(rows) == 0:
        return 0.0
    ls = lengths[rows].astype(np.float64)
    return float(cost.work(ls[0] * len(ls), float(np.dot(ls, ls))))


def _even_step(
    members: list[np.ndarray],
    first: int,
    g: int,
    lengths: IntArray,
    budget: int,
    cost: CostModel,
) -> None:
    work = [_work(members[first + r], lengths, cost) for r in range(g)]
    min_gain = MIN_GAIN * budget
    for _ in range(MAX_TRADES_PER_STEP):
        h = int(np.argmax(work))
        if work[h] - min(work) < min_gain:
            return
        traded = False
        for lo in np.argsort(work, kind="stable"):
            lo = int(lo)
            if work[lo] + min_gain >= work[h]:
                break
            best = _best_trade(members[first + h], members[first + lo], lengths, budget, cost)
            if best is not None and best[0] < work[h] - min_gain:
                _, new_h, new_lo, wh, wl = best
                members[first + h], members[first + lo] = new_h, new_lo
                work[h], work[lo] = wh, wl
                traded = True
                break
        if not traded:
            return


def _best_trade(
    heavy: np.ndarray, light: np.ndarray, lengths: IntArray, budget: int, cost: CostModel
) -> tuple[float, np.ndarray, np.ndarray, float, float] | None:
    """The trade of heavy's i-th sample for light's j-th (j = len(light): nothing back) that
    makes the costlier of the two least; None if no trade keeps both within the budget."""
    lh = lengths[heavy].astype(np.float64)
    ll = lengths[light].astype(np.float64)
    nh, nl = len(lh), len(ll)
    if nh == 0 or nl == 0:  # idle slots stay idle (a dry unit's ranks)
        return None
    # y: what heavy gets back; the last column is "nothing" (a move, heavy shrinks by one).
    y = np.append(ll, 0.0)
    x = lh[:, None]
    yy = y[None, :]
    move = np.zeros(nl + 1, dtype=bool)
    move[-1] = True
    # Longest of each group without the traded sample (both sorted longest first).
    rest_h = np.where(np.arange(nh) == 0, lh[1] if nh > 1 else 0.0, lh[0])[:, None]
    rest_l = np.where(np.arange(nl + 1) == 0, ll[1] if nl > 1 else 0.0, ll[0] if nl else 0.0)
    rest_l = np.where(move, ll[0] if nl else 0.0, rest_l)[None, :]
    size_h = np.where(move, nh - 1, nh)[None, :]
    size_l = np.where(move, nl + 1, nl)[None, :]
    long_h = np.maximum(rest_h, yy)
    long_l = np.maximum(rest_l, x)
    sq_h = float(np.dot(lh, lh)) - x * x + yy * yy
    sq_l = float(np.dot(ll, ll)) - yy * yy + x * x
    pad_h = long_h * size_h
    pad_l = long_l * size_l
    fits = ((pad_h <= budget) | (size_h <= 1)) & ((pad_l <= budget) | (size_l <= 1))
    fits &= x > yy  # heavy must shed work; equal lengths change nothing
    fits &= size_h >= 1  # a group never empties
    if not fits.any():
        return None
    wh = cost.work(pad_h, sq_h)
    wl = cost.work(pad_l, sq_l)
    worse = np.where(fits, np.maximum(wh, wl), np.inf)
    i, j = np.unravel_index(int(np.argmin(worse)), worse.shape)
    xi = heavy[i]
    if j == nl:
        new_h = np.delete(heavy, i)
        new_l = np.append(light, xi)
    else:
        new_h = heavy.copy()
        new_h[i] = light[j]
        new_l = light.copy()
        new_l[j] = xi
    new_h = new_h[np.argsort(-lengths[new_h], kind="stable")]
    new_l = new_l[np.argsort(-lengths[new_l], kind="stable")]
    return float(worse[i, j]), new_h, new_l, float(wh[i, j]), float(wl[i, j])
