"""A node's layout for its sample bookkeeping: which planning units are local, each sampler
iteration's identities and ledger, and the lookups every later step uses (view key -> unit,
iteration, slot, location). The state the other node_* modules share."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from odbclient.shm import SampleMeta
from odbd.config import DaemonConfig
from odbd.daemon.leases import LeaseTable
from odbd.daemon.locations import Location, Locations
from odbd.daemon.unit_buffers import HeldSample, LocalUnit, SamplerIteration
from odbd.errors import InvariantError
from odbd.planner.ledger import ViewLedger
from odbd.planner.sampler import num_views, sampler_identities, views_of_ranks
from odbd.planner.types import IntArray
from odbd.planner.view_keys import by_iteration

RUN_AHEAD_BUFFERS = 2  # buffers' worth of samples a unit may lease: this round's and the next


class NodeLayout:
    """A node's units and sampler iterations, and the lookups from a view key to them; the
    bookkeeping over them is node_commits.NodeCommits and node_state.NodeState."""

    def __init__(self, config: DaemonConfig, dataset_size: int) -> None:
        self.config = config
        self.planner = config.planner(dataset_size)
        self.dataset_size = dataset_size
        self.views_per_iteration = num_views(dataset_size, config.world.world_size)
        self.epoch = 0  # the epoch being planned (join) / trainer epoch (non-join)
        self._iterations: dict[int, SamplerIteration] = {}
        self._units = [self._new_unit(u) for u in self._local_units()]
        self._num_local_views = sum(len(u.views) for u in self._units)  # per iteration
        self.leases = LeaseTable(self.views_per_iteration)
        self.schema_hash: int | None = None  # chosen by the vote over the first samples
        self.first_schema: SampleMeta | None = None  # a sample of it, to name a mismatch
        self.schema_text = ""  # describe_schema(): in round offers and mismatch details
        self.schema_votes = (0, 0)  # (samples of the chosen schema, samples that voted)
        self._held: list[HeldSample] = []  # while the vote is open
        # Reads a committed sample's header from shared memory; set by the daemon (I/O), None
        # in pure use, where a schema mismatch cannot say which key differs.
        self.sample_meta: Callable[[Location], SampleMeta] | None = None
        self.rejected: Counter[str] = Counter()  # since the last round's offer
        # the same counts by the iteration of the rejected view: a join-mode offer reports
        # those of the epoch being planned (and earlier) only, see take_rejected_delta
        self._rejected_by_iteration: dict[int, Counter[str]] = {}
        self.rejected_total: Counter[str] = Counter()
        self.rejected_keys: list[int] = []  # since the last round, for the --state-dir journal
        self.first_rejection: dict[str, str] = {}  # reason -> "sample I: detail", for errors
        self.first_rejected_ids: list[int] = []  # the job's first few, for a budget failure
        self.deaths: Counter[int] = Counter()  # identity -> producer deaths while making it
        self.paused = False  # no leases while a restart waits for the trainers' resume point
        # Producers may fill the next round's buffer while this one waits for its round (the
        # exchange, the trainers' queue room): without it they idle from the moment a buffer
        # is full until its round is planned. A round still takes one buffer (unit_capacity).
        self.lease_capacity = RUN_AHEAD_BUFFERS * self.planner.unit_capacity
        self._migrated: set[int] = set()  # iterations some of whose views moved in or out

    # -- layout ------------------------------------------------------------------------------

    def _local_units(self) -> range:
        per_node = self.config.world.ranks_per_node // self.planner.ranks_per_unit
        first = self.config.node_rank * per_node
        return range(first, first + per_node)

    def _new_unit(self, unit: int) -> LocalUnit:
        ranks = self.planner.unit_ranks(unit)
        world = self.config.world.world_size
        return LocalUnit(unit, views_of_ranks(self.dataset_size, world, ranks))

    def iteration(self, index: int) -> SamplerIteration:
        if index not in self._iterations:
            identities = sampler_identities(
                self.dataset_size,
                self.config.world.world_size,
                seed=self.config.seed,
                epoch=index,
                shuffle=self.config.shuffle,
            )
            self._iterations[index] = SamplerIteration(
                identities, ViewLedger(self.views_per_iteration)
            )
        return self._iterations[index]

    def identities_of(self, keys: IntArray) -> IntArray:
        if keys.size == 0 or self.views_per_iteration == 0:
            return np.zeros(0, dtype=np.int64)
        out = np.empty_like(keys)
        for it, mask, views in by_iteration(keys, self.views_per_iteration):
            out[mask] = self.iteration(it).identities[views]
        return out

    def _split(self, key: int) -> tuple[SamplerIteration, int]:
        it, view = divmod(key, self.views_per_iteration)
        return self.iteration(it), view

    def _slot(self, iteration: int) -> int:
        """Buffer slot of an iteration: join keeps epochs apart, non-join chains them."""
        return iteration if self.config.join else 0

    def _unit_of(self, key: int) -> LocalUnit:
        rank = (key % self.views_per_iteration) % self.config.world.world_size
        unit = rank // self.planner.ranks_per_unit
        return self._units[unit - self._units[0].unit]

    def _transition(self, keys: IntArray, verb: str) -> None:
        """One ledger call per sampler iteration for a batch of keys (vectorised)."""
        for it, _, views in by_iteration(keys, self.views_per_iteration):
            getattr(self.iteration(it).ledger, verb)(views)

    def locations_of(self, keys: IntArray) -> Locations:
        """Where the committed samples of these (buffered or emitted) keys lie."""
        if keys.size == 0:
            return Locations.empty()
        out = Locations(np.empty_like(keys), np.empty_like(keys), np.empty_like(keys))
        for it, mask, views in by_iteration(keys, self.views_per_iteration):
            where = self.iteration(it).where
            if where is None:
                raise InvariantError(f"iteration {it} has no committed sample; this is an odbd bug")
            out.lanes[mask] = where.lanes[views]
            out.offsets[mask] = where.offsets[views]
            out.nbytes[mask] = where.nbytes[views]
        return out

    def _slot_array(self, keys: IntArray) -> IntArray:
        if not self.config.join:
            return np.zeros_like(keys)
        return keys // self.views_per_iteration
