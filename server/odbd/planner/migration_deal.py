"""The deal (`--migrate auto`): a round's samples that share groups are cut into the world's
groups and dealt round-robin, so every node runs neighbours of one world-wide sort.

Why: balancing each cost level's count (migration.py) evens what every node holds, but each
node still cuts its groups from its own 1/N of the round. Neighbours in a node's sort are ~N
places apart in the world's, so its groups pad as if the buffer were N times sparser, and its
k-th run of G groups differs from the other nodes' by the noise of its draw. At W = 1024 that
was most of what longtail and the heavy tail still lost to the global oracle, which sorts the
whole epoch: padding 0.3-0.6 % of the epoch's time and as much again in steps whose nodes
differ (docs/bench/migration.md, "Where the remaining gaps went").

How: sort the ordinary samples (not a group of one, not held) longest first, cut them with
the greedy fill every node uses (grouping.fill_cuts), take the groups in blocks of W = G x
nodes (a step's worth) and give group j of a block to node j mod nodes. Each node then holds
G groups of every block, spread over the block, so its k-th run of G by cost is block k's
share and step k runs block k world-wide. A node re-cuts what it receives with the same fill,
and a greedy group's size is set by its first (longest) sample alone, so a cut that starts at
a dealt group's first sample takes that group again. Dealing each node a contiguous run of G
instead tilted every step (node 0 always the block's longest): heavy tail W = 128 0.9878 of
the oracle, round-robin 0.9925, no deal 0.9915.

Most of those samples move ((N - 1) / N of them): plan_migration takes the deal only where
the work it saves, estimated by cutting every node's samples as its plan would (`cut_work`),
beats the link time of its bytes over the best level balance.

Pure: every daemon (the hub, over digest stand-ins) deals the same way from the same inputs.
"""

from __future__ import annotations

import numpy as np

from odbd.planner.config import CostModel
from odbd.planner.grouping import fill_cuts
from odbd.planner.types import FloatArray, IntArray


def deal(lengths: IntArray, budget: int, num_units: int) -> IntArray:
    """The unit each sample goes to: greedy groups over the longest-first sort (ties: input
    order), group j to unit j mod num_units (so each block of G x num_units groups, a step's
    worth, gives every unit G groups spread over it; units differ by at most one group)."""
    out = np.zeros(lengths.shape, dtype=np.int64)
    if lengths.size == 0:
        return out
    order = np.argsort(-lengths, kind="stable")
    starts, ends = fill_cuts(lengths[order], budget)
    unit_of_group = np.arange(len(starts), dtype=np.int64) % num_units
    out[order] = np.repeat(unit_of_group, np.asarray(ends) - np.asarray(starts))
    return out


def fewest_moves(classes: IntArray, holder: IntArray, dealt: IntArray, num_units: int) -> IntArray:
    """The unit each sample goes to so that every unit ends with `dealt`'s count of every class
    (samples of one class are interchangeable: one work, one length), moving the fewest: a
    unit keeps min(held, dealt) of a class (its first rows), its surplus fills the other units'
    shortfalls in unit order.

    Why: the deal hands each group to one unit, so a unit would send most of its samples and
    receive as many of the same cost back. Only the counts matter to the groups a unit cuts:
    longtail at W = 1024 moved 110 % of the bytes it ingested per round dealing samples one by
    one, and the hub's moves payload, broadcast to every node, was 10.9 MB a round."""
    key_held = classes * num_units + holder
    key_dealt = classes * num_units + dealt
    size = (int(classes.max()) + 1) * num_units if classes.size else 0
    held = np.bincount(key_held, minlength=size)
    wanted = np.bincount(key_dealt, minlength=size)
    kept = np.minimum(held, wanted)
    by_key = np.argsort(key_held, kind="stable")
    first_of_key = np.concatenate([[0], np.cumsum(held)[:-1]])
    rank = np.arange(classes.size) - first_of_key[key_held[by_key]]
    stays = np.zeros(classes.size, dtype=bool)
    stays[by_key] = rank < kept[key_held[by_key]]
    out = holder.copy()
    leaving = by_key[~stays[by_key]]  # by class, then holder
    short = np.repeat(np.arange(size), wanted - kept)  # keys short of samples, by class
    out[leaving] = short % num_units
    return out


def cut_work(
    unit: IntArray,
    lengths: IntArray,
    patches: IntArray,
    num_units: int,
    budget: int,
    cost: CostModel,
) -> tuple[FloatArray, IntArray]:
    """Per unit: the summed work of the groups a greedy cut of its samples (longest first)
    makes under the padded budget, and how many there are."""
    order = np.lexsort((-lengths, unit))
    sorted_lengths = lengths[order]
    sorted_units = unit[order]
    bounds = np.searchsorted(sorted_units, np.arange(num_units + 1))
    starts: list[int] = []
    ends: list[int] = []
    for u in range(num_units):
        a, b = int(bounds[u]), int(bounds[u + 1])
        s, e = fill_cuts(sorted_lengths[a:b], budget)
        starts.extend(x + a for x in s)
        ends.extend(x + a for x in e)
    if not starts:
        return np.zeros(num_units), np.zeros(num_units, dtype=np.int64)
    first = np.asarray(starts, dtype=np.int64)
    last = np.asarray(ends, dtype=np.int64)
    as_float = sorted_lengths.astype(np.float64)
    squares = np.concatenate([[0.0], np.cumsum(as_float * as_float)])
    summed_patches = np.concatenate([[0.0], np.cumsum(patches[order].astype(np.float64))])
    work = cost.work(
        as_float[first] * (last - first),
        squares[last] - squares[first],
        summed_patches[last] - summed_patches[first],
    )
    group_unit = sorted_units[first]
    return (
        np.bincount(group_unit, weights=np.asarray(work, np.float64), minlength=num_units),
        np.bincount(group_unit, minlength=num_units).astype(np.int64),
    )
