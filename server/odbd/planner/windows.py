"""Optimizer updates (accumulation windows): which consecutive steps of a round form one update.

A window never spans two rounds: plan_round closes every window inside the round it plans, so
an update's totals (loss tokens and samples over every rank and micro-step) are known, and its
exact loss scales computed, before its first micro-step is queued. Planning needs no lookahead
beyond today's round, at a price paid in recirculated samples instead:

- `--accumulate K`: a round's step count is rounded to a multiple of K while data still arrives
  (down, or up to K by splitting groups), so every window is K steps. The epoch's final round
  (the join flush) keeps its count: its last window may be short.
- `--tokens-per-update T`: a window closes at the first step where its loss-bearing tokens over
  every rank reach T. The steps after a round's last closed window are not run: their samples go
  back to the buffer (recirculated, like alignment's surplus) and are regrouped next round.
  Only the epoch's final round keeps a short last window. A round in which no window closes (its
  buffers hold fewer than T tokens) is one short window: raise --buffer or lower T.

Without either flag every step is its own window: today's per-step loss scales, bit for bit.
"""

from __future__ import annotations

import bisect

import numpy as np

# Windows, the plan type, lives with the other plan types (types.py); re-exported here.
from odbd.planner.types import IntArray, Windows

__all__ = ["Windows", "closed_prefix", "cut_windows", "pack_order", "round_step_count"]


def round_step_count(target: int, accumulate: int, flushing: bool) -> int:
    """The round's step count under --accumulate K: a multiple of K unless the epoch flushes.

    Down while that leaves at least one window (surplus groups recirculate, as alignment does
    anyway), else up to K (alignment splits groups or adds idle fillers to get there).
    """
    if accumulate <= 1 or flushing or target == 0:
        return target
    return max(accumulate, target // accumulate * accumulate)


def cut_windows(
    step_tokens: IntArray, step_samples: IntArray, accumulate: int, tokens_per_update: int
) -> Windows:
    """Splits a round's steps into updates; the last one may be open (not closed).

    step_tokens/step_samples: (num_steps,) global loss tokens and samples of each step.
    """
    n = int(step_tokens.shape[0])
    ends: list[int] = []
    closed: list[bool] = []
    start, tokens = 0, 0
    for step in range(n):
        tokens += int(step_tokens[step])
        size = step + 1 - start
        if (tokens_per_update > 0 and tokens >= tokens_per_update) or (
            tokens_per_update == 0 and size >= accumulate
        ):
            ends.append(step + 1)
            closed.append(True)
            start, tokens = step + 1, 0
    if start < n:
        ends.append(n)
        closed.append(False)
    end_arr = np.asarray(ends, dtype=np.int64)
    start_arr = np.concatenate([[0], end_arr[:-1]]).astype(np.int64) if ends else end_arr
    return Windows(
        starts=start_arr,
        ends=end_arr,
        num_tokens=_range_sums(step_tokens, start_arr, end_arr),
        num_samples=_range_sums(step_samples, start_arr, end_arr),
        closed=np.asarray(closed, dtype=bool),
    )


def pack_order(step_tokens: IntArray, tokens_per_update: int) -> IntArray:
    """A step order whose updates overshoot T as little as possible (--tokens-per-update).

    The round's step order is free (assignment.step_order shuffles it anyway), so updates take
    steps in the shuffled order, except that when the next step would close the update (reach
    T), the pending step that reaches T by the least (best fit) closes it instead: an update
    never overshoots T by more than it would have in the shuffled order, usually by far less.
    """
    n = int(step_tokens.shape[0])
    tokens = [int(t) for t in step_tokens]
    by_size = sorted(range(n), key=lambda i: (tokens[i], i))  # pending steps, smallest first
    sizes = [tokens[i] for i in by_size]
    taken = [False] * n
    order: list[int] = []
    cursor, need = 0, tokens_per_update
    while len(order) < n:
        while taken[cursor]:
            cursor += 1
        step = cursor
        if tokens[step] >= need:  # it would close the update: the best-fitting step does
            step = by_size[bisect.bisect_left(sizes, need)]
        k = _index_of(by_size, sizes, tokens[step], step)
        del by_size[k], sizes[k]
        taken[step] = True
        order.append(step)
        need -= tokens[step]
        if need <= 0:
            need = tokens_per_update
    return np.asarray(order, dtype=np.int64)


def _index_of(by_size: list[int], sizes: list[int], size: int, step: int) -> int:
    k = bisect.bisect_left(sizes, size)
    while by_size[k] != step:  # equal sizes are ordered by step index
        k += 1
    return k


def closed_prefix(windows: Windows) -> int:
    """Steps up to the end of the last closed window (0 when none closed)."""
    done = np.flatnonzero(windows.closed)
    return int(windows.ends[done[-1]]) if done.size else 0


def _range_sums(values: IntArray, starts: IntArray, ends: IntArray) -> IntArray:
    csum = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    return (csum[ends] - csum[starts]).astype(np.int64)
