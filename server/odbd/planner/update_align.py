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
from dataclasses import replace

import numpy as np

from odbd.planner.config import PlannerConfig
from odbd.planner.types import FloatArray, IntArray, RoundPlan, StepStats, UnitPlan


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


def align_updates(plan: RoundPlan, config: PlannerConfig) -> RoundPlan:
    """The round for --align updates: every update's groups re-dealt within each unit
    (deal_window), each rank's first in its first slots of the update. An update then spans
    as many steps as its busiest rank runs micro-steps (never fewer than before), and the
    plan records how many each rank runs (RoundPlan.micro_steps)."""
    g = config.ranks_per_unit
    world = config.world.world_size
    windows = plan.windows
    busy = plan.stats.num_samples > 0
    # per window, unit: each local rank's old slots (step * g + local), in run order
    deals: list[list[list[IntArray]]] = []
    lengths = []
    for w in range(len(windows)):
        start, end = int(windows.starts[w]), int(windows.ends[w])
        per_unit = []
        for unit in plan.units:
            ranks = config.unit_ranks(unit.unit)
            steps, local = np.nonzero(busy[start:end, ranks.start : ranks.stop])
            costs = plan.stats.work[steps + start, local + ranks.start] + config.cost.c
            slots = (steps + start) * g + local
            per_unit.append([slots[d] for d in deal_window(costs, local, g, config.cost.c)])
        deals.append(per_unit)
        lengths.append(max(end - start, *(len(d) for u in per_unit for d in u)))
    new_ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    new_starts = new_ends - np.asarray(lengths, dtype=np.int64)
    num_steps: int = int(new_ends[-1]) if lengths else 0
    micro = np.ones((len(windows), world), dtype=np.int64)
    # old (step, rank) of every new slot, -1 = idle (a rank's skipped or filler slot)
    source = np.full((num_steps, world), -1, dtype=np.int64)
    for w, per_unit in enumerate(deals):
        for unit, dealt in zip(plan.units, per_unit, strict=True):
            first = unit.unit * g
            for j, slots in enumerate(dealt):
                rows = int(new_starts[w]) + np.arange(len(slots))
                old_step, old_local = np.divmod(slots, g)
                source[rows, first + j] = old_step * world + first + old_local
                micro[w, first + j] = max(len(slots), 1)
    units = tuple(_permute_unit(u, source, world, g) for u in plan.units)
    columns = {}
    for name in StepStats.__dataclass_fields__:
        old = getattr(plan.stats, name).reshape(-1)
        column = np.zeros((num_steps, world), dtype=old.dtype)
        has = source >= 0
        column[has] = old[source[has]]
        columns[name] = column
    moved = replace(windows, starts=new_starts, ends=new_ends)
    return replace(
        plan,
        num_steps=num_steps,
        units=units,
        stats=StepStats(**columns),
        windows=moved,
        micro_steps=micro,
    )


def _permute_unit(unit: UnitPlan, source: IntArray, world: int, g: int) -> UnitPlan:
    """The unit's emitted samples in the new slot order; `source`: (steps, world) the old
    (step * world + rank) of each new slot, -1 for an idle one."""
    first = unit.unit * g
    mine = source[:, first : first + g].reshape(-1)
    old_step, old_rank = np.divmod(np.where(mine >= 0, mine, 0), world)
    old_slot = np.where(mine >= 0, old_step * g + old_rank - first, 0)
    offsets = unit.slot_offsets
    starts = np.where(mine >= 0, offsets[old_slot], 0)
    sizes = np.where(mine >= 0, offsets[old_slot + 1] - offsets[old_slot], 0)
    new_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = np.repeat(starts - new_offsets[:-1], sizes) + np.arange(int(sizes.sum()))
    return replace(unit, emitted=unit.emitted.take(rows.astype(np.int64)), slot_offsets=new_offsets)


def rank_runs(plan: RoundPlan) -> np.ndarray:
    """(num_steps, world) bool: the slots a rank runs (True everywhere with --align steps)."""
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
