"""`odbd --migrate auto`: one round's cross-node moves on the live daemons (issue 26 item 1).

Before a round's summary (split_exchange.py), every node takes its offers and runs one more
barrier exchange: its digest (planner/migration_digest.py, with its bulk port's address) out,
the hub's moves back (daemon/migration_codec.py). Then, on each node:
  - the held samples (over the budget, waiting for company) go back to its buffer one age older;
  - the sent samples' views become MOVED (NodeState.move_out) and their bytes go to their
    targets over the bulk channel (round/bulk.py), read from where its producers wrote them and
    freed once the target acknowledged them;
  - it waits for every sample the moves send it (their count is in the broadcast result), books
    them BUFFERED at the daemon-owned lane their region became (Lanes.adopt, NodeState.move_in)
    and adds them to its offer.
So every node plans the round on its buffer after the moves (the same round: deterministic),
and the transfers overlap the trainers' current steps (they run steps_ahead steps behind the
planner). A transfer that fails (the target is gone, a check refused it) raises BulkError: the
round loop fails the job as at a lost node.

A restart from --state-dir: a sender journals each move (Journal.append_moved) before any byte
goes, so a restarted node knows which of its views went elsewhere; those it did not train
itself are held (NodeState.restore). Round 0's moves exchange carries, beside the digests,
each node's foreign views its ranks trained before the resume point (the hub returns their
union, O(moved views) once per restart); then every node makes its held views that another
trained final and leases the others again (NodeState.release_held): each view trained once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from odbclient.shm import Allocation
from odbd.daemon import migration_codec
from odbd.daemon.locations import Locations
from odbd.daemon.node_state import NodeState
from odbd.daemon.payload_checks import decoded
from odbd.daemon.split_exchange import SplitExchange
from odbd.errors import InvariantError
from odbd.ingest.arena import Arena
from odbd.ingest.lanes import Lanes
from odbd.metrics.stats import DaemonStats
from odbd.planner.config import PlannerConfig
from odbd.planner.migration import LinkModel
from odbd.planner.migration_digest import UnitMoves, node_digest, pick_moves
from odbd.planner.types import SampleTable, UnitOffer
from odbd.round import RoundBarrier
from odbd.round.bulk import BulkReceiver, SampleRecord, Transfer, send_samples

log = logging.getLogger("odbd.migrate")


@dataclass(slots=True)
class _Inbox:
    """Transfers landed per round (a sender may be a round ahead of this node's wait)."""

    landed: dict[int, list[tuple[Transfer, Allocation, list[int]]]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class LiveMigration:
    def __init__(
        self,
        *,
        barrier: RoundBarrier,
        node: int,
        state: NodeState,
        lanes: Lanes,
        arena: Arena,
        stats: DaemonStats,
        link: LinkModel,
        token: bytes,
        job_id: str,
        host: str,
        free: Callable[[list[Locations]], None],
        read: Callable[[int, int, int], memoryview],
        journal: Callable[[int, np.ndarray, int], None] | None = None,
        released: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        self.barrier = barrier
        self.node = node
        self.state = state
        self.lanes = lanes
        self.arena = arena
        self.stats = stats
        self.link = link
        self.token = token
        self.job_id = job_id
        self.host = host
        self.free = free
        self.read = read
        self.journal = journal  # (round, keys, target node): --state-dir's moved record
        self.released = released  # round 0's union of foreign views trained (restart)
        self.inbox = _Inbox()
        self.address = ""
        self.receiver: BulkReceiver[Allocation] = BulkReceiver(
            token=token,
            job_id=job_id,
            node=node,
            allocate=self._allocate,
            release=arena.free,
            landed=self._landed,
        )

    async def start(self) -> None:
        bind = self.host if self.host not in ("", "localhost") else "127.0.0.1"
        port = await self.receiver.start(bind, 0)
        self.address = f"{bind}:{port}"
        log.info("node %d takes moved samples on %s (--migrate auto)", self.node, self.address)

    async def close(self) -> None:
        await self.receiver.close()

    def _allocate(self, nbytes: int) -> tuple[Allocation, memoryview] | None:
        got = self.arena.allocate(nbytes)
        return None if got is None else (got, self.arena.view(got))

    def _landed(self, transfer: Transfer, region: Allocation, offsets: list[int]) -> None:
        self.inbox.landed.setdefault(transfer.round_index, []).append((transfer, region, offsets))
        self.inbox.changed.set()

    async def round(
        self,
        exchange: SplitExchange,
        planner_round: int,
        round_index: int,
        offers: Sequence[UnitOffer],
        config: PlannerConfig,
        trained: np.ndarray | None = None,
    ) -> list[UnitOffer]:
        """This round's moves done: the offers to plan (kept rows plus what arrived).
        `planner_round` names the barrier's rounds (the exchange runs through the same
        SplitExchange as the round's others); `round_index` (the round's seed) the transfers.
        `trained` (round 0 of every daemon, empty unless restarted): this node's ranks'
        trained views of other nodes, whose union goes to `released` on every node."""
        sizes = [self.state.locations_of(o.samples.views).nbytes for o in offers]
        digests = [node_digest(o, config, s, self.link) for o, s in zip(offers, sizes, strict=True)]
        payload = migration_codec.encode_digest(self.node, digests, self.address)
        if trained is not None:
            payload = migration_codec.with_keys(trained, payload)

        def reduce(payloads: list[bytes]) -> bytes:  # on the hub only
            if trained is None:
                return migration_codec.hub_migrate(payloads, config, self.link, round_index)
            split = [
                decoded(migration_codec.split_keys, p, "digest with trained views", n, round_index)
                for n, p in enumerate(payloads)
            ]
            union = np.unique(np.concatenate([k for k, _ in split]))
            digests = [d for _, d in split]
            moves = migration_codec.hub_migrate(digests, config, self.link, round_index)
            return migration_codec.with_keys(union, moves)

        result = await exchange.moves(planner_round, payload, reduce)
        if trained is not None:
            union, result = migration_codec.split_keys(result)
            if self.released is not None:
                self.released(union)
        self.stats.migration_rounds[migration_codec.decision_of_moves(result)] += 1
        every_unit = list(range(config.num_units))
        _, moves = migration_codec.decode_moves(result, every_unit)
        addresses = migration_codec.decode_addresses(result)
        mine = {o.unit for o in offers}
        kept: list[UnitOffer] = []
        sends: list[asyncio.Future[None]] = []
        shipped: list[Locations] = []
        for offer, unit_moves in zip(offers, (moves[o.unit] for o in offers), strict=True):
            pick = pick_moves(offer, unit_moves, config)
            t = offer.samples
            if pick.hold_rows.size:
                self.state.return_samples(offer.unit, t.take(pick.hold_rows).aged())
            kept.append(UnitOffer(offer.unit, t.take(pick.keep), offer.dry))
            for target in np.unique(pick.send_targets).tolist():
                rows = pick.send_rows[pick.send_targets == target]
                table = t.take(rows)
                node = self._node_of(target, config)
                if self.journal is not None:
                    self.journal(round_index, table.views, node)
                where = self.state.move_out(table.views)
                shipped.append(where)
                sends.append(asyncio.ensure_future(
                    self._ship(round_index, node, addresses[node], table, where)
                ))  # fmt: skip
        expected = self._expected(moves, mine)
        try:
            if sends:
                await asyncio.gather(*sends)
        finally:
            for s in sends:
                s.cancel()
        if shipped:
            self.free(shipped)  # the targets hold them now
        arrived = await self._arrivals(round_index, expected)
        return self._with_arrivals(kept, arrived)

    def _node_of(self, unit: int, config: PlannerConfig) -> int:
        return unit * config.ranks_per_unit // config.world.ranks_per_node

    @staticmethod
    def _expected(moves: list[UnitMoves], mine: set[int]) -> int:
        return sum(
            int(m.send_counts[np.isin(m.send_targets, list(mine))].sum())
            for m in moves
            if m.unit not in mine
        )

    async def _ship(
        self, round_index: int, node: int, address: str, table: SampleTable, where: Locations
    ) -> None:
        segments, starts = self.lanes.resolve_many(where)
        identities = self.state.identities_of(table.views)
        payloads = [
            bytes(self.read(int(s), int(o), int(n)))
            for s, o, n in zip(segments, starts, where.nbytes, strict=True)
        ]
        records = [
            SampleRecord(
                int(v), int(i), int(n), int(k), int(p), int(a), len(b), zlib.crc32(b)
            )
            for v, i, n, k, p, a, b in zip(
                table.views, identities, table.lengths, table.tokens, table.patches, table.ages,
                payloads, strict=True,
            )
        ]  # fmt: skip
        host, port = address.rsplit(":", 1)
        started = time.perf_counter()
        await send_samples(
            host, int(port), token=self.token, job_id=self.job_id, source=self.node,
            target=node, round_index=round_index, records=records, payloads=payloads,
        )  # fmt: skip
        self.stats.migrated_out_samples += len(records)
        self.stats.migrated_out_bytes += sum(len(b) for b in payloads)
        self.stats.migrate_seconds += time.perf_counter() - started

    async def _arrivals(
        self, round_index: int, expected: int
    ) -> list[tuple[Transfer, Allocation, list[int]]]:
        while True:
            got = self.inbox.landed.get(round_index, [])
            count = sum(len(t.records) for t, _, _ in got)
            if count > expected:
                raise InvariantError(
                    f"node {self.node} received {count} moved samples in round {round_index}, "
                    f"the hub's moves send it {expected}: a daemon of another release?"
                )
            if count == expected:
                return self.inbox.landed.pop(round_index, [])
            self.inbox.changed.clear()
            # A sender that is gone fails the job through the barrier (its node is lost), so
            # the wait is bounded by the round timeout there; this one only re-checks.
            try:
                await asyncio.wait_for(self.inbox.changed.wait(), 1.0)
            except TimeoutError:
                self.barrier.raise_failure()

    def _with_arrivals(
        self,
        kept: list[UnitOffer],
        arrived: list[tuple[Transfer, Allocation, list[int]]],
    ) -> list[UnitOffer]:
        extra: dict[int, list[SampleTable]] = {}
        for transfer, region, offsets in sorted(arrived, key=lambda a: a[0].source):
            r = transfer.records
            lane = self.lanes.adopt(region, np.asarray(offsets, dtype=np.int64))
            where = Locations.in_lane(
                lane.lane_id,
                np.asarray(offsets, dtype=np.int64),
                np.asarray([x.nbytes for x in r], dtype=np.int64),
            )
            table = SampleTable.of(
                [x.view for x in r], [x.length for x in r], [x.tokens for x in r],
                [x.age for x in r], [x.patches for x in r],
            )  # fmt: skip
            self.state.move_in(table, where)
            unit = self.state.local_unit_ids()[0]  # --balance node: one unit per node
            extra.setdefault(unit, []).append(table)
            self.stats.migrated_in_samples += len(r)
            self.stats.migrated_in_bytes += sum(x.nbytes for x in r)
        return [
            UnitOffer(o.unit, SampleTable.concat_all([o.samples, *extra.get(o.unit, [])]), o.dry)
            for o in kept
        ]
