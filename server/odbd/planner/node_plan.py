"""Phase 2 of a round (summary.py lists the phases): a node fits and places its own groups.

Input: this node's GroupedUnits (phase 0) and the round's RoundDecision (phase 1). Output: a
NodeDraft (its units' UnitPlans and per (step, rank) columns) and StepTotals, the small payload
every node sends so that each can compute exact loss scales and updates (completion.py).
Cost O(this node's samples): nothing here depends on another node's buffer, only on T, the
shared step order and the company cap, which are the same on every daemon.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from odbd.planner import alignment, assignment, company, selection
from odbd.planner.config import Align, Grouping, LossScaling, PlannerConfig
from odbd.planner.grouping import longest_first_in_each, sort_longest_first, swap_across_cuts
from odbd.planner.loss_scaling import step_weights
from odbd.planner.summary import GroupedUnit, SortedBuffer, range_max
from odbd.planner.types import (
    FloatArray,
    Groups,
    IntArray,
    RoundDecision,
    SampleTable,
    StepTotals,
    UnitPlan,
)

COLUMNS = ("num_samples", "num_tokens", "real_tokens", "padded_tokens", "sum_sq", "patches")


@dataclass(frozen=True, slots=True)
class NodeDraft:
    """A node's units placed on (rank, step), before loss scales and updates."""

    node: int
    units: tuple[UnitPlan, ...]  # in unit order
    columns: dict[str, np.ndarray]  # COLUMNS -> (T, this node's ranks)
    mean_tokens: FloatArray  # (this node's ranks,) its unit's mean loss tokens per sample
    totals: StepTotals


def plan_node(
    node: int, units: Sequence[GroupedUnit], decision: RoundDecision, config: PlannerConfig
) -> NodeDraft:
    """Phase 2: fits every local unit to T steps and assigns its groups to (rank, step)."""
    g, num_steps = config.ranks_per_unit, decision.num_steps
    plans: list[UnitPlan] = []
    parts: list[dict[str, np.ndarray]] = []
    for unit in units:
        fitted, buffer = _fit(unit, num_steps * g, config, decision)
        slot_stats = buffer.range_stats(fitted.starts, fitted.ends)
        if config.grouping is Grouping.PAPER:
            group_of_slot = assignment.slots_in_order(len(fitted.starts))
        else:
            work = config.cost.work(
                slot_stats["padded_tokens"], slot_stats["sum_sq"], slot_stats["patches"]
            )
            group_of_slot = assignment.slots_by_cost(work, g, decision.step_order)
        plans.append(_unit_plan(unit.offer.unit, unit.offer.samples, fitted, group_of_slot))
        parts.append({k: v[group_of_slot].reshape(num_steps, g) for k, v in slot_stats.items()})
    columns = {
        k: np.concatenate([p[k] for p in parts], axis=1)
        if parts
        else np.zeros((num_steps, 0), dtype=np.int64)
        for k in COLUMNS
    }
    mean_tokens = np.repeat([_mean_tokens(u.offer.samples) for u in units], g).astype(np.float64)
    totals = _step_totals(node, columns, mean_tokens, plans, config)
    return NodeDraft(node, tuple(plans), columns, mean_tokens, totals)


def _step_totals(
    node: int,
    columns: dict[str, np.ndarray],
    mean_tokens: FloatArray,
    plans: Sequence[UnitPlan],
    config: PlannerConfig,
) -> StepTotals:
    samples, tokens = columns["num_samples"], columns["num_tokens"]
    approx = np.zeros(0)
    if config.loss_scaling is LossScaling.APPROX:
        approx = step_weights(config.loss_scaling, samples, tokens, mean_tokens).sum(axis=1)
    return StepTotals(
        node=node,
        num_tokens=tokens.sum(axis=1).astype(np.int64),
        num_samples=samples.sum(axis=1).astype(np.int64),
        approx_weights=approx,
        drained=all(len(p.leftover) == 0 for p in plans),
    )


def _fit(
    unit: GroupedUnit, num_slots: int, config: PlannerConfig, decision: RoundDecision
) -> tuple[alignment.FittedGroups, SortedBuffer]:
    """The unit's T x G slots, and its buffer in the order their ranges index."""
    if config.grouping is Grouping.PAPER:
        return alignment.fit_groups_paper(unit.groups, num_slots), unit.buffer
    priority = _keep_priority(unit.groups, unit.buffer, config)
    hold = np.zeros(len(unit.groups), dtype=bool)
    if decision.reference is not None:
        hold = company.unit_holds(unit.work, unit.ages, decision.reference, len(unit.profile))
        if hold.any():  # below every keep priority (those are >= 0): recirculated first, and
            # the costliest last should the unit lack room for T steps without them
            rank = unit.work / max(float(unit.work.max()), 1e-300)
            priority = np.where(hold, -1.0 - rank, priority)
    if decision.select_fullest and len(unit.groups) > num_slots:
        fullest = _fullest(unit, num_slots, hold, config)
        if fullest is not None:
            return fullest
    # --align updates: a unit short of groups leaves slots idle (its ranks skip them) rather
    # than split groups into more micro-steps, each costing the per-step constant
    split = config.align is Align.STEPS
    if split and decision.all_dry and len(unit.groups) < num_slots:
        flushed = _flush_cut(unit, num_slots, config, decision.round_index)
        if flushed is not None:
            return flushed
    return alignment.fit_groups(unit.groups, num_slots, priority, split), unit.buffer


def _flush_cut(
    unit: GroupedUnit, num_slots: int, config: PlannerConfig, round_index: int
) -> tuple[alignment.FittedGroups, SortedBuffer] | None:
    """The epoch's flush: a unit short of groups for T x G slots runs all it holds cut into
    exactly that many groups of least largest work (alignment.flush_cuts) over its grouping
    order, each group then longest first; None (split as before) under --collate packed, a
    patch budget or dense rows, whose groups are not priced as ranges of one order, and for a
    unit holding a group of one (a sample over L/2): its ordinary groups would all sit at the
    unit's own least largest work, which differs from node to node with each node's groups of
    one (heavy tail W = 1024: 0.9898 -> 0.9896 of the global oracle with them cut too)."""
    samples, order = unit.offer.samples, unit.groups.order
    if (
        len(samples) == 0
        or unit.buffer.packed
        or config.max_patches > 0
        or config.cost.dense_rows
        or 2 * int(samples.lengths.max()) > config.token_budget
    ):
        return None
    lengths = samples.lengths[order]
    squares = lengths.astype(np.float64) ** 2
    row_work = np.asarray(config.cost.work(0.0, squares, samples.patches[order]), np.float64)
    cuts = alignment.flush_cuts(lengths, row_work, config.cost.a, config.token_budget, num_slots)
    if cuts is None:
        return None
    starts, ends, num_splits = cuts
    order = longest_first_in_each(order, lengths, starts, ends)
    if config.fresh_groups:
        order = _vary(order, samples.lengths, starts, ends, config, round_index, unit.offer.unit)
    buffer = SortedBuffer.of(samples, order, packed=False)
    empty = np.zeros(0, dtype=np.int64)
    return alignment.FittedGroups(order, starts, ends, empty, num_splits), buffer


def _vary(
    order: IntArray,
    lengths: IntArray,
    starts: IntArray,
    ends: IntArray,
    config: PlannerConfig,
    round_index: int,
    unit: int,
) -> IntArray:
    """The flush cut's groups varied as grouping.py varies greedy ones (swaps across random
    cuts, within the budget), seeded by (seed, round, unit) like the unit's jittered sort.

    Why: a buffer holding the whole dataset flushes every epoch, and over a sparse one (few
    samples within 1 % of each other) the jittered order barely moves, so the cut of least
    largest work repeated every group of the epoch before
    (tests/unit/test_planner_properties.py::test_two_epochs_over_a_whole_dataset_buffer_form_different_groups,
    26 of 26 groups at seed 0); the idle fillers after the cut are left out."""
    real = int(np.count_nonzero(ends > starts))
    rng = np.random.default_rng([config.seed & (2**63 - 1), round_index, unit, 1])
    cut = Groups(order, starts[:real], ends[:real])
    return swap_across_cuts(cut, lengths, config.token_budget, rng).order


def _fullest(
    unit: GroupedUnit, num_slots: int, hold: np.ndarray, config: PlannerConfig
) -> tuple[alignment.FittedGroups, SortedBuffer] | None:
    """selection.py: the unit's fullest `num_slots` greedy groups over the exact sort of what
    company.py does not hold; the rest recirculate. None if they do not fit (then the cut runs)."""
    samples = unit.offer.samples
    order = sort_longest_first(samples)
    if hold.any():
        waiting = np.zeros(len(samples), dtype=bool)
        waiting[alignment.rows_of(unit.groups, np.flatnonzero(hold))] = True
        order = order[~waiting[order]]
    lengths = samples.lengths[order]
    # A sample recirculated MAX_HOLD_ROUNDS times outweighs any padding saved: it runs if it can.
    old = samples.ages[order] >= company.MAX_HOLD_ROUNDS
    bonus = np.where(old, float(config.token_budget), 0.0) if old.any() else None
    chosen = selection.fullest_groups(lengths, config.token_budget, num_slots, bonus)
    if chosen is None:
        return None
    starts, ends = chosen
    run = np.zeros(len(samples), dtype=bool)
    run[order[alignment.concat_ranges(starts, ends)]] = True
    fitted = alignment.FittedGroups(order, starts, ends, np.flatnonzero(~run), 0)
    return fitted, SortedBuffer.of(samples, order, packed=False)


def _keep_priority(groups: Groups, buffer: SortedBuffer, config: PlannerConfig) -> FloatArray:
    """Which groups min-time keeps when a unit has more than T steps' worth.

    Older samples first (age counts twice), so a recirculated sample waits at most a round or
    two; then groups the greedy cut filled to capacity, since only the last, partial group gains
    from being regrouped with new arrivals; then fuller groups.
    """
    if len(groups) == 0:
        return np.zeros(0)
    longest = buffer.lengths[groups.starts]
    capacity = np.maximum(config.token_budget // longest, 1)
    # Packed groups have no capacity in samples: how full they are (fill) says it all.
    full = np.zeros(len(groups)) if buffer.packed else (groups.sizes() >= capacity).astype(float)
    real = buffer.csum_len[groups.ends] - buffer.csum_len[groups.starts]
    fill = np.minimum(real / config.row_budget, 1.0)
    oldest = range_max(buffer.ages, groups)
    return 2.0 * oldest + full + fill


def _unit_plan(
    unit: int, samples: SampleTable, fitted: alignment.FittedGroups, group_of_slot: IntArray
) -> UnitPlan:
    starts, ends = fitted.starts[group_of_slot], fitted.ends[group_of_slot]
    rows = fitted.order[alignment.concat_ranges(starts, ends)]
    offsets = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)
    leftover = samples.take(fitted.leftover_rows).aged()
    return UnitPlan(unit, samples.take(rows), offsets, leftover, fitted.num_splits)


def _mean_tokens(table: SampleTable) -> float:
    return float(table.tokens.mean()) if len(table) else 0.0
