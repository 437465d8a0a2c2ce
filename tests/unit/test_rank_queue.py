"""RankQueue: what a rank's stream may send now (prefetch window, consecutive steps batched,
markers alone), cumulative delivery and re-sending after a reconnect."""

from __future__ import annotations

from odbd.daemon.node_state import Location
from odbd.serve.rank_queue import QueuedItem, RankQueue


def step(epoch: int, index: int) -> QueuedItem:
    return QueuedItem(
        epoch, index, event=f"step {epoch}/{index}", locations=[Location(0, index, 8)]
    )


def marker(epoch: int) -> QueuedItem:
    return QueuedItem(epoch, -1, event=f"end {epoch}")


def keys(items: list[QueuedItem]) -> list[tuple[int, int]]:
    return [(i.epoch, i.step) for i in items]


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


def test_take_ready_steps_takes_consecutive_steps_up_to_the_window_and_limit() -> None:
    queue = RankQueue(rank=0)
    queue.push([*(step(0, s) for s in range(6)), marker(0), step(1, 0)])
    assert keys(queue.take_ready_steps(prefetch=4, limit=2)) == [(0, 0), (0, 1)]
    assert keys(queue.take_ready_steps(prefetch=4, limit=8)) == [(0, 2), (0, 3)]  # window full
    queue.deliver(0, 3)
    assert keys(queue.take_ready_steps(prefetch=4, limit=8)) == [(0, 4), (0, 5)]  # not the marker
    assert queue.take_ready_steps(prefetch=4, limit=8) == []
    end = queue.take_ready(prefetch=4)
    assert end is not None and not end.is_step
    assert keys(queue.take_ready_steps(prefetch=4, limit=8)) == [(1, 0)]


def test_delivery_is_cumulative_and_drops_markers_before_it() -> None:
    queue = RankQueue(rank=0)
    queue.push([step(0, 0), step(0, 1), marker(0), step(1, 0), step(1, 1)])
    assert len(queue.take_ready_steps(prefetch=8, limit=8)) == 2
    queue.take_ready(prefetch=8)
    assert len(queue.take_ready_steps(prefetch=8, limit=8)) == 2
    freed = queue.deliver(1, 0)  # one report covering three steps across an epoch end
    assert freed == [Location(0, 0, 8), Location(0, 1, 8), Location(0, 0, 8)]
    assert queue.delivered_steps == 3 and queue.first_undelivered() == (1, 1)


def test_a_reconnect_is_sent_every_undelivered_step_again() -> None:
    queue = RankQueue(rank=0)
    queue.push([step(0, s) for s in range(3)])
    assert len(queue.take_ready_steps(prefetch=8, limit=8)) == 3
    queue.deliver(0, 0)
    queue.rewind()
    assert keys(queue.take_ready_steps(prefetch=8, limit=8)) == [(0, 1), (0, 2)]
