"""DeliveryReports: next() queues Delivered reports; the pump, flush() and close() send them in
step order, and a parked pump wakes for the next report."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from odbclient.reports import DeliveryReports

_PATIENCE_S = 10.0  # generous: these tests wait for a thread, never for a speed


class RecordingOutbox:
    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []
        self.changed = threading.Condition()

    def put(self, message: Any) -> None:
        with self.changed:
            self.sent.append((message.delivered.epoch, message.delivered.step))
            self.changed.notify_all()

    def wait_for(self, count: int) -> list[tuple[int, int]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.sent) >= count, _PATIENCE_S), self.sent
            return list(self.sent)


def reports_for(outbox: RecordingOutbox, **kwargs: float) -> DeliveryReports:
    return DeliveryReports(outbox, name="test-reports", **kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_add_sends_nothing_until_the_pump_or_a_flush() -> None:
    outbox = RecordingOutbox()
    reports = reports_for(outbox, poll_s=3600.0)  # the pump never comes round in this test
    try:
        assert reports.add(0, 0, wait_s=0.1, compute_s=0.2) == 1
        assert reports.add(0, 1, wait_s=0.1, compute_s=0.2) == 2
        assert outbox.sent == []
        reports.flush()
        assert outbox.sent == [(0, 0), (0, 1)]
        assert reports.add(0, 2, wait_s=0.0, compute_s=0.0) == 1
    finally:
        reports.close()
    assert outbox.sent == [(0, 0), (0, 1), (0, 2)]


@pytest.mark.timeout(30)
def test_the_pump_sends_queued_reports_without_a_flush() -> None:
    outbox = RecordingOutbox()
    reports = reports_for(outbox, poll_s=0.001)
    try:
        for step in range(5):
            reports.add(0, step, wait_s=0.0, compute_s=0.0)
        assert outbox.wait_for(5) == [(0, step) for step in range(5)]
    finally:
        reports.close()


@pytest.mark.timeout(30)
def test_a_parked_pump_wakes_for_the_next_report() -> None:
    outbox = RecordingOutbox()
    reports = reports_for(outbox, poll_s=0.001, park_after_s=0.0)
    try:
        reports.add(0, 0, wait_s=0.0, compute_s=0.0)
        outbox.wait_for(1)
        deadline = time.monotonic() + _PATIENCE_S
        while not reports._parked and time.monotonic() < deadline:
            time.sleep(0.001)
        assert reports._parked, "the pump never parked with nothing to send"
        reports.add(0, 1, wait_s=0.0, compute_s=0.0)
        assert outbox.wait_for(2) == [(0, 0), (0, 1)]
    finally:
        reports.close()


@pytest.mark.timeout(30)
def test_flushes_from_two_threads_keep_step_order() -> None:
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
            reports.add(0, step, wait_s=0.0, compute_s=0.0)
            if step % 7 == 0:
                reports.flush()
    finally:
        flushing.set()
        other.join()
        reports.close()
    assert outbox.sent == [(0, step) for step in range(2000)]


@pytest.mark.timeout(30)
def test_close_sends_what_is_queued_and_ends_the_pump() -> None:
    outbox = RecordingOutbox()
    reports = reports_for(outbox, poll_s=3600.0, park_after_s=3600.0)
    reports.add(3, 7, wait_s=0.0, compute_s=0.0)
    reports.close()
    assert outbox.sent == [(3, 7)]
    assert not reports._pump.is_alive()
    reports.close()  # idempotent
