"""Phase 0 of a round, on the node that owns the unit: group its buffer, summarize the groups.

A round is planned in phases so that no daemon touches another node's samples (issue 14, part 2):

0. local  (this module): each node groups its own units' buffers and sends a `UnitSummary` per
   unit, ~40 bytes (8 KiB with company.py's profile) whatever the buffer size
1. global (decision.py): every daemon decides the round's step count and shared orders from
   the summaries of every unit (O(units), the same on every daemon)
2. local  (node_plan.py): each node fits and assigns its own groups to (rank, step)
3. global (completion.py): per-step token and sample totals of every node give the loss scales
   and the optimizer updates; each node completes its own part

Grouping depends only on the unit's buffer and (seed, round, unit), so phase 0 needs nothing from
the other nodes; so do the budgets of --collate packed (sum of lengths) and --max-patches, which
bound each group on its own: they shape a unit's groups and their work here, and phase 1 sees
them only through the summary's group count and work profile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from odbd.planner import company
from odbd.planner.company import caps_every_round, cost_profile, outsized_work
from odbd.planner.config import Collate, CostModel, Grouping, PlannerConfig
from odbd.planner.grouping import group_buffer
from odbd.planner.packing import group_with_budgets
from odbd.planner.types import FloatArray, Groups, IntArray, SampleTable, UnitOffer, UnitSummary


@dataclass(frozen=True, slots=True)
class SortedBuffer:
    """A unit's buffer in grouping order with prefix sums, so any range's totals are O(1)."""

    lengths: IntArray  # (n,) sorted like Groups.order
    ages: IntArray
    csum_len: IntArray  # (n + 1,)
    csum_tok: IntArray
    csum_sq: FloatArray
    csum_patches: IntArray
    packed: bool  # --collate packed: a group's batch holds its real tokens only

    @staticmethod
    def of(table: SampleTable, order: IntArray, packed: bool) -> SortedBuffer:
        lengths = table.lengths[order]
        zero = np.zeros(1, dtype=np.int64)
        return SortedBuffer(
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


@dataclass(frozen=True, slots=True)
class GroupedUnit:
    """A unit's buffer after phase 0, kept on its node for phase 2."""

    offer: UnitOffer
    groups: Groups
    buffer: SortedBuffer
    # (num_groups,) a * padded + b * sum l^2 + p * patches of each group (min-time only)
    work: FloatArray
    ages: IntArray  # (num_groups,) the most rounds any member was recirculated (min-time only)
    # company.py's cost profile (min-time: with an outsized group, or in every round when
    # company.caps_every_round)
    profile: FloatArray


def group_unit(offer: UnitOffer, config: PlannerConfig, round_index: int) -> GroupedUnit:
    """Phase 0: cuts the unit's buffer into groups (grouping.py, packing.py) and prices them."""
    groups = _group(offer, config, round_index)
    buffer = SortedBuffer.of(offer.samples, groups.order, config.collate is Collate.PACKED)
    if config.grouping is Grouping.PAPER or len(groups) == 0:
        none = np.zeros(len(groups), dtype=np.int64)
        return GroupedUnit(offer, groups, buffer, none.astype(np.float64), none, np.zeros(0))
    work = buffer.work(groups.starts, groups.ends, config.cost)
    ages = range_max(buffer.ages, groups)
    profile = cost_profile(work, outsized_work(config), caps_every_round(config))
    return GroupedUnit(offer, groups, buffer, work, ages, profile)


def summarize(unit: GroupedUnit, num_units: int) -> UnitSummary:
    """The unit's summary for the round payload: its profile only if phase 1 reads it
    (company.sampled_units of `num_units`); the unit keeps it for its own holds either way."""
    samples = unit.offer.samples
    shown = company.is_sampled(unit.offer.unit, num_units)
    return UnitSummary(
        unit=unit.offer.unit,
        dry=unit.offer.dry,
        num_samples=len(samples),
        num_groups=len(unit.groups),
        max_length=int(samples.lengths.max()) if len(samples) else 0,
        profile=unit.profile if shown else np.zeros(0),
    )


def range_max(values: IntArray, groups: Groups) -> IntArray:
    """Max of values over each group's range (groups are non-empty, disjoint, any order)."""
    if groups.starts.size < 2 or bool((np.diff(groups.starts) > 0).all()):
        return np.maximum.reduceat(values, groups.starts)  # min-time cuts come in order
    by_start = np.argsort(groups.starts, kind="stable")
    maxima = np.maximum.reduceat(values, groups.starts[by_start])
    out = np.empty_like(maxima)
    out[by_start] = maxima
    return out


def _group(offer: UnitOffer, config: PlannerConfig, round_index: int) -> Groups:
    """The unit's groups: min-time/paper cuts, or the packed / patch-budget grouping."""
    rng = _cut_rng(config, round_index, offer)
    if config.collate is Collate.PACKED or config.max_patches > 0:
        return group_with_budgets(
            offer.samples, config.row_budget, config.max_patches, config.collate, rng
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
