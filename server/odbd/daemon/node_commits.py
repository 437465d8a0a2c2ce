"""What producers hand a node: commits (validated and booked as arrays), the schema vote over
the first samples, and rejections (counted per reason and iteration, quarantines after
repeated producer deaths), until each round's offer takes the counts (take_rejected_delta)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from odbclient.samples import schema_difference
from odbclient.shm import SampleMeta, ShmLayoutError
from odbd.daemon.locations import Location, Locations
from odbd.daemon.node_layout import NodeLayout
from odbd.daemon.unit_buffers import HeldSample, groups_of
from odbd.ingest.rejections import PRODUCER_CRASH
from odbd.ingest.schema_vote import SCHEMA_VOTE_SAMPLES, describe_schema, winning_schema
from odbd.planner.types import IntArray, SampleTable
from odbd.planner.view_keys import by_iteration

# A sample is quarantined once producers died this many times while making it. One death may
# be an operator's SIGKILL or the OOM killer landing on whatever id was in flight: that id is
# re-leased (nothing lost). A sample that kills its producer does so again at once (released
# ids are re-leased first), so the second death on the same identity is the crash's signature,
# at the cost of one more producer restart per bad sample.
DEATHS_TO_QUARANTINE = 2


@dataclass(frozen=True, slots=True)
class Rejected:
    view_key: int
    identity: int
    reason: str
    detail: str
    location: Location | None  # to free, when the bytes were already written


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


FIRST_REJECTED_IDS = 5  # named by a job that fails past --max-reject-fraction


class NodeCommits(NodeLayout):
    """Commits, the schema vote and rejections of one node (pure state, no I/O)."""

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
                HeldSample(
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

    def _buffer_rows(
        self, keys: IntArray, lengths: IntArray, loss_tokens: IntArray, patches: IntArray
    ) -> None:
        """Accepted rows join their unit's buffer, one chunk per (unit, slot). The rows are
        usually one chunk, whose columns are then the commit's own arrays (slices select)."""
        self._transition(keys, "buffer")
        rank = (keys % self.views_per_iteration) % self.config.world.world_size
        unit_ids = rank // self.planner.ranks_per_unit
        slots = self._slot_array(keys)
        for unit_id, mine in groups_of(unit_ids):
            unit = self._units[unit_id - self._units[0].unit]
            unit_keys = keys[mine]
            for it, _, views in by_iteration(unit_keys, self.views_per_iteration):
                unit.leased_in[it] -= len(views)
            for slot, picked in groups_of(slots[mine]):
                table = SampleTable.of(
                    unit_keys[picked],
                    lengths[mine][picked],
                    loss_tokens[mine][picked],
                    patches=patches[mine][picked],
                )  # ages 0: not recirculated yet
                unit.add_buffer(slot, table)

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
