"""Delivered reports, from next() to the daemon, batched: one report covers consecutive steps.

next() queues a report per batch it hands over (`add`); a flush sends everything queued as one
Delivered (wait and compute summed), written straight to the step socket by the calling thread
(protocol 6: a frame on a unix socket costs a few microseconds, so there is no sender thread
to wake, the cost that once made a pump thread worth having; docs/bench/datapath.md).

When ODBClient flushes (client.py): once `report_every` (prefetch / 2) reports are queued, so
the daemon keeps pushing ahead of a fast trainer; on a next() whose last flush is older than
`max_age_s`, so a trainer with long steps reports each step at once (one small write per long
step is noise); once next() has blocked for 1 ms; at an epoch's end; on close.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from odbclient.wire.odbd.v1 import trainer_pb2

DEFAULT_MAX_AGE_S = 0.002


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
        max_age_s: float | None = None,  # None: DEFAULT_MAX_AGE_S as it is when built
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self._max_age_s = DEFAULT_MAX_AGE_S if max_age_s is None else max_age_s
        self._clock = clock
        self._unsent: deque[_Report] = deque()
        self._measured: deque[tuple[int, int, float]] = deque()  # report_compute: ride along
        self._lock = threading.Lock()  # one flush at a time: reports leave in step order
        self._flushed_s = clock()
        self._closed = False

    def add(self, epoch: int, step: int, *, wait_s: float, compute_s: float) -> int:
        """Queues one report; returns how many reports are unsent."""
        self._unsent.append(_Report(epoch, step, wait_s, compute_s))
        return len(self._unsent)

    def add_measured(self, epoch: int, step: int, compute_s: float) -> None:
        """Queues the trainer's own time of one step; it leaves with the next Delivered (a
        Delivered always covers at least one new step, so none is sent for these alone)."""
        self._measured.append((epoch, step, compute_s))

    def stale(self) -> bool:
        """The last flush is older than max_age_s: the trainer's steps are long."""
        return self._clock() - self._flushed_s >= self._max_age_s

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
            self._flushed_s = self._clock()
            self._send(trainer_pb2.TrainerMessage(delivered=delivered))

    def close(self) -> None:
        """Sends what is queued; later reports are dropped (idempotent)."""
        self.flush()
        self._closed = True
