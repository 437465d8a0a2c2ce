"""Phase 3 of a round (summary.py lists the phases): global per-step totals, then each node's
loss scales and optimizer updates.

Exact loss scales divide a rank's loss tokens by the step's (or update's) tokens over every
rank, and --tokens-per-update cuts updates at global token counts, so a node cannot finish its
part from its own data: it needs every node's StepTotals (2 x T int64, ~1.3 KiB at T = 80). Once
T is fixed those depend only on the node's own buffer, so they are the second, small exchange of
a round; `combine` sums them in node order (the same additions on every daemon), and
`complete_node` then only reorders, truncates and scales this node's own units.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from odbd.errors import InvariantError
from odbd.planner import alignment, windows
from odbd.planner.config import LossScaling, PlannerConfig
from odbd.planner.loss_scaling import loss_scales
from odbd.planner.node_plan import NodeDraft
from odbd.planner.types import (
    FloatArray,
    IntArray,
    NodeRoundPlan,
    RoundDecision,
    StepStats,
    StepTotals,
    UnitPlan,
)


@dataclass(frozen=True, slots=True)
class RoundTotals:
    """Every node's StepTotals summed: the round's global per-step facts."""

    num_tokens: IntArray  # (T,)
    num_samples: IntArray  # (T,)
    approx_weights: FloatArray  # (T,) with --loss-scaling approx, else (0,)
    drained: bool  # no unit anywhere recirculates anything

    def weights(self, mode: LossScaling) -> FloatArray:
        """(T,) the loss-scale weights summed over every rank (loss_scaling.step_weights)."""
        if mode is LossScaling.APPROX:
            return self.approx_weights
        if mode is LossScaling.SAMPLE:
            return self.num_samples.astype(np.float64)
        return self.num_tokens.astype(np.float64)

    def take(self, steps: IntArray) -> RoundTotals:
        approx = self.approx_weights[steps] if self.approx_weights.size else self.approx_weights
        return RoundTotals(self.num_tokens[steps], self.num_samples[steps], approx, self.drained)


def combine(totals: Sequence[StepTotals], num_steps: int) -> RoundTotals:
    """Sums every node's totals, in node order (integers: exact; floats: same order everywhere)."""
    if [t.node for t in totals] != list(range(len(totals))):
        raise InvariantError(f"step totals must come one per node in order, got {len(totals)}")
    bad = [t.node for t in totals if t.num_tokens.shape != (num_steps,)]
    bad += [t.node for t in totals if t.num_samples.shape != (num_steps,)]
    if bad:
        raise InvariantError(
            f"nodes {sorted(set(bad))} sent totals for other than {num_steps} steps"
        )
    if not totals:
        zero = np.zeros(num_steps, dtype=np.int64)
        return RoundTotals(zero, zero, np.zeros(0), True)
    tokens = _by_node([t.num_tokens for t in totals]).sum(axis=0, dtype=np.int64)
    samples = _by_node([t.num_samples for t in totals]).sum(axis=0, dtype=np.int64)
    approx = np.zeros(0)
    if any(t.approx_weights.size for t in totals):
        # cumsum adds node after node on every machine (a sum's order is numpy's choice)
        approx = np.cumsum(_by_node([t.approx_weights for t in totals]), axis=0)[-1]
    return RoundTotals(tokens, samples, approx, all(t.drained for t in totals))


def _by_node(columns: list[np.ndarray]) -> np.ndarray:
    """(nodes, T) from one (T,) array per node; concatenate is ~5x faster than np.stack here."""
    return np.concatenate(columns).reshape(len(columns), columns[0].shape[0])


def complete_node(
    draft: NodeDraft, decision: RoundDecision, totals: RoundTotals, config: PlannerConfig
) -> NodeRoundPlan:
    """This node's part of the round: updates closed (windows.py), loss scales over them."""
    c = draft.columns
    stats = StepStats(
        num_samples=c["num_samples"],
        num_tokens=c["num_tokens"],
        real_tokens=c["real_tokens"],
        padded_tokens=c["padded_tokens"],
        work=config.cost.work(c["padded_tokens"], c["sum_sq"], c["patches"]),
        loss_scale=np.zeros(c["num_samples"].shape),
    )
    units = list(draft.units)
    final = decision.all_dry and totals.drained
    if not config.windows:
        cut = windows.Windows.per_step(totals.num_tokens, totals.num_samples)
        return _node_plan(draft, decision, units, stats, totals, final, cut, None, config)
    g = config.ranks_per_unit
    if config.tokens_per_update > 0:
        order = windows.pack_order(totals.num_tokens, config.tokens_per_update)
        units = [_reorder_steps(u, order, g) for u in units]
        stats, totals = _take_steps(stats, order), totals.take(order)
    cut = _cut(totals, config)
    num_steps = int(totals.num_tokens.shape[0])
    keep = windows.closed_prefix(cut)
    if not final and 0 < keep < num_steps:
        units = [_truncate(u, keep * g) for u in units]
        steps = np.arange(keep)
        stats, totals = _take_steps(stats, steps), totals.take(steps)
        cut = _cut(totals, config)
    return _node_plan(draft, decision, units, stats, totals, final, cut, cut.of_step(), config)


def _node_plan(
    draft: NodeDraft,
    decision: RoundDecision,
    units: list[UnitPlan],
    stats: StepStats,
    totals: RoundTotals,
    final: bool,
    cut: windows.Windows,
    window_of_step: IntArray | None,
    config: PlannerConfig,
) -> NodeRoundPlan:
    scale = loss_scales(
        config.loss_scaling, stats.num_samples, stats.num_tokens, draft.mean_tokens,
        window_of_step, step_totals=totals.weights(config.loss_scaling),
        world=config.world.world_size,
    )  # fmt: skip
    stats = dataclasses.replace(stats, loss_scale=scale)
    num_steps = int(totals.num_tokens.shape[0])
    return NodeRoundPlan(
        node=draft.node,
        round_index=decision.round_index,
        num_steps=num_steps,
        units=tuple(units),
        stats=stats,
        global_num_samples=totals.num_samples,
        global_num_tokens=totals.num_tokens,
        final=final,
        windows=cut,
    )


def _cut(totals: RoundTotals, config: PlannerConfig) -> windows.Windows:
    return windows.cut_windows(
        totals.num_tokens, totals.num_samples, config.accumulate, config.tokens_per_update
    )


def _truncate(unit: UnitPlan, num_slots: int) -> UnitPlan:
    """The unit's first num_slots slots; the later slots' samples join the leftover (aged)."""
    end = int(unit.slot_offsets[num_slots])
    tail = unit.emitted.take(np.arange(end, len(unit.emitted)))
    tail = tail.aged()
    return UnitPlan(
        unit.unit,
        unit.emitted.take(np.arange(end)),
        unit.slot_offsets[: num_slots + 1],
        unit.leftover.concat(tail),
        unit.num_splits,
    )


def _reorder_steps(unit: UnitPlan, order: IntArray, ranks_per_unit: int) -> UnitPlan:
    """The unit's steps in `order` (new step k is old step order[k]); slots move with them."""
    slots = (order[:, None] * ranks_per_unit + np.arange(ranks_per_unit)).reshape(-1)
    starts, ends = unit.slot_offsets[slots], unit.slot_offsets[slots + 1]
    rows = alignment.concat_ranges(starts, ends)
    offsets = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)
    return UnitPlan(unit.unit, unit.emitted.take(rows), offsets, unit.leftover, unit.num_splits)


def _take_steps(stats: StepStats, steps: IntArray) -> StepStats:
    """The stats of `steps` (indices into the round's steps), in that order."""
    return StepStats(*(getattr(stats, f.name)[steps] for f in dataclasses.fields(StepStats)))
