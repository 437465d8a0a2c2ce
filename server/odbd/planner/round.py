"""plan_round: the pure function every daemon runs on the same offers to get the same plan.

1. group each unit's buffer (grouping.py)
2. choose the round's step count T and fit every unit to T steps (alignment.py); in rounds with
   over-budget groups, a unit's surplus costly groups may wait a round for company (company.py)
3. place groups on (rank, step) (assignment.py)
4. close the round's optimizer updates, dropping an unclosed tail back to the buffers
   (windows.py; one update per step unless --accumulate or --tokens-per-update)
5. compute per (step, rank) stats and loss scales over each update (loss_scaling.py)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from odbd.errors import InvariantError
from odbd.planner import alignment, assignment, company, windows
from odbd.planner.config import Collate, CostModel, Grouping, PlannerConfig
from odbd.planner.grouping import group_buffer
from odbd.planner.loss_scaling import loss_scales
from odbd.planner.packing import group_with_budgets
from odbd.planner.types import (
    FloatArray,
    Groups,
    IntArray,
    RoundPlan,
    SampleTable,
    StepStats,
    UnitOffer,
    UnitPlan,
)


@dataclass(frozen=True, slots=True)
class _Sorted:
    """A unit's buffer in grouping order with prefix sums, so any range's totals are O(1)."""

    lengths: IntArray  # (n,) sorted like Groups.order
    ages: IntArray
    csum_len: IntArray  # (n + 1,)
    csum_tok: IntArray
    csum_sq: FloatArray
    csum_patches: IntArray
    packed: bool  # --collate packed: a group's batch holds its real tokens only

    @staticmethod
    def of(table: SampleTable, order: IntArray, packed: bool) -> _Sorted:
        lengths = table.lengths[order]
        zero = np.zeros(1, dtype=np.int64)
        return _Sorted(
            lengths=lengths,
            ages=table.ages[order],
            csum_len=np.concatenate([zero, np.cumsum(lengths)]),
            csum_tok=np.concatenate([zero, np.cumsum(table.tokens[order])]),
            csum_sq=np.concatenate([[0.0], np.cumsum(lengths.astype(np.float64) ** 2)]),
            csum_patches=np.concatenate([zero, np.cumsum(table.patches[order])]),
            packed=packed,
        )

    def range_stats(self, starts: IntArray, ends: IntArray) -> dict[str, np.ndarray]:
        sizes = ends - starts
        first = np.minimum(starts, max(self.lengths.shape[0] - 1, 0))
        longest = np.where(sizes > 0, self.lengths[first] if self.lengths.size else 0, 0)
        real = self.csum_len[ends] - self.csum_len[starts]
        return {
            "num_samples": sizes,
            "num_tokens": self.csum_tok[ends] - self.csum_tok[starts],
            "real_tokens": real,
            "padded_tokens": real if self.packed else longest * sizes,
            "sum_sq": self.csum_sq[ends] - self.csum_sq[starts],
            "patches": self.csum_patches[ends] - self.csum_patches[starts],
        }

    def work(self, starts: IntArray, ends: IntArray, cost: CostModel) -> FloatArray:
        """Cost-model work of each range (one group's compute, without the step constant)."""
        stats = self.range_stats(starts, ends)
        return cost.work(stats["padded_tokens"], stats["sum_sq"], stats["patches"])


def plan_round(offers: Sequence[UnitOffer], config: PlannerConfig, round_index: int) -> RoundPlan:
    """Plans one round from every unit's offer (offers[u].unit == u, one per unit)."""
    _check_offers(offers, config)
    g = config.ranks_per_unit
    grouped = [_group(o, config, round_index) for o in offers]
    packed = config.collate is Collate.PACKED
    sorted_ = [
        _Sorted.of(o.samples, gr.order, packed) for o, gr in zip(offers, grouped, strict=True)
    ]
    all_dry = all(o.dry for o in offers)
    num_steps = windows.round_step_count(
        _target_steps(offers, grouped, config), config.accumulate, all_dry
    )
    perm = assignment.step_order(num_steps, config.seed, round_index)
    waits = _waiting(grouped, sorted_, config, num_steps * g)
    units: list[UnitPlan] = []
    columns: list[dict[str, np.ndarray]] = []
    for offer, groups, srt, wait in zip(offers, grouped, sorted_, waits, strict=True):
        fitted = _fit(groups, srt, num_steps * g, config, wait)
        slot_stats = srt.range_stats(fitted.starts, fitted.ends)
        work = config.cost.work(
            slot_stats["padded_tokens"], slot_stats["sum_sq"], slot_stats["patches"]
        )
        if config.grouping is Grouping.PAPER:
            group_of_slot = assignment.slots_in_order(len(fitted.starts))
        else:
            group_of_slot = assignment.slots_by_cost(work, g, perm)
        units.append(_unit_plan(offer, fitted, group_of_slot))
        columns.append({k: v[group_of_slot].reshape(num_steps, g) for k, v in slot_stats.items()})
    step_stats = _step_stats(columns, offers, config)
    final = all_dry and all(len(u.leftover) == 0 for u in units)
    if not config.windows:
        per_step = windows.Windows.per_step(
            step_stats.global_num_tokens, step_stats.global_num_samples
        )
        return RoundPlan(round_index, num_steps, tuple(units), step_stats, final, per_step)
    return _plan_windows(round_index, units, step_stats, final, offers, config)


def _plan_windows(
    round_index: int,
    units: list[UnitPlan],
    stats: StepStats,
    final: bool,
    offers: Sequence[UnitOffer],
    config: PlannerConfig,
) -> RoundPlan:
    """Closes the round's updates; steps after the last closed one recirculate unless the
    round is the epoch's last (windows.py says why a window never waits for the next round)."""
    g = config.ranks_per_unit
    if config.tokens_per_update > 0:
        order = windows.pack_order(stats.global_num_tokens, config.tokens_per_update)
        units = [_reorder_steps(u, order, g) for u in units]
        stats = _take_steps(stats, order)
    cut = windows.cut_windows(
        stats.global_num_tokens, stats.global_num_samples, config.accumulate,
        config.tokens_per_update,
    )  # fmt: skip
    num_steps = stats.num_samples.shape[0]
    keep = windows.closed_prefix(cut)
    if not final and 0 < keep < num_steps:
        units = [_truncate(u, keep * g) for u in units]
        stats = _take_steps(stats, np.arange(keep))
        cut = windows.cut_windows(
            stats.global_num_tokens, stats.global_num_samples, config.accumulate,
            config.tokens_per_update,
        )  # fmt: skip
        num_steps = keep
    per_sample = _per_rank_mean_tokens(offers, config)
    scale = loss_scales(
        config.loss_scaling, stats.num_samples, stats.num_tokens, per_sample, cut.of_step()
    )
    stats = dataclasses.replace(stats, loss_scale=scale)
    return RoundPlan(round_index, num_steps, tuple(units), stats, final, cut)


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


def _group(offer: UnitOffer, config: PlannerConfig, round_index: int) -> Groups:
    """The unit's groups: min-time/paper cuts, or the packed / patch-budget grouping."""
    rng = _cut_rng(config, round_index, offer)
    if config.collate is Collate.PACKED or config.max_patches > 0:
        return group_with_budgets(
            offer.samples, config.token_budget, config.max_patches, config.collate, rng
        )
    return group_buffer(offer.samples, config.token_budget, config.grouping, rng)


def _cut_rng(
    config: PlannerConfig, round_index: int, offer: UnitOffer
) -> np.random.Generator | None:
    """Seeds min-time's jittered sort: (seed, round, unit) is the same on every daemon, and
    rounds are numbered across epochs, so a later epoch's buffer is grouped differently."""
    if not config.fresh_groups:
        return None
    return np.random.default_rng([config.seed & (2**63 - 1), round_index, offer.unit])


def _check_offers(offers: Sequence[UnitOffer], config: PlannerConfig) -> None:
    units = [o.unit for o in offers]
    if units != list(range(config.num_units)):
        raise InvariantError(
            f"plan_round needs one offer per unit in order 0..{config.num_units - 1}, got {units}"
        )


def _target_steps(
    offers: Sequence[UnitOffer], grouped: Sequence[Groups], config: PlannerConfig
) -> int:
    counts = [len(gr) for gr in grouped]
    if config.grouping is Grouping.PAPER:
        samples = [len(o.samples) for o in offers]
        return alignment.paper_target_steps(
            counts, samples, config.ranks_per_unit, config.max_steps_per_round
        )
    dry = [o.dry for o in offers]
    return alignment.min_time_target_steps(
        counts, dry, config.ranks_per_unit, config.max_steps_per_round
    )


def _fit(
    groups: Groups, srt: _Sorted, num_slots: int, config: PlannerConfig, wait: np.ndarray
) -> alignment.FittedGroups:
    if config.grouping is Grouping.PAPER:
        return alignment.fit_groups_paper(groups, num_slots)
    priority = _keep_priority(groups, srt, config)
    if wait.any():  # below every keep priority (those are >= 0): recirculated first
        priority = np.where(wait, -1.0, priority)
    return alignment.fit_groups(groups, num_slots, priority)


# Groups a unit may hold back per rank in one round (company.py); it bounds the search. On
# bench-planner's oracle workloads at W=128 units held back 1-2 per rank at the 90th percentile,
# 4.4 at most, and this cap measured the same ratios as none.
MAX_WAITS_PER_RANK = 4


def _waiting(
    grouped: Sequence[Groups], sorted_: Sequence[_Sorted], config: PlannerConfig, num_slots: int
) -> list[np.ndarray]:
    """min-time: which groups of each unit wait a round for company (company.py)."""
    # max, not the first row: the jittered sort may put a sample within 1 % of it first.
    giants = any(
        len(srt.lengths) and int(srt.lengths.max()) > config.token_budget for srt in sorted_
    )
    if (
        config.grouping is Grouping.PAPER
        or not giants
        or all(len(gr) <= num_slots for gr in grouped)
    ):
        return [np.zeros(len(gr), dtype=bool) for gr in grouped]
    costs, fresh = [], []
    for groups, srt in zip(grouped, sorted_, strict=True):
        if len(groups) == 0:
            costs.append(np.zeros(0))
            fresh.append(np.zeros(0, dtype=bool))
            continue
        costs.append(srt.work(groups.starts, groups.ends, config.cost))
        fresh.append(_range_max(srt.ages, groups) == 0)
    max_waits = MAX_WAITS_PER_RANK * config.ranks_per_unit
    return company.waiting_groups(costs, fresh, num_slots, max_waits)


def _keep_priority(groups: Groups, srt: _Sorted, config: PlannerConfig) -> FloatArray:
    """Which groups min-time keeps when a unit has more than T steps' worth.

    Older samples first (age counts twice), so a recirculated sample waits at most a round or
    two; then groups the greedy cut filled to capacity, since only the last, partial group gains
    from being regrouped with new arrivals; then fuller groups.
    """
    if len(groups) == 0:
        return np.zeros(0)
    longest = srt.lengths[groups.starts]
    capacity = np.maximum(config.token_budget // longest, 1)
    # Packed groups have no capacity in samples: how full they are (fill) says it all.
    full = np.zeros(len(groups)) if srt.packed else (groups.sizes() >= capacity).astype(float)
    real = srt.csum_len[groups.ends] - srt.csum_len[groups.starts]
    fill = np.minimum(real / config.token_budget, 1.0)
    oldest = _range_max(srt.ages, groups)
    return 2.0 * oldest + full + fill


def _range_max(values: IntArray, groups: Groups) -> IntArray:
    """Max of values over each group's range (groups are non-empty, disjoint, any order)."""
    if groups.starts.size < 2 or bool((np.diff(groups.starts) > 0).all()):
        return np.maximum.reduceat(values, groups.starts)  # min-time cuts come in order
    by_start = np.argsort(groups.starts, kind="stable")
    maxima = np.maximum.reduceat(values, groups.starts[by_start])
    out = np.empty_like(maxima)
    out[by_start] = maxima
    return out


def _unit_plan(
    offer: UnitOffer, fitted: alignment.FittedGroups, group_of_slot: IntArray
) -> UnitPlan:
    starts, ends = fitted.starts[group_of_slot], fitted.ends[group_of_slot]
    rows = fitted.order[alignment.concat_ranges(starts, ends)]
    offsets = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)
    leftover = offer.samples.take(fitted.leftover_rows)
    leftover = leftover.aged()
    return UnitPlan(offer.unit, offer.samples.take(rows), offsets, leftover, fitted.num_splits)


def _step_stats(
    columns: Sequence[dict[str, np.ndarray]], offers: Sequence[UnitOffer], config: PlannerConfig
) -> StepStats:
    def stack(key: str) -> np.ndarray:
        return np.concatenate([c[key] for c in columns], axis=1)

    num_samples, num_tokens = stack("num_samples"), stack("num_tokens")
    padded = stack("padded_tokens")
    per_sample = _per_rank_mean_tokens(offers, config)
    return StepStats(
        num_samples=num_samples,
        num_tokens=num_tokens,
        real_tokens=stack("real_tokens"),
        padded_tokens=padded,
        work=config.cost.work(padded, stack("sum_sq"), stack("patches")),
        loss_scale=loss_scales(config.loss_scaling, num_samples, num_tokens, per_sample),
    )


def _per_rank_mean_tokens(offers: Sequence[UnitOffer], config: PlannerConfig) -> FloatArray:
    means = [_mean_tokens(o.samples) for o in offers]
    return np.repeat(means, config.ranks_per_unit).astype(np.float64)


def _mean_tokens(table: SampleTable) -> float:
    return float(table.tokens.mean()) if len(table) else 0.0
