"""Offline driver: runs the production planner round by round over a known list of lengths.

Used by `odbd simulate`, the property tests and the benchmarks. It plays the daemon's part with
an arrival model instead of producers: each round every unit's buffer is topped up from its
pending sampler views (at most `arrivals_per_round[u]` new ones, modelling uneven producers),
then plan_round runs. The ledger tracks every view's state throughout.

Termination (paper section 2.3): join mode runs each epoch's sampler until every unit is dry and
empty (every identity emitted). Non-join chains sampler iterations without a flush and ends a
trainer epoch at the first step where the cumulative emitted count reaches (epoch + 1) * N.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from odbd.errors import ConfigError, InvariantError
from odbd.planner.config import CostModel, PlannerConfig
from odbd.planner.ledger import ViewLedger
from odbd.planner.migration import LinkModel, plan_migration
from odbd.planner.migration_digest import plan_digested
from odbd.planner.round import RoundTrace, plan_round
from odbd.planner.sampler import num_views, sampler_identities, views_of_ranks
from odbd.planner.types import IntArray, RoundPlan, SampleTable, StepStats, UnitOffer
from odbd.planner.view_keys import by_iteration


@dataclass(slots=True)
class _Iteration:
    """One pass of the DistributedSampler (an epoch in join mode)."""

    index: int
    identities: IntArray  # (M,) view -> dataset identity
    ledger: ViewLedger


@dataclass(slots=True)
class _UnitFeed:
    """A unit's pending views across chained iterations, and its buffer."""

    views: IntArray  # this unit's view ids within one iteration, sampler order
    iteration: int = 0
    cursor: int = 0
    buffer: SampleTable = field(default_factory=SampleTable.empty)


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """Every round planned, with the steps the trainers actually ran."""

    rounds: tuple[RoundPlan, ...]
    steps_kept: tuple[int, ...]  # per round: leading steps run (non-join may stop mid-round)
    step_epoch: IntArray  # (steps,) trainer-visible epoch of every kept step
    ledgers: tuple[ViewLedger, ...]  # per sampler iteration
    identities: tuple[IntArray, ...]  # per sampler iteration: view -> dataset identity
    num_views: int  # M: views per iteration; a view key is iteration * M + view
    num_rejected: int  # 0-length samples refused at ingest
    ranks_per_unit: int
    world_size: int
    # --migrate auto (migration.py): per round, samples and bytes moved between nodes before
    # it was planned, and bytes of the samples that arrived (ingested) for it; empty when off
    moved_samples: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))
    moved_bytes: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))
    moved_peak_bytes: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))  # 1 node
    ingested_bytes: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))

    def stats(self) -> StepStats:
        """All kept steps of all rounds, concatenated: arrays of shape (steps, W)."""
        parts = [(r.stats, k) for r, k in zip(self.rounds, self.steps_kept, strict=True)]
        fields = ("num_samples", "num_tokens", "real_tokens", "padded_tokens", "work", "loss_scale")
        empty = np.zeros((0, self.world_size))
        return StepStats(
            *(np.concatenate([empty] + [getattr(s, f)[:k] for s, k in parts]) for f in fields)
        )

    def step_epochs(self) -> IntArray:
        return self.step_epoch

    def sample_ids(self, view_keys: IntArray) -> IntArray:
        """Dataset identities of view keys."""
        if self.num_views == 0:
            return view_keys.copy()
        out = np.empty_like(view_keys)
        for it, mask, views in by_iteration(view_keys, self.num_views):
            out[mask] = self.identities[it][views]
        return out

    def iter_steps(self) -> Iterator[tuple[int, int, list[list[tuple[int, int]]]]]:
        """(epoch, step within epoch, per global rank [(sample_id, length), ...])."""
        position = 0
        step_in_epoch: dict[int, int] = {}
        for plan, kept in zip(self.rounds, self.steps_kept, strict=True):
            world = plan.stats.num_samples.shape[1]
            for step in range(kept):
                epoch = int(self.step_epoch[position])
                position += 1
                k = step_in_epoch.get(epoch, 0)
                step_in_epoch[epoch] = k + 1
                ranks = []
                for rank in range(world):
                    views = plan.group_views(step, rank, self.ranks_per_unit)
                    lengths = plan.group_lengths(step, rank, self.ranks_per_unit)
                    ids = self.sample_ids(views)
                    ranks.append(list(zip(ids.tolist(), lengths.tolist(), strict=True)))
                yield epoch, k, ranks


def simulate(
    lengths: np.ndarray,
    config: PlannerConfig,
    *,
    epochs: int = 1,
    join: bool = True,
    tokens: np.ndarray | None = None,
    shuffle: bool = True,
    arrivals_per_round: Sequence[int] | None = None,
    costs: Sequence[CostModel] = (),
    patches: np.ndarray | None = None,
    trace: RoundTrace | None = None,
    migration: LinkModel | None = None,
    digest: bool = False,
) -> SimulationResult:
    """Plans `epochs` trainer epochs of a dataset whose sample i has length lengths[i]
    (and patches[i] vision patches, default 0).

    `costs`: round r plans with costs[r % len(costs)], as under --cost-model auto, where the
    daemons refit the model as the run goes (default: config.cost throughout). `trace` records
    every round's per-node planning time and payloads (round.RoundTrace). `migration`: plan
    every round after migration.py's cross-node moves under this link model (--migrate auto);
    `digest`: decide them as the live daemons do, from O(bins) digests (migration_digest.py).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    loss_tokens = lengths if tokens is None else np.asarray(tokens, dtype=np.int64)
    if migration is not None and not config.migrate:
        config = dataclasses.replace(config, migrate=True)
    _check_inputs(lengths, loss_tokens, epochs, arrivals_per_round, config, join)
    sim = _Simulation(lengths, loss_tokens, config, shuffle, arrivals_per_round)
    sim.costs = list(costs)
    sim.trace = trace
    sim.migration = migration
    sim.digest = digest
    if patches is not None:
        sim.patches = np.asarray(patches, dtype=np.int64)
        if sim.patches.shape != lengths.shape or (sim.patches.size and sim.patches.min() < 0):
            raise ConfigError("patch counts must have one non-negative entry per sample")
    return sim.run(epochs, join)


def _check_inputs(
    lengths: np.ndarray,
    tokens: np.ndarray,
    epochs: int,
    arrivals: Sequence[int] | None,
    config: PlannerConfig,
    join: bool,
) -> None:
    if lengths.ndim != 1 or (lengths.size and int(lengths.min()) < 0):
        raise ConfigError("lengths must be a 1-D list of non-negative integers")
    if tokens.shape != lengths.shape or (tokens.size and bool((tokens > lengths).any())):
        raise ConfigError("loss tokens must have one entry per sample and never exceed its length")
    if epochs < 1:
        raise ConfigError(f"epochs must be >= 1 for a simulation, got {epochs}")
    if config.windows and not join:
        raise ConfigError(
            "optimizer updates (--accumulate, --tokens-per-update) need join mode: a no-join "
            "epoch ends mid-round, which would cut an update in two; drop --no-join"
        )
    if arrivals is not None and (len(arrivals) != config.num_units or min(arrivals, default=1) < 1):
        raise ConfigError(f"arrivals_per_round needs {config.num_units} positive counts")


class _Simulation:
    """Mutable driver state; every decision is delegated to plan_round."""

    def __init__(
        self,
        lengths: IntArray,
        tokens: IntArray,
        config: PlannerConfig,
        shuffle: bool,
        arrivals: Sequence[int] | None,
    ) -> None:
        self.lengths, self.tokens, self.config, self.shuffle = lengths, tokens, config, shuffle
        self.costs: list[CostModel] = []  # per round, cycled; empty: config.cost
        self.trace: RoundTrace | None = None
        self.migration: LinkModel | None = None
        self.digest = False  # migration decided from digests (the live daemons' way)
        self.moved_samples: list[int] = []
        self.moved_bytes: list[int] = []
        self.moved_peak_bytes: list[int] = []
        self.ingested_bytes: list[int] = []
        self._arrived_tokens = 0  # tokens ingested since the last round was planned
        self.patches = np.zeros_like(lengths)  # (N,) vision patches per dataset identity
        self.num_samples = int(lengths.shape[0])
        world = config.world.world_size
        self.num_views = num_views(self.num_samples, world)
        self.arrivals = list(arrivals) if arrivals else [config.unit_capacity] * config.num_units
        self.iterations: list[_Iteration] = []
        self.feeds = [
            _UnitFeed(views_of_ranks(self.num_samples, world, config.unit_ranks(u)))
            for u in range(config.num_units)
        ]
        self.rounds: list[RoundPlan] = []
        self.kept: list[int] = []
        self.epochs_of_steps: list[IntArray] = []
        self.num_rejected = 0

    def run(self, epochs: int, join: bool) -> SimulationResult:
        if join:
            for epoch in range(epochs):
                self._run_join_epoch(epoch)
        else:
            self._run_quota(epochs)
        return SimulationResult(
            rounds=tuple(self.rounds),
            steps_kept=tuple(self.kept),
            step_epoch=np.concatenate(self.epochs_of_steps or [np.zeros(0, np.int64)]),
            ledgers=tuple(it.ledger for it in self.iterations),
            identities=tuple(it.identities for it in self.iterations),
            num_views=self.num_views,
            num_rejected=self.num_rejected,
            ranks_per_unit=self.config.ranks_per_unit,
            world_size=self.config.world.world_size,
            moved_samples=np.asarray(self.moved_samples, dtype=np.int64),
            moved_bytes=np.asarray(self.moved_bytes, dtype=np.int64),
            moved_peak_bytes=np.asarray(self.moved_peak_bytes, dtype=np.int64),
            ingested_bytes=np.asarray(self.ingested_bytes, dtype=np.int64),
        )

    def _run_join_epoch(self, epoch: int) -> None:
        self._iteration(epoch)
        for feed in self.feeds:
            feed.iteration, feed.cursor = epoch, 0
        for _ in range(self._round_bound()):
            plan = self._round(chain=False)
            self._keep(plan, plan.num_steps, np.full(plan.num_steps, epoch, dtype=np.int64))
            if plan.final:
                return
        raise InvariantError(f"epoch {epoch} did not terminate within {self._round_bound()} rounds")

    def _run_quota(self, epochs: int) -> None:
        quota = epochs * self.num_samples
        consumed = 0  # emitted views plus views rejected at ingest, which also use up the quota
        for _ in range(self._round_bound() * epochs):
            rejected_before = self.num_rejected
            plan = self._round(chain=True)
            consumed += self.num_rejected - rejected_before
            per_step = plan.stats.global_num_samples
            before = consumed + np.cumsum(per_step) - per_step
            kept = int(np.count_nonzero(before < quota))
            consumed += int(per_step[:kept].sum())
            self._keep(plan, kept, before[:kept] // max(self.num_samples, 1))
            if consumed >= quota:
                return
        raise InvariantError(f"quota {quota} not reached: consumed {consumed} views")

    def _round_bound(self) -> int:
        """Theorem 4's O(N/W + D) envelope, with room: a bug shows up as an error, not a hang."""
        per_unit = self.num_views // max(self.config.num_units, 1)
        return 4 * (per_unit + self.config.unit_capacity) + 16

    def _round(self, chain: bool) -> RoundPlan:
        offers = [self._top_up(u, feed, chain) for u, feed in enumerate(self.feeds)]
        config = self.config
        if self.costs:
            config = dataclasses.replace(
                config, cost=self.costs[len(self.rounds) % len(self.costs)]
            )
        held: tuple[SampleTable, ...] = ()
        if self.migration is not None:
            decide = plan_digested if self.digest else plan_migration
            moves = decide(offers, config, self.migration)
            offers, held = list(moves.offers), moves.held
            self.moved_samples.append(moves.num_moved)
            self.moved_bytes.append(moves.bytes_moved)
            self.moved_peak_bytes.append(moves.busiest_node_bytes(config.num_units))
            self.ingested_bytes.append(
                int(np.ceil(self._arrived_tokens * self.migration.bytes_per_token))
            )
            self._arrived_tokens = 0
        plan = plan_round(offers, config, len(self.rounds), self.trace)
        for unit, feed in zip(plan.units, self.feeds, strict=True):
            feed.buffer = unit.leftover
            if held and len(held[unit.unit]):
                feed.buffer = feed.buffer.concat(held[unit.unit])
        return plan

    def _keep(self, plan: RoundPlan, kept: int, epochs: IntArray) -> None:
        for unit in plan.units:
            end = int(unit.slot_offsets[kept * self.config.ranks_per_unit])
            self._emit(unit.emitted.views[:end])
            # Steps past the quota are not run: their samples stay buffered (non-join only).
            if end < len(unit.emitted):
                rest = unit.emitted.take(np.arange(end, len(unit.emitted)))
                self.feeds[unit.unit].buffer = self.feeds[unit.unit].buffer.concat(rest)
        self.rounds.append(plan)
        self.kept.append(kept)
        self.epochs_of_steps.append(epochs.astype(np.int64))

    def _emit(self, view_keys: IntArray) -> None:
        if self.num_views == 0 or view_keys.size == 0:
            return
        for it, _, views in by_iteration(view_keys, self.num_views):
            self.iterations[it].ledger.emit(views)

    def _top_up(self, unit: int, feed: _UnitFeed, chain: bool) -> UnitOffer:
        room = min(self.config.unit_capacity - len(feed.buffer), self.arrivals[unit])
        while room > 0:
            if feed.cursor == len(feed.views):
                if not chain or self.num_samples == 0:
                    break
                feed.iteration, feed.cursor = feed.iteration + 1, 0
            taken = feed.views[feed.cursor : feed.cursor + room]
            feed.cursor += len(taken)
            room -= len(taken)
            feed.buffer = feed.buffer.concat(self._arrive(feed.iteration, taken))
        dry = not chain and feed.cursor == len(feed.views)
        return UnitOffer(unit, feed.buffer, dry)

    def _arrive(self, iteration: int, views: IntArray) -> SampleTable:
        """Producers lease the views and commit their samples; 0-length samples are rejected."""
        it = self._iteration(iteration)
        identities = it.identities[views]
        lengths = self.lengths[identities]
        it.ledger.lease(views)
        bad = lengths == 0
        it.ledger.reject(views[bad])
        it.ledger.buffer(views[~bad])
        self.num_rejected += int(bad.sum())
        good = ~bad
        keys = views[good] + iteration * self.num_views
        good_ids = identities[good]
        self._arrived_tokens += int(lengths[good].sum())
        return SampleTable.of(
            keys, lengths[good], self.tokens[good_ids], patches=self.patches[good_ids]
        )

    def _iteration(self, index: int) -> _Iteration:
        while len(self.iterations) <= index:
            i = len(self.iterations)
            identities = sampler_identities(
                self.num_samples,
                self.config.world.world_size,
                seed=self.config.seed,
                epoch=i,
                shuffle=self.shuffle,
            )
            self.iterations.append(_Iteration(i, identities, ViewLedger(self.num_views)))
        return self.iterations[index]
