"""Per-rank queue of planned steps, pushed ahead to the rank's trainer client.

Items stay queued until the trainer reports them delivered, so a client that reconnects is
sent again every step it had not delivered; their shared memory is freed only then.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from odbd.daemon.node_state import Location


@dataclass(slots=True)
class QueuedItem:
    epoch: int
    step: int  # -1 for markers (epoch end, job end)
    event: Any  # trainer_pb2.TrainerEvent, built once when planned
    locations: list[Location] = field(default_factory=list)

    @property
    def is_step(self) -> bool:
        return self.step >= 0


class RankQueue:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._items: deque[QueuedItem] = deque()
        self._sent = 0  # items[:_sent] were sent on the current connection
        self._changed = asyncio.Event()
        self.delivered_steps = 0
        self._attached = False
        self.attaches = 0  # trainer connections so far: a failed job waits until each was told

    @property
    def attached(self) -> bool:
        return self._attached

    @attached.setter
    def attached(self, value: bool) -> None:
        self.attaches += value and not self._attached
        self._attached = value

    def push(self, items: list[QueuedItem]) -> None:
        self._items.extend(items)
        self._changed.set()

    def queued_steps(self) -> int:
        return sum(1 for item in self._items if item.is_step)

    def rewind(self) -> None:
        """The connection ended: the next one starts at the first undelivered item."""
        self._sent = 0
        self._changed.set()

    def take_ready(self, prefetch: int) -> QueuedItem | None:
        """The next item if it may be sent now (fewer than `prefetch` sent steps await
        delivery, or it is a marker); None when the stream must wait."""
        if self._sent >= len(self._items):
            return None
        item = self._items[self._sent]
        if item.is_step:
            in_flight = sum(1 for i in range(self._sent) if self._items[i].is_step)
            if in_flight >= prefetch:
                return None
        self._sent += 1
        return item

    def take_ready_step(self, prefetch: int) -> QueuedItem | None:
        """Like take_ready, but only a step: a marker waits for a message of its own."""
        if self._sent < len(self._items) and self._items[self._sent].is_step:
            return self.take_ready(prefetch)
        return None

    async def next_to_send(self, prefetch: int) -> QueuedItem:
        """The next item, once it may be sent (take_ready)."""
        while (item := self.take_ready(prefetch)) is None:
            self._changed.clear()
            await self._changed.wait()
        return item

    def deliver(self, epoch: int, step: int) -> list[Location]:
        """Drops items up to and including (epoch, step); returns their locations to free."""
        freed: list[Location] = []
        while self._items and self._sent > 0:
            head = self._items[0]
            if head.is_step and (head.epoch, head.step) > (epoch, step):
                break
            self._items.popleft()
            self._sent -= 1
            freed.extend(head.locations)
            if head.is_step:
                self.delivered_steps += 1
        self._changed.set()
        return freed

    def drop_unsent(self) -> list[Location]:
        """The job failed: items not yet sent will never be; returns their locations."""
        dropped = [self._items.pop() for _ in range(len(self._items) - self._sent)]
        self._changed.set()
        return [location for item in dropped for location in item.locations]

    def skip_before(self, epoch: int, step: int) -> list[Location]:
        """Resume: steps before (epoch, step) count as delivered by the previous client."""
        freed: list[Location] = []
        while self._items:
            head = self._items[0]
            before = (head.epoch, head.step) < (epoch, step) if head.is_step else head.epoch < epoch
            if not before:
                break
            self._items.popleft()
            freed.extend(head.locations)
        self._sent = 0
        return freed

    def first_undelivered(self) -> tuple[int, int] | None:
        for item in self._items:
            if item.is_step:
                return item.epoch, item.step
        return None
