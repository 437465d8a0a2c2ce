"""Producer lanes: each producer allocates samples inside its own region of the arena.

The daemon carves one lane per connected producer out of the node's Arena; the producer runs
its own allocator inside it (odbclient.alloc.FreeList), so writing a sample needs no round trip.
The daemon tracks which lane offsets hold live samples: trainers' deliveries free them (the
offsets go back to the producer), and a lane whose producer died is returned to the arena once
its last live sample was delivered. Bytes a killed producer half-wrote were never committed,
so they are never read: they vanish with the lane.

A lane's first LANE_HEADER_BYTES are its header (odbclient.producer.lane): the view key its producer
is making, IDLE between samples. The daemon sets it IDLE when it opens the lane and reads it
when the producer's stream ends, to learn which id (if any) was in flight when it died.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from odbclient.producer.lane import IDLE
from odbclient.shm import Allocation
from odbd.daemon.locations import Location, Locations, common_lane
from odbd.errors import InvariantError
from odbd.ingest.arena import Arena


@dataclass(slots=True)
class Lane:
    lane_id: int
    allocation: Allocation  # the lane's bytes in the arena
    segment_index: int
    producer: int | None  # None once its producer disconnected
    live: set[int] = field(default_factory=set)  # lane offsets of committed, undelivered samples


class Lanes:
    def __init__(self, arena: Arena, lane_bytes: int) -> None:
        self.arena = arena
        self.lane_bytes = lane_bytes
        self._segment_index = {name: i for i, name in enumerate(arena.segment_names)}
        self._lanes: dict[int, Lane] = {}
        self._next_id = 0

    def open(self, producer: int) -> Lane | None:
        """A fresh lane, or None when the arena has no room (too many producers for --shm-size)."""
        allocation = self.arena.allocate(self.lane_bytes)
        if allocation is None:
            return None
        lane = Lane(self._next_id, allocation, self._segment_index[allocation.segment], producer)
        with self.arena.view(allocation) as header:  # a reused lane holds old bytes
            struct.pack_into("<q", header, 0, IDLE)
        self._lanes[lane.lane_id] = lane
        self._next_id += 1
        return lane

    def adopt(self, allocation: Allocation, offsets: np.ndarray) -> Lane:
        """A daemon-owned lane over an arena region the bulk channel filled with samples moved
        here from another node (round/bulk.py), live at `offsets`. It has no producer, so the
        delivery of its last sample returns the region to the arena (_maybe_reclaim), and no
        freed offset is handed to a producer."""
        lane = Lane(self._next_id, allocation, self._segment_index[allocation.segment], None)
        lane.live.update(np.asarray(offsets, dtype=np.int64).tolist())
        if len(lane.live) != len(offsets):
            raise InvariantError(f"moved-in samples share an offset: {offsets.tolist()[:8]}")
        self._lanes[lane.lane_id] = lane
        self._next_id += 1
        return lane

    def get(self, lane_id: int) -> Lane:
        return self._lanes[lane_id]

    def hold(self, lane_id: int, offsets: np.ndarray) -> None:
        """Marks committed samples live (decode_commit checked bounds and overlaps)."""
        live = self._lanes[lane_id].live
        before = len(live)
        live.update(offsets.tolist())
        if len(live) != before + len(offsets):
            raise InvariantError(f"lane {lane_id}: an offset was committed twice")

    def in_flight(self, lane_id: int) -> int | None:
        """The view key the lane's producer was making (its header), None between samples."""
        with self.arena.view(self._lanes[lane_id].allocation) as lane:
            (key,) = struct.unpack_from("<q", lane, 0)
        return None if key == IDLE else int(key)

    def resolve(self, location: Location) -> tuple[int, int]:
        """(segment index, byte offset in the segment) of a sample, for the trainer."""
        lane = self._lanes[location.lane]
        return lane.segment_index, lane.allocation.offset + location.offset

    def resolve_many(self, locations: Locations) -> tuple[np.ndarray, np.ndarray]:
        """(segment indices, byte offsets in the segments) of samples, as arrays."""
        if len(locations) == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        ids = np.unique(locations.lanes)
        if len(ids) == 1:  # one lane (one producer): no per-lane lookup table
            lane = self._lanes[int(ids[0])]
            segments = np.full(len(locations), lane.segment_index, dtype=np.int64)
            return segments, locations.offsets + lane.allocation.offset
        index = np.searchsorted(ids, locations.lanes)
        lanes = [self._lanes[i] for i in ids.tolist()]
        segment_of = np.asarray([lane.segment_index for lane in lanes], dtype=np.int64)
        base_of = np.asarray([lane.allocation.offset for lane in lanes], dtype=np.int64)
        return segment_of[index], locations.offsets + base_of[index]

    def orphan(self, lane_id: int) -> None:
        lane = self._lanes[lane_id]
        lane.producer = None
        self._maybe_reclaim(lane)

    def free(self, groups: list[Locations]) -> dict[int, np.ndarray]:
        """Frees delivered samples; returns producer -> lane offsets to hand back to it."""
        lane_id = common_lane(groups)
        if lane_id is not None:  # a trainer's report of one producer's steps: the usual case
            return self._free_in_lane(lane_id, groups)
        freed = Locations.concat(groups)
        back: dict[int, np.ndarray] = {}
        if len(freed) == 0:
            return back
        first, last = int(freed.lanes.min()), int(freed.lanes.max())
        ids = [first] if first == last else np.unique(freed.lanes).tolist()  # one: no sort
        for lane_id in ids:
            lane = self._lanes.get(lane_id)
            if lane is None:
                continue
            offsets = freed.offsets if len(ids) == 1 else freed.offsets[freed.lanes == lane_id]
            lane.live.difference_update(offsets.tolist())
            if lane.producer is not None:
                previous = back.get(lane.producer)
                back[lane.producer] = (
                    offsets if previous is None else np.concatenate([previous, offsets])
                )
            else:
                self._maybe_reclaim(lane)
        return back

    def _free_in_lane(self, lane_id: int, groups: list[Locations]) -> dict[int, np.ndarray]:
        """free() of rows known to lie in one lane: only their offsets are joined."""
        offsets = (
            groups[0].offsets if len(groups) == 1 else np.concatenate([g.offsets for g in groups])
        )
        lane = self._lanes.get(lane_id)
        if lane is None or len(offsets) == 0:
            return {}
        lane.live.difference_update(offsets.tolist())
        if lane.producer is None:
            self._maybe_reclaim(lane)
            return {}
        return {lane.producer: offsets}

    def _maybe_reclaim(self, lane: Lane) -> None:
        if lane.producer is None and not lane.live:
            self.arena.free(lane.allocation)
            del self._lanes[lane.lane_id]

    @property
    def num_lanes(self) -> int:
        return len(self._lanes)
