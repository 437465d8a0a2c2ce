"""Per-rank queue of planned steps, pushed ahead to the rank's trainer client.

Items stay queued until the trainer reports them delivered, so a client that reconnects is
sent again every step it had not delivered; their shared memory is freed only then.

The job's end: a rank has taken it once its stream closed after the JobEnd marker went out on
that stream with every step delivered (a failed job's end needs no delivery: its remaining
steps will not run). The trainer closes the stream (ODBClient.close, or its process exiting);
a trainer that keeps its client open is attached and is waited for. A failed job's end is the
one the daemon closes itself (`next_to_send` returns None once it went out), so the trainer
reads it as JobFailedError before the daemon shuts its server down.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.daemon.locations import Locations
from odbd.daemon.rewind import DEFAULT_REWIND_STEPS, StepHistory
from odbd.daemon.trained import RankTrained, StepCounts


@dataclass(slots=True)
class QueuedItem:
    epoch: int
    step: int  # -1 for markers (epoch end, job end)
    # A marker's trainer_pb2.TrainerEvent; a step's serialized trainer_pb2.StepBatch (bytes),
    # encoded once when planned however often it is sent (trainer_service._steps_event)
    event: Any
    locations: list[Locations] = field(default_factory=list)
    counts: StepCounts | None = None  # a step's: what delivering it adds to `RankQueue.trained`

    @property
    def is_step(self) -> bool:
        return self.step >= 0

    @property
    def job_end(self) -> trainer_pb2.JobEnd | None:
        """The JobEnd this marker carries, if it is the job's end."""
        event = self.event
        if isinstance(event, trainer_pb2.TrainerEvent) and event.HasField("job_end"):
            return event.job_end
        return None


class RankQueue:
    def __init__(
        self,
        rank: int,
        clock: Callable[[], float] = time.monotonic,
        history_steps: int = DEFAULT_REWIND_STEPS,
    ) -> None:
        self.rank = rank
        self._items: deque[QueuedItem] = deque()
        self._sent = 0  # items[:_sent] were sent on the current connection
        # Counts kept as items move, so the round loop's readiness check (on every commit) and
        # each step sent cost O(1), not a scan of the queue.
        self._num_steps = 0  # steps among items
        self._sent_steps = 0  # steps among items[:_sent]: sent, awaiting Delivered
        self._changed = asyncio.Event()
        self._clock = clock
        self.delivered_steps = 0
        self.trained = RankTrained()  # the delivered steps' samples and tokens (trained.py)
        # (epoch, step) of the newest step a trainer reported delivered: its shared memory is
        # freed, so it can never be sent again (a resume point at or before it is refused).
        self.last_delivered: tuple[int, int] | None = None
        self._attached = False
        self.ever_attached = False
        self.detached_at_s: float | None = None  # clock() when the last stream ended
        self._job_end_sent: trainer_pb2.JobEnd | None = None  # on the current connection
        self.took_job_end = False  # sticky: see the module docstring
        # Items handed out (delivered or skipped), for rewinds (odbd.daemon.rewind); while a
        # rewind makes its samples again the queue is gated: nothing is sent.
        self.history = StepHistory(history_steps)
        self.gated = False
        self.ever_sent = False  # a step went out to a trainer of this daemon process
        # ODBClient.end_job(): (epoch, step) of the first step the rank will not train; items
        # from there on are dropped as they come (end_at), the job's end excepted.
        self.end_point: tuple[int, int] | None = None

    @property
    def attached(self) -> bool:
        """A trainer's stream is open for this rank (set by the step channel: TrainerService)."""
        return self._attached

    @attached.setter
    def attached(self, value: bool) -> None:
        if value:
            self.ever_attached = True
        elif self._attached:
            self.detached_at_s = self._clock()
            self.took_job_end = self.took_job_end or self._job_end_taken_here()
            self._job_end_sent = None
        self._attached = value

    def push(self, items: list[QueuedItem]) -> list[Locations]:
        """Queues `items`; after end_at, those past the end point are dropped instead and
        their locations returned (to free: nobody will take them)."""
        freed: list[Locations] = []
        if self.end_point is not None:
            freed = [loc for item in items if self._past_end(item) for loc in item.locations]
            items = [item for item in items if not self._past_end(item)]
        self._items.extend(items)
        self._num_steps += sum(1 for item in items if item.is_step)
        self._changed.set()
        return freed

    def end_at(self, epoch: int, step: int) -> list[Locations]:
        """The rank's trainer called end_job() before (epoch, step): it takes nothing from
        there on, so queued items past it go (sent or not: the client skips them) and so does
        every later push; the job's end stays. Returns the dropped items' locations."""
        self.end_point = (epoch, step)
        kept: deque[QueuedItem] = deque()
        freed: list[Locations] = []
        sent = 0
        for i, item in enumerate(self._items):
            if self._past_end(item):
                freed += item.locations
                continue
            kept.append(item)
            sent += i < self._sent
        self._items, self._sent = kept, sent
        self._num_steps = sum(1 for item in kept if item.is_step)
        self._sent_steps = sum(1 for i, item in enumerate(kept) if i < sent and item.is_step)
        self._changed.set()
        return freed

    def _past_end(self, item: QueuedItem) -> bool:
        """At or after the end point: a step from it on, an epoch's end from its epoch on."""
        if self.end_point is None or item.job_end is not None:
            return False
        if item.is_step:
            return (item.epoch, item.step) >= self.end_point
        return item.epoch >= self.end_point[0]

    def queued_steps(self) -> int:
        return self._num_steps

    def rewind(self) -> None:
        """The connection ended: the next one starts at the first undelivered item."""
        self._sent = self._sent_steps = 0
        self._job_end_sent = None
        self._changed.set()

    def finished(self) -> bool:
        """The stream may end: a failed job's end went out on it (nothing more will follow)."""
        return self._job_end_sent is not None and self._job_end_sent.failed

    def _job_end_taken_here(self) -> bool:
        """This connection got the job's end and (unless the job failed) every step."""
        return self.finished() or (self._job_end_sent is not None and self.queued_steps() == 0)

    def take_ready(self, prefetch: int) -> QueuedItem | None:
        """The next item if it may be sent now (fewer than `prefetch` sent steps await
        delivery, or it is a marker); None when the stream must wait."""
        if self._sent >= len(self._items) or self.gated:
            return None
        item = self._items[self._sent]
        if item.is_step:
            if self._sent_steps >= prefetch:
                return None
            self._sent_steps += 1
            self.ever_sent = True
        elif item.job_end is not None:
            self._job_end_sent = item.job_end
        self._sent += 1
        return item

    def take_ready_steps(
        self, prefetch: int, max_steps: int, budget_bytes: int
    ) -> list[QueuedItem]:
        """take_ready while it gives a step (a marker waits for a message of its own), at
        most `max_steps` of them and until their events' bytes reach `budget_bytes` (the step
        that reaches it is taken): one loop over the queue for a message's worth of steps."""
        items, sent, taken_bytes = self._items, self._sent, 0
        steps: list[QueuedItem] = []
        room = min(prefetch - self._sent_steps, max_steps)
        while len(steps) < room and taken_bytes < budget_bytes and sent < len(items):
            item = items[sent]
            if item.step < 0:  # a marker waits for a message of its own
                break
            steps.append(item)
            taken_bytes += len(item.event)
            sent += 1
        self._sent = sent
        self._sent_steps += len(steps)
        return steps

    async def next_to_send(self, prefetch: int) -> QueuedItem | None:
        """The next item, once it may be sent (take_ready); None once the stream is finished
        (a failed job's end went out): the stream should end."""
        while (item := self.take_ready(prefetch)) is None:
            if self.finished():
                return None
            self._changed.clear()
            await self._changed.wait()
        return item

    def deliver(self, epoch: int, step: int) -> list[Locations]:
        """Drops items up to and including (epoch, step); returns their locations to free."""
        freed: list[Locations] = []
        items = self._items
        delivered = 0  # steps among the dropped items
        last: QueuedItem | None = None  # the last of them
        # head.step >= 0 is head.is_step, inline: this runs per item of every report.
        while items and self._sent > 0:
            head = items[0]
            if head.step >= 0:
                if (head.epoch, head.step) > (epoch, step):
                    break
                delivered += 1
                last = head
                if head.counts is not None:
                    self.trained.add(head.epoch, head.step, head.counts)
            elif head.job_end is not None:
                break  # stays queued: a trainer that connects later is told the job's end too
            items.popleft()
            self._sent -= 1
            freed += head.locations
            self.history.add(head.epoch, head.step, head.event, head.counts)
        if last is not None:
            self.last_delivered = (last.epoch, last.step)
        self.delivered_steps += delivered
        self._num_steps -= delivered
        self._sent_steps -= delivered
        self._changed.set()
        return freed

    def drop_unsent(self) -> list[Locations]:
        """The job failed: items not yet sent will never be; returns their locations."""
        dropped = [self._items.pop() for _ in range(len(self._items) - self._sent)]
        self._num_steps -= sum(1 for item in dropped if item.is_step)
        self._changed.set()
        return [location for item in dropped for location in item.locations]

    def fail_job(self, end: QueuedItem) -> list[Locations]:
        """The job failed after its end was queued: unsent items (a successful JobEnd among
        them) are dropped and `end` (a failed JobEnd) follows what was sent."""
        freed = self.drop_unsent()
        self.push([end])
        return freed

    def skip_before(self, epoch: int, step: int) -> list[Locations]:
        """Resume: steps before (epoch, step) count as delivered by the previous client."""
        freed: list[Locations] = []
        while self._items:
            head = self._items[0]
            before = (head.epoch, head.step) < (epoch, step) if head.is_step else head.epoch < epoch
            if not before or head.job_end is not None:  # the job's end is never skipped
                break
            self._items.popleft()
            freed.extend(head.locations)
            self._num_steps -= head.is_step
            # trained by the last client
            self.history.add(head.epoch, head.step, head.event, head.counts)
            if head.is_step:
                self.last_delivered = (head.epoch, head.step)
        self._sent = self._sent_steps = 0
        return freed

    def restore_front(
        self, items: list[tuple[int, int, Any, list[Locations], StepCounts | None]]
    ) -> None:
        """A rewind is ready: its steps (epoch, step, event, locations, counts) go before
        every queued item, and sending starts again (delivering them adds their counts to
        `trained` again: the trainer computes them again)."""
        self._items.extendleft(
            QueuedItem(epoch, step, event, locations, counts)
            for epoch, step, event, locations, counts in reversed(items)
        )
        self._num_steps += sum(1 for _, step, _, _, _ in items if step >= 0)
        self._sent = self._sent_steps = 0
        self.gated = False
        self._changed.set()

    def first_undelivered(self) -> tuple[int, int] | None:
        for item in self._items:
            if item.is_step:
                return item.epoch, item.step
        return None
