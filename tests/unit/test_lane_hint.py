"""Locations.lane (rows known to lie in one lane) and Lanes.free's path for such rows: the
same frees, offsets handed back and lanes reclaimed as without the hint."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from odbclient.shm import Allocation
from odbd.daemon.locations import Locations, common_lane
from odbd.ingest.lanes import Lanes

_SAMPLE = 64


class FakeArena:
    """What Lanes uses of an Arena, in a bytearray (no shared memory)."""

    segment_names = ["seg"]

    def __init__(self) -> None:
        self.bytes = bytearray(1 << 16)
        self.next = 0
        self.freed: list[Allocation] = []

    def allocate(self, nbytes: int) -> Allocation:
        allocation = Allocation("seg", self.next, nbytes)
        self.next += nbytes
        return allocation

    def view(self, allocation: Allocation) -> memoryview:
        return memoryview(self.bytes)[allocation.offset : allocation.offset + allocation.length]

    def free(self, allocation: Allocation) -> None:
        self.freed.append(allocation)


def _rows(lane_ids: list[int]) -> Locations:
    n = len(lane_ids)
    offsets = np.arange(n, dtype=np.int64) * _SAMPLE + _SAMPLE
    return Locations(np.asarray(lane_ids, dtype=np.int64), offsets, np.full(n, _SAMPLE))


def test_with_lane_is_set_only_for_rows_of_one_lane() -> None:
    assert _rows([2, 2, 2]).with_lane().lane == 2
    assert _rows([2, 3, 2]).with_lane().lane is None
    assert _rows([]).with_lane().lane is None
    one = Locations.in_lane(4, np.array([64, 128]), np.array([8, 8]))
    assert one.lane == 4
    assert one.take(slice(0, 1)).lane == 4
    assert Locations.concat([one, one.take(slice(1, 2))]).lane == 4
    assert Locations.concat([one, _rows([4])]).lane is None  # one part does not know
    assert common_lane([]) is None


@st.composite
def lanes_and_steps(draw: st.DrawFn) -> tuple[int, list[bool], list[int], list[int]]:
    """Lanes (some orphaned), a lane per sample, and step sizes covering the samples."""
    num_lanes = draw(st.integers(1, 3))
    orphaned = draw(st.lists(st.booleans(), min_size=num_lanes, max_size=num_lanes))
    lane_of = draw(st.lists(st.integers(0, num_lanes - 1), min_size=1, max_size=40))
    sizes, left = [], len(lane_of)
    for size in draw(st.lists(st.integers(0, 8), max_size=10)):  # empty steps: idle fillers
        sizes.append(min(size, left))
        left -= sizes[-1]
    sizes.append(left)
    return num_lanes, orphaned, lane_of, sizes


def _free_all(
    num_lanes: int, orphaned: list[bool], lane_of: list[int], sizes: list[int], hint: bool
) -> tuple[list[dict[int, list[int]]], list[set[int]], list[int], int]:
    arena = FakeArena()
    lanes = Lanes(arena, 1 << 12)  # type: ignore[arg-type]
    opened = [lanes.open(producer=10 + i) for i in range(num_lanes)]
    assert all(lane is not None for lane in opened)
    ids = [lane.lane_id for lane in opened if lane is not None]
    counts = [0] * num_lanes
    lane_ids, offsets = [], []
    for i in lane_of:  # each lane's samples at its own offsets
        counts[i] += 1
        lane_ids.append(ids[i])
        offsets.append(counts[i] * _SAMPLE)
    rows = Locations(np.asarray(lane_ids), np.asarray(offsets), np.full(len(offsets), _SAMPLE))
    for i, lane_id in enumerate(ids):
        lanes.hold(lane_id, rows.offsets[rows.lanes == lane_id])
        if orphaned[i]:
            lanes.orphan(lane_id)
    backs, start = [], 0
    steps = []
    for size in sizes:
        step = rows.take(slice(start, start + size))
        steps.append(step.with_lane() if hint else step)
        start += size
    for k in range(0, len(steps), 2):  # a report frees two steps at a time
        back = lanes.free(steps[k : k + 2])
        backs.append({p: o.tolist() for p, o in back.items()})
    live = [lanes.get(i).live for i in ids if i in lanes._lanes]
    return backs, live, [a.offset for a in arena.freed], lanes.num_lanes


@settings(max_examples=300, deadline=None)
@given(lanes_and_steps())
def test_free_of_one_lane_rows_is_the_general_free(
    case: tuple[int, list[bool], list[int], list[int]],
) -> None:
    assert _free_all(*case, hint=True) == _free_all(*case, hint=False)
