"""DeliveryReports: next() queues Delivered reports; the pump, flush() and close() send each
batch of them as one report covering consecutive steps, in order, and a parked pump wakes for
the next report."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from odbclient.reports import DeliveryReports

_PATIENCE_S = 10.0  # generous: these tests wait for a thread, never for a speed


class RecordingOutbox:
    """Records each Delivered as (epoch, last step, steps covered, wait_s, compute_s)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, int, float, float]] = []
        self.changed = threading.Condition()

    def put(self, message: Any) -> None:
        d = message.delivered
        with self.changed:
            self.sent.append((d.epoch, d.step, d.steps, d.wait_s, d.compute_s))
            self.changed.notify_all()

    def steps(self) -> int:
        return sum(report[2] for report in self.sent)

    def wait_for_steps(self, count: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.steps() >= count, _PATIENCE_S), self.sent


def reports_for(outbox: RecordingOutbox, **kwargs: float) -> DeliveryReports:
    return DeliveryReports(outbox, name="test-reports", **kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_flush_sends_what_is_queued_as_one_report() -> None:
    outbox = RecordingOutbox()
    reports = reports_for(outbox, poll_s=3600.0)  # the pump never comes round in this test
    try:
        assert reports.add(0, 0, wait_s=0.25, compute_s=1.0) == 1
        assert reports.add(0, 1, wait_s=0.5, compute_s=2.0) == 2
        assert outbox.sent == []
        reports.flush()
        assert outbox.sent == [(0, 1, 2, 0.75, 3.0)]
        reports.flush()  # nothing queued: nothing sent
        assert reports.add(1, 0, wait_s=0.0, compute_s=0.0) == 1
    finally:
        reports.close()
    assert outbox.sent == [(0, 1, 2, 0.75, 3.0), (1, 0, 1, 0.0, 0.0)]


@pytest.mark.timeout(30)
def test_the_pump_sends_queued_reports_without_a_flush() -> None:
    outbox = RecordingOutbox()
    reports = reports_for(outbox, poll_s=0.001)
    try:
        for step in range(5):
            reports.add(0, step, wait_s=0.0, compute_s=0.0)
        outbox.wait_for_steps(5)
        assert outbox.sent[-1][:2] == (0, 4)
    finally:
        reports.close()


@pytest.mark.timeout(30)
def test_a_parked_pump_wakes_for_the_next_report() -> None:
    outbox = RecordingOutbox()
    reports = reports_for(outbox, poll_s=0.001, park_after_s=0.0)
    try:
        reports.add(0, 0, wait_s=0.0, compute_s=0.0)
        outbox.wait_for_steps(1)
        deadline = time.monotonic() + _PATIENCE_S
        while not reports._parked and time.monotonic() < deadline:
            time.sleep(0.001)
        assert reports._parked, "the pump never parked with nothing to send"
        reports.add(0, 1, wait_s=0.0, compute_s=0.0)
        outbox.wait_for_steps(2)
        assert outbox.sent[-1][:3] == (0, 1, 1)
    finally:
        reports.close()


@pytest.mark.timeout(30)
def test_flushes_from_two_threads_cover_every_step_once_in_order() -> None:
    outbox = RecordingOutbox()
    reports = reports_for(outbox, poll_s=0.0001)
    flushing = threading.Event()

    def flush_in_a_loop() -> None:
        while not flushing.is_set():
            reports.flush()

    other = threading.Thread(target=flush_in_a_loop)
    other.start()
    try:
        for step in range(2000):
            reports.add(0, step, wait_s=1.0, compute_s=0.0)
            if step % 7 == 0:
                reports.flush()
    finally:
        flushing.set()
        other.join()
        reports.close()
    last_steps = [report[1] for report in outbox.sent]
    assert last_steps == sorted(set(last_steps)) and last_steps[-1] == 1999
    assert outbox.steps() == 2000 and sum(report[3] for report in outbox.sent) == 2000.0
    # Each report covers exactly the steps after the previous one's last.
    starts = [0, *(s + 1 for s in last_steps[:-1])]
    assert [r[2] for r in outbox.sent] == [
        s - a + 1 for a, s in zip(starts, last_steps, strict=True)
    ]


@pytest.mark.timeout(30)
def test_close_sends_what_is_queued_and_ends_the_pump() -> None:
    outbox = RecordingOutbox()
    reports = reports_for(outbox, poll_s=3600.0, park_after_s=3600.0)
    reports.add(3, 7, wait_s=0.0, compute_s=0.0)
    reports.close()
    assert outbox.sent == [(3, 7, 1, 0.0, 0.0)]
    assert not reports._pump.is_alive()
    reports.close()  # idempotent


class MessageOutbox:
    def __init__(self) -> None:
        self.messages: list[Any] = []

    def put(self, message: Any) -> None:
        self.messages.append(message.delivered)


@pytest.mark.timeout(30)
def test_measured_step_times_ride_along_with_the_next_report_only() -> None:
    outbox = MessageOutbox()
    reports = DeliveryReports(outbox, name="test-reports", poll_s=3600.0)  # type: ignore[arg-type]
    try:
        reports.add(0, 0, wait_s=0.0, compute_s=0.0)
        reports.flush()
        reports.add_measured(0, 0, 0.125)
        reports.flush()  # no new step: a Delivered would count one, so nothing is sent
        assert len(outbox.messages) == 1
        reports.add(0, 1, wait_s=0.0, compute_s=0.125)
        reports.flush()
    finally:
        reports.close()
    assert [list(d.measured) for d in outbox.messages][0] == []
    last = outbox.messages[1]
    assert (last.step, last.steps) == (1, 1)
    assert [(m.epoch, m.step, m.compute_s) for m in last.measured] == [(0, 0, 0.125)]
