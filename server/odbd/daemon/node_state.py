"""A node's sample bookkeeping between ingest and the round barrier (pure state, no I/O).

Every sampler view of this node's units moves pending -> leased -> buffered -> emitted (or
rejected), tracked by one ViewLedger per sampler iteration. A view key is
iteration * views_per_iteration + view, so chained iterations (non-join) and the next epoch's
prefetch (join) never collide. The I/O layer (ingest/service.py, daemon/round_loop.py) calls
these methods and performs what they return.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from odbclient.samples import schema_difference
from odbclient.shm import SampleMeta, ShmLayoutError
from odbd.config import DaemonConfig
from odbd.daemon.leases import NO_HOLDER, LeaseTable
from odbd.errors import InvariantError
from odbd.ingest.rejections import PRODUCER_CRASH
from odbd.ingest.schema_vote import SCHEMA_VOTE_SAMPLES, describe_schema, winning_schema
from odbd.planner.ledger import ViewLedger, ViewState
from odbd.planner.sampler import num_views, sampler_identities, views_of_ranks
from odbd.planner.types import IntArray, SampleTable, UnitOffer
from odbd.planner.view_keys import by_iteration

RUN_AHEAD_BUFFERS = 2  # buffers' worth of samples a unit may lease: this round's and the next
# A sample is quarantined once producers died this many times while making it. One death may
# be an operator's SIGKILL or the OOM killer landing on whatever id was in flight: that id is
# re-leased (nothing lost). A sample that kills its producer does so again at once (released
# ids are re-leased first), so the second death on the same identity is the crash's signature,
# at the cost of one more producer restart per bad sample.
DEATHS_TO_QUARANTINE = 2


@dataclass(frozen=True, slots=True)
class Location:
    """Where a committed sample's bytes lie: inside a producer's lane of the arena."""

    lane: int
    offset: int  # byte offset inside the lane
    nbytes: int


@dataclass(frozen=True, slots=True)
class Rejected:
    view_key: int
    identity: int
    reason: str
    detail: str
    location: Location | None  # to free, when the bytes were already written


@dataclass(frozen=True, slots=True)
class Locations:
    """Where committed samples' bytes lie, as columns: row i is one sample (a Location).

    The hot path (commit, step building, frees) moves these arrays, never a Python object per
    sample."""

    lanes: IntArray  # (n,) int64 lane id
    offsets: IntArray  # (n,) int64 byte offset inside the lane
    nbytes: IntArray  # (n,) int64
    # Every row lies in this lane, when known (None: not known, maybe several): a step's rows
    # are freed without concatenating and reducing their lane ids (Lanes.free).
    lane: int | None = None

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def with_lane(self) -> Locations:
        """These rows, with `lane` set if they all lie in one lane (two reductions, once)."""
        if self.lane is not None or len(self) == 0:
            return self
        first, last = int(self.lanes.min()), int(self.lanes.max())
        if first != last:
            return self
        return Locations(self.lanes, self.offsets, self.nbytes, first)

    @staticmethod
    def empty() -> Locations:
        z = np.zeros(0, dtype=np.int64)
        return Locations(z, z, z)

    @staticmethod
    def in_lane(lane: int, offsets: IntArray, nbytes: IntArray) -> Locations:
        offsets = np.asarray(offsets, dtype=np.int64)
        return Locations(
            np.full(offsets.shape, lane, dtype=np.int64),
            offsets,
            np.asarray(nbytes, dtype=np.int64),
            lane,
        )

    @staticmethod
    def concat(parts: list[Locations]) -> Locations:
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return Locations.empty()
        return Locations(
            np.concatenate([p.lanes for p in parts]),
            np.concatenate([p.offsets for p in parts]),
            np.concatenate([p.nbytes for p in parts]),
            common_lane(parts),
        )

    def take(self, rows: IntArray | slice) -> Locations:
        return Locations(self.lanes[rows], self.offsets[rows], self.nbytes[rows], self.lane)

    def at(self, row: int) -> Location:
        return Location(int(self.lanes[row]), int(self.offsets[row]), int(self.nbytes[row]))


def common_lane(parts: list[Locations]) -> int | None:
    """The lane every row of `parts` lies in, if each part knows it is that one lane."""
    lane = parts[0].lane if parts else None
    if lane is None:
        return None
    for part in parts:
        if part.lane != lane:
            return None
    return lane


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    """What NodeState.commit decided for each row of a CommitBatch: exactly one of accepted
    (buffered), rejected, or stale (its key is no longer this producer's lease)."""

    accepted: np.ndarray  # (n,) bool (buffered, or held for the schema vote)
    rejections: list[Rejected]  # in row order; their bytes go back to the producer
    stale: np.ndarray  # (n,) bool; their bytes go back to the producer
    # Samples held for the schema vote (this commit's or earlier ones, any producer's) that
    # this commit's closing of the vote rejected: their lanes hold them until freed.
    voted_out: list[Rejected] = field(default_factory=list)

    @property
    def num_accepted(self) -> int:
        return int(np.count_nonzero(self.accepted))


@dataclass(slots=True)
class _Iteration:
    identities: IntArray  # (M,) view -> dataset identity
    ledger: ViewLedger
    # view -> where its committed sample lies; valid while the ledger says BUFFERED (or the
    # view was emitted and its step is queued). Allocated at the iteration's first commit:
    # 24 bytes per view, next to the identities' 8.
    where: Locations | None = None

    def store(self, views: IntArray, locations: Locations) -> None:
        if self.where is None:
            m = len(self.identities)
            self.where = Locations(
                np.zeros(m, np.int64), np.zeros(m, np.int64), np.zeros(m, np.int64)
            )
        self.where.lanes[views] = locations.lanes
        self.where.offsets[views] = locations.offsets
        self.where.nbytes[views] = locations.nbytes


@dataclass(slots=True)
class _Unit:
    """One planning unit of this node (the node itself, or one rank with --balance rank)."""

    unit: int
    views: IntArray  # this unit's views of one iteration, sampler order
    iteration: int = 0  # the iteration `cursor` walks
    cursor: int = 0
    retry: deque[int] = field(default_factory=deque)  # released leases, re-leased first
    # After a restart with --migrate auto: views this unit moved out before it (the journal's
    # `moved` records) that its own ranks never trained. Another node may have trained them, so
    # they are neither leased nor dry until round 0's moves exchange says which (release_held).
    held: list[int] = field(default_factory=list)
    leased_in: Counter[int] = field(default_factory=Counter)  # iteration -> its keys leased
    buffers: dict[int, list[SampleTable]] = field(default_factory=dict)  # slot -> chunks
    # slot -> samples in its chunks, kept as chunks come and go: readiness is checked on every
    # commit, and a buffer holds one chunk per commit (tens of them), too many to sum each time.
    num_buffered: Counter[int] = field(default_factory=Counter)
    num_buffered_total: int = 0  # over every slot

    def buffered(self, slot: int) -> int:
        return self.num_buffered[slot]

    def add_buffer(self, slot: int, table: SampleTable, *, first: bool = False) -> None:
        """Buffers a chunk of samples in `slot`; `first` puts it before the chunks there."""
        chunks = self.buffers.setdefault(slot, [])
        if first:
            chunks.insert(0, table)
        else:
            chunks.append(table)
        self.num_buffered[slot] += len(table)
        self.num_buffered_total += len(table)

    def take_buffer(self, slot: int, limit: int) -> SampleTable:
        """The first `limit` buffered samples in view order; the rest wait for the next round."""
        chunks = self.buffers.pop(slot, [])
        self.num_buffered_total -= self.num_buffered.pop(slot, 0)
        table = SampleTable.concat_all(chunks)
        # Sorted by view, so the plan does not depend on the order producers committed in.
        order = np.argsort(table.views, kind="stable")
        if len(order) > limit:
            self.add_buffer(slot, table.take(order[limit:]))
        return table.take(order[:limit])


def _concat_keys(parts: list[IntArray]) -> IntArray:
    """The parts joined as one int64 array (no copy for one part)."""
    if len(parts) == 1:
        return parts[0].astype(np.int64, copy=False)
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else _NO_KEYS


_NO_KEYS = np.zeros(0, dtype=np.int64)
_NO_KEYS.flags.writeable = False  # shared by every empty answer


def _groups_of(values: IntArray) -> list[tuple[int, IntArray | slice]]:
    """(value, rows holding it) for each distinct value; `slice(None)` when all are equal (a
    commit's rows usually share one unit and one buffer slot: no sort, no mask)."""
    if values.size == 0:
        return []
    first, last = int(values.min()), int(values.max())
    if first == last:
        return [(first, slice(None))]
    return [(v, values == v) for v in np.unique(values).tolist()]


FIRST_REJECTED_IDS = 5  # named by a job that fails past --max-reject-fraction


@dataclass(frozen=True, slots=True)
class _Held:
    """A committed sample held aside while the node's schema vote is open (schema_vote.py);
    its lease has ended, it still counts against its unit's lease capacity (leased_in)."""

    producer: int
    key: int
    location: Location
    length: int
    loss_tokens: int
    schema_hash: int
    patches: int


class NodeState:
    """Leases, commits and buffers of one node; offers for rounds; nothing here blocks."""

    def __init__(self, config: DaemonConfig, dataset_size: int) -> None:
        self.config = config
        self.planner = config.planner(dataset_size)
        self.dataset_size = dataset_size
        self.views_per_iteration = num_views(dataset_size, config.world.world_size)
        self.epoch = 0  # the epoch being planned (join) / trainer epoch (non-join)
        self._iterations: dict[int, _Iteration] = {}
        self._units = [self._new_unit(u) for u in self._local_units()]
        self._num_local_views = sum(len(u.views) for u in self._units)  # per iteration
        self.leases = LeaseTable(self.views_per_iteration)
        self.schema_hash: int | None = None  # chosen by the vote over the first samples
        self.first_schema: SampleMeta | None = None  # a sample of it, to name a mismatch
        self.schema_text = ""  # describe_schema(): in round offers and mismatch details
        self.schema_votes = (0, 0)  # (samples of the chosen schema, samples that voted)
        self._held: list[_Held] = []  # while the vote is open
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

    def _new_unit(self, unit: int) -> _Unit:
        ranks = self.planner.unit_ranks(unit)
        world = self.config.world.world_size
        return _Unit(unit, views_of_ranks(self.dataset_size, world, ranks))

    def iteration(self, index: int) -> _Iteration:
        if index not in self._iterations:
            identities = sampler_identities(
                self.dataset_size,
                self.config.world.world_size,
                seed=self.config.seed,
                epoch=index,
                shuffle=self.config.shuffle,
            )
            self._iterations[index] = _Iteration(identities, ViewLedger(self.views_per_iteration))
        return self._iterations[index]

    def identities_of(self, keys: IntArray) -> IntArray:
        if keys.size == 0 or self.views_per_iteration == 0:
            return np.zeros(0, dtype=np.int64)
        out = np.empty_like(keys)
        for it, mask, views in by_iteration(keys, self.views_per_iteration):
            out[mask] = self.iteration(it).identities[views]
        return out

    def _split(self, key: int) -> tuple[_Iteration, int]:
        it, view = divmod(key, self.views_per_iteration)
        return self.iteration(it), view

    def _slot(self, iteration: int) -> int:
        """Buffer slot of an iteration: join keeps epochs apart, non-join chains them."""
        return iteration if self.config.join else 0

    def _unit_of(self, key: int) -> _Unit:
        rank = (key % self.views_per_iteration) % self.config.world.world_size
        unit = rank // self.planner.ranks_per_unit
        return self._units[unit - self._units[0].unit]

    # -- leasing -----------------------------------------------------------------------------

    def _last_iteration(self) -> int | None:
        """The last sampler iteration to lease from; None = endless."""
        if self.config.epochs == 0 or not self.config.join:
            return None  # non-join chains iterations until the trainers' quota is met
        return self.config.epochs - 1

    def _outstanding(self, unit: _Unit) -> int:
        return sum(unit.leased_in.values()) + unit.num_buffered_total

    def lease(self, producer: int, count: int, deadline: float) -> IntArray:
        """Up to `count` view keys for a producer, keeping each unit within its buffer."""
        if self.paused:
            return np.zeros(0, dtype=np.int64)
        parts: list[IntArray] = []
        num_keys = 0
        for unit in sorted(self._units, key=self._outstanding):
            room = min(self.lease_capacity - self._outstanding(unit), count - num_keys)
            if room <= 0:  # the usual answer to a free: every unit's buffer is spoken for
                continue
            taken = self._take_keys(unit, room)
            for it, _, views in by_iteration(taken, self.views_per_iteration):
                unit.leased_in[it] += len(views)
            parts.append(taken)
            num_keys += len(taken)
        granted = _concat_keys(parts)
        if num_keys:
            self._transition(granted, "lease")
            self.leases.grant(granted, producer, deadline)
        return granted

    def _take_keys(self, unit: _Unit, room: int) -> IntArray:
        """The unit's next `room` keys: released leases first, then the sampler, in bulk
        (slices of the unit's views: no Python int per key)."""
        retried: list[int] = []
        while room > len(retried) and unit.retry:
            retried.append(unit.retry.popleft())
        parts = [np.asarray(retried, dtype=np.int64)] if retried else []
        left = room - len(retried)
        while left > 0:
            if unit.cursor == len(unit.views) and not self._advance_iteration(unit):
                break
            chunk = unit.views[unit.cursor : unit.cursor + left]
            unit.cursor += len(chunk)
            left -= len(chunk)
            parts.append(chunk + unit.iteration * self.views_per_iteration)
        return _concat_keys(parts)

    def _advance_iteration(self, unit: _Unit) -> bool:
        """Moves a unit whose iteration is fully leased to the next one, if allowed yet."""
        last = self._last_iteration()
        nxt = unit.iteration + 1
        ahead_limit = self.epoch + 1 if self.config.join else None  # join: one epoch ahead
        if len(unit.views) == 0 or (last is not None and nxt > last):
            return False
        if ahead_limit is not None and nxt > ahead_limit:
            return False
        unit.iteration, unit.cursor = nxt, 0
        return True

    def _transition(self, keys: IntArray, verb: str) -> None:
        """One ledger call per sampler iteration for a batch of keys (vectorised)."""
        for it, _, views in by_iteration(keys, self.views_per_iteration):
            getattr(self.iteration(it).ledger, verb)(views)

    def release(self, keys: list[int]) -> None:
        """Leases that will not be committed (producer gone, lease expired) go back to pending."""
        asked = np.unique(np.asarray(keys, dtype=np.int64))
        held = asked[self.leases.holders(asked) != NO_HOLDER]
        if not held.size:
            return
        self.leases.end(held)
        for key in held.tolist():  # rare (expiry, a producer's end): a loop is fine here
            unit = self._unit_of(key)
            unit.leased_in[key // self.views_per_iteration] -= 1
            unit.retry.append(key)
        self._transition(held, "release")

    def expired(self, now: float) -> list[int]:
        return self.leases.expired(now).tolist()

    def leases_of(self, producer: int) -> list[int]:
        return self.leases.keys_of(producer).tolist()

    def lease_holders(self) -> set[int]:
        return self.leases.producers()

    # -- commits -----------------------------------------------------------------------------

    def commit(
        self,
        producer: int,
        keys: IntArray,
        locations: Locations,
        lengths: IntArray,
        loss_tokens: IntArray,
        schema_hashes: IntArray,
        patches: IntArray | None = None,  # (n,) vision patches; None = all 0
    ) -> CommitOutcome:
        """Buffers committed samples, validated and booked as arrays (rows in commit order).

        A commit for a key this producer no longer holds (its lease expired and went to another
        producer) is stale: dropped and its bytes freed, the sample will be (or was) made again.
        """
        held = self._held_by(producer, keys)
        if patches is None:
            patches = np.zeros_like(lengths)
        if self._accepts_every_row(held, lengths, schema_hashes):
            # The usual commit: no row to select, so the columns are booked as they came.
            self._book(producer, keys, locations, lengths, loss_tokens, patches)
            return CommitOutcome(held, [], ~held)
        bad_length = held & (lengths <= 0)
        candidates = np.flatnonzero(held & ~bad_length)
        if self.schema_hash is None:
            return self._commit_to_vote(
                producer, keys, locations, lengths, loss_tokens, schema_hashes, patches, held
            )
        mismatch = np.zeros_like(held)
        if candidates.size:
            mismatch[candidates] = schema_hashes[candidates] != self.schema_hash
        rejections = [
            self._reject_row(int(keys[i]), bool(bad_length[i]), locations.at(int(i)))
            for i in np.flatnonzero(bad_length | mismatch).tolist()
        ]  # rare: a loop is fine here
        accepted = held & ~bad_length & ~mismatch
        rows = np.flatnonzero(accepted)
        if rows.size:
            self._book(
                producer,
                keys[rows],
                locations.take(rows),
                lengths[rows],
                loss_tokens[rows],
                patches[rows],
            )
        return CommitOutcome(accepted, rejections, ~held)

    # -- the schema vote (schema_vote.py) ----------------------------------------------------

    @property
    def schema_voting(self) -> bool:
        """Samples are held aside until the node's schema is chosen."""
        return self.schema_hash is None and bool(self._held)

    def _vote_size(self) -> int:
        """Samples the vote waits for: no more than the units may lease, nor than one
        iteration's views of this node (a small dataset would never reach the default)."""
        capacity = self.lease_capacity * len(self._units)
        return max(1, min(SCHEMA_VOTE_SAMPLES, capacity, self._num_local_views))

    def _commit_to_vote(
        self,
        producer: int,
        keys: IntArray,
        locations: Locations,
        lengths: IntArray,
        loss_tokens: IntArray,
        schema_hashes: IntArray,
        patches: IntArray,
        held: np.ndarray,
    ) -> CommitOutcome:
        """A commit while the schema is not chosen yet: empty samples are rejected, the others
        held aside (their lanes keep them); the vote closes once enough are held."""
        bad_length = held & (lengths <= 0)
        rejections = [
            self._reject_row(int(keys[i]), True, locations.at(int(i)))
            for i in np.flatnonzero(bad_length).tolist()
        ]
        votes = held & ~bad_length
        rows = np.flatnonzero(votes)
        if rows.size:
            self.leases.end(keys[rows], held_by=producer)
        for i in rows.tolist():
            self._held.append(
                _Held(
                    producer, int(keys[i]), locations.at(i), int(lengths[i]),
                    int(loss_tokens[i]), int(schema_hashes[i]), int(patches[i]),
                )
            )  # fmt: skip
        voted_out = self.close_schema_vote() if len(self._held) >= self._vote_size() else []
        return CommitOutcome(votes, rejections, ~held, voted_out)

    def close_schema_vote(self) -> list[Rejected]:
        """Chooses the schema most held samples share, buffers those and rejects the others
        (returned: their bytes are to be freed). Also called by the ingest sweep once the vote
        waited SCHEMA_VOTE_WAIT_S, so few or slow samples still start the job."""
        if self.schema_hash is not None or not self._held:
            return []
        held, self._held = self._held, []
        winner, votes = winning_schema([h.schema_hash for h in held])
        self.schema_hash, self.schema_votes = winner, (votes, len(held))
        first = next(h for h in held if h.schema_hash == winner)
        self.first_schema = self._schema_at(first.location)  # read once per job
        self.schema_text = describe_schema(self.first_schema, winner)
        for producer in sorted({h.producer for h in held}):
            rows = [h for h in held if h.producer == producer and h.schema_hash == winner]
            if rows:
                self._book(
                    producer,
                    np.asarray([h.key for h in rows], dtype=np.int64),
                    Locations(
                        np.asarray([h.location.lane for h in rows], dtype=np.int64),
                        np.asarray([h.location.offset for h in rows], dtype=np.int64),
                        np.asarray([h.location.nbytes for h in rows], dtype=np.int64),
                    ),
                    np.asarray([h.length for h in rows], dtype=np.int64),
                    np.asarray([h.loss_tokens for h in rows], dtype=np.int64),
                    np.asarray([h.patches for h in rows], dtype=np.int64),
                    end_leases=False,
                )
        return [
            self._count_rejection(h.key, "schema_mismatch", self._mismatch_detail(h.location),
                                  h.location)
            for h in held
            if h.schema_hash != winner
        ]  # fmt: skip

    def _accepts_every_row(
        self, held: np.ndarray, lengths: IntArray, schema_hashes: IntArray
    ) -> bool:
        """Every row is held, non-empty and of the job's schema (known by now): four
        reductions instead of the per-row masks of the general path."""
        return (
            self.schema_hash is not None
            and len(lengths) > 0
            and bool(held.all())
            and int(lengths.min()) > 0
            and bool((schema_hashes == self.schema_hash).all())
        )

    def _book(
        self,
        producer: int,
        keys: IntArray,
        locations: Locations,
        lengths: IntArray,
        loss_tokens: IntArray,
        patches: IntArray,
        *,
        end_leases: bool = True,
    ) -> None:
        """Buffers accepted rows (every key held by `producer`): their leases end (samples held
        for the schema vote had theirs ended), where they lie is stored, and they join their
        unit's buffer."""
        if end_leases:
            self.leases.end(keys, held_by=producer)
        for it, mask, views in by_iteration(keys, self.views_per_iteration):
            self.iteration(it).store(
                views, locations if isinstance(mask, slice) else locations.take(mask)
            )
        self._buffer_rows(keys, lengths, loss_tokens, patches)

    def _held_by(self, producer: int, keys: IntArray) -> np.ndarray:
        """(n,) bool: the key's lease is this producer's, and it is the key's first row (a
        repeated key in one commit is stale after its first row, as with one row at a time)."""
        listed = keys.tolist()
        held = self.leases.holders(keys) == producer
        if len(set(listed)) < len(listed):  # rare: a producer repeated a key
            _, first = np.unique(keys, return_index=True)
            once = np.zeros(len(keys), dtype=bool)
            once[first] = True
            held &= once
        return held

    def _reject_row(self, key: int, zero_length: bool, location: Location) -> Rejected:
        if zero_length:
            return self._reject_leased(
                key, "zero_length", f"{self.config.length_key} has length 0", location
            )
        return self._reject_leased(
            key, "schema_mismatch", self._mismatch_detail(location), location
        )

    def _mismatch_detail(self, location: Location) -> str:
        """Names both schemas: the node's (and how it was chosen) and this sample's."""
        first, this = self.first_schema, self._schema_at(location)
        what = (
            schema_difference(first, this, reference="the job's schema")
            if first is not None and this is not None
            else "keys, dtypes or shapes differ from the job's schema"
        )
        votes, voters = self.schema_votes
        chosen = f" (chosen by {votes} of the first {voters} samples)" if voters else ""
        return (
            f"{what}; the job's schema is {self.schema_text}{chosen}; every sample needs its "
            "keys and dtypes, and the same dimensions after the first; make them uniform in "
            "preprocessing"
        )

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

    def _buffer_rows(
        self, keys: IntArray, lengths: IntArray, loss_tokens: IntArray, patches: IntArray
    ) -> None:
        """Accepted rows join their unit's buffer, one chunk per (unit, slot). The rows are
        usually one chunk, whose columns are then the commit's own arrays (slices select)."""
        self._transition(keys, "buffer")
        rank = (keys % self.views_per_iteration) % self.config.world.world_size
        unit_ids = rank // self.planner.ranks_per_unit
        slots = self._slot_array(keys)
        for unit_id, mine in _groups_of(unit_ids):
            unit = self._units[unit_id - self._units[0].unit]
            unit_keys = keys[mine]
            for it, _, views in by_iteration(unit_keys, self.views_per_iteration):
                unit.leased_in[it] -= len(views)
            for slot, picked in _groups_of(slots[mine]):
                table = SampleTable.of(
                    unit_keys[picked],
                    lengths[mine][picked],
                    loss_tokens[mine][picked],
                    patches=patches[mine][picked],
                )  # ages 0: not recirculated yet
                unit.add_buffer(slot, table)

    def _slot_array(self, keys: IntArray) -> IntArray:
        if not self.config.join:
            return np.zeros_like(keys)
        return keys // self.views_per_iteration

    def _schema_at(self, location: Location) -> SampleMeta | None:
        """A committed sample's keys, dtypes and shapes; None without a reader or if unreadable."""
        if self.sample_meta is None:
            return None
        try:
            return self.sample_meta(location)
        except ShmLayoutError:  # a producer wrote garbage: the message stays generic
            return None

    def reject(self, producer: int, key: int, reason: str, detail: str) -> Rejected | None:
        """A producer could not make this sample; None if it no longer held the lease."""
        if self.leases.holder(key) != producer:
            return None
        return self._reject_leased(key, reason, detail, None)

    def producer_died(self, producer: int, key: int, name: str) -> tuple[int, Rejected | None]:
        """Producer `producer` (`name`) ended with `key` in flight (its lane header): counts the
        death against the sample's identity. Returns (deaths so far, the quarantine as a
        rejection once they reach DEATHS_TO_QUARANTINE, else None: the lease is released)."""
        if self.leases.holder(key) != producer:
            return 0, None  # a stale mark: the lease expired and went elsewhere
        it, view = self._split(key)
        identity = int(it.identities[view])
        self.deaths[identity] += 1
        deaths = self.deaths[identity]
        if deaths < DEATHS_TO_QUARANTINE:
            return deaths, None
        detail = (
            f"{deaths} producers died while making it (the last: {name}); quarantined, "
            "never emitted"
        )
        return deaths, self._reject_leased(key, PRODUCER_CRASH, detail, None)

    def _reject_leased(
        self, key: int, reason: str, detail: str, location: Location | None
    ) -> Rejected:
        self.leases.end(np.asarray([key], dtype=np.int64))
        return self._count_rejection(key, reason, detail, location)

    def _count_rejection(
        self, key: int, reason: str, detail: str, location: Location | None
    ) -> Rejected:
        """A rejected key whose lease has ended: it leaves its unit's lease budget and its
        ledger, and is counted."""
        self._unit_of(key).leased_in[key // self.views_per_iteration] -= 1
        it, view = self._split(key)
        it.ledger.reject([view])
        self.rejected_keys.append(key)
        self.rejected[reason] += 1
        iteration = key // max(self.views_per_iteration, 1)
        by_it = self._rejected_by_iteration.setdefault(iteration, Counter())
        by_it[reason] += 1
        self.rejected_total[reason] += 1
        identity = int(it.identities[view])
        self.first_rejection.setdefault(reason, f"sample {identity}: {detail}")
        if len(self.first_rejected_ids) < FIRST_REJECTED_IDS:
            self.first_rejected_ids.append(identity)
        return Rejected(key, identity, reason, detail, location)

    # -- rounds ------------------------------------------------------------------------------

    def _plan_slot(self) -> int:
        return self._slot(self.epoch)

    def dry(self, unit: _Unit, *, held: bool = True) -> bool:
        """No view of the epoch being planned is pending or leased on this unit (join only).
        `held=False`: as if the views a restart holds back (_Unit.held) were done."""
        if not self.config.join:
            return False
        e = self.epoch
        exhausted = unit.iteration > e or (unit.iteration == e and unit.cursor == len(unit.views))
        if not exhausted:  # the usual case, checked on every commit: skip the scans below
            return False
        in_flight = unit.leased_in[e] > 0
        m = max(self.views_per_iteration, 1)
        retrying = any(k // m == e for k in unit.retry)
        waiting = held and any(k // m == e for k in unit.held)
        return not in_flight and not retrying and not waiting

    def units_ready(self) -> bool:
        # Held views do not hold up a round: round 0's moves exchange is what releases them.
        slot = self._plan_slot()
        return all(
            u.buffered(slot) >= self.planner.unit_capacity or self.dry(u, held=False)
            for u in self._units
        )

    def buffered_now(self) -> int:
        slot = self._plan_slot()
        return sum(u.buffered(slot) for u in self._units)

    def offers(self) -> list[UnitOffer]:
        """This node's units' offers for the next round (their buffers leave the state)."""
        slot, limit = self._plan_slot(), self.planner.unit_capacity
        offers = []
        for u in self._units:
            table = u.take_buffer(slot, limit)
            # Dry only once nothing is left behind for a later round either.
            offers.append(UnitOffer(u.unit, table, self.dry(u) and u.buffered(slot) == 0))
        return offers

    def return_samples(self, unit: int, table: SampleTable) -> None:
        """Recirculated (or not-run) samples go back into the unit's buffer."""
        if len(table):
            local = self._units[unit - self._units[0].unit]
            local.add_buffer(self._plan_slot(), table, first=True)

    def mark_emitted(self, keys: IntArray) -> None:
        """Emitted views' locations are gathered by the caller first (round_loop), so an
        iteration with no view left to buffer drops its location columns: non-join jobs chain
        iterations without end, and 24 bytes per view each would add up."""
        if not keys.size:
            return
        for it, _, views in by_iteration(keys, self.views_per_iteration):
            iteration = self.iteration(it)
            iteration.ledger.emit(views)
            self._drop_where_when_done(it)

    def _drop_where_when_done(self, it: int) -> None:
        iteration = self.iteration(it)
        ledger = iteration.ledger
        if it in self._migrated:
            # Moves put other nodes' views in this ledger: count this node's own views only.
            final = [ViewState.EMITTED, ViewState.REJECTED, ViewState.MOVED]
            states = [ledger.state_of(u.views) for u in self._units]
            done = sum(int(np.isin(x, final).sum()) for x in states)
            foreign_live = ledger.count(ViewState.BUFFERED) - sum(
                int((x == ViewState.BUFFERED).sum()) for x in states
            )
            if done == self._num_local_views and foreign_live == 0:
                iteration.where = None
            return
        done = ledger.count(ViewState.EMITTED) + ledger.count(ViewState.REJECTED)
        if done == self._num_local_views:  # the ledger spans every node's views
            iteration.where = None

    # -- cross-node moves (planner/migration_digest.py, round/bulk.py) --------------------

    def move_out(self, keys: IntArray) -> Locations:
        """Samples taken out of this round's offer for another node: their views are MOVED
        here (final: the receiver emits them), and where they lie is returned so the caller
        ships the bytes and, once the receiver has them, frees them (lanes.free)."""
        if not keys.size:
            return Locations.empty()
        where = self.locations_of(keys)
        for it, _, _ in by_iteration(keys, self.views_per_iteration):
            self._migrated.add(it)
        self._transition(keys, "move_out")
        for it, _, _ in by_iteration(keys, self.views_per_iteration):
            self._drop_where_when_done(it)
        return where

    def move_in(self, table: SampleTable, locations: Locations) -> None:
        """Samples another node moved here landed in this node's arena at `locations`: their
        views are BUFFERED here (from PENDING, or from MOVED if this node had moved them out).
        The caller puts the table in this round's offer of the receiving unit (the plan's
        leftovers then come back to that unit's buffer, return_samples)."""
        keys = table.views
        if not keys.size:
            return
        for it, mask, views in by_iteration(keys, self.views_per_iteration):
            self._migrated.add(it)
            iteration = self.iteration(it)
            back = iteration.ledger.state_of(views) == ViewState.MOVED
            iteration.ledger.move_back(views[back])
            iteration.ledger.move_in(views[~back])
            iteration.store(views, locations if isinstance(mask, slice) else locations.take(mask))

    def take_rejected_delta(self) -> dict[str, int]:
        """The rejections for this round's offer, which every node adds to the tally (and the
        --max-reject-fraction budget) of the epoch being planned. In join mode an epoch is an
        iteration, and producers read ahead into the next one while this one is planned: its
        rejections wait for its own epoch (they used to count in this one, so 3 bad samples of
        60 read twice over two epochs were '4 of 60' in epoch 0, past a 5 % budget). Non-join
        epochs are slices of one endless stream: every rejection counts when it happens."""
        if not self.config.join:
            delta = dict(self.rejected)
            self.rejected.clear()
            self._rejected_by_iteration.clear()
            return delta
        taken: Counter[str] = Counter()
        for iteration in [i for i in self._rejected_by_iteration if i <= self.epoch]:
            taken.update(self._rejected_by_iteration.pop(iteration))
        self.rejected.subtract(taken)
        self.rejected = +self.rejected  # drops the reasons at zero
        return dict(taken)

    def take_rejected_keys(self) -> list[int]:
        keys, self.rejected_keys = self.rejected_keys, []
        return keys

    def restore(
        self, trained: IntArray, rejected: IntArray, epoch: int, moved: IntArray | None = None
    ) -> None:
        """After a restart: trained views stay emitted, rejected ones rejected, the rest of every
        iteration up to the latest one touched is pending again, re-leased in sampler order.
        `moved`: keys this node's journal says it moved to other nodes (--migrate auto); those
        of its own views that it did not train itself are held (_Unit.held) until
        release_held() learns which of them another node trained."""
        m = self.views_per_iteration
        self.epoch = epoch
        done = np.concatenate([trained, rejected]).astype(np.int64)
        moved = np.zeros(0, dtype=np.int64) if moved is None else moved.astype(np.int64)
        moved = moved[self.is_home(moved)]
        touched = [epoch] if self.config.join else [0]
        last = max(touched + (np.concatenate([done, moved]) // max(m, 1)).tolist()) if m else 0
        first = epoch if self.config.join else 0
        for it in range(first, last + 1):
            ledger = self.iteration(it).ledger
            emitted = trained[trained // m == it] % m
            ledger.lease(emitted)
            ledger.buffer(emitted)
            ledger.emit(emitted)
            refused = rejected[rejected // m == it] % m
            ledger.lease(refused)
            ledger.reject(refused)
        foreign = trained[~self.is_home(trained)]
        self._migrated.update((foreign // max(m, 1)).tolist())  # their ledgers count own views
        done_set = set(done.tolist())
        held_set = set(moved[moved // max(m, 1) >= first].tolist()) - done_set
        for unit in self._units:
            keys = [k for it in range(first, last + 1) for k in (unit.views + it * m).tolist()]
            unit.retry = deque(k for k in keys if k not in done_set and k not in held_set)
            unit.held = [k for k in keys if k in held_set]
            unit.iteration, unit.cursor = last, len(unit.views)

    def is_home(self, keys: IntArray) -> np.ndarray:
        """Which keys are views of this node's own units (not moved in from another node)."""
        if not keys.size or not self.views_per_iteration:
            return np.zeros(keys.shape, dtype=bool)
        ranks = (keys % self.views_per_iteration) % self.config.world.world_size
        return ranks // self.config.world.ranks_per_node == self.config.node_rank

    def num_held(self) -> int:
        return sum(len(u.held) for u in self._units)

    def release_held(self, trained_elsewhere: IntArray) -> tuple[int, int]:
        """Round 0 after a restart told every node which views the others trained before the
        resume point: of the held views, those are final here (MOVED, as when they left), the
        rest are leased again (the node they went to lost them). Returns (final, re-leased)."""
        elsewhere = set(trained_elsewhere.tolist())
        final: list[int] = []
        again = 0
        for unit in self._units:
            for key in unit.held:
                if key in elsewhere:
                    final.append(key)
                else:
                    unit.retry.append(key)
                    again += 1
            unit.held = []
        keys = np.asarray(sorted(final), dtype=np.int64)
        for it, _, views in by_iteration(keys, self.views_per_iteration):
            self._migrated.add(it)
            ledger = self.iteration(it).ledger
            ledger.lease(views)
            ledger.buffer(views)
            ledger.move_out(views)
        return len(final), again

    def local_unit_ids(self) -> list[int]:
        return [u.unit for u in self._units]

    def ledger_counts(self) -> dict[str, int]:
        """Views of this node's units by state, summed over live iterations (for status)."""
        total: Counter[str] = Counter()
        for it in self._iterations.values():
            for state, n in it.ledger.counts().items():
                total[state.name.lower()] += n
        return dict(total)
