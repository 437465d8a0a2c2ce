"""The daemon's per-sample state as columns: a CommitBatch is validated and booked with array
operations, with the row-by-row semantics (repeats, stale leases, rejections in row order),
and lanes resolve and free many samples at once."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from odbclient.producer.lane import LANE_HEADER_BYTES
from odbclient.wire.odbd.v1 import ingest_pb2
from odbd.config import DaemonConfig
from odbd.daemon.locations import Locations
from odbd.daemon.node_state import NodeState
from odbd.ingest.arena import Arena
from odbd.ingest.lanes import Lanes
from odbd.ingest.validate import MalformedMessage, decode_commit
from odbd.world import World


def make_state(dataset_size: int = 64, join: bool = True, nodes: int = 1) -> NodeState:
    peers = tuple(f"127.0.0.1:{9000 + n}" for n in range(nodes)) if nodes > 1 else ()
    config = DaemonConfig(
        world=World(nodes, 1), peers=peers, buffer=8, token_budget=64,
        dataset_size=dataset_size, join=join,
    )  # fmt: skip
    return NodeState(config, dataset_size)


def at(offsets: list[int]) -> Locations:
    return Locations.in_lane(0, np.asarray(offsets), np.full(len(offsets), 8))


def test_a_repeated_key_in_one_commit_is_buffered_once_and_its_repeat_freed() -> None:
    state = make_state()
    state.schema_hash = 1  # as chosen by the schema vote (test_schema_mismatch tests the vote)
    keys = state.lease(producer=0, count=2, deadline=10.0)
    twice = np.array([keys[0], keys[0], keys[1]])
    ones = np.ones(3, np.int64)
    outcome = state.commit(0, twice, at([64, 128, 192]), ones * 3, ones * 3, ones)
    assert outcome.accepted.tolist() == [True, False, True]
    assert outcome.stale.tolist() == [False, True, False]
    assert state.buffered_now() == 2 and len(state.leases) == 0
    assert state.locations_of(keys).offsets.tolist() == [64, 192]


def test_each_row_is_accepted_rejected_or_stale_and_rejections_keep_row_order() -> None:
    state = make_state()
    state.schema_hash = 7  # as chosen by the schema vote
    keys = state.lease(producer=0, count=5, deadline=10.0)
    other = state.lease(producer=1, count=1, deadline=10.0)
    rows = np.array([keys[0], keys[1], other[0], keys[2], keys[3]])
    lengths = np.array([4, 0, 4, 4, 4], np.int64)  # row 1: zero length
    hashes = np.array([7, 7, 7, 9, 7], np.int64)  # row 3: another schema than the job's
    outcome = state.commit(0, rows, at([64, 128, 192, 256, 320]), lengths, lengths, hashes)
    assert outcome.accepted.tolist() == [True, False, False, False, True]
    assert outcome.stale.tolist() == [False, False, True, False, False]
    reasons = [(r.view_key, r.reason, r.location.offset if r.location else None)
               for r in outcome.rejections]  # fmt: skip
    assert reasons == [(keys[1], "zero_length", 128), (keys[2], "schema_mismatch", 256)]
    counts = state.ledger_counts()
    assert (counts["buffered"], counts["rejected"], counts["leased"]) == (2, 2, 2)
    assert state.leases.keys().tolist() == sorted([int(keys[4]), int(other[0])])


def test_locations_are_found_across_iterations() -> None:
    state = make_state(dataset_size=4, join=False)  # chained iterations: keys past one epoch
    keys = state.lease(producer=0, count=8, deadline=10.0)
    assert keys.max() >= 4  # the second iteration's keys are leased too
    ones = np.ones(len(keys), np.int64)
    offsets = [64 * (i + 1) for i in range(len(keys))]
    state.commit(0, keys, at(offsets), ones, ones, ones)
    assert state.locations_of(keys[::-1].copy()).offsets.tolist() == offsets[::-1]


@pytest.mark.parametrize("nodes", [1, 2])  # with 2, the other node's views never come here
def test_an_iteration_drops_its_location_columns_once_every_view_is_emitted(nodes: int) -> None:
    state = make_state(dataset_size=4 * nodes, join=False, nodes=nodes)
    keys = state.lease(producer=0, count=8, deadline=10.0)
    assert len(keys) == 8
    ones = np.ones(len(keys), np.int64)
    state.commit(0, keys, at([64 * (i + 1) for i in range(len(keys))]), ones, ones, ones)
    first, second = keys[keys < 4 * nodes], keys[keys >= 4 * nodes]
    assert len(first) == 4
    state.mark_emitted(first[:2])
    assert state.iteration(0).where is not None  # two views of iteration 0 still buffered
    state.mark_emitted(np.sort(first[2:]))
    assert state.iteration(0).where is None
    assert state.locations_of(second).offsets.size == len(second)  # iteration 1 keeps its own


@pytest.fixture
def lanes() -> Iterator[Lanes]:
    arena = Arena.create(f"t{uuid.uuid4().hex[:8]}", 0, 1 << 16)
    yield Lanes(arena, 4096)
    arena.close()


def test_lanes_resolve_and_free_samples_of_several_lanes_at_once(lanes: Lanes) -> None:
    first, second = lanes.open(producer=0), lanes.open(producer=1)
    assert first is not None and second is not None
    lanes.hold(first.lane_id, np.array([64, 128]))
    lanes.hold(second.lane_id, np.array([64]))
    both = Locations(
        np.array([second.lane_id, first.lane_id, first.lane_id]),
        np.array([64, 64, 128]),
        np.array([8, 8, 8]),
    )
    segments, offsets = lanes.resolve_many(both)
    one_by_one = [lanes.resolve(both.at(i)) for i in range(3)]
    assert list(zip(segments.tolist(), offsets.tolist(), strict=True)) == one_by_one
    lanes.orphan(second.lane_id)  # its producer died with a live sample
    back = lanes.free([both.take(slice(0, 2)), both.take(slice(2, 3))])
    assert {p: o.tolist() for p, o in back.items()} == {0: [64, 128]}  # nothing for the dead
    assert lanes.num_lanes == 1  # the orphaned lane went back to the arena with its last sample
    assert first.live == set()


def test_a_lane_offset_held_twice_is_an_invariant_error(lanes: Lanes) -> None:
    lane = lanes.open(producer=0)
    assert lane is not None
    lanes.hold(lane.lane_id, np.array([64]))
    with pytest.raises(Exception, match="committed twice"):
        lanes.hold(lane.lane_id, np.array([64]))


def commit_batch(offsets: list[int], nbytes: list[int]) -> ingest_pb2.CommitBatch:
    n = len(offsets)
    return ingest_pb2.CommitBatch(
        view_keys=np.arange(n, dtype="<i8").tobytes(),
        offsets=np.array(offsets, "<u8").tobytes(),
        nbytes=np.array(nbytes, "<u8").tobytes(),
        lengths=np.ones(n, "<u4").tobytes(),
        loss_tokens=np.ones(n, "<u4").tobytes(),
        schema_hashes=np.ones(n, "<u8").tobytes(),
    )


@pytest.mark.parametrize(
    ("offsets", "nbytes", "live", "message"),
    [
        ([64, 4000], [8, 200], set(), "does not lie inside"),  # runs past the lane
        ([64, 8], [8, 8], set(), "does not lie inside"),  # inside the lane header
        ([64, 2**64 - 8], [8, 16], set(), "does not lie inside"),  # past the lane
        ([64, 128], [8, 2**64 - 64], set(), "does not lie inside"),  # offset + size wraps
        ([64, 128], [8, 0], set(), "does not lie inside"),  # zero bytes
        ([64, 64], [8, 8], set(), "reuses a lane offset"),
        ([64, 128], [8, 8], {128}, "reuses a lane offset"),
    ],
)
def test_a_commit_outside_its_lane_or_over_a_live_sample_is_malformed(
    offsets: list[int], nbytes: list[int], live: set[int], message: str
) -> None:
    with pytest.raises(MalformedMessage, match=message):
        decode_commit(commit_batch(offsets, nbytes), 4096, live)
    assert LANE_HEADER_BYTES == 64  # the header the cases above step into


@pytest.mark.parametrize("seed", range(30))
def test_a_commit_is_refused_exactly_when_a_row_lies_outside_its_lane(seed: int) -> None:
    """decode_commit checks bounds with reductions; the row-by-row rule decides the same."""
    rng = np.random.default_rng(seed)
    lane_bytes = 4096
    edges = [0, 1, 63, 4000, 4095, 4096, 4097, 2**63, 2**64 - 8]
    inside = list(range(64, 3000, 96))  # most rows: inside, so some commits are too
    offsets = rng.choice(np.array(edges + inside, np.uint64), size=2, replace=False)
    sizes = [0, 1, 4032, 4096, 2**64 - 64] + [8, 96] * 10
    nbytes = rng.choice(np.array(sizes, np.uint64), size=2)
    outside = [
        n == 0 or o < LANE_HEADER_BYTES or o > lane_bytes or n > lane_bytes - o
        for o, n in zip(offsets.tolist(), nbytes.tolist(), strict=True)
    ]
    batch = commit_batch(offsets.tolist(), nbytes.tolist())
    if any(outside):
        with pytest.raises(MalformedMessage, match="does not lie inside"):
            decode_commit(batch, lane_bytes, set())
    else:
        assert decode_commit(batch, lane_bytes, set()).offsets.tolist() == offsets.tolist()


def test_a_commit_inside_its_lane_decodes() -> None:
    rows = decode_commit(commit_batch([64, 4088], [8, 8]), 4096, {192})
    assert rows.offsets.tolist() == [64, 4088] and rows.patches.tolist() == [0, 0]
