"""Did this process run? Gaps between event-loop ticks show when it was frozen (pure, no I/O).

A daemon stopped by SIGSTOP, a VM pause, swapping or CPU starvation does not run its event loop;
the monotonic clock keeps going. When it runs again its round deadlines are overdue and its
peers' messages wait unread in the socket, so a deadline that fires then says nothing about the
peers. The hub ticks a StallWatch every TICK_S and asks it, before blaming a peer, how long this
process itself was not running.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

TICK_S = 0.25
# A gap this long between ticks is a stall, not scheduling noise on a loaded machine.
MIN_STALL_S = 1.0


@dataclass(frozen=True, slots=True)
class Stall:
    start_s: float  # monotonic: the last tick before the gap
    end_s: float  # the first tick after it (or "now" for a gap still open)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class StallWatch:
    def __init__(self, now_s: float) -> None:
        self._last_tick_s = now_s
        self._stalls: deque[Stall] = deque(maxlen=16)

    def tick(self, now_s: float) -> None:
        if now_s - self._last_tick_s >= MIN_STALL_S:
            self._stalls.append(Stall(self._last_tick_s, now_s))
        self._last_tick_s = now_s

    def longest_since(self, since_s: float, now_s: float) -> Stall | None:
        """The longest stall that ended after `since_s`, the open gap up to `now_s` included."""
        candidates = [s for s in self._stalls if s.end_s > since_s]
        if now_s - self._last_tick_s >= MIN_STALL_S:
            candidates.append(Stall(self._last_tick_s, now_s))
        return max(candidates, key=lambda s: s.duration_s, default=None)


def frozen_past_deadline(stall: Stall | None, elapsed_s: float, deadline_s: float) -> bool:
    """A deadline passed only because this process was frozen: it ran for less than the
    deadline (`elapsed_s` since the deadline's start, minus its longest stall)."""
    return stall is not None and elapsed_s - stall.duration_s < deadline_s
