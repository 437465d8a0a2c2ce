"""Samples made again for rewinds (odbd.daemon.rewind): the steps of a rewinding rank wait
in a `Rewind` until every sample they held is back in shared memory, made by id through the
node's producers under view keys of their own, then go back to the front of the rank's queue
with their new locations."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.daemon.locations import Locations
from odbd.daemon.rewind import HistoryItem, Position
from odbd.daemon.trained import StepCounts

if TYPE_CHECKING:
    from odbd.serve.rank_queue import RankQueue

log = logging.getLogger("odbd.rewind")

# Re-made samples' view keys: -2, -3, ... (-1 is the lane header's "between samples" mark,
# odbclient.producer.lane.IDLE); the sampler's keys are >= 0, so a commit tells them apart by sign.
FIRST_REMAKE_KEY = -2
REMAKE_ATTEMPTS = 3  # a sample whose re-make is rejected this often fails the job


@dataclass(slots=True)
class Rewind:
    """One rank's rewind in progress: its steps wait for their samples to be made again."""

    rank: int
    resume: Position
    items: list[HistoryItem]  # from the history, oldest first
    batches: dict[int, trainer_pb2.StepBatch] = field(default_factory=dict)  # item -> parsed
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # key -> (item, row)
    made: dict[int, tuple[Locations, int]] = field(default_factory=dict)  # key -> where, nbytes
    attempts: dict[int, int] = field(default_factory=dict)  # key -> rejected re-makes

    @property
    def complete(self) -> bool:
        return len(self.made) == len(self.rows)


@dataclass(slots=True)
class _Lease:
    producer: int
    deadline: float


class Rewinder:
    """Every rewind of this node: the samples to make again, their leases, the steps to put
    back. Called from the event loop only (trainer service, ingest service)."""

    def __init__(
        self,
        *,
        node: int,
        resolve: Callable[[Locations], tuple[np.ndarray, np.ndarray]],
        free: Callable[[list[Locations]], None],
        fail: Callable[[str], None],
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.node = node
        self._resolve = resolve  # Lanes.resolve_many: (segments, offsets) for the trainer
        self._free = free  # gives shared memory back to its producer
        self._fail = fail  # the job cannot go on (a sample cannot be made again)
        self._wake = wake  # producers may lease now (IngestService.pump_leases)
        self.active: dict[int, Rewind] = {}  # rank -> its rewind
        self._queues: dict[int, RankQueue] = {}
        self._next_key = FIRST_REMAKE_KEY
        self._owner: dict[int, Rewind] = {}  # key -> rewind (not made yet)
        self._identity: dict[int, int] = {}  # key -> dataset identity
        self._waiting: deque[int] = deque()  # keys to lease, in order
        self._leases: dict[int, _Lease] = {}
        self.num_rewinds = 0
        self.num_remade = 0
        self._no_room_since: float | None = None  # every producer waits for lane space

    # -- trainers ------------------------------------------------------------------------

    def start(self, queue: RankQueue, resume: Position) -> None:
        """Rewinds `queue` (a RankQueue) to `resume`: gates it and asks for its samples."""
        items = queue.history.take_from(resume)
        rewind = Rewind(queue.rank, resume, items)
        for i, (_, step, event, _) in enumerate(items):
            if step < 0:
                continue
            batch = trainer_pb2.StepBatch.FromString(event)  # type: ignore[arg-type]
            rewind.batches[i] = batch
            for row, identity in enumerate(np.frombuffer(batch.sample_ids, "<i8").tolist()):
                key, self._next_key = self._next_key, self._next_key - 1
                rewind.rows[key] = (i, row)
                self._owner[key] = rewind
                self._identity[key] = identity
                self._waiting.append(key)
        queue.gated = True
        queue.took_job_end = False  # it trains those steps again before the job's end
        queue.last_delivered = queue.history.last_step()
        queue.trained.rewind(
            resume,
            queue.last_delivered,
            queue.history.epoch_global_samples(queue.last_delivered[0])
            if queue.last_delivered is not None
            else 0,
        )
        self.active[queue.rank] = rewind
        self._queues[queue.rank] = queue
        self.num_rewinds += 1
        steps = len(rewind.batches)
        log.info(
            "trainer rank %d resumes at epoch %d step %d: rewinding %d steps it already took; "
            "%d samples are made again, then the same steps are sent again",
            queue.rank, resume[0], resume[1], steps, len(rewind.rows),
        )  # fmt: skip
        self._finish_if_complete(rewind)
        self._wake()

    def cancel(self, rank: int) -> None:
        """The rank's trainer left before its rewind was served: the steps are history again
        (its next trainer decides afresh), made samples are freed, leases forgotten."""
        rewind = self.active.pop(rank, None)
        if rewind is None:
            return
        queue = self._queues.pop(rank)
        queue.history.put_back(rewind.items)
        queue.last_delivered = queue.history.last_step()
        queue.gated = False
        self._free([where for where, _ in rewind.made.values()])
        for key in rewind.rows:
            self._forget(key)
        log.info("trainer rank %d left during its rewind; the rewind is dropped", rank)

    def cancel_all(self) -> None:
        for rank in list(self.active):
            self.cancel(rank)

    def _forget(self, key: int) -> None:
        self._owner.pop(key, None)
        self._identity.pop(key, None)
        self._leases.pop(key, None)
        # a key still in _waiting is skipped when leased (no owner)

    # -- producers -----------------------------------------------------------------------

    def wanted(self) -> bool:
        return bool(self._waiting)

    def lease(self, producer: int, count: int, deadline: float) -> tuple[np.ndarray, np.ndarray]:
        """Up to `count` (keys, identities) to make again, oldest rewind first."""
        keys: list[int] = []
        while self._waiting and len(keys) < count:
            key = self._waiting.popleft()
            if key in self._owner:
                keys.append(key)
                self._leases[key] = _Lease(producer, deadline)
        ids = [self._identity[k] for k in keys]
        return np.asarray(keys, dtype=np.int64), np.asarray(ids, dtype=np.int64)

    def commit(self, producer: int, keys: np.ndarray, locations: Locations) -> np.ndarray:
        """(n,) bool: rows taken (their shared memory now belongs to a rewound step); the
        others are stale (a cancelled rewind, an expired lease) and go back to the producer."""
        accepted = np.zeros(len(keys), dtype=bool)
        done: list[Rewind] = []
        for i, key in enumerate(keys.tolist()):
            lease = self._leases.get(key)
            rewind = self._owner.get(key)
            if lease is None or lease.producer != producer or rewind is None:
                continue
            accepted[i] = True
            del self._leases[key], self._owner[key], self._identity[key]
            rewind.made[key] = (locations.take(slice(i, i + 1)), int(locations.nbytes[i]))
            if rewind.complete:
                done.append(rewind)
        self.num_remade += int(accepted.sum())
        for rewind in done:
            self._finish_if_complete(rewind)
        return accepted

    def reject(self, producer: int, key: int, detail: str) -> bool:
        """A producer could not make a sample again (True if the key was a re-make): retried,
        and the job fails after REMAKE_ATTEMPTS, since the rewound step cannot be exact."""
        lease = self._leases.get(key)
        rewind = self._owner.get(key)
        if lease is None or lease.producer != producer or rewind is None:
            return key <= FIRST_REMAKE_KEY
        del self._leases[key]
        rewind.attempts[key] = rewind.attempts.get(key, 0) + 1
        identity = self._identity[key]
        if rewind.attempts[key] >= REMAKE_ATTEMPTS:
            self._fail(
                f"rank {rewind.rank}'s rewind to epoch {rewind.resume[0]} step "
                f"{rewind.resume[1]} needs sample {identity} again, and making it failed "
                f"{REMAKE_ATTEMPTS} times ({detail}); it was trained before, so dataset[i] is "
                "not deterministic. The job stops rather than train another step in its place; "
                "make dataset[i] depend only on i, then resume from the checkpoint"
            )
            return True
        self._waiting.appendleft(key)
        return True

    def release(self, keys: list[int]) -> None:
        """Leases that will not be committed (producer gone, lease expired): made by another."""
        for key in sorted(keys, reverse=True):
            if self._leases.pop(key, None) is not None and key in self._owner:
                self._waiting.appendleft(key)
        if keys:
            self._wake()

    def leases_of(self, producer: int) -> list[int]:
        return [k for k, lease in self._leases.items() if lease.producer == producer]

    def expired(self, now: float) -> list[int]:
        return [k for k, lease in self._leases.items() if lease.deadline <= now]

    def check_room(self, now: float, *, lanes_full: bool, timeout_s: float) -> None:
        """Fails the job if rewinds wait while every producer waits for lane space for
        `timeout_s`: the shared memory is held by the rewinding ranks' own queued steps, which
        they take only after the rewind, so it would wait forever."""
        if not self.active or not lanes_full:
            self._no_room_since = None
            return
        if self._no_room_since is None:
            self._no_room_since = now
            return
        if now - self._no_room_since < timeout_s:
            return
        missing = sum(len(r.rows) - len(r.made) for r in self.active.values())
        self._fail(
            f"ranks {sorted(self.active)} rewind to their checkpoint and need {missing} samples "
            f"made again, but every producer has waited {now - self._no_room_since:.0f} s for "
            "lane space, held by steps those ranks take only after the rewind. The job stops "
            "rather than wait forever; raise --shm-size (room for --steps-ahead queued steps "
            "and the steps since a checkpoint) or lower --steps-ahead, then resume from the "
            "checkpoint with --state-dir"
        )
        self._no_room_since = None

    # -- completion ------------------------------------------------------------------------

    def _finish_if_complete(self, rewind: Rewind) -> None:
        if not rewind.complete or self.active.get(rewind.rank) is not rewind:
            return
        del self.active[rewind.rank]
        queue = self._queues.pop(rewind.rank)
        queue.restore_front(self._rebuild(rewind))
        log.info(
            "trainer rank %d: rewind to epoch %d step %d ready (%d samples made again)",
            rewind.rank, rewind.resume[0], rewind.resume[1], len(rewind.rows),
        )  # fmt: skip

    def _rebuild(
        self, rewind: Rewind
    ) -> list[tuple[int, int, object, list[Locations], StepCounts | None]]:
        """The rewound items with each step's samples at their new locations."""
        by_item: dict[int, list[tuple[int, Locations, int]]] = {}
        for key, (item, row) in rewind.rows.items():
            where, size = rewind.made[key]
            by_item.setdefault(item, []).append((row, where, size))
        out: list[tuple[int, int, object, list[Locations], StepCounts | None]] = []
        for i, (epoch, step, event, counts) in enumerate(rewind.items):
            batch = rewind.batches.get(i)
            if batch is None or not by_item.get(i):
                out.append((epoch, step, event, [], counts))
                continue
            rows = sorted(by_item[i], key=lambda r: r[0])
            where = Locations.concat([w for _, w, _ in rows]).with_lane()
            segments, offsets = self._resolve(where)
            nbytes = np.asarray([n for _, _, n in rows], dtype=np.int64)
            old = np.frombuffer(batch.nbytes, "<u8").astype(np.int64)
            if not np.array_equal(old, nbytes):
                log.warning(
                    "rank %d epoch %d step %d: samples made again differ in size from the first "
                    "time (%s bytes, now %s): dataset[i] is not deterministic, so the rewound "
                    "step is not the step trained before",
                    rewind.rank, epoch, step, old.tolist(), nbytes.tolist(),
                )  # fmt: skip
            batch.segments = segments.astype("<u4").tobytes()
            batch.offsets = offsets.astype("<u8").tobytes()
            batch.nbytes = nbytes.astype("<u8").tobytes()
            out.append((epoch, step, batch.SerializeToString(), [where], counts))
        return out
