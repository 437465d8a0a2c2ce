"""Inputs and outputs of the planner stages (DESIGN.md section 7 is the glossary).

Data path: SampleTable (a unit's buffer) -> Groups (grouping) -> UnitSummary (what the other
daemons learn of it) -> RoundDecision (from every unit's summary) -> UnitPlan (alignment and step
assignment, on the unit's node) and StepTotals (what every node learns of them) -> NodeRoundPlan
(one node's part, with per-(step, rank) stats and loss scales) -> RoundPlan (every node's part).
Arrays are numpy int64 unless noted; shapes are documented on the fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from odbd.errors import InvariantError

if TYPE_CHECKING:
    from odbd.planner.windows import Windows

IntArray = np.ndarray  # int64, 1-D unless noted
FloatArray = np.ndarray  # float64


@dataclass(frozen=True, slots=True)
class SampleTable:
    """Metadata of buffered samples; row i is one sampler view."""

    views: IntArray  # (n,) global view index within the epoch (DistributedSampler position)
    lengths: IntArray  # (n,) tokens after preprocessing; what padding and the budget see
    tokens: IntArray  # (n,) loss-bearing tokens (t_r of the paper); <= lengths
    ages: IntArray  # (n,) rounds this sample has already been recirculated
    # (n,) vision patches (--max-patches: a key's first dimension or a count key); 0 without
    patches: IntArray

    def __len__(self) -> int:
        return int(self.views.shape[0])

    @staticmethod
    def empty() -> SampleTable:
        z = np.zeros(0, dtype=np.int64)
        return SampleTable(z, z, z, z, z)

    @staticmethod
    def of(
        views: object,
        lengths: object,
        tokens: object = None,
        ages: object = None,
        patches: object = None,
    ) -> SampleTable:
        """Builds a table from sequences; tokens default to lengths, ages and patches to 0."""
        v = np.asarray(views, dtype=np.int64).reshape(-1)
        n = np.asarray(lengths, dtype=np.int64).reshape(-1)
        t = n.copy() if tokens is None else np.asarray(tokens, dtype=np.int64).reshape(-1)
        a = np.zeros_like(v) if ages is None else np.asarray(ages, dtype=np.int64).reshape(-1)
        p = np.zeros_like(v) if patches is None else np.asarray(patches, np.int64).reshape(-1)
        if not (v.shape == n.shape == t.shape == a.shape == p.shape):
            raise InvariantError(f"sample table columns differ in length: {v.shape} {n.shape}")
        return SampleTable(v, n, t, a, p)

    def take(self, index: IntArray | slice) -> SampleTable:
        """The rows at `index`; a slice gives views of the columns, not copies."""
        return SampleTable(
            self.views[index],
            self.lengths[index],
            self.tokens[index],
            self.ages[index],
            self.patches[index],
        )

    def concat(self, other: SampleTable) -> SampleTable:
        return SampleTable(
            *(
                np.concatenate([getattr(self, name), getattr(other, name)])
                for name in ("views", "lengths", "tokens", "ages", "patches")
            )
        )

    @staticmethod
    def concat_all(tables: list[SampleTable]) -> SampleTable:
        """The tables' rows in order, one concatenation per column."""
        if not tables:
            return SampleTable.empty()
        if len(tables) == 1:
            return tables[0]
        return SampleTable(
            *(
                np.concatenate([getattr(t, name) for t in tables])
                for name in ("views", "lengths", "tokens", "ages", "patches")
            )
        )

    def aged(self) -> SampleTable:
        """The same samples one recirculation older (leftovers of a round)."""
        return SampleTable(self.views, self.lengths, self.tokens, self.ages + 1, self.patches)


@dataclass(frozen=True, slots=True)
class Groups:
    """Groups cut from one unit's SampleTable, in the strategy's order.

    Rows are first sorted by length, longest first (`order`); every group is a contiguous range
    of that sorted order, so its first member is its longest and prefix sums give its totals.
    """

    order: IntArray  # (n,) row indices into the table, longest first (ties: lower view first)
    starts: IntArray  # (num_groups,) group g is order[starts[g]:ends[g]]
    ends: IntArray  # (num_groups,)

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    def sizes(self) -> IntArray:
        return self.ends - self.starts

    def members(self, g: int) -> IntArray:
        return self.order[self.starts[g] : self.ends[g]]


@dataclass(frozen=True, slots=True)
class UnitOffer:
    """One unit's contribution to a round: its whole buffer and whether more will arrive."""

    unit: int  # node index (balance=node) or global rank (balance=rank)
    samples: SampleTable
    dry: bool  # no view of this unit is pending or leased: nothing more arrives this epoch


@dataclass(frozen=True, slots=True)
class UnitPlan:
    """What one unit emits in a round. Slot s = step * ranks_per_unit + local_rank."""

    unit: int
    emitted: SampleTable  # samples in slot order, slot by slot
    slot_offsets: IntArray  # (num_steps * ranks_per_unit + 1,); an empty slot is an idle filler
    leftover: SampleTable  # recirculated: back into the unit's buffer, ages already incremented
    num_splits: int  # groups split to reach the round's step count

    def slot(self, step: int, local_rank: int, ranks_per_unit: int) -> slice:
        s = step * ranks_per_unit + local_rank
        return slice(int(self.slot_offsets[s]), int(self.slot_offsets[s + 1]))


@dataclass(frozen=True, slots=True)
class StepStats:
    """Per (step, rank) facts of a round; every array has shape (num_steps, world_size)."""

    num_samples: IntArray
    num_tokens: IntArray  # loss-bearing tokens
    real_tokens: IntArray  # sum of lengths
    padded_tokens: IntArray  # max length x count; 0 for idle
    work: FloatArray  # a * padded + b * sum l^2 (cost model, without the per-step constant c)
    loss_scale: FloatArray

    @property
    def global_num_samples(self) -> IntArray:  # (num_steps,)
        return self.num_samples.sum(axis=1)

    @property
    def global_num_tokens(self) -> IntArray:  # (num_steps,)
        return self.num_tokens.sum(axis=1)


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """The plan of one round: identical on every daemon given the same offers and config."""

    round_index: int
    num_steps: int  # T: every rank runs exactly this many steps this round
    units: tuple[UnitPlan, ...]  # in unit order
    stats: StepStats
    final: bool  # every unit was dry and nothing is left: the epoch's last round
    windows: Windows  # the round's optimizer updates (one per step without --accumulate etc.)
    # (num_windows, world) micro-steps each rank runs per update with --align updates
    # (planner/update_align.py); None with --align steps: every rank runs every step
    micro_steps: IntArray | None = None

    def group_views(self, step: int, rank: int, ranks_per_unit: int) -> IntArray:
        """View ids of one rank's batch at one step of this round (empty = idle filler)."""
        unit = self.units[rank // ranks_per_unit]
        return unit.emitted.views[unit.slot(step, rank % ranks_per_unit, ranks_per_unit)]

    def group_lengths(self, step: int, rank: int, ranks_per_unit: int) -> IntArray:
        unit = self.units[rank // ranks_per_unit]
        return unit.emitted.lengths[unit.slot(step, rank % ranks_per_unit, ranks_per_unit)]


@dataclass(frozen=True, slots=True)
class StepTotals:
    """One node's per-step totals after phase 2 (node_plan.py): the round's second payload.

    Every node's totals, summed, are the round's global per-step facts: the token totals exact
    loss scales divide by, and the updates of --tokens-per-update.
    """

    node: int
    num_tokens: IntArray  # (T,) loss-bearing tokens over the node's ranks
    num_samples: IntArray  # (T,)
    approx_weights: FloatArray  # (T,) sum of --loss-scaling approx weights; (0,) in other modes
    drained: bool  # the node's units left nothing to recirculate (with all dry: the last round)


@dataclass(frozen=True, slots=True)
class NodeRoundPlan:
    """One node's part of a round: what its daemon queues. The round-wide fields (num_steps,
    final, windows, global totals) are identical on every node; RoundPlan is every node's
    NodeRoundPlan put side by side (round.py)."""

    node: int
    round_index: int
    num_steps: int
    units: tuple[UnitPlan, ...]  # this node's units, in unit order
    stats: StepStats  # (num_steps, this node's ranks)
    global_num_samples: IntArray  # (num_steps,) over every rank of the world
    global_num_tokens: IntArray  # (num_steps,)
    final: bool
    windows: Windows
    # (num_windows, this node's ranks) micro-steps per update with --align updates
    # (planner/update_align.py); None with --align steps
    micro_steps: IntArray | None = None


@dataclass(frozen=True, slots=True)
class UnitSummary:
    """What the other daemons learn of one unit's buffer in a round (the round payload)."""

    unit: int
    dry: bool  # nothing more arrives for this unit this epoch
    num_samples: int  # buffered samples (the paper's S_r)
    num_groups: int  # groups the buffer was cut into (G_r)
    max_length: int  # its longest sample: a group over the budget turns company.py's cap on
    # (<= company.PROFILE_DEPTH,) its costliest groups' work, descending (company.py's
    # profile); empty in a buffer without an outsized group (one sample over the budget)
    # unless company.caps_every_round, and in units phase 1 does not sample
    profile: FloatArray


@dataclass(frozen=True, slots=True)
class RoundDecision:
    """The round's shared decisions; identical on every daemon."""

    round_index: int
    num_steps: int  # T: every rank runs this many steps (before --tokens-per-update cuts)
    step_order: IntArray  # (T,) step_order[k] = step of the k-th costliest run (assignment.py)
    all_dry: bool  # every unit is dry: the epoch flushes
    # (<= company.PROFILE_DEPTH,) company.py's cap profile, None when no group waits this round
    reference: FloatArray | None
    # selection.py: units with surplus run their fullest T x G groups (a round of few groups)
    select_fullest: bool = False
