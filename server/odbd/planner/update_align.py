"""--align updates: ranks aligned at optimizer updates instead of micro-steps (issue 26, ODC).

With --align steps (the default) every rank runs every step of an update, and the update takes
sum over its steps of max over ranks of the step's cost: a rank with a light step waits at that
step's all-reduce, and idle fillers cost a step each. With --align updates a rank all-reduces
once per update, after its last micro-step (DDP `no_sync()` on the ones before), so the update
takes max over ranks of the sum of that rank's micro-steps' costs, and each rank runs only the
micro-steps it has groups for.

`align_updates` turns a round planned for step alignment into one for update alignment: each
unit's groups of each update (its non-idle slots over its ranks and the update's steps) are
dealt again over the unit's ranks by cost (deal_window), each rank's groups in its first slots
of the update. A rank may now run more micro-steps than the update had steps (many light
groups) or fewer (a few heavy ones): the update spans as many steps as its busiest rank runs
micro-steps, and the other ranks skip the rest. Samples never leave their unit (the
data-local bound), no group changes, and every group keeps its stats and loss scale (a
group's scale is its own weight over the update's total, both unchanged), so the ledger and
the exact per-update loss scales hold as they did; the journal records the aligned plan.

A rank runs `micro_steps[w, r]` >= 1 micro-steps in update w: its groups, or one idle filler
when its unit had fewer groups than ranks (it must still join the update's all-reduce). Its
slots after those are skipped: queued like every slot (step numbers, the journal and resume
points stay a grid every rank shares), but the client drops them unseen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from odbd.planner.config import PlannerConfig
from odbd.planner.types import (
    FloatArray,
    IntArray,
    NodeRoundPlan,
    RoundPlan,
    StepStats,
    UnitPlan,
)
from odbd.planner.windows import Windows


def deal_window(costs: FloatArray, ranks: IntArray, g: int, step_cost: float) -> list[IntArray]:
    """One unit's groups of one update, dealt to its g ranks: per rank, indices into `costs`
    in the order it runs them. `costs` (n,): each group's cost with the per-step constant;
    `ranks` (n,): the rank the step plan gave it, in step order.

    Longest processing time first: costliest first (ties: the lower index, so every daemon
    deals alike), each to the least loaded rank (ties: the lowest), any number per rank. LPT
    is no optimum, so the step plan's own dealing is kept when it is not slower."""
    load = np.zeros(g, dtype=np.float64)
    dealt: list[list[int]] = [[] for _ in range(g)]
    for i in np.lexsort((np.arange(costs.shape[0]), -costs)).tolist():
        rank = int(np.argmin(load))
        dealt[rank].append(i)
        load[rank] += float(costs[i])
    kept = [np.flatnonzero(ranks == r) for r in range(g)]
    if _makespan(kept, costs, step_cost) <= _makespan(dealt, costs, step_cost):
        return kept
    return [np.asarray(d, dtype=np.int64) for d in dealt]


def _makespan(
    dealt: Sequence[Sequence[int] | IntArray], costs: FloatArray, step_cost: float
) -> float:
    """The unit's slowest rank's time in the update; a rank without groups runs one filler."""
    return max(float(costs[np.asarray(d, dtype=np.int64)].sum()) if len(d) else step_cost
               for d in dealt)  # fmt: skip


@dataclass(frozen=True, slots=True)
class NodeDeal:
    """One node's groups of every update of a round dealt over its ranks (deal_window): all
    of --align updates a node can work out alone. The round's step grid needs every node's
    (UpdateGrid); the split live round sends `lengths`, `times` and the per-position columns
    to the hub (daemon/split_round.py, exchange 3)."""

    # per window, per column (rank) of the node: its groups' old slots (step * width + column)
    # in the order it runs them
    runs: tuple[tuple[IntArray, ...], ...]
    lengths: IntArray  # (W,) the node's most micro-steps of one rank per update (0: no group)
    times: FloatArray  # (W,) its slowest rank's time in each update (token-equivalents)
    # (sum(lengths),) per update, per position of a rank's run: the node's samples, loss tokens,
    # slowest rank's cost and summed cost there (the round's per-step facts after alignment)
    num_samples: IntArray
    num_tokens: IntArray
    max_work: FloatArray
    sum_work: FloatArray


@dataclass(frozen=True, slots=True)
class UpdateGrid:
    """The round's step grid under --align updates, the same on every node: each update's
    length in steps, and per new step the world's samples, tokens and costs."""

    lengths: IntArray  # (W,) max(the update's steps, every node's longest run)
    num_samples: IntArray  # (sum(lengths),)
    num_tokens: IntArray
    max_work: FloatArray
    sum_work: FloatArray
    time: float  # sum over updates of the slowest rank's time: the round's estimated time


def deal_node(
    stats: StepStats, units: Sequence[UnitPlan], windows: Windows, first: int, config: PlannerConfig
) -> NodeDeal:
    """Every update's groups of each unit dealt again over the unit's ranks (deal_window).
    `stats` holds the ranks first .. first + width - 1 (one node's, or the world's)."""
    g, c = config.ranks_per_unit, config.cost.c
    width = int(stats.num_samples.shape[1])
    busy = stats.num_samples > 0
    flat = {k: getattr(stats, k).reshape(-1) for k in ("num_samples", "num_tokens", "work")}
    runs: list[tuple[IntArray, ...]] = []
    lengths, times = [], []
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("s", "t", "max", "sum")}
    for w in range(len(windows)):
        start, end = int(windows.starts[w]), int(windows.ends[w])
        per_col: list[IntArray] = [np.zeros(0, dtype=np.int64)] * width
        slowest = 0.0
        for unit in units:
            col0 = unit.unit * g - first
            steps, local = np.nonzero(busy[start:end, col0 : col0 + g])
            costs = stats.work[steps + start, local + col0] + c
            slots = (steps + start) * width + col0 + local
            for j, d in enumerate(deal_window(costs, local, g, c)):
                per_col[col0 + j] = slots[d]
                slowest = max(slowest, float(costs[d].sum()) if len(d) else c)
        n = max((len(r) for r in per_col), default=0)
        at = np.full((n, width), -1, dtype=np.int64)  # old flat slot at (position, column)
        for col, r in enumerate(per_col):
            at[: len(r), col] = r
        has = at >= 0
        for key, name in (("s", "num_samples"), ("t", "num_tokens")):
            columns[key].append(np.where(has, flat[name][at], 0).sum(axis=1, dtype=np.int64))
        work = np.where(has, flat["work"][at], 0.0)
        columns["max"].append(work.max(axis=1) if width else np.zeros(n))
        columns["sum"].append(np.cumsum(work, axis=1)[:, -1] if width else np.zeros(n))
        runs.append(tuple(per_col))
        lengths.append(n)
        times.append(slowest)
    return NodeDeal(
        tuple(runs), np.asarray(lengths, dtype=np.int64), np.asarray(times, dtype=np.float64),
        *(_joined(columns[k], dtype) for k, dtype in
          (("s", np.int64), ("t", np.int64), ("max", np.float64), ("sum", np.float64))),
    )  # fmt: skip


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)


def reduce_deals(deals: Sequence[NodeDeal], windows: Windows) -> UpdateGrid:
    """Every node's deal, in node order -> the round's grid (the hub's reduction). An update
    spans as many steps as its busiest rank runs micro-steps, never fewer than before."""
    sizes = windows.ends - windows.starts
    lengths = np.max([sizes, *(d.lengths for d in deals)], axis=0).astype(np.int64)
    total = int(lengths.sum())
    out_starts = np.cumsum(lengths) - lengths
    summed: dict[str, np.ndarray] = {
        "num_samples": np.zeros(total, dtype=np.int64),
        "num_tokens": np.zeros(total, dtype=np.int64),
        "max_work": np.zeros(total, dtype=np.float64),
        "sum_work": np.zeros(total, dtype=np.float64),
    }
    for d in deals:  # node after node: float sums in the same order everywhere
        rows = np.concatenate(
            [out_starts[w] + np.arange(n) for w, n in enumerate(d.lengths.tolist())]
            + [np.zeros(0, dtype=np.int64)]
        ).astype(np.int64)
        summed["num_samples"][rows] += d.num_samples
        summed["num_tokens"][rows] += d.num_tokens
        summed["max_work"][rows] = np.maximum(summed["max_work"][rows], d.max_work)
        summed["sum_work"][rows] += d.sum_work
    slowest = np.max([d.times for d in deals], axis=0) if deals else np.zeros(len(windows))
    return UpdateGrid(lengths=lengths, time=sum(slowest.tolist()), **summed)


def pick_grid(grids: Sequence[UpdateGrid]) -> int:
    """The alternative whose updates end soonest; the first (the split plan) on a tie."""
    return min(range(len(grids)), key=lambda i: (grids[i].time, i))


def align_stats(
    stats: StepStats,
    units: Sequence[UnitPlan],
    windows: Windows,
    first: int,
    deal: NodeDeal,
    lengths: IntArray,
    config: PlannerConfig,
) -> tuple[StepStats, tuple[UnitPlan, ...], Windows, IntArray]:
    """A node's (or the world's) part moved onto the round's grid: each rank's groups in its
    first slots of every update, the rest idle. Returns the stats, units, windows and the
    (W, width) micro-steps each rank runs per update."""
    g = config.ranks_per_unit
    width = int(stats.num_samples.shape[1])
    new_ends = np.cumsum(lengths).astype(np.int64)
    new_starts = new_ends - lengths
    num_steps = int(new_ends[-1]) if len(lengths) else 0
    micro = np.ones((len(windows), width), dtype=np.int64)
    source = np.full((num_steps, width), -1, dtype=np.int64)  # old flat slot of each new one
    for w, per_col in enumerate(deal.runs):
        for col, slots in enumerate(per_col):
            source[int(new_starts[w]) + np.arange(len(slots)), col] = slots
            micro[w, col] = max(len(slots), 1)
    moved_units = tuple(_permute_unit(u, source, width, g, u.unit * g - first) for u in units)
    columns = {}
    has = source >= 0
    for name in StepStats.__dataclass_fields__:
        old = getattr(stats, name).reshape(-1)
        column = np.zeros((num_steps, width), dtype=old.dtype)
        column[has] = old[source[has]]
        columns[name] = column
    moved = replace(windows, starts=new_starts, ends=new_ends)
    return StepStats(**columns), moved_units, moved, micro


def align_node(
    plan: NodeRoundPlan, first: int, deal: NodeDeal, grid: UpdateGrid, config: PlannerConfig
) -> NodeRoundPlan:
    """One node's part of the round for --align updates, on the round's grid."""
    stats, units, moved, micro = align_stats(
        plan.stats, plan.units, plan.windows, first, deal, grid.lengths, config
    )
    return replace(
        plan,
        num_steps=int(grid.lengths.sum()),
        units=units,
        stats=stats,
        global_num_samples=grid.num_samples,
        global_num_tokens=grid.num_tokens,
        windows=moved,
        micro_steps=micro,
    )


def align_updates(plan: RoundPlan, config: PlannerConfig) -> RoundPlan:
    """The whole world's round for --align updates (one node's deal_node, reduce_deals and
    align_node over every rank at once): every update's groups re-dealt within each unit,
    each rank's first in its first slots of the update. An update then spans as many steps
    as its busiest rank runs micro-steps (never fewer than before), and the plan records
    how many each rank runs (RoundPlan.micro_steps)."""
    deal = deal_node(plan.stats, plan.units, plan.windows, 0, config)
    grid = reduce_deals([deal], plan.windows)
    stats, units, moved, micro = align_stats(
        plan.stats, plan.units, plan.windows, 0, deal, grid.lengths, config
    )
    return replace(
        plan,
        num_steps=int(grid.lengths.sum()),
        units=units,
        stats=stats,
        windows=moved,
        micro_steps=micro,
    )


def _permute_unit(unit: UnitPlan, source: IntArray, width: int, g: int, col0: int) -> UnitPlan:
    """The unit's emitted samples in the new slot order; `source`: (steps, width) the old
    (step * width + column) of each new slot, -1 for an idle one; the unit's ranks are the
    columns col0 .. col0 + g - 1."""
    mine = source[:, col0 : col0 + g].reshape(-1)
    old_step, old_col = np.divmod(np.where(mine >= 0, mine, 0), width)
    old_slot = np.where(mine >= 0, old_step * g + old_col - col0, 0)
    offsets = unit.slot_offsets
    starts = np.where(mine >= 0, offsets[old_slot], 0)
    sizes = np.where(mine >= 0, offsets[old_slot + 1] - offsets[old_slot], 0)
    new_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = np.repeat(starts - new_offsets[:-1], sizes) + np.arange(int(sizes.sum()))
    return replace(unit, emitted=unit.emitted.take(rows.astype(np.int64)), slot_offsets=new_offsets)


def rank_runs(plan: RoundPlan | NodeRoundPlan) -> np.ndarray:
    """(num_steps, ranks) bool: the slots a rank runs (True everywhere with --align steps)."""
    runs = np.ones(plan.stats.num_samples.shape, dtype=bool)
    if plan.micro_steps is None:
        return runs
    position = np.arange(plan.num_steps) - np.repeat(
        plan.windows.starts, plan.windows.ends - plan.windows.starts
    )
    return position[:, None] < plan.micro_steps[plan.windows.of_step()]


def update_times(plan: RoundPlan, step_cost: float) -> FloatArray:
    """(num_windows,) each update's time in token-equivalents: max over ranks of the sum of the
    rank's micro-steps' costs (--align updates), or the sum over the update's steps of the
    slowest rank's cost (--align steps)."""
    windows = plan.windows
    work = plan.stats.work
    if plan.micro_steps is None:
        per_step = work.max(axis=1) + step_cost
        return np.add.reduceat(per_step, windows.starts) if len(windows) else np.zeros(0)
    runs = rank_runs(plan)
    per_rank = np.add.reduceat(np.where(runs, work + step_cost, 0.0), windows.starts, axis=0)
    return per_rank.max(axis=1) if len(windows) else np.zeros(0)
