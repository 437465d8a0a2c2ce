"""The hand-off from a stream's reader thread to the trainer thread: items visible at once,
the waiting taker woken only when the reader rings.

Why (issue 15): with a queue, every batch the reader queued woke a trainer thread that was
waiting for it, and the trainer, faster than the reader, was waiting for nearly every step: a
context switch and a GIL hand-off on both threads per step, ~10 us of the trainer process's
CPU. Here `add` only appends (a batch is visible to a `take` that does not wait: a trainer
arriving while the reader collates the rest of a message finds it), and a taker that found
nothing waits until `ring`. The reader rings after the first batch of a recv (a waiting
trainer gets it after one collation, as with a queue) and after the last: about 2 wake-ups per
recv (~8 steps at full speed) instead of one per step.

Lost wake-ups cannot happen: the taker sets `_waiting`, then looks at the items again before
it blocks; the reader appends, then looks at `_waiting` (the GIL orders the two threads' steps).
A ring that finds the taker gone leaves a stale token, which costs a later wait one extra turn.
"""

from __future__ import annotations

import queue
import time
from collections import deque


class Inbox:
    """Items from one producer thread to one consumer thread (see the module)."""

    def __init__(self) -> None:
        self._items: deque[object] = deque()
        self._doorbell: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._waiting = False  # the taker found no item and waits (or is about to)

    def add(self, item: object) -> None:
        """Appends `item` without waking a waiting taker (the producer thread)."""
        self._items.append(item)

    def ring(self) -> None:
        """Wakes the taker if it waits (the producer thread, after adding)."""
        if self._waiting:
            self._waiting = False
            self._doorbell.put(None)

    def put(self, item: object) -> None:
        """add, then ring."""
        self._items.append(item)
        self.ring()

    def __len__(self) -> int:
        return len(self._items)

    def qsize(self) -> int:
        """len(), as queue.SimpleQueue names it."""
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()

    def take(self, timeout_s: float) -> object:
        """The oldest item, waiting up to `timeout_s` for a ring; raises queue.Empty after it."""
        items = self._items
        if items:
            return items.popleft()
        deadline_s = time.monotonic() + timeout_s
        while True:
            self._waiting = True
            if items:  # added after the check above, before _waiting was set: no ring comes
                self._waiting = False
                return items.popleft()
            remaining_s = deadline_s - time.monotonic()
            try:
                if remaining_s <= 0:
                    raise queue.Empty
                self._doorbell.get(timeout=remaining_s)
            except queue.Empty:
                self._waiting = False
                if items:
                    return items.popleft()
                raise
            if items:
                return items.popleft()
