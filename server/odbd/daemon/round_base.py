"""The round loop's state: what it holds between rounds, shared by its steps (one class,
round_loop.RoundLoop's base; the steps are the modules round_wait, round_progress,
round_apply and round_ending)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from odbd.config import DaemonConfig
from odbd.daemon.cost_learning import CostLearner
from odbd.daemon.end_requests import (
    Point,
)
from odbd.daemon.journal import Journal
from odbd.daemon.locations import Locations
from odbd.daemon.migration_live import LiveMigration
from odbd.daemon.node_state import NodeState
from odbd.daemon.split_exchange import SplitExchange
from odbd.daemon.updates import UpdateNumbering
from odbd.errors import OdbdError
from odbd.ingest.lanes import Lanes
from odbd.metrics.stats import DaemonStats
from odbd.planner.cost_fit import (
    FitConfig,
    row_feature,
)
from odbd.planner.identities import EpochIdentities, IdentitySource
from odbd.planner.types import NodeRoundPlan
from odbd.round import RoundBarrier
from odbd.serve.rank_queue import RankQueue

log = logging.getLogger("odbd.round")


class JobFailed(OdbdError):
    """The job cannot train (an epoch emitted nothing): trainers got JobEnd(failed) first."""


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


class RoundLoopState:
    """What the round loop knows between rounds: its collaborators, the epoch and job
    counters every daemon keeps identical, and the end_job() points heard of. The loop's
    concerns (round_wait, round_progress, round_apply, round_ending) are its subclasses."""

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
