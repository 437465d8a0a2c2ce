"""Step assignment: which fitted group runs on which (rank, step) of the round.

A step lasts as long as its slowest rank, so min-time sorts a unit's groups by cost and gives
each step a run of similar-cost groups; every unit uses the same sorted position for the same
step, which also matches costs across nodes. One shared permutation then mixes the steps so
long-sample steps are not all at the start of the round.
"""

from __future__ import annotations

import numpy as np

from odbd.planner.types import IntArray


def step_order(num_steps: int, seed: int, round_index: int) -> IntArray:
    """perm[k] = the step that gets the k-th most expensive slice; identical on every daemon."""
    rng = np.random.default_rng([seed, round_index])
    return rng.permutation(num_steps).astype(np.int64)


def slots_by_cost(work: np.ndarray, ranks_per_unit: int, perm: IntArray) -> IntArray:
    """group_of_slot for min-time: slot s = step * G + local_rank holds group group_of_slot[s].

    The k-th run of G groups (by descending cost) goes to step perm[k]; within a run the local
    rank rotates with k so no rank is always the heaviest of its node.
    """
    g = ranks_per_unit
    by_cost = np.argsort(-work, kind="stable")
    j = np.arange(by_cost.shape[0], dtype=np.int64)
    run = j // g
    slot = perm[run] * g + (j + run) % g
    group_of_slot = np.empty_like(by_cost)
    group_of_slot[slot] = by_cost
    return group_of_slot


def slots_in_order(num_groups: int) -> IntArray:
    """The paper's order: group j runs at step j // G on local rank j % G."""
    return np.arange(num_groups, dtype=np.int64)
