"""Who holds each leased view key, and until when, as columns (pure state, no I/O).

A view key is iteration * views_per_iteration + view (node_state.py). Each sampler iteration
with leases out has two dense columns over its views: the holding producer (-1: no lease) and
the lease's deadline (loop clock seconds). Granting, checking and ending the leases of a commit
are fancy-indexing calls, never a Python object per sample; scans (expiry, a producer's
leases) touch only the iterations with leases out.

Memory: 12 bytes per view of each iteration with leases out. An iteration's columns are kept
while it has none out for a moment (a producer waiting for lane space commits all it holds),
and dropped once another iteration is granted leases: the run-ahead limit keeps leases in at
most two iterations at a time.
"""

from __future__ import annotations

import numpy as np

from odbd.planner.types import IntArray
from odbd.planner.view_keys import by_iteration

NO_HOLDER = -1


class LeaseTable:
    def __init__(self, views_per_iteration: int) -> None:
        self._m = views_per_iteration
        self._holder: dict[int, np.ndarray] = {}  # iteration -> (M,) int32 producer
        self._deadline: dict[int, np.ndarray] = {}  # iteration -> (M,) float64 loop time
        self._count: dict[int, int] = {}  # iteration -> leases out
        self._per_producer: dict[int, int] = {}  # producer -> leases out (0s removed)

    def __len__(self) -> int:
        return sum(self._count.values())

    def _columns(self, it: int) -> tuple[np.ndarray, np.ndarray]:
        if it not in self._holder:
            for idle in [i for i, n in self._count.items() if n == 0]:
                del self._holder[idle], self._deadline[idle], self._count[idle]
            self._holder[it] = np.full(self._m, NO_HOLDER, dtype=np.int32)
            self._deadline[it] = np.zeros(self._m, dtype=np.float64)
            self._count[it] = 0
        return self._holder[it], self._deadline[it]

    def grant(self, keys: IntArray, producer: int, deadline: float) -> None:
        """Leases free keys (none may be held: the ledger moved them PENDING -> LEASED)."""
        for it, _, views in by_iteration(keys, self._m):
            holder, deadlines = self._columns(it)
            holder[views] = producer
            deadlines[views] = deadline
            self._count[it] += len(views)
        if keys.size:
            self._per_producer[producer] = self._per_producer.get(producer, 0) + int(keys.size)

    def holders(self, keys: IntArray) -> np.ndarray:
        """(n,) int64 producer holding each key's lease, NO_HOLDER for none."""
        out = np.full(keys.shape, NO_HOLDER, dtype=np.int64)
        if not self._holder:  # nothing leased (also: an empty dataset, M = 0)
            return out
        for it, rows, views in by_iteration(keys, self._m):
            holder = self._holder.get(it)
            if holder is not None:
                out[rows] = holder[views]
        return out

    def holder(self, key: int) -> int:
        if not self._holder:
            return NO_HOLDER
        it, view = divmod(key, self._m)
        holder = self._holder.get(it)
        return NO_HOLDER if holder is None else int(holder[view])

    def end(self, keys: IntArray, *, held_by: int | None = None) -> None:
        """Ends held leases (committed, released, rejected); every key must be held, once.
        `held_by`: the caller checked that this producer holds every key (a commit), so the
        holders are not read back and counted."""
        for it, _, views in by_iteration(keys, self._m):
            holder = self._holder[it]
            if held_by is not None:
                self._forget(held_by, len(views))
            else:
                counts = np.bincount(holder[views])  # held: every entry is a producer >= 0
                for producer in np.flatnonzero(counts).tolist():
                    self._forget(producer, int(counts[producer]))
            holder[views] = NO_HOLDER
            self._count[it] -= len(views)

    def _forget(self, producer: int, num_leases: int) -> None:
        left = self._per_producer[producer] - num_leases
        if left:
            self._per_producer[producer] = left
        else:
            del self._per_producer[producer]

    def _held(self, it: int) -> np.ndarray:
        return np.flatnonzero(self._holder[it] != NO_HOLDER)

    def keys(self) -> IntArray:
        """Every leased key, ascending."""
        parts = [self._held(it) + it * self._m for it in sorted(self._count) if self._count[it]]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def keys_of(self, producer: int) -> IntArray:
        """The keys `producer` holds, ascending."""
        keys = self.keys()
        return keys[self.holders(keys) == producer]

    def expired(self, now: float) -> IntArray:
        """Keys whose lease deadline passed, ascending."""
        keys = self.keys()
        due = np.zeros(keys.shape, dtype=bool)
        for it, rows, views in by_iteration(keys, self._m):
            due[rows] = self._deadline[it][views] <= now
        return keys[due]

    def producers(self) -> set[int]:
        """Producers holding at least one lease."""
        return set(self._per_producer)
