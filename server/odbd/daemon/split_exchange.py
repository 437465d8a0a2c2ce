"""The two exchanges of one live round on the split planner (split_round.py says what they
carry), and what they cost this daemon: the I/O half of split_round, kept out of round_loop.py.

Round k of the planner is barrier rounds 2k (summaries -> the hub's decision) and 2k + 1 (step
totals -> the round's totals); every daemon runs both for every round, so the barrier's rounds
stay in lock-step. With --align updates a round is three: 3k, 3k + 1 (both alternatives'
totals) and 3k + 2 (the deals -> the step grid, split_updates.py). With --migrate auto the
moves' exchange (digests -> the hub's moves, migration_live.py) comes first, so each of these
is one later and a round is 3 or 4. Every exchange goes through the same barrier (and relay
tree). Planning time is this daemon's own CPU on the round: its local phases, plus the hub's
reductions on the hub.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from odbd.daemon import split_round, split_updates, summary_codec
from odbd.planner.config import Align, PlannerConfig
from odbd.planner.cost_fit import CostFit
from odbd.planner.identities import IdentitySource
from odbd.planner.summary import GroupedUnit
from odbd.planner.types import NodeRoundPlan, RoundDecision, UnitOffer
from odbd.round import RoundBarrier
from odbd.round.barrier import RoundRecord

Reducer = Callable[[list[bytes]], bytes]  # every node's payload -> the result (the hub's)


def barrier_round(round_index: int, phase: int, per_round: int = 2) -> int:
    """The barrier round of planner round `round_index`'s exchange `phase` (0 .. per_round - 1;
    per_round: exchanges_per_round)."""
    return per_round * round_index + phase


def exchanges_per_round(config: PlannerConfig) -> int:
    """Barrier exchanges per planner round: the moves' first with --migrate auto
    (migration_live.py), then the summaries, the totals and, with --align updates, the deals."""
    return int(config.migrate) + split_updates.exchanges_per_round(config)


@dataclass(slots=True)
class SplitExchange:
    barrier: RoundBarrier
    node: int
    per_round: int = 2  # barrier exchanges per round (3 with --align updates)
    planning_s: float = 0.0  # the round being planned, so far
    exchange_s: float = 0.0  # its two exchanges, from the summary's send to the totals
    last_round: RoundRecord | None = None  # both exchanges of the last round, for /metrics
    source: IdentitySource | None = None  # this node's views' identities (EpochEnd's count)
    first: int = 0  # the summary's phase: 1 when the moves' exchange comes first (--migrate)

    @classmethod
    def of(cls, barrier: RoundBarrier, node: int, config: PlannerConfig) -> SplitExchange:
        return cls(barrier, node, exchanges_per_round(config), first=int(config.migrate))

    async def moves(self, round_index: int, payload: bytes, reduce: Reducer) -> bytes:
        """--migrate auto's exchange 0 (migration_live.py): digests out, the hub's moves back.
        It opens the round, so the round's planning and exchange times start here."""
        self.planning_s = self.exchange_s = 0.0
        return await self._exchange(round_index, -self.first, payload, self._timed(reduce))

    async def decide(
        self,
        round_index: int,
        seed_round: int,
        side: summary_codec.NodeSummary,
        offers: Sequence[UnitOffer],
        config: PlannerConfig,
        absorb: Callable[[list[np.ndarray]], CostFit],
    ) -> tuple[list[GroupedUnit], split_round.DecisionPayload]:
        """Exchange 1: this node's summary out, the hub's decision back."""
        started = time.perf_counter()
        grouped, payload = split_round.node_summary(side, offers, config, seed_round)
        opened = self.first == 0  # else moves() opened the round
        self.planning_s = (0.0 if opened else self.planning_s) + time.perf_counter() - started

        reduce = self._timed(
            lambda p: split_round.hub_decide(p, config, seed_round, absorb, round_index)
        )
        sent = time.perf_counter()
        result = await self.barrier.exchange_reduced(
            barrier_round(round_index, self.first, self.per_round), payload, reduce
        )
        self.exchange_s = (0.0 if opened else self.exchange_s) + time.perf_counter() - sent
        last_node = self.barrier.last_round.last_node if self.barrier.last_round else 0
        self.last_round = RoundRecord(round_index, self.exchange_s, last_node)
        started = time.perf_counter()
        decided = split_round.decode_decision(result, config)
        self.planning_s += time.perf_counter() - started
        return grouped, decided

    async def complete(
        self,
        round_index: int,
        grouped: Sequence[GroupedUnit],
        decision: RoundDecision,
        config: PlannerConfig,
    ) -> tuple[NodeRoundPlan, split_round.RoundExtras]:
        """Exchange 2: this node's step totals out, the round's totals back; its part planned.
        With --align updates, also exchange 3 (split_updates.py)."""
        if config.align is Align.UPDATES:
            return await self._complete_updates(round_index, grouped, decision, config)
        started = time.perf_counter()
        draft, payload = split_round.node_totals(self.node, grouped, decision, config, self.source)
        self.planning_s += time.perf_counter() - started

        reduce = self._timed(lambda p: split_round.hub_combine(p, decision.num_steps))
        result = await self._exchange(round_index, 1, payload, reduce)
        started = time.perf_counter()
        done = split_round.node_complete(draft, decision, result, config)
        self.planning_s += time.perf_counter() - started
        return done

    async def _complete_updates(
        self,
        round_index: int,
        grouped: Sequence[GroupedUnit],
        decision: RoundDecision,
        config: PlannerConfig,
    ) -> tuple[NodeRoundPlan, split_round.RoundExtras]:
        """--align updates: exchange 2 for both alternatives, then exchange 3 (the deals)."""
        started = time.perf_counter()
        drafts, payload = split_updates.node_totals(
            self.node, grouped, decision, config, self.source
        )
        self.planning_s += time.perf_counter() - started

        combine = self._timed(lambda p: split_updates.hub_combine(p, decision.num_steps))
        result = await self._exchange(round_index, 1, payload, combine)
        started = time.perf_counter()
        parts = split_updates.node_complete(drafts, decision, result, config)
        first = config.world.ranks_of(self.node).start
        deals, payload = split_updates.node_deals(parts, first, config)
        self.planning_s += time.perf_counter() - started
        windows = [p.windows for p, _ in parts]

        grid = self._timed(lambda p: split_updates.hub_grid(p, windows))
        result = await self._exchange(round_index, 2, payload, grid)
        started = time.perf_counter()
        done = split_updates.node_align(parts, deals, result, first, config)
        self.planning_s += time.perf_counter() - started
        return done

    def _timed(self, reduce: Reducer) -> Reducer:
        """`reduce` (run on the hub only) with its time added to the round's planning time."""

        def timed(payloads: list[bytes]) -> bytes:
            begun = time.perf_counter()
            try:
                return reduce(payloads)
            finally:
                self.planning_s += time.perf_counter() - begun

        return timed

    async def _exchange(
        self, round_index: int, phase: int, payload: bytes, reduce: Reducer
    ) -> bytes:
        """One exchange other than the summaries' (`phase` counts from theirs), its time
        added to the round's."""
        sent = time.perf_counter()
        result = await self.barrier.exchange_reduced(
            barrier_round(round_index, self.first + phase, self.per_round), payload, reduce
        )
        self.exchange_s += time.perf_counter() - sent
        if self.last_round is not None:
            self.last_round = RoundRecord(round_index, self.exchange_s, self.last_round.last_node)
        return result
