"""Rewinds on a running daemon (odbd.daemon.rewind): which resume points are served, refused or
skipped to; the history a rank queue keeps; a rewind that puts the same steps back with their
samples at new locations, and one dropped when its trainer leaves first."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.daemon.locations import Locations
from odbd.daemon.remake import REMAKE_ATTEMPTS, Rewinder
from odbd.daemon.rewind import StepHistory, Verdict, decide_resume, fresh_node_failure
from odbd.daemon.trained import StepCounts
from odbd.serve.rank_queue import QueuedItem, RankQueue


def decide(resume, *, last=None, floor=(0, 0), sent=True, journal=False, limit=100):
    return decide_resume(
        rank=1, node=3, resume=resume, last_delivered=last, floor=floor, ever_sent=sent,
        from_journal=journal, history_steps=limit,
    )  # fmt: skip


def test_a_resume_point_inside_the_history_is_a_rewind_and_after_it_continues() -> None:
    assert decide((0, 5), last=(0, 9)).verdict is Verdict.REWIND
    assert decide((0, 9), last=(0, 9)).verdict is Verdict.REWIND
    assert decide((0, 10), last=(0, 9)).verdict is Verdict.CONTINUE
    assert decide((1, 0), last=(0, 9)).verdict is Verdict.CONTINUE
    # the previous epoch, still in the history
    assert decide((0, 3), last=(1, 4)).verdict is Verdict.REWIND


def test_a_resume_point_older_than_the_history_is_refused_naming_the_bound() -> None:
    decision = decide((0, 2), last=(0, 9), floor=(0, 5), limit=4)
    assert decision.verdict is Verdict.REFUSE
    assert "node 3" in decision.reason and "--rewind-steps" in decision.reason
    assert "epoch 0 step 5" in decision.reason and "Nothing was trained" in decision.reason


def test_a_daemon_started_afresh_refuses_a_checkpoints_resume_point_naming_state_dir() -> None:
    decision = decide((0, 15), sent=False)
    assert decision.verdict is Verdict.REFUSE
    assert "node 3" in decision.reason and "without --state-dir" in decision.reason
    assert "rank 1" in decision.reason
    # the job's first step is no resume point to refuse; a journal restart checks it itself
    assert decide((0, 0), sent=False).verdict is Verdict.CONTINUE
    assert decide((0, 15), sent=False, journal=True).verdict is Verdict.CONTINUE
    # before the point a journal restart resumed at: not this daemon's to send
    refused = decide((0, 12), sent=False, journal=True, floor=(0, 15))
    assert refused.verdict is Verdict.REFUSE and "--state-dir journal" in refused.reason


def test_history_keeps_the_last_steps_and_its_floor_follows_what_it_dropped() -> None:
    history = StepHistory(limit=3)
    for s in range(3):
        history.add(0, s, f"0/{s}")
    history.add(0, -1, "end 0")
    assert history.floor == (0, 0) and history.num_steps == 3
    history.add(1, 0, "1/0")
    assert history.floor == (0, 1) and history.num_steps == 3
    history.add(1, 1, "1/1")
    history.add(1, 2, "1/2")  # drops 0/2 and then... the marker stays until a step goes
    assert history.floor == (0, 3)
    history.add(1, 3, "1/3")  # drops the marker and 1/0
    assert history.floor == (1, 1)
    taken = history.take_from((1, 2))
    assert [(e, s) for e, s, *_ in taken] == [(1, 2), (1, 3)]
    assert history.last_step() == (1, 1) and history.num_steps == 1
    history.put_back(taken)
    assert history.last_step() == (1, 3) and history.num_steps == 3


def test_take_from_the_next_epochs_first_step_leaves_the_epochs_end_behind() -> None:
    history = StepHistory(limit=10)
    for item in [(0, 0), (0, 1), (0, -1), (1, 0)]:
        history.add(*item, "x")
    assert [(e, s) for e, s, *_ in history.take_from((1, 0))] == [(1, 0)]
    assert [(e, s) for e, s, *_ in history.take_from((0, 1))] == [(0, 1), (0, -1)]


def batch(epoch: int, step: int, ids: list[int]) -> bytes:
    return trainer_pb2.StepBatch(
        epoch=epoch,
        step=step,
        num_samples=len(ids),
        sample_ids=np.asarray(ids, "<i8").tobytes(),
        segments=np.zeros(len(ids), "<u4").tobytes(),
        offsets=np.arange(len(ids), dtype="<u8").tobytes(),
        nbytes=np.full(len(ids), 64, "<u8").tobytes(),
    ).SerializeToString()


def make_rewinder(failures: list[str], freed: list) -> Rewinder:
    return Rewinder(
        node=0,
        resolve=lambda where: (np.full(len(where), 7), where.offsets + 1000),
        free=freed.extend,
        fail=failures.append,
    )


def delivered_queue(steps: list[tuple[int, int, list[int]]]) -> RankQueue:
    queue = RankQueue(0)
    items = [QueuedItem(e, s, batch(e, s, ids) if s >= 0 else "end", []) for e, s, ids in steps]
    queue.push(items)
    while queue.take_ready(100) is not None:
        pass
    last = [(e, s) for e, s, *_ in steps if s >= 0][-1]
    queue.deliver(*last)
    return queue


def test_a_rewind_sends_the_same_steps_again_with_the_samples_made_again() -> None:
    async def run() -> None:
        failures: list[str] = []
        rewinder = make_rewinder(failures, [])
        queue = delivered_queue([(0, 0, [5, 6]), (0, 1, [7]), (0, 2, []), (0, 3, [8, 5])])
        queue.push([QueuedItem(0, 4, batch(0, 4, [9]), [])])  # sent, not delivered
        queue.rewind()
        rewinder.start(queue, (0, 1))
        assert queue.gated and queue.take_ready(100) is None
        assert queue.last_delivered == (0, 0)
        keys, ids = rewinder.lease(producer=4, count=10, deadline=1e9)
        assert ids.tolist() == [7, 8, 5] and (keys < -1).all()
        where = Locations.in_lane(2, np.asarray([64, 128, 192]), np.asarray([64, 64, 64]))
        # a producer that holds no lease commits nothing
        assert not rewinder.commit(9, keys, where).any()
        assert rewinder.commit(4, keys, where).all()
        sent = []
        while (item := queue.take_ready(100)) is not None:
            sent.append(item)
        assert [(i.epoch, i.step) for i in sent] == [(0, 1), (0, 2), (0, 3), (0, 4)]
        again = trainer_pb2.StepBatch.FromString(sent[2].event)
        assert np.frombuffer(again.sample_ids, "<i8").tolist() == [8, 5]
        assert np.frombuffer(again.offsets, "<u8").tolist() == [1128, 1192]
        assert np.frombuffer(again.segments, "<u4").tolist() == [7, 7]
        assert (again.epoch, again.step, again.num_samples) == (0, 3, 2)
        assert [len(loc) for i in sent for loc in i.locations] == [1, 2]  # freed on delivery
        queue.deliver(0, 4)
        assert queue.history.last_step() == (0, 4) and queue.history.num_steps == 5
        assert not failures

    asyncio.run(run())


def test_a_rewind_whose_trainer_leaves_is_dropped_and_its_samples_freed() -> None:
    freed: list = []
    rewinder = make_rewinder([], freed)
    queue = delivered_queue([(0, 0, [1]), (0, 1, [2]), (0, 2, [3])])
    rewinder.start(queue, (0, 1))
    keys, _ = rewinder.lease(1, 1, 1e9)
    rewinder.commit(1, keys, Locations.in_lane(0, np.asarray([64]), np.asarray([64])))
    rewinder.cancel(0)
    assert not queue.gated and queue.last_delivered == (0, 2) and len(freed) == 1
    assert queue.history.num_steps == 3
    assert rewinder.lease(1, 5, 1e9)[0].size == 0  # nothing left to make
    # a late commit of a dropped re-make is stale: its bytes go back to the producer
    late = rewinder.commit(1, keys, Locations.in_lane(0, np.asarray([128]), np.asarray([64])))
    assert not late.any()


def test_a_sample_that_cannot_be_made_again_fails_the_job_after_retries() -> None:
    failures: list[str] = []
    rewinder = make_rewinder(failures, [])
    queue = delivered_queue([(0, 0, [1]), (0, 1, [42])])
    rewinder.start(queue, (0, 1))
    for _ in range(REMAKE_ATTEMPTS):
        keys, ids = rewinder.lease(3, 1, 1e9)
        assert ids.tolist() == [42]
        rewinder.reject(3, int(keys[0]), "boom")
    assert len(failures) == 1 and "sample 42" in failures[0] and "deterministic" in failures[0]


def test_expired_or_released_remake_leases_are_leased_again() -> None:
    rewinder = make_rewinder([], [])
    queue = delivered_queue([(0, 0, [1, 2])])
    rewinder.start(queue, (0, 0))
    keys, _ = rewinder.lease(3, 2, deadline=5.0)
    assert rewinder.expired(4.0) == [] and sorted(rewinder.expired(5.0)) == sorted(keys.tolist())
    rewinder.release(rewinder.leases_of(3))
    again, ids = rewinder.lease(4, 5, 1e9)
    assert sorted(again.tolist()) == sorted(keys.tolist()) and sorted(ids.tolist()) == [1, 2]


@pytest.mark.parametrize("limit", [0, 2])
def test_a_queue_keeps_at_most_its_history_bound(limit: int) -> None:
    queue = RankQueue(0, history_steps=limit)
    queue.push([QueuedItem(0, s, batch(0, s, [s]), []) for s in range(5)])
    while queue.take_ready(100) is not None:
        pass
    queue.deliver(0, 4)
    assert queue.history.num_steps == limit
    assert queue.history.floor == (0, 5 - limit)


def test_a_rewind_that_waits_for_lane_space_fails_the_job_naming_shm_size() -> None:
    failures: list[str] = []
    rewinder = make_rewinder(failures, [])
    queue = delivered_queue([(0, 0, [1]), (0, 1, [2])])
    rewinder.start(queue, (0, 0))
    rewinder.check_room(0.0, lanes_full=True, timeout_s=10)
    rewinder.check_room(5.0, lanes_full=False, timeout_s=10)  # a free came: the wait restarts
    rewinder.check_room(6.0, lanes_full=True, timeout_s=10)
    rewinder.check_room(15.0, lanes_full=True, timeout_s=10)
    assert not failures
    rewinder.check_room(16.0, lanes_full=True, timeout_s=10)
    assert len(failures) == 1 and "--shm-size" in failures[0] and "2 samples" in failures[0]


def test_a_mixed_restart_names_the_node_that_started_afresh_not_the_checkpoints() -> None:
    message = fresh_node_failure([1], {0: (0, 3), 1: None})
    assert message.startswith("node 1 started afresh, without a --state-dir journal")
    assert "node 0 resumes from its journal at epoch 0 step 3" in message
    assert "node 1 lost the job's state" in message


def test_the_history_keeps_each_steps_counts_for_the_trained_position() -> None:
    history = StepHistory(limit=10)
    for step, samples in enumerate([3, 5, 7]):
        history.add(0, step, b"", StepCounts(1, 1, 1, 1, samples, step == 2))
    history.add(0, -1, "end 0")
    history.add(1, 0, b"", StepCounts(1, 1, 1, 1, 11, False))
    taken = history.take_from((0, 2))
    assert [c.global_samples for *_, c in taken if c is not None] == [7, 11]
    assert history.epoch_global_samples(0) == 8 and history.epoch_global_samples(1) == 0
