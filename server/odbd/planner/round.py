"""plan_round: one round planned for every node, phase by phase (summary.py lists the phases).

0. group each unit's buffer and summarize it (summary.py; on the unit's node)
1. decide T, the shared step order and company.py's cap from the summaries (decision.py;
   the same on every daemon, O(units))
2. fit every unit to T steps and place its groups on (rank, step) (node_plan.py, alignment.py,
   assignment.py; on the unit's node)
3. sum every node's per-step totals, then close each node's optimizer updates and compute its
   exact loss scales (completion.py, windows.py, loss_scaling.py)

Every phase a node runs only needs its own units plus the shared, small inputs, so a daemon's
planning work is O(its samples + units + nodes x T), not O(world). plan_round runs every node's
part (the daemon today, `odbd simulate`, the property tests) and puts the NodeRoundPlans side by
side; `trace` records how long each node's own part took (a per-daemon time) and the payloads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from odbd.errors import InvariantError
from odbd.planner.completion import combine, complete_node
from odbd.planner.config import Align, Balance, PlannerConfig
from odbd.planner.decision import decide_round
from odbd.planner.node_plan import NodeDraft, plan_node
from odbd.planner.summary import GroupedUnit, group_unit, summarize
from odbd.planner.types import (
    NodeRoundPlan,
    RoundDecision,
    RoundPlan,
    StepStats,
    StepTotals,
    UnitOffer,
    UnitSummary,
)
from odbd.planner.update_align import align_node, deal_node, pick_grid, reduce_deals


@dataclass(slots=True)
class RoundTrace:
    """What each phase of the rounds planned with it took, and what the nodes exchanged, for
    `odbd simulate --planning-time` and the planner benchmark (simulate/planning_time.py)."""

    local_s: list[list[float]] = field(default_factory=list)  # per round, node: phases 0, 2, 3
    shared_s: list[float] = field(default_factory=list)  # per round: phase 1, phase 3's sums
    summaries: list[list[UnitSummary]] = field(default_factory=list)  # per round, per unit
    totals: list[list[StepTotals]] = field(default_factory=list)  # per round, per node

    def per_daemon_s(self) -> np.ndarray:
        """(rounds, nodes): each daemon's planning time per round, its own node's phases plus
        the decisions every daemon computes."""
        return np.asarray(self.local_s) + np.asarray(self.shared_s)[:, None]

    def whole_world_s(self) -> np.ndarray:
        """(rounds,): one process planning every node's part (what each daemon did before)."""
        return np.asarray(self.local_s).sum(axis=1) + np.asarray(self.shared_s)


def units_of_node(config: PlannerConfig, node: int) -> range:
    """Units whose ranks are on `node`: the node itself, or its ranks with --balance rank."""
    if config.balance is Balance.NODE:
        return range(node, node + 1)
    g = config.world.ranks_per_node
    return range(node * g, (node + 1) * g)


def plan_round(
    offers: Sequence[UnitOffer],
    config: PlannerConfig,
    round_index: int,
    trace: RoundTrace | None = None,
) -> RoundPlan:
    """Plans one round from every unit's offer (offers[u].unit == u, one per unit)."""
    _check_offers(offers, config)
    clock = _Clock()
    nodes = range(config.world.num_nodes)
    grouped: list[list[GroupedUnit]] = []
    summaries: list[UnitSummary] = []
    for node in nodes:
        with clock.local(node):
            mine = [group_unit(offers[u], config, round_index) for u in units_of_node(config, node)]
            summaries += [summarize(u, config.num_units) for u in mine]
        grouped.append(mine)
    with clock.shared():
        decision = decide_round(summaries, config, round_index)
    steps_config = replace(config, align=Align.STEPS)
    parts, drafts = _place(grouped, decision, steps_config, clock)
    if config.align is Align.UPDATES:
        parts, drafts = _aligned_at_updates(parts, drafts, grouped, decision, config, clock)
    if trace is not None:
        trace.local_s.append([clock.local_s[n] for n in nodes])
        trace.shared_s.append(clock.shared_s)
        trace.summaries.append(summaries)
        trace.totals.append([d.totals for d in drafts])
    return assemble(parts, decision)


def _place(
    grouped: list[list[GroupedUnit]], decision: RoundDecision, config: PlannerConfig, clock: _Clock
) -> tuple[list[NodeRoundPlan], list[NodeDraft]]:
    """Phases 2 and 3: every node's groups on (rank, step), updates closed, loss scales."""
    nodes = range(len(grouped))
    drafts: list[NodeDraft] = []
    for node in nodes:
        with clock.local(node):
            drafts.append(plan_node(node, grouped[node], decision, config))
    with clock.shared():
        totals = combine([d.totals for d in drafts], decision.num_steps)
    parts = []
    for node in nodes:
        with clock.local(node):
            parts.append(complete_node(drafts[node], decision, totals, config))
    return parts, drafts


def _aligned_at_updates(
    split: list[NodeRoundPlan],
    drafts: list[NodeDraft],
    grouped: list[list[GroupedUnit]],
    decision: RoundDecision,
    config: PlannerConfig,
    clock: _Clock,
) -> tuple[list[NodeRoundPlan], list[NodeDraft]]:
    """--align updates (update_align.py): the step plan's groups dealt by cost. A unit short
    of groups for the round's slots splits groups under --align steps; with ranks aligned at
    updates it may instead leave slots idle (its ranks skip them). Splitting saves padding
    and fills ranks, but each piece costs a micro-step: the round takes whichever plan's
    updates end sooner, the split one on a tie (never slower than --align steps).

    Each node deals its own part (deal_node), the grid is every node's deals reduced
    (reduce_deals, the hub's), and each node moves its part onto it: the live daemons' three
    exchanges (daemon/split_round.py) in one process."""
    alternatives = [(split, drafts)]
    if any(u.num_splits for p in split for u in p.units):
        alternatives.append(_place(grouped, decision, config, clock))
    firsts = [config.world.ranks_of(p.node).start for p in split]
    dealt, grids = [], []
    for parts, _ in alternatives:
        deals = []
        for p, first in zip(parts, firsts, strict=True):
            with clock.local(p.node):
                deals.append(deal_node(p.stats, p.units, p.windows, first, config))
        with clock.shared():
            grids.append(reduce_deals(deals, parts[0].windows))
        dealt.append(deals)
    chosen = pick_grid(grids)
    parts, chosen_drafts = alternatives[chosen]
    aligned = []
    for p, first, deal in zip(parts, firsts, dealt[chosen], strict=True):
        with clock.local(p.node):
            aligned.append(align_node(p, first, deal, grids[chosen], config))
    return aligned, chosen_drafts


def assemble(parts: Sequence[NodeRoundPlan], decision: RoundDecision) -> RoundPlan:
    """The whole-world plan: every node's part side by side (ranks in global order)."""
    first = parts[0]
    for p in parts:
        if (p.num_steps, p.final, len(p.windows)) != (first.num_steps, first.final,
                                                       len(first.windows)):  # fmt: skip
            raise InvariantError(f"node {p.node} planned a different round than node 0")
    fields = StepStats.__dataclass_fields__
    stats = StepStats(
        *(np.concatenate([getattr(p.stats, f) for p in parts], axis=1) for f in fields)
    )
    units = tuple(u for p in parts for u in p.units)
    micro = None
    if first.micro_steps is not None:
        micro = np.concatenate([p.micro_steps for p in parts if p.micro_steps is not None], axis=1)
    return RoundPlan(
        decision.round_index, first.num_steps, units, stats, first.final, first.windows, micro
    )


class _Clock:
    """Accumulates perf_counter seconds per node and for the shared decisions."""

    def __init__(self) -> None:
        self.local_s: dict[int, float] = {}
        self.shared_s = 0.0

    @contextmanager
    def local(self, node: int) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.local_s[node] = self.local_s.get(node, 0.0) + time.perf_counter() - start

    @contextmanager
    def shared(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.shared_s += time.perf_counter() - start


def _check_offers(offers: Sequence[UnitOffer], config: PlannerConfig) -> None:
    units = [o.unit for o in offers]
    if units != list(range(config.num_units)):
        raise InvariantError(
            f"plan_round needs one offer per unit in order 0..{config.num_units - 1}, got {units}"
        )
