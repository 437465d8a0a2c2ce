"""Producer lanes: each producer allocates samples inside its own region of the arena.

The daemon carves one lane per connected producer out of the node's Arena; the producer runs
its own allocator inside it (odbclient.alloc.FreeList), so writing a sample needs no round trip.
The daemon tracks which lane offsets hold live samples: trainers' deliveries free them (the
offsets go back to the producer), and a lane whose producer died is returned to the arena once
its last live sample was delivered. Bytes a killed producer half-wrote were never committed,
so they are never read: they vanish with the lane.

A lane's first LANE_HEADER_BYTES are its header (odbclient.lane): the view key its producer
is making, IDLE between samples. The daemon sets it IDLE when it opens the lane and reads it
when the producer's stream ends, to learn which id (if any) was in flight when it died.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from dataclasses import dataclass, field

from odbclient.lane import IDLE
from odbclient.shm import Allocation
from odbd.daemon.node_state import Location
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

    def get(self, lane_id: int) -> Lane:
        return self._lanes[lane_id]

    def hold(self, location: Location) -> None:
        lane = self._lanes[location.lane]
        if location.offset in lane.live:
            raise InvariantError(f"lane {lane.lane_id} offset {location.offset} committed twice")
        if location.offset + location.nbytes > lane.allocation.length:
            raise InvariantError(f"sample at lane offset {location.offset} overruns its lane")
        lane.live.add(location.offset)

    def in_flight(self, lane_id: int) -> int | None:
        """The view key the lane's producer was making (its header), None between samples."""
        with self.arena.view(self._lanes[lane_id].allocation) as lane:
            (key,) = struct.unpack_from("<q", lane, 0)
        return None if key == IDLE else int(key)

    def resolve(self, location: Location) -> tuple[int, int]:
        """(segment index, byte offset in the segment) of a sample, for the trainer."""
        lane = self._lanes[location.lane]
        return lane.segment_index, lane.allocation.offset + location.offset

    def orphan(self, lane_id: int) -> None:
        lane = self._lanes[lane_id]
        lane.producer = None
        self._maybe_reclaim(lane)

    def free(self, locations: list[Location]) -> dict[int, list[int]]:
        """Frees delivered samples; returns producer -> lane offsets to hand back to it."""
        back: dict[int, list[int]] = defaultdict(list)
        for location in locations:
            lane = self._lanes.get(location.lane)
            if lane is None:
                continue
            lane.live.discard(location.offset)
            if lane.producer is not None:
                back[lane.producer].append(location.offset)
            else:
                self._maybe_reclaim(lane)
        return back

    def _maybe_reclaim(self, lane: Lane) -> None:
        if lane.producer is None and not lane.live:
            self.arena.free(lane.allocation)
            del self._lanes[lane.lane_id]

    @property
    def num_lanes(self) -> int:
        return len(self._lanes)
