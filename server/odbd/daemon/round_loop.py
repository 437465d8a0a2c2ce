"""The round loop: wait until this node is ready, exchange summaries, plan, queue the steps.

1. wait: every local unit has a full buffer or is dry, and the trainers have at most
   `steps_ahead` steps queued (so the exchange of round k+1 overlaps their consumption of k)
2. exchange and plan (split_exchange.py, split_round.py): this node's unit summaries go to the
   hub, which decides the round once; this node fits its own units to it, their step totals go
   to the hub, and the round's totals come back: no node's samples leave it
3. apply: this node's ranks get their steps; recirculated samples return to the buffer;
   epochs end (join: the flush round; non-join: the step that reaches the sample quota)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from odbclient.shm import read_meta
from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.config import DaemonConfig
from odbd.daemon import split_round, summary_codec
from odbd.daemon.cost_learning import CostLearner
from odbd.daemon.end_requests import (
    EndDecision,
    EndOutcome,
    Point,
    end_decision,
    missing_failure,
)
from odbd.daemon.journal import Journal, JournalStep, ResumeState
from odbd.daemon.migration_live import LiveMigration
from odbd.daemon.node_state import Locations, NodeState
from odbd.daemon.split_exchange import SplitExchange, barrier_round
from odbd.daemon.trained import StepCounts, steps_trained
from odbd.daemon.updates import UpdateNumbering
from odbd.errors import InvariantError, OdbdError
from odbd.ingest.lanes import Lanes
from odbd.ingest.rejections import (
    budget_failure,
    empty_dataset_failure,
    empty_epoch_failure,
    epoch_rejection_summary,
    over_budget,
)
from odbd.metrics.stats import DaemonStats
from odbd.planner.config import ROW_CAP_SHIFTS, Align, Collate, PlannerConfig
from odbd.planner.cost_fit import (
    CostFit,
    CostModelMode,
    FitConfig,
    FitState,
    RowFeature,
    row_feature,
)
from odbd.planner.estimate import round_estimates
from odbd.planner.identities import EpochIdentities, IdentitySource, StepIdentities
from odbd.planner.progress import (
    JobShape,
    ProgressColumns,
    StepFactsColumns,
    capped_job_progress,
    steps_progress,
)
from odbd.planner.types import NodeRoundPlan, SampleTable, UnitPlan
from odbd.planner.update_align import rank_runs
from odbd.round import RoundBarrier
from odbd.serve.rank_queue import QueuedItem, RankQueue

log = logging.getLogger("odbd.round")

_WAIT_LOG_S = 10.0
_TELL_FAILURE_S = 60.0  # a failed job waits this long for unattached trainers to learn why


def wait_reason(
    *,
    producers: int,
    buffered: int,
    rejected: dict[str, int],
    lanes_full: bool,
    starting: tuple[int, float] = (0, 0.0),
    slow: tuple[str, int, float] | None = None,
    held_by_ranks: bool = False,
) -> str:
    """Why nothing arrives, as far as this node can tell, for the periodic wait line.

    `slow`: (producer, identity, seconds) of the sample a producer has been making longest,
    once past SLOW_SAMPLE_S (a 60 s dataset[i] read as "making samples" before).
    `held_by_ranks`: ranks sit on undelivered steps (named before this reason by the caller).
    `starting`: the --workers processes alive and seconds since the first started. With none
    attached they are still in the dataset factory (it runs in every worker before it
    connects), which can take minutes for a real dataset: telling the operator to start
    producers by hand then sent them the wrong way (found with a 45 s factory)."""
    workers, since_s = starting
    if producers == 0 and workers > 0:
        return (
            f"no producer is attached yet: {workers} --workers process"
            f"{'es' if workers > 1 else ''} started {since_s:.0f} s ago and "
            f"{'have' if workers > 1 else 'has'} not connected; each builds the dataset "
            "(the --dataset factory runs in every worker) before it connects, so a slow "
            "factory shows here and the round starts once one connects; if it never does, "
            "run the worker's command (ps shows it) by hand to see where it stops"
        )
    if producers == 0:
        return (
            "no producer is attached: start producers on this node (python -m "
            "odbclient.producer.producer_main --socket ...), or see above why --workers stopped"
        )
    if lanes_full and held_by_ranks:  # the ranks named first hold the space: not a size issue
        return "every producer waits for lane space, which those undelivered steps hold"
    if lanes_full:
        return "every producer waits for lane space: raise --shm-size or lower --buffer"
    if slow is not None:
        name, identity, seconds_in = slow
        return (
            f"{producers} producers attached, and producer {name} has been inside "
            f"dataset[{identity}] for {seconds_in:.0f} s; a sample that slow holds up the "
            "round (speed up its preprocessing; a --workers process inside one sample for "
            "--lease-timeout is killed as hung)"
        )
    if buffered == 0 and rejected:
        return (
            f"{producers} producers attached but every sample since the last round was "
            f"rejected {rejected}"
        )
    return f"{producers} producers attached and making samples"


class JobFailed(OdbdError):
    """The job cannot train (an epoch emitted nothing): trainers got JobEnd(failed) first."""


def _describe_rank(queue: RankQueue) -> str:
    first = queue.first_undelivered()
    where = f" from epoch {first[0]} step {first[1]}" if first is not None else ""
    client = "its client is attached" if queue.attached else "no client attached"
    return f"rank {queue.rank} has {queue.queued_steps()} steps undelivered{where}, {client}"


@dataclass(slots=True)
class EpochTally:
    """Facts of the epoch being emitted: steps, samples, rejections and distinct identities
    over every node (from the hub's results, so the same on every daemon)."""

    steps: int = 0
    samples: int = 0
    identities: EpochIdentities = dataclasses.field(default_factory=EpochIdentities)
    rejected: Counter[str] | None = None

    @property
    def num_seen(self) -> int:
        return self.identities.count


class RoundLoop:
    def __init__(
        self,
        *,
        config: DaemonConfig,
        state: NodeState,
        barrier: RoundBarrier,
        queues: dict[int, RankQueue],
        lanes: Lanes,
        read_sample: Callable[[int, int, int], memoryview],
        on_planned: Callable[[NodeRoundPlan], None],
        stats: DaemonStats,
        journal: Journal | None = None,
        lanes_full: Callable[[], bool] = lambda: False,
        producers: Callable[[], int] = lambda: 0,
        starting: Callable[[], tuple[int, float]] = lambda: (0, 0.0),
        slow_sample: Callable[[], tuple[str, int, float] | None] = lambda: None,
        free: Callable[[list[Locations]], None] = lambda locations: None,
    ) -> None:
        self.config = config
        self.state = state
        self.barrier = barrier
        self.queues = queues
        self.lanes = lanes
        self.read_sample = read_sample
        self.on_planned = on_planned
        self.stats = stats
        self._warned_long = False  # the over-budget warnings are shown once per daemon
        self._warned_many = False
        self.journal = journal
        self.lanes_full = lanes_full  # IngestService.lanes_full
        self.lanes_full_warned = False
        self.producers = producers  # producers attached now (for the wait line)
        self.starting = starting  # --workers processes alive, seconds since the first started
        self.slow_sample = slow_sample  # IngestService.slowest_sample
        self.free = free  # shared memory of steps dropped unsent (past a rank's end_job point)
        # ODBClient.end_job() points (end_requests.py decides what they mean): this node's
        # ranks' as their streams say them, and every rank's as the rounds carried them. Only
        # the latter decide the job's end, so every daemon decides it in the same round.
        self.end_points_local: dict[int, Point] = {}
        self.end_requests: dict[int, Point] = {}
        self._end_unsent = False  # a local rank's point is not in an offer yet
        self.end_first_s: float | None = None  # time.monotonic() of the first point heard of
        self.resume: tuple[int, int] | None = None  # set by restore(): announced in round 0
        self.round_seed_base = 0  # plans of a restarted job must not repeat the old seeds
        self.progress = asyncio.Event()
        self._exchanging = False  # this node's offer is in the barrier: it waits for the others
        self._exchange_started_s = 0.0  # time.monotonic() when it went in
        self._room: bool | None = None  # set while _wait_ready waits: were the queues short?
        self.round_index = 0
        self.done = False
        self.failure: str | None = None  # an epoch trained nothing: the same round everywhere
        self.fatal: str | None = None  # this node cannot go on (its producers keep dying)
        self.quota_consumed = 0  # non-join: views emitted or rejected, over every node
        self.filler_schema = ""
        self.steps_in_epoch: Counter[int] = Counter()
        self.tally = self._new_tally()
        self.last_wait_log = time.monotonic()
        # Per epoch, over every node: samples and loss tokens planned (StepBatch.progress).
        self.epoch_emitted: Counter[int] = Counter()
        self.epoch_tokens: Counter[int] = Counter()
        # Samples and loss tokens of every step this daemon planned (all epochs, all nodes):
        # with each round's offers, the mean tokens per sample that the job's fraction uses.
        self.planned_samples = 0
        self.planned_tokens = 0
        self.token_floor: dict[int, float] = {}  # epoch -> its last step's token fraction
        self.held_estimates: dict[int, int] = {}  # epoch -> its steps as estimated last round
        self.updates = UpdateNumbering(self.state.planner, stats)
        # --max-updates: optimizer updates planned so far over every epoch; `capped` once the
        # round holding the job's last update is planned (the steps after it are not run).
        self.updates_done = 0
        self.capped = False
        self.cost = CostLearner(
            config.cost_model,
            self.state.planner.cost,
            FitConfig(
                warmup=config.cost_warmup, window=max(config.cost_warmup, FitConfig().window)
            ),
            row_feature(self.state.planner),
        )
        self.split = SplitExchange.of(barrier, config.node_rank, self.state.planner)
        self.split.source = IdentitySource(
            state.dataset_size, state.views_per_iteration, state.identities_of
        )
        # --migrate auto (migration_live.py), set by the daemon once its bulk port listens
        self.migration: LiveMigration | None = None
        self.foreign_trained = np.zeros(0, dtype=np.int64)  # restore(): see there
        # (samples, loss tokens) every unit's buffer held this round (RoundExtras)
        self.offered = (0, 0)
        self._first_rank = config.local_ranks[0]  # a NodeRoundPlan's columns start here

    def _new_tally(self) -> EpochTally:
        return EpochTally(0, 0, EpochIdentities(), Counter())

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

    # -- 1. readiness ------------------------------------------------------------------------

    def _queued_min(self) -> int:
        """Fewest steps queued for a rank that still trains (0 once every local rank ended:
        its node must keep offering rounds, or the others' end points could never arrive)."""
        live = [q.queued_steps() for q in self.queues.values() if q.end_point is None]
        return min(live, default=0)

    async def _wait_ready(self) -> None:
        reported = ""  # the last reason sent to the hub, so an unchanged wait sends nothing
        while True:
            self.barrier.raise_failure()  # a lost peer fails the job now, not at the next round
            if self.fatal is not None:
                self.abort(self.fatal)
                await self._tell_trainers()
                raise JobFailed(self.fatal)
            if self._end_unsent:
                return  # a local rank's end_job() point goes to every node with this round
            room = self._queued_min() <= self.config.steps_ahead
            if room and (self.state.units_ready() or self._round_rejected()):
                return
            if room and self._buffer_capped_by_lanes():
                self._count_lanes_full_round()
                return
            self.progress.clear()
            self._room = room
            try:
                # asyncio.timeout, not wait_for: this runs on every commit and Delivered, and
                # wait_for wraps the wait in a new Task each time.
                async with asyncio.timeout(self.config.stall_s):
                    await self.progress.wait()
            except TimeoutError:
                # Producers made no progress for stall_s: rather than starve the trainers,
                # plan with what is buffered once they are about to run dry.
                if self._queued_min() <= 1 and self.state.buffered_now() > 0:
                    return
                reason = self._wait_reason(room)
                self._log_waiting(reason)
                if reason != reported:
                    round_index = barrier_round(self.round_index, 0, self.split.per_round)
                    await self.barrier.report_waiting(round_index, reason)
                    reported = reason
            finally:
                self._room = None

    def ingest_progress(self) -> None:
        """A commit, rejection, LaneFull or producer change: it may end a wait for buffers,
        never a wait for queue room (only Delivered reports make room), so that wait sleeps on."""
        if self._room is not False:
            self.progress.set()

    def trainer_progress(self) -> None:
        """A Delivered report (or steps skipped on resume): it may end a wait for queue room,
        never a wait for buffers, so that wait sleeps on. Without the split, every commit and
        every report woke the loop to find nothing to do."""
        if self._room is not True:
            self.progress.set()

    def _round_rejected(self) -> bool:
        """A round's worth of this node's samples was rejected and none is buffered: offer the
        empty round anyway, so the counts reach every node and the epoch can end (non-join
        epochs end by counting rejections against the quota)."""
        capacity = self.state.planner.unit_capacity * len(self.state.local_unit_ids())
        rejected = sum(self.state.rejected.values())
        return self.state.buffered_now() == 0 and rejected >= capacity

    def _buffer_capped_by_lanes(self) -> bool:
        """Every producer waits for lane space with samples buffered: the buffer cannot fill
        before this round frees shared memory, so plan now rather than wait stall_s."""
        return self.state.buffered_now() > 0 and self.lanes_full()

    def _count_lanes_full_round(self) -> None:
        """Counts a round offered short because the lanes are full; the first one warns."""
        self.stats.lanes_full_rounds += 1
        if self.lanes_full_warned:
            return
        self.lanes_full_warned = True
        per_sample = self.stats.ingest_bytes / max(self.stats.ingest_samples, 1)
        capacity = self.state.planner.unit_capacity * len(self.state.local_unit_ids())
        log.warning(
            "round %d: the producer lanes (%.1f MiB each) filled up with %d samples "
            "buffered, short of the %d a round takes (%.1f MiB at %.2f MiB per sample), so "
            "rounds are planned with what the lanes hold: smaller rounds, more of them. For "
            "full rounds raise --shm-size or lower --buffer (odbd_lanes_full_rounds_total "
            "counts these rounds).",
            self.round_index,
            self.lanes.lane_bytes / 2**20,
            self.state.buffered_now(),
            capacity,
            capacity * per_sample / 2**20,
            per_sample / 2**20,
        )

    def _wait_reason(self, room: bool) -> str:
        """Why this node cannot offer the round yet, naming the ranks that hold it up.

        No room: every local rank has more than --steps-ahead steps queued, so the ranks that
        have not taken theirs are named. Room but no full buffer: producers are short, and if a
        rank sits on far more queued steps than --steps-ahead, its undelivered batches hold the
        shared memory the producers need, so it is named too.
        """
        lagging = sorted(
            (q for q in self.queues.values() if q.queued_steps() > self.config.steps_ahead),
            key=lambda q: (-q.queued_steps(), q.rank),
        )
        ranks = "; ".join(_describe_rank(q) for q in lagging[:4])
        if not room:
            return (
                f"its trainers have not taken their queued steps ({ranks}); a rank that stopped "
                "calling next() (hung, deadlocked, or stuck outside the loop) holds up the job"
            )
        producers = (
            f"its producers filled {self.state.buffered_now()} of the "
            f"{self.state.planner.unit_capacity} samples a unit buffers "
            f"({len(self.state.leases)} leases out): "
            + wait_reason(
                producers=self.producers(),
                buffered=self.state.buffered_now(),
                rejected=dict(self.state.rejected),
                lanes_full=self.lanes_full(),
                starting=self.starting(),
                slow=self.slow_sample(),
                held_by_ranks=bool(lagging),
            )
        )
        if lagging:
            # The rank first: it is the cause, and the lanes-full advice (raise --shm-size)
            # read first sent operators to resize memory for a stopped trainer.
            return (
                f"shared memory is held by undelivered steps ({ranks}); a rank that stopped "
                f"calling next() holds up the job, and meanwhile {producers}"
            )
        return producers

    @property
    def waiting_for(self) -> str:
        """What the next round waits for, for `odbd status` and a stalled trainer's error."""
        if self._exchanging:
            # Read after "waits because": it was "the other nodes' offers for round K", which
            # neither read as a reason nor said for how long or when a deadline names the node.
            since_s = time.monotonic() - self._exchange_started_s
            return (
                f"not every other node has sent its offer for round {self.round_index} yet "
                f"(this node sent its own {since_s:.0f} s ago; at --round-timeout "
                f"{self.config.round_timeout_s:g} s the hub fails the job naming the missing node)"
            )
        return "" if self._room is None else self._wait_reason(self._room)

    def _log_waiting(self, reason: str) -> None:
        now = time.monotonic()
        if now - self.last_wait_log < _WAIT_LOG_S:
            return
        self.last_wait_log = now
        log.info("round %d waits: %s", self.round_index, reason)

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

    # -- 4. apply ----------------------------------------------------------------------------

    def _apply(
        self, plan: NodeRoundPlan, rejected: dict[str, int], extras: split_round.RoundExtras
    ) -> None:
        quota_before = self.quota_consumed
        step_epochs = self._step_epochs(plan)
        kept = len(step_epochs)
        steps_before = sum(self.steps_in_epoch.values())
        step_numbers = self._number_steps(step_epochs)
        updates = self.updates.of_round(plan, step_epochs, self.round_index)
        progress = self._plan_progress(plan, quota_before, step_epochs, step_numbers)
        if self.config.max_updates:
            progress = self._capped_progress(progress, updates, steps_before)
        if self.journal is not None:
            self._journal_round(plan, step_epochs, step_numbers, rejected, extras)
        for unit in plan.units:  # this node's units only
            self._queue_unit(plan, unit, step_epochs, step_numbers, progress, updates)
        self._record_steps(plan, kept, extras)
        self.stats.record_planned(
            step_epochs, step_numbers, progress.epoch_steps_estimate, progress.epoch_steps_exact
        )
        self._advance_epochs(plan, step_epochs, extras.step_identities())
        if self.capped:
            self._end_job(f"--max-updates {self.config.max_updates} reached")

    def _record_round(self, plan: NodeRoundPlan, extras: split_round.RoundExtras) -> None:
        """Round facts for /metrics; every daemon records the same global numbers."""
        s = self.stats
        s.rounds += 1
        record = self.split.last_round
        if record is not None:
            s.round_duration.observe(record.duration_s)
            s.last_peer[record.last_node] += 1
        s.splits += extras.splits
        s.recirculated += extras.offered_samples - int(plan.global_num_samples.sum())
        if self.done:
            return  # keep the last epoch's final progress (set by _end_epoch) on display
        s.epoch = self.state.epoch
        s.epoch_samples = self.tally.samples
        s.epoch_identities = self.tally.num_seen

    def _record_steps(
        self, plan: NodeRoundPlan, kept: int, extras: split_round.RoundExtras
    ) -> None:
        stats, s = plan.stats, self.stats
        world = self.state.planner.world.world_size
        s.global_steps += kept
        s.step_max_work += float(extras.step_max_work[:kept].sum())  # every rank's: the hub's
        s.step_mean_work += float(extras.step_sum_work[:kept].sum()) / world
        s.global_samples += int(plan.global_num_samples[:kept].sum())
        s.global_tokens += int(plan.global_num_tokens[:kept].sum())
        # --align updates: a rank's skipped slots are queued and delivered (steps) but never
        # run, so they are no fillers (idle_steps)
        runs = rank_runs(plan)[:kept]
        for rank in self.queues:
            rs, column = s.rank(rank), rank - self._first_rank
            samples = stats.num_samples[:kept, column]
            rs.steps += kept
            rs.idle_steps += int(((samples == 0) & runs[:, column]).sum())
            rs.samples += int(samples.sum())
            rs.real_tokens += int(stats.real_tokens[:kept, column].sum())
            rs.padded_tokens += int(stats.padded_tokens[:kept, column].sum())
            rs.loss_tokens += int(stats.num_tokens[:kept, column].sum())

    def _journal_round(
        self,
        plan: NodeRoundPlan,
        step_epochs: list[int],
        step_numbers: list[int],
        rejected: dict[str, int],
        extras: split_round.RoundExtras,
    ) -> None:
        """Appends what this round hands to trainers, before any of it is queued: this node's
        ranks' samples (the journal's per-rank counts are 0 for the other nodes' ranks, whose
        samples only their own journal holds), and every node's identities per step (the
        hub's), so a restart counts the epoch's identities as the others do."""
        assert self.journal is not None
        kept = len(step_epochs)
        g = self.state.planner.ranks_per_unit
        parts = [
            u.emitted.views[int(u.slot_offsets[k * g]) : int(u.slot_offsets[(k + 1) * g])]
            for k in range(kept)
            for u in plan.units
        ]
        keys = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        per_step = plan.global_num_samples[:kept].tolist()
        counts = np.zeros((kept, self.state.planner.world.world_size), dtype=np.int64)
        local = plan.stats.num_samples.shape[1]
        counts[:, self._first_rank : self._first_rank + local] = plan.stats.num_samples[:kept]
        steps = [[e, n, c] for e, n, c in zip(step_epochs, step_numbers, per_step, strict=True)]
        self.journal.append_round(
            self.round_seed_base + self.round_index,
            steps,
            keys,
            counts,
            self.state.take_rejected_keys(),
            rejected,
            [list(extras.step_identities().of_step(i)) for i in range(kept)],
        )

    def restore(self, resume: ResumeState, update: int = 0) -> None:
        """Continues a restarted job at the trainers' resume point (journal.replay's result);
        `update` is the index of the first update not trained (the trainers' state_dict)."""
        self.updates.restore(resume.epoch, update)
        local = set(self.queues)
        trained = [k for s in resume.trained_steps for r, keys in enumerate(s.keys_by_rank)
                   if r in local for k in keys.tolist()]  # fmt: skip
        trained_keys = np.asarray(trained, dtype=np.int64)
        self.state.restore(
            trained_keys,
            np.asarray(resume.rejected_keys, dtype=np.int64),
            resume.epoch,
            np.asarray(resume.moved_keys, dtype=np.int64),
        )
        # --migrate auto: views of other nodes this node's ranks trained before the resume
        # point, for round 0's moves exchange (their home nodes hold them back till then)
        self.foreign_trained = np.unique(trained_keys[~self.state.is_home(trained_keys)])
        for s in resume.trained_steps:
            self.steps_in_epoch[s.epoch] = max(self.steps_in_epoch[s.epoch], s.step + 1)
            self.quota_consumed += s.global_samples
            self.epoch_emitted[s.epoch] += s.global_samples
            if s.epoch == resume.epoch:
                self.tally.steps += 1
                self.tally.samples += s.global_samples
                self._restore_identities(s)
        self.steps_in_epoch[resume.epoch] = resume.step
        if not self.config.join:
            self.quota_consumed += sum(resume.rejected.values())
        self.stats.epochs_done = resume.epoch if self.config.join else 0
        self.resume = (resume.epoch, resume.step)
        self.round_seed_base = resume.incarnation * 1_000_000_000
        self.updates_done = self._updates_before(resume.epoch, update)

    def _restore_identities(self, step: JournalStep) -> None:
        """A trained step's identities, as the round's result gave them to every daemon; a
        journal from before they were recorded holds this node's ranks' views only."""
        if step.identities is not None:
            self.tally.identities.fold(*step.identities)
            return
        source = self.split.source
        assert source is not None
        local = source.of_steps([np.concatenate(step.keys_by_rank)])
        self.tally.identities.fold(*local.of_step(0))

    def _updates_before(self, epoch: int, update: int) -> int:
        """--max-updates after a restart: the updates trained before the resume point. Exact
        without windows (a step is an update) and with --accumulate K (an epoch of n steps is
        ceil(n / K) updates, its last one short); with --tokens-per-update (or --align updates,
        whose updates may span more than K steps) the earlier epochs' updates are counted as if
        of K = the mean steps per update of the resume epoch."""
        if not self.state.planner.windows:
            return sum(self.steps_in_epoch.values())
        k = max(self.config.accumulate, 1)
        sized_by_plan = self.config.tokens_per_update or self.config.align is Align.UPDATES
        if sized_by_plan and update:
            k = max(round(self.steps_in_epoch[epoch] / update), 1)
        earlier = sum(-(-n // k) for e, n in self.steps_in_epoch.items() if e < epoch)
        return earlier + update

    def _number_steps(self, step_epochs: list[int]) -> list[int]:
        """Step index within its epoch, identical on every rank and daemon."""
        numbers = []
        for epoch in step_epochs:
            numbers.append(self.steps_in_epoch[epoch])
            self.steps_in_epoch[epoch] += 1
        return numbers

    def _step_epochs(self, plan: NodeRoundPlan) -> list[int]:
        limit = self._steps_within_cap(plan)
        if self.config.join:
            return [self.state.epoch] * min(plan.num_steps, limit)
        per_step = plan.global_num_samples.tolist()
        n = max(self.state.dataset_size, 1)
        quota = self.config.epochs * self.state.dataset_size if self.config.epochs else None
        epochs: list[int] = []
        for count in per_step:
            if quota is not None and self.quota_consumed >= quota:
                break
            if len(epochs) >= limit:
                break
            epochs.append(self.quota_consumed // n)
            self.quota_consumed += count
        return epochs

    def _steps_within_cap(self, plan: NodeRoundPlan) -> int:
        """How many of the round's steps --max-updates lets run: up to the step that ends the
        job's last update (then `capped`), else all. An update ends at every step without
        windows, else at each window's last step (the same on every daemon)."""
        if not self.config.max_updates:
            return plan.num_steps
        ends = [True] * plan.num_steps
        if self.state.planner.windows:
            ends = [False] * plan.num_steps
            for end in plan.windows.ends.tolist():
                ends[int(end) - 1] = True
        left = self.config.max_updates - self.updates_done
        done = 0
        for i, end in enumerate(ends):
            done += end
            if done >= left:
                self.capped = True
                self.updates_done += done
                return i + 1
        self.updates_done += done
        return plan.num_steps

    def _capped_progress(
        self,
        progress: ProgressColumns,
        updates: list[trainer_pb2.Update | None],
        steps_before: int,
    ) -> ProgressColumns:
        """--max-updates: the job's fraction and step count are exact from the first step."""
        kept = len(progress.job_fraction)
        ends = [u is None or u.end for u in updates]
        done_before = self.updates_done - sum(ends)  # _steps_within_cap counted this round
        shares = [1.0 if u is None else (u.step_in_update + 1) / u.num_steps for u in updates]
        fraction, steps = capped_job_progress(
            self.config.max_updates, done_before, steps_before, ends[:kept], shares[:kept]
        )
        return dataclasses.replace(progress, job_fraction=fraction, job_steps_estimate=steps)

    def _plan_progress(
        self,
        plan: NodeRoundPlan,
        quota_before: int,
        step_epochs: list[int],
        step_numbers: list[int],
    ) -> ProgressColumns:
        """Each kept step's StepBatch.progress, from global facts only (the same on every
        daemon): non-join counts the epoch's views by the sample quota (rejections included,
        the step reaching the epoch's share is its last); join by the epoch's emitted and
        rejected samples (the flush round's last step is the epoch's last)."""
        n = self.state.dataset_size
        job = JobShape(dataset_size=n, epochs=self.config.epochs)
        assert self.tally.rejected is not None
        rejected = sum(self.tally.rejected.values())  # join: of the epoch being planned
        quota = quota_before
        facts = StepFactsColumns([], [], [], [], [], [], [])
        # Python ints, once per round: the properties sum a (T, world) array on every access.
        global_samples = plan.global_num_samples.tolist()
        global_tokens = plan.global_num_tokens.tolist()
        mean_tokens = self._mean_tokens(plan)
        self.planned_samples += sum(global_samples[: len(step_epochs)])
        self.planned_tokens += sum(global_tokens[: len(step_epochs)])
        steps_before: dict[int, int] = {}  # epoch -> steps of the epochs before it
        join, final_step = self.config.join, len(step_epochs) - 1 if plan.final else -1
        for i, epoch in enumerate(step_epochs):
            if epoch not in steps_before:
                steps_before[epoch] = sum(c for e, c in self.steps_in_epoch.items() if e < epoch)
            samples = global_samples[i]
            emitted = self.epoch_emitted[epoch] = self.epoch_emitted[epoch] + samples
            tokens = self.epoch_tokens[epoch] = self.epoch_tokens[epoch] + global_tokens[i]
            quota += samples
            if join:
                facts.consumed.append(emitted + rejected)
                facts.last.append(i == final_step)
            else:
                facts.consumed.append(quota - epoch * n)
                facts.last.append(quota >= (epoch + 1) * n)
            facts.emitted.append(emitted)
            facts.tokens.append(tokens)
            facts.steps_before_epoch.append(steps_before[epoch])
            facts.mean_tokens.append(mean_tokens)
            facts.token_floor.append(self.token_floor.get(epoch, 0.0))
        facts.epoch.extend(step_epochs)
        facts.step.extend(step_numbers)
        progress = steps_progress(job, facts)
        for epoch, fraction in zip(step_epochs, progress.epoch_token_fraction, strict=True):
            self.token_floor[epoch] = fraction  # the last step of each epoch in the round wins
        # One estimate per round and epoch, held while near (planner/estimate.py).
        settled = round_estimates(job, facts, progress, self.held_estimates)
        self.held_estimates = settled.held
        return settled.progress

    def _mean_tokens(self, plan: NodeRoundPlan) -> float:
        """Loss tokens per sample over every sample ingested so far, as every daemon sees it:
        those of the steps planned before this round and those every unit's buffer held this
        round (emitted now or recirculated; the hub's sum, `offered`). Ingested in sampler
        order, so unbiased by which samples the planner picks first (planner/progress.py);
        0.0 before any sample."""
        samples = self.planned_samples + self.offered[0]
        tokens = self.planned_tokens + self.offered[1]
        return tokens / samples if samples else 0.0

    def _queue_unit(
        self,
        plan: NodeRoundPlan,
        unit: UnitPlan,
        step_epochs: list[int],
        step_numbers: list[int],
        progress: ProgressColumns,
        updates: list[trainer_pb2.Update | None],
    ) -> None:
        g = self.state.planner.ranks_per_unit
        ranks = self.state.planner.unit_ranks(unit.unit)
        kept = len(step_epochs)
        end = int(unit.slot_offsets[kept * g])
        emitted = _EmittedColumns.gather(self.state, self.lanes, unit.emitted.views[:end])
        self.state.mark_emitted(unit.emitted.views[:end])  # after the gather: it may drop them
        self._count_oversized(unit.emitted.take(slice(0, end)))  # views of the columns
        tail = unit.emitted.take(slice(end, None))  # past the quota: not run
        self.state.return_samples(unit.unit, unit.leftover.concat(tail))
        progress_messages = _progress_messages(progress)  # one per step, every rank
        facts = _StepColumns.of(plan, unit, kept * g)
        first = self._first_rank  # plan.stats' column of a rank is its rank less this
        patch_weight = self.cost.model.p  # once per round: the model is refit between rounds
        bounds = unit.slot_offsets.tolist()
        for local_rank, rank in enumerate(ranks):
            items = []
            for step in range(kept):
                s = step * g + local_rank
                items.append(self._step_item(
                    facts, emitted, step, rank, rank - first, s, slice(bounds[s], bounds[s + 1]),
                    step_epochs[step], step_numbers[step], progress_messages[step],
                    self.updates.of_rank(updates[step], plan, step, rank - first), patch_weight,
                ))  # fmt: skip
            self.free(self.queues[rank].push(items))

    def _count_oversized(self, emitted: SampleTable) -> None:
        """Counts emitted samples over the token or patch budget; warns once per budget.

        Grouping gives such a sample a group of its own, so it trains, but its step exceeds
        the budget the operator sized memory for."""
        budget, max_patches = self.config.token_budget, self.config.max_patches
        long = emitted.lengths > budget
        many = emitted.patches > max_patches if max_patches else np.zeros_like(long)
        if not self._warned_long and long.any():
            self._warned_long = True
            i = int(np.flatnonzero(long)[0])
            log.warning(
                "sample %d has %d tokens, more than --token-budget %d: it is trained alone in "
                "its own group, whose %s exceeds the budget (shown once; "
                "odbd_oversized_samples_total counts them all); raise --token-budget or "
                "truncate samples in preprocessing",
                int(self.state.identities_of(emitted.views[i : i + 1])[0]),
                int(emitted.lengths[i]),
                budget,
                "token count" if self.config.collate is Collate.PACKED else "padded area",
            )
        if not self._warned_many and many.any():
            self._warned_many = True
            i = int(np.flatnonzero(many)[0])
            log.warning(
                "sample %d has %d patches, more than --max-patches %d: it is trained alone in "
                "its own group (shown once; odbd_oversized_samples_total counts them all); "
                "raise --max-patches or resize its images in preprocessing",
                int(self.state.identities_of(emitted.views[i : i + 1])[0]),
                int(emitted.patches[i]),
                max_patches,
            )
        self.stats.oversized_samples += int((long | many).sum())

    def _step_item(
        self,
        facts: _StepColumns,
        emitted: _EmittedColumns,
        step: int,
        rank: int,
        column: int,
        slot: int,
        rows: slice,
        epoch: int,
        number: int,
        progress: trainer_pb2.Progress,
        update: trainer_pb2.Update | None,
        patch_weight: float,
    ) -> QueuedItem:
        idle = rows.stop <= rows.start
        # Patches enter the fit as p token-equivalents each (the planner's own weight, the
        # cost model's p), so the learned model keeps the vision share fixed and fits the
        # scale of the whole step.
        linear = facts.padded_tokens[step][column] + patch_weight * facts.slot_patches[slot]
        self.cost.expect(rank, epoch, number, linear, facts.slot_sum_sq[slot])
        if not idle and not self.filler_schema:
            self._learn_schema(
                (int(emitted.segments[rows.start]), int(emitted.offsets[rows.start])),
                int(emitted.locations.nbytes[rows.start]),
            )
        batch = trainer_pb2.StepBatch(
            epoch=epoch,
            step=number,
            is_idle=idle,
            loss_scale=facts.loss_scale[step][column],
            num_samples=facts.num_samples[step][column],
            num_tokens=facts.num_tokens[step][column],
            global_num_samples=facts.global_num_samples[step],
            global_num_tokens=facts.global_num_tokens[step],
            sample_ids=emitted.sample_ids_bytes[rows.start * 8 : rows.stop * 8],
            segments=emitted.segments_bytes[rows.start * 4 : rows.stop * 4],
            offsets=emitted.offsets_bytes[rows.start * 8 : rows.stop * 8],
            nbytes=emitted.nbytes_bytes[rows.start * 8 : rows.stop * 8],
            filler_schema=self.filler_schema if idle else "",
            progress=progress,
        )
        if update is not None:
            batch.update.CopyFrom(update)
        freed = [emitted.locations.take(rows)] if not idle else []
        counts = StepCounts(
            samples=facts.num_samples[step][column],
            loss_tokens=facts.num_tokens[step][column],
            real_tokens=facts.real_tokens[step][column],
            padded_tokens=facts.padded_tokens[step][column],
            global_samples=facts.global_num_samples[step],
            epoch_last=progress.epoch_steps_exact and number + 1 == progress.epoch_steps_estimate,
        )
        return QueuedItem(epoch, number, batch.SerializeToString(), freed, counts)

    def _learn_schema(self, where: tuple[int, int], nbytes: int) -> None:
        meta = read_meta(self.read_sample(where[0], where[1], nbytes))
        fields = [
            [f.name, f.dtype, [] if len(f.shape) == 1 else list(f.shape)] for f in meta.fields
        ]
        self.filler_schema = json.dumps(fields)

    def _advance_epochs(
        self, plan: NodeRoundPlan, step_epochs: list[int], emitted: StepIdentities
    ) -> None:
        """Counts the kept steps into their epochs' tallies and ends the epochs they finish.
        `emitted`: every node's identities per step (the hub's sum), folded into each step's
        own epoch (a --no-join round may end one epoch and start the next)."""
        if self.config.join:
            self.tally.steps += len(step_epochs)
            self.tally.samples += int(plan.global_num_samples[: len(step_epochs)].sum())
            for i in range(len(step_epochs)):
                self.tally.identities.fold(*emitted.of_step(i))
            if plan.final and len(step_epochs) == plan.num_steps:  # not cut by --max-updates
                self._end_epoch(self.state.epoch)
                self.state.epoch += 1
                if self.config.epochs and self.state.epoch >= self.config.epochs:
                    self._end_job("all epochs done")
            return
        for i, epoch in enumerate(step_epochs):
            if epoch > self.state.epoch:
                self._end_epoch(self.state.epoch)
                self.state.epoch = epoch
            self.tally.steps += 1
            self.tally.samples += int(plan.global_num_samples[i])
            self.tally.identities.fold(*emitted.of_step(i))
        n = self.state.dataset_size
        if self.capped and n and self.quota_consumed >= (self.state.epoch + 1) * n:
            self._end_epoch(self.state.epoch)  # the job's last update ends this epoch too
        quota = self.config.epochs * self.state.dataset_size
        if self.config.epochs and self.quota_consumed >= quota:
            self._end_epoch(self.state.epoch)
            self._end_job("sample quota reached")

    def _end_epoch(self, epoch: int) -> None:
        tally = self.tally
        assert tally.rejected is not None
        if tally.samples == 0:
            # Decided from global facts (every node's offers), so every daemon fails alike; the
            # trainers get the failed JobEnd instead of an empty epoch.
            self.failure = empty_epoch_failure(epoch, tally.rejected, self.state.first_rejection)
            self._end_job(self.failure, failed=True)
            return
        end = trainer_pb2.EpochEnd(
            epoch=epoch,
            num_steps=tally.steps,
            global_num_samples=tally.samples,
            rejected_by_reason=dict(tally.rejected),
            num_identities=tally.num_seen,
        )
        if tally.rejected:
            log.warning(
                "%s; the job goes on (at most --max-reject-fraction %g of an epoch may be "
                "rejected); the first of each reason was logged when it happened",
                epoch_rejection_summary(epoch, tally.rejected, self.state.dataset_size),
                self.config.max_reject_fraction,
            )
        # Planned, not trained: the queues hold up to --steps-ahead of its steps (a small epoch
        # is planned whole at start-up). "epoch N trained" follows when the trainers took it.
        taken = steps_trained(epoch, [q.trained for q in self.queues.values()])
        log.info(
            "epoch %d planned: %d steps, %d samples, %d identities of %d, rejected %s; "
            "trained so far: %s",
            epoch,
            tally.steps,
            tally.samples,
            end.num_identities,
            self.state.dataset_size,
            dict(tally.rejected) or "none",
            "every step" if taken is None else f"{taken} of its {tally.steps} steps",
        )
        for queue in self.queues.values():
            queue.push([QueuedItem(epoch, -1, trainer_pb2.TrainerEvent(epoch_end=end))])
        self.stats.epoch_samples, self.stats.epoch_identities = tally.samples, end.num_identities
        self.tally = self._new_tally()
        self.stats.epochs_done += 1

    def _end_job(self, reason: str, failed: bool = False) -> None:
        if self.done:
            return  # a failure ended it already (then "all epochs done" follows)
        self.done = True
        end = trainer_pb2.JobEnd(reason=reason, failed=failed)
        for queue in self.queues.values():
            queue.push([QueuedItem(self.state.epoch, -1, trainer_pb2.TrainerEvent(job_end=end))])

    # -- ODBClient.end_job() ------------------------------------------------------------------

    def request_end(self, rank: int, epoch: int, step: int) -> None:
        """A local rank called end_job() before (epoch, step): it takes nothing from there on
        (its queue drops those steps now), and its point goes to every node with the next
        round, offered at once. Once every round is planned (`done`), no round can carry it:
        this node's own ranks decide for it alone."""
        if rank in self.end_points_local or self.failure is not None:
            return  # end_job() twice: the client sends it once; a resent one changes nothing
        point = self._normalized((epoch, step))
        self.end_points_local[rank] = point
        if self.end_first_s is None:
            self.end_first_s = time.monotonic()
        self.free(self.queues[rank].end_at(*point))
        log.info("rank %d called end_job() at epoch %d step %d", rank, *point)
        if self.done:
            self._decide_end(end_decision(self.queues, self.end_points_local), local=True)
            return
        self._end_unsent = True
        self.progress.set()

    def _normalized(self, point: Point) -> Point:
        """(e, n) with n the final step count of epoch e is (e + 1, 0): a rank that left its
        loop before taking the epoch's end trained the same steps as one that took it."""
        epoch, step = point
        if epoch < self.state.epoch and step >= self.steps_in_epoch[epoch]:
            return epoch + 1, 0
        return point

    @property
    def ending(self) -> bool:
        """A rank called end_job() (here, or on another node as far as rounds told)."""
        return bool(self.end_points_local or self.end_requests)

    def ending_status(self, now_s: float) -> str:
        """`odbd status`'s ending line: who called end_job() where, who the job waits for (as
        far as rounds told this node; once every round is planned, this node's ranks only) and
        the time left before --end-timeout fails it. "" while no rank called it."""
        if self.end_first_s is None:
            return ""
        requests = {**self.end_requests, **self.end_points_local}
        world = self.state.planner.world
        ranks = sorted(self.queues) if self.done else list(range(world.world_size))
        by_point: dict[Point, list[int]] = {}
        for rank, point in sorted(requests.items()):
            by_point.setdefault(point, []).append(rank)
        called = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} at epoch {e} step {s}"
            for (e, s), rs in sorted(by_point.items())
        )
        waiting = [r for r in ranks if r not in requests]
        if not waiting:
            return f"end_job() called by every rank ({called}): the job ends there"
        left = max(self.config.end_timeout_s - (now_s - self.end_first_s), 0.0)
        return (
            f"end_job() called by {called}; waiting for rank{'s' if len(waiting) > 1 else ''} "
            f"{','.join(map(str, waiting))} (the job fails in {left:.0f} s, --end-timeout "
            f"{self.config.end_timeout_s:g} s)"
        )

    def _local_end_points(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((r, e, s) for r, (e, s) in sorted(self.end_points_local.items()))

    def _ends_by_request(self, ended: tuple[tuple[int, int, int], ...]) -> bool:
        """Merges every node's end_job() points (the hub's list in node order, the same on
        every daemon after a round); True once they end the job here."""
        for rank, epoch, step in ended:
            self.end_requests.setdefault(rank, (epoch, step))
        if self.end_requests and self.end_first_s is None:
            self.end_first_s = time.monotonic()
        world = range(self.state.planner.world.world_size)
        return self._decide_end(end_decision(world, self.end_requests), local=False)

    def _decide_end(self, decision: EndDecision, *, local: bool) -> bool:
        if decision.outcome is EndOutcome.FAIL:
            self.failure = decision.reason
            self.abort(decision.reason)
            return True
        if decision.outcome is not EndOutcome.END or local:
            return False  # local (every round planned): the queued job's end follows as is
        assert decision.point is not None
        for queue in self.queues.values():
            self.free(queue.end_at(*decision.point))
        log.info("%s: the job ends there; steps planned after it are dropped", decision.reason)
        self._end_job(decision.reason)
        return True

    def end_overdue(self, now_s: float) -> str | None:
        """The failure once --end-timeout passed since the first end_job() point heard of
        with some rank's point still unknown (every rank's, or this node's own once no round
        can carry points any more); None otherwise."""
        if self.end_first_s is None or self.failure is not None:
            return None
        if now_s - self.end_first_s < self.config.end_timeout_s:
            return None
        world = self.state.planner.world
        ranks = self.queues if self.done else range(world.world_size)
        requests = {**self.end_requests, **self.end_points_local}
        if self.done:
            requests = {r: p for r, p in requests.items() if r in self.queues}
        if end_decision(ranks, requests).outcome is not EndOutcome.WAIT:
            return None
        nodes = {r: r // world.ranks_per_node for r in range(world.world_size)}
        return missing_failure(ranks, requests, self.config.end_timeout_s, nodes)

    def give_up(self, reason: str) -> None:
        """This node cannot make samples any more: the job fails at once (peers see it go)."""
        self.fatal = reason
        self.progress.set()

    async def _tell_trainers(self) -> None:
        """A job can fail before its trainers attach (every sample rejected in seconds): wait,
        bounded, until each local rank connected once, so it raises JobFailedError with the
        reason rather than finding no daemon. Ranks still attached are drained by the daemon."""
        deadline = time.monotonic() + _TELL_FAILURE_S
        while missing := [r for r, q in self.queues.items() if not q.ever_attached]:
            if time.monotonic() > deadline:
                log.warning("ranks %s never attached to learn that the job failed", missing)
                return
            await asyncio.sleep(0.05)

    def fail(self, reason: str) -> None:
        """The job stops (SIGTERM): trainers take what is queued, then learn why."""
        self._end_job(reason, failed=True)

    def abort(self, reason: str) -> None:
        """The job cannot go on (peer lost, round timeout): trainers learn it next.

        Steps not yet sent are dropped: the dead node's ranks will never run them, so a
        trainer that kept training would hang in its next DDP collective instead.
        """
        if not self.done:
            for queue in self.queues.values():
                queue.drop_unsent()
            self._end_job(reason, failed=True)


@dataclass(frozen=True, slots=True)
class _EmittedColumns:
    """A unit's emitted samples of one round, gathered once as the StepBatch's wire arrays
    (fancy indexing); each step then slices its rows, with no Python object per sample."""

    locations: Locations  # (n,) where each sample lies, freed once its step is delivered
    segments: np.ndarray  # (n,) int64 arena segment index
    offsets: np.ndarray  # (n,) int64 byte offset in the segment
    # The StepBatch fields' packed bytes of all n rows, serialized once per round: a step's
    # field is a slice of bytes (one C call), not a numpy slice and tobytes (two) per field.
    sample_ids_bytes: bytes  # (n,) <i8 dataset identities
    segments_bytes: bytes  # (n,) <u4
    offsets_bytes: bytes  # (n,) <u8
    nbytes_bytes: bytes  # (n,) <u8

    @staticmethod
    def gather(state: NodeState, lanes: Lanes, keys: np.ndarray) -> _EmittedColumns:
        locations = state.locations_of(keys).with_lane()  # its steps' frees skip the lane ids
        segments, offsets = lanes.resolve_many(locations)
        return _EmittedColumns(
            locations,
            segments,
            offsets,
            state.identities_of(keys).astype("<i8").tobytes(),
            segments.astype("<u4").tobytes(),
            offsets.astype("<u8").tobytes(),
            locations.nbytes.astype("<u8").tobytes(),
        )


@dataclass(frozen=True, slots=True)
class _StepColumns:
    """A round's per-(step, rank) numbers as Python lists and one unit's per-slot sums, read
    once per round: each StepBatch then reads list items, not numpy scalars and reductions."""

    loss_scale: list[list[float]]  # [step][column]: this node's ranks' columns
    num_samples: list[list[int]]  # [step][column]
    num_tokens: list[list[int]]  # [step][column]
    padded_tokens: list[list[int]]  # [step][column]
    real_tokens: list[list[int]]  # [step][column]
    global_num_samples: list[int]  # [step]
    global_num_tokens: list[int]  # [step]
    slot_sum_sq: list[float]  # [slot]: sum of squared lengths (the cost model's l^2 feature)
    slot_patches: list[float]  # [slot]: vision patches

    @staticmethod
    def of(plan: NodeRoundPlan, unit: UnitPlan, num_slots: int) -> _StepColumns:
        stats = plan.stats  # this node's ranks' columns
        lengths = unit.emitted.lengths.astype(np.int64)
        return _StepColumns(
            stats.loss_scale.astype(np.float64).tolist(),
            stats.num_samples.tolist(),
            stats.num_tokens.tolist(),
            stats.padded_tokens.tolist(),
            stats.real_tokens.tolist(),
            plan.global_num_samples.tolist(),
            plan.global_num_tokens.tolist(),
            _slot_sums(lengths * lengths, unit.slot_offsets, num_slots),
            _slot_sums(unit.emitted.patches.astype(np.int64), unit.slot_offsets, num_slots),
        )


def _slot_sums(values: np.ndarray, slot_offsets: np.ndarray, num_slots: int) -> list[float]:
    """Per slot s, the sum of values[slot_offsets[s]:slot_offsets[s + 1]] (int64: exact, as
    the per-slot float sums were for any realistic lengths)."""
    cumulative = np.concatenate([np.zeros(1, np.int64), np.cumsum(values, dtype=np.int64)])
    bounds = slot_offsets[: num_slots + 1]
    return (cumulative[bounds[1:]] - cumulative[bounds[:-1]]).astype(np.float64).tolist()


def _progress_messages(progress: ProgressColumns) -> list[trainer_pb2.Progress]:
    """Each step's StepBatch.progress, field by field (dataclasses.asdict deep-copies)."""
    return [
        trainer_pb2.Progress(
            epoch_steps_estimate=steps,
            epoch_steps_exact=exact,
            epoch_sample_fraction=sample_fraction,
            epoch_token_fraction=token_fraction,
            epoch_tokens=tokens,
            job_fraction=job_fraction,
            job_steps_estimate=job_steps,
        )
        for steps, exact, sample_fraction, token_fraction, tokens, job_fraction, job_steps in zip(
            progress.epoch_steps_estimate,
            progress.epoch_steps_exact,
            progress.epoch_sample_fraction,
            progress.epoch_token_fraction,
            progress.epoch_tokens,
            progress.job_fraction,
            progress.job_steps_estimate,
            strict=True,
        )
    ]


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
