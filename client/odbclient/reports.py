"""Delivered reports, from next() to the daemon without waking a thread inside next().

Why: next() on a ready batch is ~35 us of queue and bookkeeping work. Handing a message to
gRPC inside it cost ~60 us more per step, and waking any helper thread ~30 us (measured with an
instrumented client, docs/bench/datapath.md): the woken threads (gRPC's sender, then the daemon,
then our own reader collating the next pushed batch) compete with the trainer for the 2 cores
and the GIL before next() has returned. So next() only appends to a deque, and a pump thread
sends what is queued every `poll_s` while batches flow. After `park_after_s` without a report
it parks until the next one, so a paused or slow trainer costs no polling; with steps that
long, the one wake per step is a small share of the step.

A flush sends everything queued as one Delivered covering those consecutive steps (wait and
compute summed): per message, gRPC costs both sides far more than the few bytes. Besides the
pump, ODBClient flushes once next() has blocked for 1 ms, at an epoch's end and once half its
prefetch window is unreported, so the daemon keeps pushing ahead of a fast trainer.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import NamedTuple

from odbclient.connect import Outbox, start_reader
from odbclient.wire.odbd.v1 import trainer_pb2

DEFAULT_POLL_S = 0.005
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
        outbox: Outbox,
        *,
        name: str,
        poll_s: float = DEFAULT_POLL_S,
        park_after_s: float = DEFAULT_PARK_AFTER_S,
    ) -> None:
        self._outbox = outbox
        self._poll_s, self._park_after_s = poll_s, park_after_s
        self._unsent: deque[_Report] = deque()
        self._measured: deque[tuple[int, int, float]] = deque()  # report_compute: ride along
        self._lock = threading.Lock()  # one flush at a time: reports leave in step order
        self._wake = threading.Event()
        self._parked = True
        self._closed = False
        self._pump = start_reader(self._run, name=name)

    def add(self, epoch: int, step: int, *, wait_s: float, compute_s: float) -> int:
        """Queues one report (any thread; wakes nobody unless the pump is parked); returns how
        many reports are unsent."""
        self._unsent.append(_Report(epoch, step, wait_s, compute_s))
        if self._parked:
            self._wake.set()
        return len(self._unsent)

    def add_measured(self, epoch: int, step: int, compute_s: float) -> None:
        """Queues the trainer's own time of one step; it leaves with the next Delivered (a
        Delivered always covers at least one new step, so none is sent for these alone)."""
        self._measured.append((epoch, step, compute_s))

    def flush(self) -> None:
        """Hands every queued report to gRPC now, as one Delivered (any thread)."""
        if not self._unsent:
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
            self._outbox.put(trainer_pb2.TrainerMessage(delivered=delivered))

    def close(self) -> None:
        """Flushes what is queued and ends the pump (idempotent)."""
        self._closed = True
        self._wake.set()
        self.flush()
        if self._pump is not threading.current_thread():
            self._pump.join(timeout=1.0)

    def _run(self) -> None:
        last_report_s = time.monotonic()
        while True:
            if self._parked:
                self._wake.wait()
                self._parked = False
                last_report_s = time.monotonic()
            self._wake.clear()
            if self._closed:
                return
            self._wake.wait(self._poll_s)  # a sleep that close() can cut short
            if self._unsent:
                self.flush()
                last_report_s = time.monotonic()
            elif time.monotonic() - last_report_s > self._park_after_s:
                self._parked = True
                if self._unsent:  # add() ran before it could see the flag: stay awake
                    self._parked = False
