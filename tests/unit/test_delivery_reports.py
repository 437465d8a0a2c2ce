"""DeliveryReports: next() queues Delivered reports; flush(), flush_due() (the reader thread,
once the oldest is poll_s old) and close() send each batch of them as one report covering
consecutive steps, in order, through the stream's send."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from odbclient.trainer.reports import DeliveryReports


class RecordingSend:
    """Records each Delivered as (epoch, last step, steps covered, wait_s, compute_s)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, int, float, float]] = []
        self.messages: list[Any] = []

    def __call__(self, message: Any) -> None:
        d = message.delivered
        self.messages.append(d)
        self.sent.append((d.epoch, d.step, d.steps, d.wait_s, d.compute_s))

    def steps(self) -> int:
        return sum(report[2] for report in self.sent)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_flush_sends_what_is_queued_as_one_report() -> None:
    send = RecordingSend()
    reports = DeliveryReports(send)
    assert reports.add(0, 0, wait_s=0.25, compute_s=1.0) == 1
    assert reports.add(0, 1, wait_s=0.5, compute_s=2.0) == 2
    assert send.sent == []
    reports.flush()
    assert send.sent == [(0, 1, 2, 0.75, 3.0)]
    reports.flush()  # nothing queued: nothing sent
    assert reports.add(1, 0, wait_s=0.0, compute_s=0.0) == 1
    reports.close()
    assert send.sent == [(0, 1, 2, 0.75, 3.0), (1, 0, 1, 0.0, 0.0)]


def test_the_reader_waits_until_the_oldest_report_is_due_then_flushes() -> None:
    clock, send = FakeClock(), RecordingSend()
    reports = DeliveryReports(send, poll_s=0.25, park_after_s=2.0, clock=clock)  # exact floats
    assert reports.poll_timeout_s() is None  # nothing ever added: wait for data alone
    reports.add(0, 0, wait_s=0.0, compute_s=0.0)
    clock.now_s += 0.125
    reports.add(0, 1, wait_s=0.0, compute_s=0.0)
    assert reports.poll_timeout_s() == 0.125  # until the oldest is poll_s old
    reports.flush_due()
    assert send.sent == []
    clock.now_s += 0.125
    assert reports.poll_timeout_s() == 0.0
    reports.flush_due()
    assert send.sent == [(0, 1, 2, 0.0, 0.0)]
    assert reports.poll_timeout_s() == 0.25  # reports flowed lately: one may come meanwhile
    clock.now_s += 2.0
    assert reports.poll_timeout_s() is None  # parked: a paused trainer costs no polling


@pytest.mark.timeout(30)
def test_flushes_from_two_threads_cover_every_step_once_in_order() -> None:
    send = RecordingSend()
    reports = DeliveryReports(send)
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
    last_steps = [report[1] for report in send.sent]
    assert last_steps == sorted(set(last_steps)) and last_steps[-1] == 1999
    assert send.steps() == 2000 and sum(report[3] for report in send.sent) == 2000.0
    # Each report covers exactly the steps after the previous one's last.
    starts = [0, *(s + 1 for s in last_steps[:-1])]
    assert [r[2] for r in send.sent] == [s - a + 1 for a, s in zip(starts, last_steps, strict=True)]


def test_close_sends_what_is_queued_and_nothing_after() -> None:
    send = RecordingSend()
    reports = DeliveryReports(send)
    reports.add(3, 7, wait_s=0.0, compute_s=0.0)
    reports.close()
    assert send.sent == [(3, 7, 1, 0.0, 0.0)]
    reports.add(3, 8, wait_s=0.0, compute_s=0.0)
    reports.flush()
    reports.close()  # idempotent
    assert send.sent == [(3, 7, 1, 0.0, 0.0)]


def test_measured_step_times_ride_along_with_the_next_report_only() -> None:
    send = RecordingSend()
    reports = DeliveryReports(send)
    reports.add(0, 0, wait_s=0.0, compute_s=0.0)
    reports.flush()
    reports.add_measured(0, 0, 0.125)
    reports.flush()  # no new step: a Delivered would count one, so nothing is sent
    assert len(send.messages) == 1
    reports.add(0, 1, wait_s=0.0, compute_s=0.125)
    reports.flush()
    assert list(send.messages[0].measured) == []
    last = send.messages[1]
    assert (last.step, last.steps) == (1, 1)
    assert [(m.epoch, m.step, m.compute_s) for m in last.measured] == [(0, 0, 0.125)]


def test_the_first_report_after_a_pause_wakes_the_parked_reader_once() -> None:
    clock, wakes = FakeClock(), []
    reports = DeliveryReports(
        RecordingSend(), poll_s=0.25, park_after_s=2.0, clock=clock, wake=lambda: wakes.append(1)
    )
    reports.add(0, 0, wait_s=0.0, compute_s=0.0)
    assert wakes == []  # the reader was never parked
    reports.flush()
    clock.now_s += 2.0
    assert reports.poll_timeout_s() is None  # parks
    reports.add(0, 1, wait_s=0.0, compute_s=0.0)
    reports.add(0, 2, wait_s=0.0, compute_s=0.0)
    assert wakes == [1]  # one wake, then the reader polls again
    assert reports.poll_timeout_s() == 0.25
