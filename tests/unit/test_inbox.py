"""odbclient.trainer.inbox: items in order, visible without a ring, a waiting taker woken by a ring,
never a lost wake-up (issue 15: the reader rings about twice per recv, not once per step)."""

from __future__ import annotations

import queue
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odbclient.trainer.inbox import Inbox


def wait_until_waiting(inbox: Inbox) -> None:
    """Until a taker thread has found the inbox empty (it then waits for a ring)."""
    done = threading.Event()
    while not inbox._waiting:
        done.wait(0.001)


def test_items_come_out_in_order_without_a_ring() -> None:
    inbox = Inbox()
    for i in range(5):
        inbox.add(i)
    assert len(inbox) == 5
    assert [inbox.take(0.0) for _ in range(5)] == [0, 1, 2, 3, 4]
    assert len(inbox) == 0


def test_an_empty_inbox_times_out_with_queue_empty() -> None:
    with pytest.raises(queue.Empty):
        Inbox().take(0.01)


def test_a_ring_wakes_the_waiting_taker() -> None:
    inbox, got = Inbox(), []
    taker = threading.Thread(target=lambda: got.append(inbox.take(30.0)))
    taker.start()
    wait_until_waiting(inbox)
    inbox.add("batch")
    inbox.ring()
    taker.join(30.0)
    assert got == ["batch"] and not inbox._waiting


def test_a_stale_ring_does_not_end_a_later_wait_early() -> None:
    inbox = Inbox()
    inbox._waiting = True
    inbox.ring()  # a token for a taker that has since found its item without waiting
    with pytest.raises(queue.Empty):
        inbox.take(0.01)
    inbox.put("late")
    assert inbox.take(0.01) == "late"


def test_clear_drops_what_is_queued() -> None:
    inbox = Inbox()
    inbox.add(1)
    inbox.clear()
    inbox.put("closed")
    assert inbox.take(0.0) == "closed" and len(inbox) == 0


@settings(deadline=None, max_examples=40)
@given(rings=st.lists(st.booleans(), min_size=1, max_size=60))
def test_every_item_reaches_a_taker_that_waits_between_them(rings: list[bool]) -> None:
    """The reader adds items and rings after some of them and always after the last (as
    stream.py does per recv); the taker, taking as fast as it can, gets every item in order
    and never waits for one out its whole timeout (a lost wake-up would)."""
    inbox, got = Inbox(), []

    def take_all() -> None:
        for _ in rings:
            got.append(inbox.take(30.0))

    taker = threading.Thread(target=take_all)
    taker.start()
    for i, ring in enumerate(rings):
        inbox.add(i)
        if ring:
            inbox.ring()
    inbox.ring()
    taker.join(60.0)
    assert got == list(range(len(rings)))
