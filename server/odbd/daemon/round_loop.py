"""The round loop: wait until this node is ready, exchange summaries, plan, queue the steps.

1. wait (round_wait.py): every local unit has a full buffer or is dry, and the trainers have at
   most `steps_ahead` steps queued (so the exchange of round k+1 overlaps their consumption of k)
2. exchange and plan (this module; split_exchange.py, split_round.py): this node's unit
   summaries go to the hub, which decides the round once; this node fits its own units to it,
   their step totals go to the hub, and the round's totals come back: no node's samples leave it
3. apply (round_apply.py, numbers from round_progress.py): this node's ranks get their steps;
   recirculated samples return to the buffer; epochs end (round_ending.py; join: the flush
   round; non-join: the step that reaches the sample quota)
The state the steps share is round_base.RoundLoopState; each step is a class over it, and
RoundLoop is all of them with the loop that runs them in order.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from odbd.daemon import split_round, summary_codec
from odbd.daemon.cost_learning import CostLearner
from odbd.daemon.round_apply import RoundApplying
from odbd.daemon.round_base import JobFailed
from odbd.daemon.round_wait import RoundWaiting
from odbd.errors import InvariantError
from odbd.ingest.rejections import (
    budget_failure,
    empty_dataset_failure,
    over_budget,
)
from odbd.planner.config import ROW_CAP_SHIFTS, PlannerConfig
from odbd.planner.cost_fit import (
    CostFit,
    CostModelMode,
    FitState,
    RowFeature,
)

log = logging.getLogger("odbd.round")


class RoundLoop(RoundWaiting, RoundApplying):
    """One round after another until every epoch is planned (the steps: module docstring)."""

    async def run(self) -> None:
        if self.state.dataset_size == 0:
            # Refused before the first round, as a failed job rather than an exit at start-up:
            # the trainers then raise JobFailedError with this line instead of waiting for a
            # daemon that is gone (it exited 0 with "the dataset is empty" at INFO before).
            self.failure = empty_dataset_failure(self.config.dataset)
            self._end_job(self.failure, failed=True)
            await self._tell_trainers()
            raise JobFailed(self.failure)
        while not self.done:
            await self._wait_ready()
            side = summary_codec.NodeSummary(
                node=self.config.node_rank,
                epoch=self.state.epoch,
                units=(),
                rejected=self.state.take_rejected_delta(),
                resume=self.resume if self.round_index == 0 else None,
                observations=self.cost.take_new(),
                schema=self._schema(),
                ended=self._local_end_points(),
            )
            self._end_unsent = False
            self._exchanging, self._exchange_started_s = True, time.monotonic()
            planner = self._planner()
            seed_round = self.round_seed_base + self.round_index
            offers = self.state.offers()
            if self.migration is not None:
                restart = self.foreign_trained if self.round_index == 0 else None
                offers = await self.migration.round(
                    self.split, self.round_index, seed_round, offers, planner, restart
                )
            grouped, decided = await self.split.decide(
                self.round_index, seed_round, side, tuple(offers), planner, self.cost.absorb,
            )  # fmt: skip
            facts = decided.facts
            if facts.invariant is not None:
                self._exchanging = False
                raise InvariantError(facts.invariant)
            self._take_facts(facts)
            if self._schemas_disagree(facts.schema) or self._past_budget():
                self._exchanging = False
                break
            if self._ends_by_request(facts.ended):
                self._exchanging = False
                break  # every rank called end_job(): this round's steps would be past the end
            assert decided.decision is not None
            plan, extras = await self.split.complete(
                self.round_index, grouped, decided.decision, planner
            )
            self._exchanging = False  # both exchanges: the others' totals are awaited too
            self.stats.round_planning.observe(self.split.planning_s)
            self.offered = (extras.offered_samples, extras.offered_tokens)
            self._apply(plan, facts.rejected, extras)
            self._record_round(plan, extras)
            self.on_planned(plan)
            self.round_index += 1
        if self.failure is not None:
            await self._tell_trainers()
            raise JobFailed(self.failure)

    # -- 3. plan inputs ----------------------------------------------------------------------

    def _take_facts(self, facts: split_round.RoundFacts) -> None:
        """The round's merged side facts (the hub checked that the nodes agree on the epoch and
        the resume point, split_round.merge_facts): rejections and the cost model."""
        assert self.tally.rejected is not None
        self.tally.rejected.update(facts.rejected)
        self.quota_consumed += sum(facts.rejected.values()) if not self.config.join else 0
        if facts.fit is not None:
            self._adopt_fit(facts.fit)

    def _schema(self) -> tuple[int, str] | None:
        schema_hash = self.state.schema_hash
        return None if schema_hash is None else (schema_hash, self.state.schema_text)

    def _schemas_disagree(self, failure: str | None) -> bool:
        """Nodes that chose different sample schemas fail the job before this round is planned
        (the hub compared every node's, and every daemon gets its verdict): one rule, so no
        node trains under a schema another rejects."""
        if failure is None:
            return False
        self.failure = failure
        self._end_job(failure, failed=True)
        return True

    def _past_budget(self) -> bool:
        """The epoch's rejections over every node passed --max-reject-fraction: the job fails
        now, before this round is planned (every daemon decides it from the same offers)."""
        assert self.tally.rejected is not None
        total = sum(self.tally.rejected.values())
        fraction = self.config.max_reject_fraction
        if not over_budget(total, self.state.dataset_size, fraction):
            return False
        self.failure = budget_failure(
            self.state.epoch,
            self.tally.rejected,
            self.state.dataset_size,
            fraction,
            self.state.first_rejected_ids,
            self.state.first_rejection,
        )
        self._end_job(self.failure, failed=True)
        return True

    def _adopt_fit(self, fit: CostFit) -> None:
        """The hub's fit of every node's timed steps so far (the hub absorbed this round's in
        its decision, cost_learning.py): every daemon plans the next round with it."""
        self.cost.fit = fit
        if fit.state is FitState.FITTED and fit != self.stats.cost_fit:
            log.info(
                "round %d: cost model fitted to %d rank-steps: %r s/padded token, %r s/l^2, "
                "%r s/step, median error %.1f%% (fixed model %.1f%%)%s%s",
                self.round_index, fit.num_observations, *fit.seconds, 100 * fit.error,
                100 * fit.fixed_error, _attention_note(fit),
                "" if self.cost.learned else "; not used (--cost-model fixed)",
            )  # fmt: skip
        self.stats.cost_fit = fit
        self.stats.cost_learned = self.cost.learned

    def _planner(self) -> PlannerConfig:
        """The planner config of this round: under --cost-model auto its cost model is the fit
        of every node's timed steps up to the previous round (the same on every daemon)."""
        if not self.cost.learned:
            return warmup_planner(self.state.planner, self.cost, self.round_index)
        return dataclasses.replace(self.state.planner, cost=self.cost.model)


def _attention_note(fit: CostFit) -> str:
    """How the fit priced packed rows' attention (--attention dense/auto), for the refit log."""
    if not fit.model.dense_rows and "dense" not in fit.errors:
        return ""
    chosen = "dense" if fit.model.dense_rows else "varlen"
    tried = ", ".join(f"{name} {100 * e:.1f}%" for name, e in sorted(fit.errors.items()))
    best = fit.model.best_row()
    row = ""
    if best < 1.0:  # c = 0: every sample costs least alone
        row = ", one sample per packed row (no per-step constant measured)"
    elif best < float("inf"):
        row = f", packed rows up to {best:.0f} tokens"
    return f"; attention over packed rows: {chosen} ({tried}){row}"


def warmup_planner(planner: PlannerConfig, cost: CostLearner, round_index: int) -> PlannerConfig:
    """The round's planner before the cost fit is usable: as configured, except that packed
    rows whose attention is to be learned (--attention auto/dense with --cost-model auto)
    take turns at full, half and quarter budget (ROW_CAP_SHIFTS; the same on every daemon)."""
    if cost.mode is not CostModelMode.AUTO or cost.rows is RowFeature.SAMPLES:
        return planner
    shift = ROW_CAP_SHIFTS[round_index % len(ROW_CAP_SHIFTS)]
    return dataclasses.replace(planner, row_cap=max(planner.token_budget >> shift, 1))
