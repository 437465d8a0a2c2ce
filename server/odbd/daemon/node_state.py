"""A node's sample bookkeeping between ingest and the round barrier (pure state, no I/O).

Every sampler view of this node's units moves pending -> leased -> buffered -> emitted (or
rejected), tracked by one ViewLedger per sampler iteration. A view key is
iteration * views_per_iteration + view, so chained iterations (non-join) and the next epoch's
prefetch (join) never collide. The I/O layer (ingest/service.py, daemon/round_*.py) calls
these methods and performs what they return. The layout is node_layout.py, commits, the schema
vote and rejections node_commits.py; this module leases views and forms the rounds' offers.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np

from odbd.daemon.leases import NO_HOLDER
from odbd.daemon.locations import Locations
from odbd.daemon.node_commits import NodeCommits
from odbd.daemon.unit_buffers import LocalUnit, concat_keys
from odbd.planner.ledger import ViewState
from odbd.planner.types import IntArray, SampleTable, UnitOffer
from odbd.planner.view_keys import by_iteration


class NodeState(NodeCommits):
    """Leases, commits and buffers of one node; offers for rounds; nothing here blocks."""

    # -- leasing -----------------------------------------------------------------------------

    def _last_iteration(self) -> int | None:
        """The last sampler iteration to lease from; None = endless."""
        if self.config.epochs == 0 or not self.config.join:
            return None  # non-join chains iterations until the trainers' quota is met
        return self.config.epochs - 1

    def _outstanding(self, unit: LocalUnit) -> int:
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
        granted = concat_keys(parts)
        if num_keys:
            self._transition(granted, "lease")
            self.leases.grant(granted, producer, deadline)
        return granted

    def _take_keys(self, unit: LocalUnit, room: int) -> IntArray:
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
        return concat_keys(parts)

    def _advance_iteration(self, unit: LocalUnit) -> bool:
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

    # -- rounds ------------------------------------------------------------------------------

    def _plan_slot(self) -> int:
        return self._slot(self.epoch)

    def dry(self, unit: LocalUnit, *, held: bool = True) -> bool:
        """No view of the epoch being planned is pending or leased on this unit (join only).
        `held=False`: as if the views a restart holds back (LocalUnit.held) were done."""
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

    def restore(
        self, trained: IntArray, rejected: IntArray, epoch: int, moved: IntArray | None = None
    ) -> None:
        """After a restart: trained views stay emitted, rejected ones rejected, the rest of every
        iteration up to the latest one touched is pending again, re-leased in sampler order.
        `moved`: keys this node's journal says it moved to other nodes (--migrate auto); those
        of its own views that it did not train itself are held (LocalUnit.held) until
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
