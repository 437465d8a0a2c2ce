"""When a daemon may end its job (odbd.daemon.job_end): no fixed grace while a rank is
attached, an attach deadline for absent ranks, and a stop that waits only for attached ones."""

from __future__ import annotations

import pytest

from odbd.daemon.job_end import (
    Outcome,
    RankPresence,
    dropped_summary,
    end_verdict,
    overdue_ranks,
    presences,
)
from odbd.serve.rank_queue import QueuedItem, RankQueue

TIMEOUT_S = 60.0


def rank(
    r: int,
    *,
    attached: bool = False,
    took: bool = False,
    absent_s: float = 0.0,
    ever: bool = True,
    steps: int = 0,
) -> RankPresence:
    return RankPresence(
        rank=r,
        attached=attached,
        took_job_end=took,
        absent_s=0.0 if attached else absent_s,
        ever_attached=ever or attached,
        undelivered_steps=steps,
        first_undelivered=(1, 40) if steps else None,
    )


@pytest.mark.parametrize("steps", [1, 125])
def test_an_attached_rank_is_waited_for_however_long_its_steps_take(steps: int) -> None:
    # The old daemon gave up 60 s after the last round; an attached rank has no deadline now.
    ranks = [rank(0, took=True), rank(1, attached=True, steps=steps)]
    verdict = end_verdict(ranks, attach_timeout_s=TIMEOUT_S)
    assert verdict.outcome is Outcome.WAIT
    assert "rank 1" in verdict.reason and "attached" in verdict.reason


def test_the_job_ends_once_every_rank_took_its_end() -> None:
    verdict = end_verdict([rank(0, took=True), rank(1, took=True)], attach_timeout_s=TIMEOUT_S)
    assert verdict.outcome is Outcome.DONE and verdict.dropped == ()


def test_a_rank_that_left_after_taking_every_step_is_not_waited_for() -> None:
    ranks = [rank(0, took=True), rank(1, absent_s=10 * TIMEOUT_S, steps=0)]
    assert end_verdict(ranks, attach_timeout_s=TIMEOUT_S).outcome is Outcome.DONE


@pytest.mark.parametrize(
    ("absent", "outcome"),
    [(TIMEOUT_S - 1, Outcome.WAIT), (TIMEOUT_S, Outcome.FAIL), (10 * TIMEOUT_S, Outcome.FAIL)],
)
def test_a_rank_that_never_attached_fails_the_job_at_the_attach_deadline(
    absent: float, outcome: Outcome
) -> None:
    ranks = [rank(0, took=True), rank(1, ever=False, absent_s=absent, steps=12)]
    verdict = end_verdict(ranks, attach_timeout_s=TIMEOUT_S)
    assert verdict.outcome is outcome
    if outcome is Outcome.FAIL:
        assert "rank 1 never attached within --attach-timeout 60 s" in verdict.reason
        assert "12 steps undelivered" in verdict.reason
        assert [r.rank for r in verdict.dropped] == [1]


def test_a_rank_that_detached_with_steps_owed_fails_the_job_counted_from_its_detach() -> None:
    ranks = [rank(0, attached=True, steps=3), rank(1, absent_s=TIMEOUT_S + 1, steps=7)]
    verdict = end_verdict(ranks, attach_timeout_s=TIMEOUT_S)
    assert verdict.outcome is Outcome.FAIL
    assert "rank 1 detached and did not come back" in verdict.reason
    waiting = end_verdict(
        [rank(0, attached=True, steps=3), rank(1, absent_s=TIMEOUT_S - 1, steps=7)],
        attach_timeout_s=TIMEOUT_S,
    )
    assert waiting.outcome is Outcome.WAIT


def test_overdue_ranks_during_the_rounds_include_a_detached_rank_with_nothing_queued() -> None:
    # While rounds run, a rank owes the steps not yet planned: its queue being empty is no excuse.
    ranks = [rank(0, attached=True), rank(1, absent_s=TIMEOUT_S, steps=0)]
    assert [r.rank for r in overdue_ranks(ranks, TIMEOUT_S)] == [1]


def test_a_stop_with_nothing_attached_ends_at_once_and_names_what_it_drops() -> None:
    ranks = [rank(0, ever=False, absent_s=1, steps=30), rank(1, ever=False, absent_s=1, steps=30)]
    verdict = end_verdict(ranks, attach_timeout_s=TIMEOUT_S, stopping=True)
    assert verdict.outcome is Outcome.STOP
    summary = dropped_summary(verdict.dropped)
    assert summary.startswith("60 steps undelivered: rank 0: 30 steps from epoch 1 step 40")
    assert "never attached" in summary


def test_a_stop_waits_for_attached_ranks_until_its_deadline() -> None:
    ranks = [rank(0, attached=True, steps=4), rank(1, ever=False, absent_s=1, steps=4)]
    waiting = end_verdict(ranks, attach_timeout_s=TIMEOUT_S, stopping=True)
    assert waiting.outcome is Outcome.WAIT and "rank 0" in waiting.reason
    assert "rank 1" not in waiting.reason  # nobody can take a detached rank's steps
    over = end_verdict(ranks, attach_timeout_s=TIMEOUT_S, stopping=True, stop_overdue=True)
    assert over.outcome is Outcome.STOP
    assert dropped_summary(over.dropped).startswith("8 steps undelivered")


def test_a_stop_that_dropped_nothing_has_an_empty_summary() -> None:
    verdict = end_verdict([rank(0, absent_s=1, ever=False)], attach_timeout_s=1, stopping=True)
    assert verdict.outcome is Outcome.STOP and dropped_summary(verdict.dropped) == ""


def test_presences_count_absence_from_the_detach_or_from_the_daemon_being_ready() -> None:
    now = [100.0]
    fresh, left = RankQueue(0, clock=lambda: now[0]), RankQueue(1, clock=lambda: now[0])
    left.push([QueuedItem(0, 0, event="step")])
    left.attached = True
    now[0] = 130.0
    left.attached = False
    now[0] = 150.0
    by_rank = {p.rank: p for p in presences([fresh, left], ready_s=90.0, now_s=now[0])}
    assert (by_rank[0].absent_s, by_rank[0].ever_attached) == (60.0, False)
    assert (by_rank[1].absent_s, by_rank[1].undelivered_steps) == (20.0, 1)
