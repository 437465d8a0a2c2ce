"""Delivered reports, from next() to the daemon without a thread wake-up inside next().

Why: next() on a ready batch is ~30 us of queue and bookkeeping work. Writing a report to the
daemon inside it cost ~90 us more at p50 under load (2026-11-25, docs/bench/datapath.md): the
write wakes the daemon, which competes with the trainer for the 2 cores before next() has
returned. So next() only appends to a deque (`add`), and the stream's reader thread, which
exists anyway, writes what is queued (`flush`, straight to the step socket) once the oldest
report is `poll_s` old: it waits for the socket with `poll_timeout_s()` as its timeout. After
`park_after_s` without a report it waits for data alone, so a paused trainer costs no polling,
and the first report after that wakes it (`wake`: one write to a pipe, once per pause).

A flush sends everything queued as one Delivered covering those consecutive steps (wait and
compute summed): fewer messages for both sides. Besides the reader, ODBClient flushes once next()
has blocked for 1 ms, at an epoch's end and once half its prefetch window is unreported, so the
daemon keeps pushing ahead of a fast trainer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from odbclient.wire.odbd.v1 import trainer_pb2

DEFAULT_POLL_S = 0.0025
DEFAULT_PARK_AFTER_S = 0.05


class _Report(NamedTuple):
    epoch: int
    step: int
    wait_s: float
    compute_s: float


class DeliveryReports:
    """The Delivered reports of one trainer stream, queued by next() and sent in batches."""

    def __init__(
        self,
        send: Callable[[trainer_pb2.TrainerMessage], None],
        *,
        poll_s: float | None = None,  # None: DEFAULT_POLL_S as it is when built
        park_after_s: float = DEFAULT_PARK_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        wake: Callable[[], None] = lambda: None,  # ends the reader's wait (parked only)
    ) -> None:
        self._send = send
        self._wake = wake
        self._parked = False  # the reader waits for data alone: add() must wake it
        self._poll_s = DEFAULT_POLL_S if poll_s is None else poll_s
        self._park_after_s = park_after_s
        self._clock = clock
        self._unsent: deque[_Report] = deque()
        self._measured: deque[tuple[int, int, float]] = deque()  # report_compute: ride along
        self._lock = threading.Lock()  # one flush at a time: reports leave in step order
        self._first_unsent_s = 0.0  # clock() when the oldest unsent report was added
        self._last_added_s = -float("inf")
        self._closed = False

    def add(self, epoch: int, step: int, *, wait_s: float, compute_s: float) -> int:
        """Queues one report (wakes nobody); returns how many reports are unsent."""
        now_s = self._clock()
        if not self._unsent:
            self._first_unsent_s = now_s
        self._last_added_s = now_s
        self._unsent.append(_Report(epoch, step, wait_s, compute_s))
        if self._parked:  # rare: the first report after a pause of park_after_s
            self._parked = False
            self._wake()
        return len(self._unsent)

    def add_measured(self, epoch: int, step: int, compute_s: float) -> None:
        """Queues the trainer's own time of one step; it leaves with the next Delivered (a
        Delivered always covers at least one new step, so none is sent for these alone)."""
        self._measured.append((epoch, step, compute_s))

    def poll_timeout_s(self) -> float | None:
        """How long the reader thread may wait for data before it should flush: until the
        oldest report is poll_s old; poll_s while reports flowed within park_after_s (one may
        be added meanwhile); None (wait for data alone) once they stopped."""
        now_s = self._clock()
        if self._unsent:
            return max(0.0, self._first_unsent_s + self._poll_s - now_s)
        if now_s - self._last_added_s < self._park_after_s:
            return self._poll_s
        self._parked = True
        if self._unsent:  # add() ran before it could see the flag: do not park
            self._parked = False
            return 0.0
        return None

    def flush_due(self) -> None:
        """Flushes if the oldest report is poll_s old (the reader thread, after each wait)."""
        if self._unsent and self._clock() - self._first_unsent_s >= self._poll_s:
            self.flush()

    def flush(self) -> None:
        """Sends every queued report now, as one Delivered (any thread)."""
        if not self._unsent or self._closed:
            return
        with self._lock:
            taken = [self._unsent.popleft() for _ in range(len(self._unsent))]
            if not taken:
                return
            delivered = trainer_pb2.Delivered(
                epoch=taken[-1].epoch,
                step=taken[-1].step,
                wait_s=sum(report.wait_s for report in taken),
                compute_s=sum(report.compute_s for report in taken),
                steps=len(taken),
            )
            while self._measured:
                epoch, step, compute_s = self._measured.popleft()
                delivered.measured.add(epoch=epoch, step=step, compute_s=compute_s)
            self._send(trainer_pb2.TrainerMessage(delivered=delivered))

    def close(self) -> None:
        """Sends what is queued; later reports are dropped (idempotent)."""
        self.flush()
        self._closed = True
