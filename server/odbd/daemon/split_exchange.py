"""The two exchanges of one live round on the split planner (split_round.py says what they
carry), and what they cost this daemon: the I/O half of split_round, kept out of round_loop.py.

Round k of the planner is barrier rounds 2k (summaries -> the hub's decision) and 2k + 1 (step
totals -> the round's totals); every daemon runs both for every round, so the barrier's rounds
stay in lock-step. Planning time is this daemon's own CPU on the round: its three local phases,
plus the hub's two reductions on the hub.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from odbd.daemon import split_round, summary_codec
from odbd.planner.config import PlannerConfig
from odbd.planner.cost_fit import CostFit
from odbd.planner.summary import GroupedUnit
from odbd.planner.types import NodeRoundPlan, RoundDecision, UnitOffer
from odbd.round import RoundBarrier
from odbd.round.barrier import RoundRecord


def barrier_round(round_index: int, phase: int, phases: int = 2) -> int:
    """The barrier round of planner round `round_index`'s exchange `phase` (0 .. phases - 1):
    2 per round, 3 with --migrate auto (the moves' exchange first, migration_live.py)."""
    return phases * round_index + phase


@dataclass(slots=True)
class SplitExchange:
    barrier: RoundBarrier
    node: int
    planning_s: float = 0.0  # the round being planned, so far
    exchange_s: float = 0.0  # its two exchanges, from the summary's send to the totals
    last_round: RoundRecord | None = None  # both exchanges of the last round, for /metrics
    first: int = 0  # the summary's phase: 1 when the moves' exchange comes first
    phases: int = 2  # barrier rounds per planner round

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
        self.planning_s = time.perf_counter() - started

        def reduce(payloads: list[bytes]) -> bytes:  # on the hub only
            begun = time.perf_counter()
            try:
                return split_round.hub_decide(payloads, config, seed_round, absorb, round_index)
            finally:
                self.planning_s += time.perf_counter() - begun

        sent = time.perf_counter()
        result = await self.barrier.exchange_reduced(
            barrier_round(round_index, self.first, self.phases), payload, reduce
        )
        self.exchange_s = time.perf_counter() - sent
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
        """Exchange 2: this node's step totals out, the round's totals back; its part planned."""
        started = time.perf_counter()
        draft, payload = split_round.node_totals(self.node, grouped, decision, config)
        self.planning_s += time.perf_counter() - started

        def reduce(payloads: list[bytes]) -> bytes:  # on the hub only
            begun = time.perf_counter()
            try:
                return split_round.hub_combine(payloads, decision.num_steps)
            finally:
                self.planning_s += time.perf_counter() - begun

        sent = time.perf_counter()
        result = await self.barrier.exchange_reduced(
            barrier_round(round_index, self.first + 1, self.phases), payload, reduce
        )
        self.exchange_s += time.perf_counter() - sent
        if self.last_round is not None:
            self.last_round = RoundRecord(round_index, self.exchange_s, self.last_round.last_node)
        started = time.perf_counter()
        done = split_round.node_complete(draft, decision, result, config)
        self.planning_s += time.perf_counter() - started
        return done
