"""The containers of a node's sample bookkeeping: a sampler iteration (its identities, ledger
and where its committed samples lie) and a local planning unit (its lease cursor and its
buffers of committed samples per slot), with the key helpers they share."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from odbd.daemon.locations import Location, Locations
from odbd.planner.ledger import ViewLedger
from odbd.planner.types import IntArray, SampleTable


@dataclass(slots=True)
class SamplerIteration:
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
class LocalUnit:
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


def concat_keys(parts: list[IntArray]) -> IntArray:
    """The parts joined as one int64 array (no copy for one part)."""
    if len(parts) == 1:
        return parts[0].astype(np.int64, copy=False)
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else NO_KEYS


NO_KEYS = np.zeros(0, dtype=np.int64)
NO_KEYS.flags.writeable = False  # shared by every empty answer


def groups_of(values: IntArray) -> list[tuple[int, IntArray | slice]]:
    """(value, rows holding it) for each distinct value; `slice(None)` when all are equal (a
    commit's rows usually share one unit and one buffer slot: no sort, no mask)."""
    if values.size == 0:
        return []
    first, last = int(values.min()), int(values.max())
    if first == last:
        return [(first, slice(None))]
    return [(v, values == v) for v in np.unique(values).tolist()]


@dataclass(frozen=True, slots=True)
class HeldSample:
    """A committed sample held aside while the node's schema vote is open (schema_vote.py);
    its lease has ended, it still counts against its unit's lease capacity (leased_in)."""

    producer: int
    key: int
    location: Location
    length: int
    loss_tokens: int
    schema_hash: int
    patches: int
