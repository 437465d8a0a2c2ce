"""Costly groups wait a round for company (min-time; issue 14, item 1).

A step lasts as long as its costliest group, and every unit gives each step G groups from its
own buffer (data stays on its node), the k-th costliest run of G on every unit sharing step k
(assignment.py). When one unit holds more costly groups than the others (a heavy tail: a few
giants more on one node), its extra giants land in steps where the other units run ordinary
groups, and those steps cost a giant's time for the work of ordinary ones.

A unit that has more groups than the round's T * G slots recirculates some anyway. Here it
recirculates its costliest *fresh* groups instead, as many as bring its cost profile (its groups'
costs sorted, position by position) closest to the round's median profile over all units. Only
groups never recirculated before may wait, so a group waits at most one round (the termination
bound of DESIGN.md section 3.3 keeps its form), and only the unit's surplus may wait, so T does
not change. The reference is the median of every unit's profile, which each unit's summary carries
(summary.py), so every daemon computes the same one; a unit's own choice is made on its node.

plan_round searches only rounds that hold a group over the budget (a giant): on the named
distributions, which have none, waiting moved the oracle ratio by <= 0.002 for ~5 % of
plan_round's time; on a Pareto heavy tail it gains 0.007-0.015 (docs/bench/planner.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from odbd.planner.types import FloatArray


def waiting_groups(
    costs: Sequence[FloatArray], fresh: Sequence[np.ndarray], num_slots: int, max_waits: int
) -> list[np.ndarray]:
    """Per unit, a bool mask over its groups: True = recirculate this round.

    costs[u]: (groups,) work of unit u's groups; fresh[u]: (groups,) True if no member was
    recirculated before; num_slots: groups each unit runs this round (T * G). The split planner
    runs the same two steps on different daemons: reference_profile from every unit's
    top_profile (the round's summaries), unit_waits on the unit's own node.
    """
    if num_slots == 0 or not any(len(c) > num_slots for c in costs):
        return [np.zeros(len(c), dtype=bool) for c in costs]
    reference = reference_profile([top_profile(c, PROFILE_DEPTH) for c in costs], num_slots)
    return [
        unit_waits(c, f, num_slots, max_waits, reference) for c, f in zip(costs, fresh, strict=True)
    ]


def top_profile(cost: FloatArray, depth: int) -> FloatArray:
    """(<= depth,) the unit's `depth` largest group costs, descending: its cost profile."""
    return -np.sort(-np.asarray(cost, dtype=np.float64))[:depth]


def reference_profile(profiles: Sequence[FloatArray], num_slots: int) -> FloatArray:
    """(depth,) the median over units of their profiles (zero beyond a unit's groups), depth =
    min(num_slots, PROFILE_DEPTH). np.median sorts each column: the same on every daemon."""
    depth = min(num_slots, PROFILE_DEPTH)
    matrix = np.zeros((len(profiles), depth))
    for u, profile in enumerate(profiles):
        top = profile[:depth]
        matrix[u, : len(top)] = top
    return np.asarray(np.median(matrix, axis=0), dtype=np.float64)


def unit_waits(
    cost: FloatArray, fresh: np.ndarray, num_slots: int, max_waits: int, reference: FloatArray
) -> np.ndarray:
    """One unit's waits (bool over its groups) given the round's reference profile."""
    wait = np.zeros(len(cost), dtype=bool)
    if len(cost) <= num_slots or num_slots == 0:
        return wait
    depth = len(reference)
    order = _costliest_first(cost, depth + max_waits)
    profile = np.zeros(depth)
    top = cost[order[:depth]]
    profile[: len(top)] = top
    # A unit whose profile never rises above the reference cannot come closer by waiting (that
    # only lowers its profile), so it is not searched (~1 unit in 5 on a heavy tail).
    if not bool((profile > reference).any()):
        return wait
    surplus = min(len(cost) - num_slots, max_waits)
    return _closest_shift(cost, fresh, order, surplus, reference)


# Positions of the profile compared: the costliest groups, where a heavy tail's giants sit.
# Comparing whole profiles gained at most 0.003 more of the oracle's efficiency in
# bench-planner's table, for a ~5x longer search (an (s, T * G) gather per unit).
PROFILE_DEPTH = 64


def _costliest_first(cost: FloatArray, count: int) -> np.ndarray:
    """The first >= `count` entries of np.argsort(-cost, kind="stable") (all if fewer).

    Only these can move the top `depth` positions: a fresh group below position
    depth + max_waits shifts nothing above depth when it waits. np.partition finds the count-th
    largest *value*, the same on every machine (argpartition's choice among equal values is
    not), and every cost >= it is sorted stably, so ties keep index order as in a full sort.
    """
    if count >= len(cost):
        return np.argsort(-cost, kind="stable")
    threshold = np.partition(cost, len(cost) - count)[len(cost) - count]
    top = np.flatnonzero(cost >= threshold)
    return top[np.argsort(-cost[top], kind="stable")]


def _closest_shift(
    cost: FloatArray, fresh: np.ndarray, order: np.ndarray, max_waits: int, reference: FloatArray
) -> np.ndarray:
    """Waits for the s costliest fresh groups, s <= max_waits minimizing the L1 distance of the
    unit's top profile to `reference` (same length); ties go to fewer waits.

    Dropping the first s fresh positions p_1 < ... < p_s of the sorted costs moves new position j
    to old position j + #{i <= s : p_i - (i - 1) <= j}; all s at once is one (s, depth) gather.
    """
    depth = len(reference)
    sorted_cost = cost[order]
    removable = np.flatnonzero(fresh[order])[:max_waits]  # `order` may hold only the top
    shifted = removable - np.arange(len(removable))  # p_i - (i - 1), nondecreasing
    below = np.searchsorted(shifted, np.arange(depth), side="right")
    counts = np.arange(len(removable) + 1)[:, None]
    old = np.arange(depth)[None, :] + np.minimum(counts, below[None, :])
    # cumsum adds left to right on every machine (a pairwise sum's order is numpy's choice), so
    # every daemon compares the same distances.
    distance = np.cumsum(np.abs(sorted_cost[old] - reference[None, :]), axis=1)[:, -1]
    best = int(np.argmin(distance))  # first minimum: the fewest waits
    wait = np.zeros(len(cost), dtype=bool)
    wait[order[removable[:best]]] = True
    return wait
