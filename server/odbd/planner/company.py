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
not change. Every daemon sees every unit's groups, so the choice is the same everywhere.

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
    recirculated before; num_slots: groups each unit runs this round (T * G).
    """
    waits = [np.zeros(len(c), dtype=bool) for c in costs]
    if num_slots == 0 or not any(len(c) > num_slots for c in costs):
        return waits
    depth = min(num_slots, PROFILE_DEPTH)
    orders = [_costliest_first(c, depth + max_waits) for c in costs]
    profiles = np.zeros((len(costs), depth))
    for u, (c, order) in enumerate(zip(costs, orders, strict=True)):
        top = c[order[:depth]]
        profiles[u, : len(top)] = top
    reference = np.median(profiles, axis=0)
    # A unit whose profile never rises above the reference cannot come closer by waiting (that
    # only lowers its profile), so it is not searched (~1 unit in 5 on a heavy tail).
    above: np.ndarray = np.asarray((profiles > reference[None, :]).any(axis=1))
    for u, (c, f, order) in enumerate(zip(costs, fresh, orders, strict=True)):
        if len(c) > num_slots and above[u]:
            surplus = min(len(c) - num_slots, max_waits)
            waits[u] = _closest_shift(c, f, order, surplus, reference)
    return waits


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
