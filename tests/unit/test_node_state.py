"""NodeState: leasing runs one buffer ahead of the round, a round takes one buffer, and a unit
is dry only once nothing is left for a later round; stale commits are freed, not buffered;
the node's lanes count as full once every producer holding leases waits for lane space."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np

from odbclient.wire.odbd.v1 import ingest_pb2
from odbd.config import DaemonConfig
from odbd.daemon.locations import Locations
from odbd.daemon.node_layout import RUN_AHEAD_BUFFERS
from odbd.daemon.node_state import NodeState
from odbd.ingest.arena import Arena
from odbd.ingest.lanes import Lanes
from odbd.ingest.service import IngestService, ProducerSession
from odbd.world import World

BUFFER = 4


def make_state(dataset_size: int = 64) -> NodeState:
    config = DaemonConfig(
        world=World(1, 1), buffer=BUFFER, token_budget=64, dataset_size=dataset_size
    )
    return NodeState(config, dataset_size)


def commit_all(state: NodeState, producer: int, keys: np.ndarray) -> int:
    n = len(keys)
    locations = Locations.in_lane(0, 64 * np.arange(n), np.full(n, 8))
    ones = np.ones(n, dtype=np.int64)
    outcome = state.commit(producer, keys, locations, ones * 3, ones * 3, ones)
    assert outcome.rejections == [] and not outcome.stale.any()
    return outcome.num_accepted


def test_producers_lease_up_to_the_run_ahead_buffers_and_no_more() -> None:
    state = make_state()
    keys = state.lease(producer=0, count=1000, deadline=10.0)
    assert len(keys) == RUN_AHEAD_BUFFERS * BUFFER
    assert len(state.lease(producer=0, count=1000, deadline=10.0)) == 0  # no room left


def test_a_round_takes_one_buffer_in_view_order_and_leaves_the_rest() -> None:
    state = make_state()
    keys = state.lease(producer=0, count=1000, deadline=10.0)
    assert commit_all(state, 0, keys[::-1].copy()) == len(keys)  # committed out of order
    assert state.units_ready()
    [offer] = state.offers()
    assert offer.samples.views.tolist() == sorted(keys.tolist())[:BUFFER]
    assert not offer.dry  # the rest is still buffered
    assert state.buffered_now() == len(keys) - BUFFER
    # Room opened for one more buffer's worth of leases.
    assert len(state.lease(producer=0, count=1000, deadline=10.0)) == BUFFER


def test_a_unit_is_dry_only_when_its_leftovers_are_gone_too() -> None:
    state = make_state(dataset_size=2 * BUFFER)  # the whole epoch fits the run-ahead
    keys = state.lease(producer=0, count=1000, deadline=10.0)
    commit_all(state, 0, keys)
    first, second = state.offers()[0], state.offers()[0]
    assert (len(first.samples), first.dry) == (BUFFER, False)
    assert (len(second.samples), second.dry) == (BUFFER, True)


def test_a_commit_for_a_lease_another_producer_now_holds_is_freed_not_buffered() -> None:
    state = make_state()
    keys = state.lease(producer=0, count=2, deadline=10.0)
    state.release(state.leases_of(0))  # e.g. the lease expired
    again = state.lease(producer=1, count=2, deadline=10.0)
    assert sorted(again.tolist()) == sorted(keys.tolist())
    locations = Locations.in_lane(0, np.array([64, 128]), np.full(2, 8))
    ones = np.ones(2, dtype=np.int64)
    outcome = state.commit(0, keys, locations, ones * 3, ones * 3, ones)
    assert outcome.num_accepted == 0 and outcome.stale.tolist() == [True, True]
    assert state.buffered_now() == 0


def test_lanes_are_full_once_every_lease_holder_waits_for_lane_space() -> None:
    """IngestService.lanes_full: the round loop plans a short round on it (no I/O involved)."""
    state = make_state()
    service = IngestService(
        state=state,
        lanes=None,  # type: ignore[arg-type]  # lanes_full and give_back never touch them
        welcome=ingest_pb2.IngestWelcome(),
        lease_timeout_s=10.0,
        on_progress=lambda: None,
        on_rejected=lambda rejected: None,
        stats=None,  # type: ignore[arg-type]
    )
    for producer in (0, 1):
        service.sessions[producer] = ProducerSession(
            producer=producer,
            name=f"p{producer}",
            lane=None,  # type: ignore[arg-type]
            outbox=asyncio.Queue(),
        )
        state.lease(producer=producer, count=2, deadline=10.0)
    assert not service.lanes_full()
    service.sessions[0].lane_full = True
    assert not service.lanes_full()  # producer 1 holds leases and can still commit
    service.sessions[1].lane_full = True
    assert service.lanes_full()
    service.give_back({1: np.array([0])})  # a FreeBatch may make room: producer 1 says again if not
    assert not service.sessions[1].lane_full and not service.lanes_full()
    state.release(state.leases_of(1))  # producer 1 holds nothing: only producer 0 matters
    assert service.lanes_full()


def _service(state: NodeState, rejected: list) -> IngestService:
    return IngestService(
        state=state,
        lanes=None,  # type: ignore[arg-type]  # leases and rejections never touch lanes
        welcome=ingest_pb2.IngestWelcome(),
        lease_timeout_s=10.0,
        on_progress=lambda: None,
        on_rejected=rejected.append,
        stats=None,  # type: ignore[arg-type]
    )


def test_rejected_ids_leave_the_lease_budget_and_more_ids_are_granted() -> None:
    """Issue 11: with every sample rejected the reject branch granted nothing more, so a
    producer with credit left waited forever while the round loop waited for samples."""
    state, rejected = make_state(), []
    service = _service(state, rejected)
    session = ProducerSession(0, "p0", None, asyncio.Queue())  # type: ignore[arg-type]
    service.sessions[0] = session

    def grant() -> list[int]:
        message = session.outbox.get_nowait()
        return np.frombuffer(message.lease.view_keys, "<i8").tolist()

    async def producer() -> None:  # pump_leases reads the running loop's clock
        lease = ingest_pb2.ProducerMessage(lease=ingest_pb2.LeaseRequest(count=100))
        service.on_message(session, lease)
        first = grant()
        assert len(first) == RUN_AHEAD_BUFFERS * BUFFER  # the lease budget, not the credit
        rows = [
            ingest_pb2.Rejection(view_key=k, reason="not_a_dict", detail="a tuple") for k in first
        ]
        reject = ingest_pb2.ProducerMessage(reject=ingest_pb2.RejectBatch(rejections=rows))
        service.on_message(session, reject)

    asyncio.run(producer())
    assert len(rejected) == RUN_AHEAD_BUFFERS * BUFFER
    assert len(grant()) == RUN_AHEAD_BUFFERS * BUFFER  # granted again from the credit left
    assert state.first_rejection == {"not_a_dict": f"sample {rejected[0].identity}: a tuple"}


def test_an_id_in_flight_at_two_producer_deaths_is_quarantined_one_death_re_leases() -> None:
    state = make_state()
    key = int(state.lease(producer=0, count=1, deadline=10.0)[0])
    assert state.producer_died(0, key, "worker-0") == (1, None)  # maybe an operator's SIGKILL
    state.release(state.leases_of(0))
    assert int(state.lease(producer=1, count=1, deadline=10.0)[0]) == key  # re-leased first
    assert state.producer_died(0, key, "worker-0") == (0, None)  # a stale mark: not its lease
    deaths, quarantined = state.producer_died(1, key, "worker-1")
    assert deaths == 2 and quarantined is not None
    assert quarantined.reason == "producer_crash" and "worker-1" in quarantined.detail
    assert len(state.leases) == 0 and state.take_rejected_delta() == {"producer_crash": 1}
    assert state.ledger_counts()["rejected"] == 1


def test_a_lane_header_is_idle_when_opened_and_read_back_by_the_daemon() -> None:
    arena = Arena.create(f"t{uuid.uuid4().hex[:8]}", 0, 1 << 16)
    try:
        lanes = Lanes(arena, 4096)
        first = lanes.open(producer=0)
        assert first is not None and lanes.in_flight(first.lane_id) is None
        with arena.view(first.allocation) as lane:
            lane[:8] = np.int64(41).tobytes()  # what a producer writes before dataset[i]
        assert lanes.in_flight(first.lane_id) == 41
        lanes.orphan(first.lane_id)  # no live samples: back to the arena
        second = lanes.open(producer=1)  # the same bytes, reused
        assert second is not None and second.allocation.offset == first.allocation.offset
        assert lanes.in_flight(second.lane_id) is None
    finally:
        arena.close()
