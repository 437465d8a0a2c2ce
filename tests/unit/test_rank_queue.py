"""RankQueue and the Train stream's batching: what a rank's stream may send now (prefetch
window, consecutive steps in one message within its limits, markers alone), cumulative
delivery and re-sending after a reconnect."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.daemon.locations import Location
from odbd.serve.rank_queue import QueuedItem, RankQueue
from odbd.serve.trainer_service import (
    MAX_EVENT_BYTES,
    MAX_STEPS_PER_EVENT,
    _ready_steps,
    _steps_event,
)


def step(epoch: int, index: int) -> QueuedItem:
    return QueuedItem(
        epoch, index, event=f"step {epoch}/{index}", locations=[Location(0, index, 8)]
    )


def marker(epoch: int) -> QueuedItem:
    return QueuedItem(epoch, -1, event=f"end {epoch}")


def keys(items: list[QueuedItem]) -> list[tuple[int, int]]:
    return [(i.epoch, i.step) for i in items]


def take_ready_step(queue: RankQueue, prefetch: int) -> QueuedItem | None:
    """take_ready, but only a step (a marker waits for a message of its own): the step-by-step
    reference that RankQueue.take_ready_steps replaced in the daemon."""
    if queue._sent < len(queue._items) and queue._items[queue._sent].is_step:
        return queue.take_ready(prefetch)
    return None


def ready_steps(queue: RankQueue, prefetch: int) -> list[QueuedItem]:
    taken = []
    while (item := take_ready_step(queue, prefetch)) is not None:
        taken.append(item)
    return taken


def test_take_ready_stops_at_the_prefetch_window_until_a_delivery() -> None:
    queue = RankQueue(rank=0)
    queue.push([step(0, s) for s in range(5)])
    first, second = queue.take_ready(2), queue.take_ready(2)
    assert first is not None and second is not None
    assert keys([first, second]) == [(0, 0), (0, 1)]
    assert queue.take_ready(2) is None
    assert queue.deliver(0, 0) == [Location(0, 0, 8)]
    third = queue.take_ready(2)
    assert third is not None and (third.epoch, third.step) == (0, 2)


def test_take_ready_step_takes_steps_up_to_the_window_but_never_a_marker() -> None:
    queue = RankQueue(rank=0)
    queue.push([*(step(0, s) for s in range(6)), marker(0), step(1, 0)])
    assert keys(ready_steps(queue, prefetch=4)) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    queue.deliver(0, 3)
    assert keys(ready_steps(queue, prefetch=4)) == [(0, 4), (0, 5)]  # not the marker
    end = queue.take_ready(prefetch=4)
    assert end is not None and not end.is_step
    assert keys(ready_steps(queue, prefetch=4)) == [(1, 0)]


def test_delivery_is_cumulative_and_drops_markers_before_it() -> None:
    queue = RankQueue(rank=0)
    queue.push([step(0, 0), step(0, 1), marker(0), step(1, 0), step(1, 1)])
    assert len(ready_steps(queue, prefetch=8)) == 2
    queue.take_ready(prefetch=8)
    assert len(ready_steps(queue, prefetch=8)) == 2
    freed = queue.deliver(1, 0)  # one report covering three steps across an epoch end
    assert freed == [Location(0, 0, 8), Location(0, 1, 8), Location(0, 0, 8)]
    assert queue.delivered_steps == 3 and queue.first_undelivered() == (1, 1)


def test_a_reconnect_is_sent_every_undelivered_step_again() -> None:
    queue = RankQueue(rank=0)
    queue.push([step(0, s) for s in range(3)])
    assert len(ready_steps(queue, prefetch=8)) == 3
    queue.deliver(0, 0)
    queue.rewind()
    assert keys(ready_steps(queue, prefetch=8)) == [(0, 1), (0, 2)]


def test_a_message_of_steps_stays_within_its_step_and_byte_limits() -> None:
    def planned(index: int, sample_bytes: int) -> QueuedItem:
        batch = trainer_pb2.StepBatch(epoch=0, step=index, sample_ids=bytes(sample_bytes))
        return QueuedItem(0, index, event=batch.SerializeToString())

    queue = RankQueue(rank=0)
    queue.push([planned(s, 400_000) for s in range(5)])
    first = queue.take_ready(prefetch=64)
    assert first is not None
    steps = _ready_steps(queue, 64, first=first)
    assert keys(steps) == [(0, 0), (0, 1), (0, 2)]  # stops once past MAX_EVENT_BYTES
    assert sum(len(s.event) for s in steps[:-1]) < MAX_EVENT_BYTES
    assert len(_steps_event(steps)) < 4 << 20  # the client's limit

    small = RankQueue(rank=0)
    small.push([planned(s, 8) for s in range(MAX_STEPS_PER_EVENT + 5)])
    first = small.take_ready(prefetch=64)
    assert first is not None
    assert len(_ready_steps(small, 64, first=first)) == MAX_STEPS_PER_EVENT


def job_end(epoch: int, *, failed: bool = False) -> QueuedItem:
    end = trainer_pb2.JobEnd(reason="all epochs done", failed=failed)
    return QueuedItem(epoch, -1, event=trainer_pb2.TrainerEvent(job_end=end))


def send_all(queue: RankQueue) -> list[QueuedItem]:
    sent = []
    while (item := queue.take_ready(prefetch=64)) is not None:
        sent.append(item)
    return sent


def test_a_rank_took_the_job_end_once_its_stream_closes_after_it_with_every_step_delivered() -> (
    None
):
    queue = RankQueue(rank=0)
    queue.push([step(0, 0), step(0, 1), marker(0), job_end(0)])
    queue.attached = True
    send_all(queue)
    queue.deliver(0, 1)
    assert not queue.finished()  # a successful end: the trainer closes its stream itself
    assert not queue.took_job_end  # still attached
    queue.attached = False
    assert queue.took_job_end


def test_a_stream_that_ends_with_steps_undelivered_has_not_taken_the_job_end() -> None:
    queue = RankQueue(rank=0)
    queue.push([step(0, 0), step(0, 1), job_end(0)])
    queue.attached = True
    send_all(queue)
    queue.deliver(0, 0)
    queue.attached = False  # e.g. the trainer broke out of its loop and closed the client
    queue.rewind()
    assert not queue.took_job_end and queue.detached_at_s is not None
    queue.attached = True  # it comes back: step 1 and the job's end are sent again
    assert [i.step for i in send_all(queue)] == [1, -1]
    queue.deliver(0, 1)
    queue.attached = False
    assert queue.took_job_end


def test_a_failed_job_end_finishes_the_stream_as_soon_as_it_is_sent() -> None:
    queue = RankQueue(rank=0)
    queue.push([step(0, 0), step(0, 1)])
    queue.attached = True
    send_all(queue)
    queue.fail_job(job_end(0, failed=True))
    assert not queue.finished()
    assert send_all(queue)[-1].job_end is not None
    assert queue.finished()  # the prefetched steps will not run: no delivery is awaited


def test_fail_job_replaces_an_unsent_successful_job_end() -> None:
    queue = RankQueue(rank=0)
    queue.push([step(0, 0), job_end(0)])
    queue.fail_job(job_end(0, failed=True))
    ends = [i.job_end for i in send_all(queue) if i.job_end is not None]
    assert [e.failed for e in ends] == [True]


def test_the_job_end_stays_queued_after_delivery_for_a_client_that_connects_later() -> None:
    queue = RankQueue(rank=0)
    queue.push([step(0, 0), job_end(0)])
    send_all(queue)
    queue.deliver(0, 0)
    queue.rewind()
    again = send_all(queue)
    assert [i.job_end is not None for i in again] == [True]


def test_next_to_send_returns_none_once_a_failed_job_end_went_out_but_waits_after_success() -> None:
    async def scenario(failed: bool) -> bool:
        queue = RankQueue(rank=0)
        queue.push([step(0, 0), job_end(0, failed=failed)])
        first = await queue.next_to_send(prefetch=8)
        end = await queue.next_to_send(prefetch=8)
        assert first is not None and end is not None and end.job_end is not None
        queue.deliver(0, 0)
        waiting = asyncio.ensure_future(queue.next_to_send(prefetch=8))
        await asyncio.sleep(0.05)
        ended = waiting.done() and waiting.result() is None
        waiting.cancel()
        return ended

    assert asyncio.run(scenario(failed=True))
    assert not asyncio.run(scenario(failed=False))  # the trainer, not the daemon, closes it


def _recount(queue: RankQueue) -> tuple[int, int]:
    """(queued steps, sent steps awaiting Delivered), counted from the items themselves."""
    items = list(queue._items)
    return sum(i.is_step for i in items), sum(i.is_step for i in items[: queue._sent])


def test_step_counts_kept_by_the_queue_match_a_recount_after_every_operation() -> None:
    queue, rng, next_step = RankQueue(0), random.Random(5), 0
    for _ in range(2000):
        op = rng.choice(["push", "push", "take", "take", "deliver", "rewind", "drop", "skip"])
        if op == "push":
            items = [step(0, next_step + i) for i in range(rng.randint(1, 4))]
            next_step += len(items)
            queue.push(items + ([marker(0)] if rng.random() < 0.1 else []))
        elif op == "take":
            queue.take_ready(prefetch=rng.randint(1, 6))
        elif op == "deliver" and queue._sent:
            sent = [i for i in list(queue._items)[: queue._sent] if i.is_step]
            if sent:
                last = rng.choice(sent)
                queue.deliver(last.epoch, last.step)
        elif op == "rewind":
            queue.rewind()
        elif op == "drop":
            queue.drop_unsent()
        elif op == "skip" and rng.random() < 0.2:
            queue.skip_before(0, next_step - rng.randint(0, 5))
        num_steps, sent_steps = _recount(queue)
        assert queue.queued_steps() == num_steps
        assert queue._sent_steps == sent_steps


@pytest.mark.parametrize("num_steps", [1, 2, 5])
@pytest.mark.parametrize("sample_bytes", [0, 100, 20_000])  # lengths of 1, 2 and 3 varint bytes
def test_a_steps_event_joined_from_serialized_steps_is_the_event_protobuf_builds(
    num_steps: int, sample_bytes: int
) -> None:
    batches = [
        trainer_pb2.StepBatch(
            epoch=1, step=s, loss_scale=0.25, sample_ids=bytes(sample_bytes),
            progress=trainer_pb2.Progress(epoch_steps_estimate=9, epoch_sample_fraction=0.5),
        )
        for s in range(num_steps)
    ]  # fmt: skip
    items = [QueuedItem(1, s, event=b.SerializeToString()) for s, b in enumerate(batches)]
    expected = (
        trainer_pb2.TrainerEvent(step=batches[0])
        if num_steps == 1
        else trainer_pb2.TrainerEvent(steps=trainer_pb2.StepBatches(steps=batches))
    )
    assert trainer_pb2.TrainerEvent.FromString(_steps_event(items)) == expected
    assert _steps_event(items) == expected.SerializeToString()


def test_a_resume_past_every_step_skips_to_the_job_end_but_keeps_it() -> None:
    """Ranks restarted without a state_dict may agree on the job's end (odbclient.trainer.align):
    the steps and epoch ends before it are skipped, the end itself is still sent."""
    queue = RankQueue(rank=0)
    queue.push([step(0, 0), step(0, 1), marker(0), step(1, 0), marker(1), job_end(1)])
    freed = queue.skip_before(2**32 - 1, 0)
    assert freed == [Location(0, 0, 8), Location(0, 1, 8), Location(0, 0, 8)]
    assert [i.job_end is not None for i in send_all(queue)] == [True]


def test_a_resume_at_an_epochs_end_skips_its_steps_and_keeps_its_end() -> None:
    queue = RankQueue(rank=0)
    queue.push([step(0, 0), step(0, 1), marker(0), step(1, 0)])
    queue.skip_before(0, 2**63 - 1)
    assert keys(send_all(queue)) == [(0, -1), (1, 0)]


def _ready_steps_one_by_one(queue: RankQueue, prefetch: int, first: QueuedItem) -> list[QueuedItem]:
    """_ready_steps as it was: take_ready_step until a limit (the reference)."""
    steps, nbytes = [first], len(first.event)
    while len(steps) < MAX_STEPS_PER_EVENT and nbytes < MAX_EVENT_BYTES:
        item = take_ready_step(queue, prefetch)
        if item is None:
            break
        steps.append(item)
        nbytes += len(item.event)
    return steps


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.one_of(st.none(), st.integers(1, MAX_EVENT_BYTES // 3)), max_size=60),
    prefetch=st.integers(0, 50),
    reports=st.lists(st.integers(0, 60), max_size=6),
)
@example(sizes=[MAX_EVENT_BYTES // 4] * 6, prefetch=50, reports=[])  # exactly the byte limit
def test_ready_steps_takes_what_take_ready_step_would(
    sizes: list[int | None], prefetch: int, reports: list[int]
) -> None:
    """Steps of any size (None: a marker), any prefetch window and deliveries between
    messages: the same messages, and the queue left in the same state, as step by step."""

    def queue_of() -> RankQueue:
        queue = RankQueue(rank=0)
        queue.push([
            marker(0) if size is None else QueuedItem(0, i, event=b"x" * size)
            for i, size in enumerate(sizes)
        ])  # fmt: skip
        return queue

    async def messages(batch: bool) -> list[list[tuple[int, int]]]:
        queue, out = queue_of(), []
        for upto in [*reports, len(sizes)]:
            while (first := queue.take_ready(prefetch)) is not None:
                if first.is_step:
                    taken = (
                        _ready_steps(queue, prefetch, first=first)
                        if batch
                        else _ready_steps_one_by_one(queue, prefetch, first)
                    )
                    out.append(keys(taken))
                else:
                    out.append(keys([first]))
            queue.deliver(0, upto)
            out.append([(queue.queued_steps(), queue.delivered_steps)])
        return out

    assert asyncio.run(messages(True)) == asyncio.run(messages(False))
