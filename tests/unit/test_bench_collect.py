"""tests/bench/test_bench_round.py `_collect`: a process that reported and exited 0 is not a
death (issue 25: 2 runs of 3 of `make bench-round` at 8 daemons failed on exactly that)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import pytest

from tests.bench.test_bench_round import _collect, _spawn

pytestmark = pytest.mark.timeout(120)


def report_after(delay_s: float, value: float, conn: Connection) -> None:
    time.sleep(delay_s)  # the other process has reported and exited by then
    conn.send(("latencies", [value]))


def die_silently(conn: Connection) -> None:
    conn.close()


def test_a_process_that_reported_and_exited_is_not_taken_for_a_death():
    # The fast one reports and exits 0 while the slow one still works (as the hub of an 8-daemon
    # run finishes before its spokes): before the fix its pipe's end-of-file raised "died".
    spawned = [_spawn(report_after, (0.0, 1.0)), _spawn(report_after, (1.5, 2.0))]
    samples = _collect([p for p, _ in spawned], [c for _, c in spawned], 2)
    assert sorted(samples) == [1.0, 2.0]


def test_a_process_that_exits_before_reporting_is_a_death():
    spawned = [_spawn(die_silently, ()), _spawn(report_after, (30.0, 2.0))]
    with pytest.raises(AssertionError, match="died before reporting"):
        _collect([p for p, _ in spawned], [c for _, c in spawned], 2)
    assert all(not p.is_alive() for p, _ in spawned)  # the survivor was killed, not left behind
