"""Which samples a unit runs in a round of few, large groups (min-time, padded; issue 14, item 1).

A buffer of short samples is cut into few groups of hundreds of samples each (all-short: ~32
groups of ~250 per 8,192-sample buffer, 33 integer lengths), so nearly every greedy group
straddles two lengths and pads its shorter members by a token or so: ~1 % of the round's
work, enough to cost the epoch one step more than the offline oracle's. A round of few steps
can afford to run fewer groups and keep more samples back (they wait in the buffer and meet
the next round's arrivals), if the samples kept back are the ones that pad:

1. decide (every daemon, from the summaries): in a filling round without a sample over the
   budget whose T x G is at most MAX_SELECT_GROUPS and whose units' groups hold at least
   MIN_GROUP_SAMPLES samples on average, T is lowered by RESERVE_STEPS (at least one
   step is left) and the round is marked `select_fullest` (`reserve_steps`); rounds of up to
   WIDE_MAX_SELECT_GROUPS groups of at least WIDE_MIN_GROUP_SAMPLES give up WIDE_RESERVE_STEPS
   (longtail: groups of ~42 samples, ~23 steps a round);
2. select (each unit on its node): of every way to run T x G greedy full groups over the exact
   longest-first sort, skipping samples between them, the one with the most real tokens
   (`fullest_groups`, an exact dynamic programme); the skipped samples recirculate.

Groups are still the greedy full groups (each takes as many of the next samples as the budget
admits), so the budget holds; a round still runs T x G full groups, so an epoch still takes
O(N / W + D) rounds; nothing waits once a unit is dry (the epoch's last rounds flush everything).
The programme makes T x G passes over a band of the buffer about as wide as the samples
skipped, which is why only rounds of few groups use it (MAX_SELECT_GROUPS): those are the
rounds of many short samples per group, where a straddle costs the most. Measured in
docs/bench/planner.md, fifth and sixth passes.
"""

from __future__ import annotations

import numpy as np

from odbd.planner.types import FloatArray, IntArray

# Steps a selecting round gives up, so its units keep ~RESERVE_STEPS x G groups' worth of
# samples back to choose from (all-short at W=16: 1 / 2 steps gave odbd/oracle 0.98800 / 0.99610,
# 0.98819 with none).
RESERVE_STEPS = 2
# The most groups per unit (T x G, before the reserve) of a round that selects: the programme
# costs one pass over the buffer per group run.
MAX_SELECT_GROUPS = 64
# The fewest samples per group (each unit's mean) of a round that selects: a straddle of one
# token pads a group's shorter members by ~1 / l, and a group holds ~L / l samples, so only
# groups of many short samples lose much to it (all-short: ~250 per group, 1.1 % padding).
MIN_GROUP_SAMPLES = 64


# The wider band (sixth pass): rounds of up to WIDE_MAX_SELECT_GROUPS groups of at least
# WIDE_MIN_GROUP_SAMPLES samples give up WIDE_RESERVE_STEPS (longtail: ~42 samples a group,
# ~23 steps a round). One step's worth of samples kept back is enough to choose from there:
# giving up 2 (the narrow band's) lowered longtail at W=1024, 1 raised every longtail row
# (W=1024: 0.97721 -> 0.97714 / 0.97916 of the oracle).
WIDE_RESERVE_STEPS = 1
WIDE_MAX_SELECT_GROUPS = 256
WIDE_MIN_GROUP_SAMPLES = 32


def reserve_steps(target_steps: int, ranks_per_unit: int, samples_per_group: float) -> int:
    """Steps given up in a round of `target_steps` whose units' groups hold at least
    `samples_per_group` samples on average (0: the round does not select)."""
    num_groups = target_steps * ranks_per_unit
    if num_groups <= MAX_SELECT_GROUPS and samples_per_group >= MIN_GROUP_SAMPLES:
        reserve = RESERVE_STEPS
    elif num_groups <= WIDE_MAX_SELECT_GROUPS and samples_per_group >= WIDE_MIN_GROUP_SAMPLES:
        reserve = WIDE_RESERVE_STEPS
    else:
        return 0
    return min(reserve, target_steps - 1)


def fullest_groups(
    lengths: IntArray, budget: int, num_groups: int, bonus: FloatArray | None = None
) -> tuple[IntArray, IntArray] | None:
    """Starts and ends of `num_groups` disjoint ranges of `lengths` (sorted longest first), each
    the greedy full group from its first sample, with the most real tokens (plus `bonus`, per
    sample, for samples that should not wait again); None if fewer than that many fit.

    A group from sample s ends at end(s) = min(s + floor(L / l_s), n), non-decreasing in s, so
    the k-th group of any choice starts no earlier than the k-th greedy group from the front
    (`first`) and no later than leaves room for the rest (`last`): the programme only visits
    that band, ~ the skipped samples wide. best_k(s) = gain(s) + the most of k - 1 groups
    ending by s (a prefix maximum over the previous band).
    """
    n = int(lengths.shape[0])
    if num_groups < 1 or n == 0:
        return None
    ends = np.minimum(np.arange(n) + np.maximum(budget // np.maximum(lengths, 1), 1), n)
    value = lengths.astype(np.float64) if bonus is None else lengths + bonus
    csum = np.concatenate([[0.0], np.cumsum(value)])
    gain = csum[ends] - csum[:-1]
    bands = _bands(ends, num_groups)
    if bands is None:
        return None
    first, last = bands
    # ends is non-decreasing, so the starts in band k - 1 whose group ends by s are a prefix of
    # it: (starts ending by s) - first[k - 1], clipped to the band; one search for every k.
    ending_by = np.searchsorted(ends, np.arange(n), "right")
    best = gain[first[0] : last[0] + 1]
    bests = [best]  # per k: the most tokens of k + 1 groups, the last starting at each of band k
    for k in range(1, num_groups):
        prefix = np.maximum.accumulate(best)
        before = np.clip(ending_by[first[k] : last[k] + 1] - first[k - 1], 0, len(best))
        reach = np.maximum(before - 1, 0)
        best = np.where(before > 0, gain[first[k] : last[k] + 1] + prefix[reach], -np.inf)
        bests.append(best)
    if not np.isfinite(best.max()):
        return None
    starts = np.empty(num_groups, dtype=np.int64)
    starts[-1] = int(np.argmax(best)) + first[-1]
    for k in range(num_groups - 1, 0, -1):
        # its predecessor: the best start of band k - 1 it can follow (argmax: ties, the earlier)
        reach_k = int(ending_by[starts[k]]) - first[k - 1]
        starts[k - 1] = int(np.argmax(bests[k - 1][:reach_k])) + first[k - 1]
    return starts, ends[starts].astype(np.int64)


def _bands(ends: IntArray, num_groups: int) -> tuple[list[int], list[int]] | None:
    """Per k, the first and last sample the k-th of `num_groups` groups can start at."""
    n = int(ends.shape[0])
    first: list[int] = []
    s = 0
    for _ in range(num_groups):
        if s >= n:
            return None
        first.append(s)
        s = int(ends[s])
    last = [0] * num_groups
    limit = n - 1
    for k in range(num_groups - 1, -1, -1):
        last[k] = limit
        limit = int(np.searchsorted(ends, limit, side="right")) - 1  # its end <= the next start
    if any(lo > hi for lo, hi in zip(first, last, strict=True)):
        return None
    return first, last
