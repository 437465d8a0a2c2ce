"""Where committed samples' bytes lie in the arena: one Location, or Locations as columns
(the hot path moves arrays, never a Python object per sample)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from odbd.planner.types import IntArray


@dataclass(frozen=True, slots=True)
class Location:
    """Where a committed sample's bytes lie: inside a producer's lane of the arena."""

    lane: int
    offset: int  # byte offset inside the lane
    nbytes: int


@dataclass(frozen=True, slots=True)
class Locations:
    """Where committed samples' bytes lie, as columns: row i is one sample (a Location).

    The hot path (commit, step building, frees) moves these arrays, never a Python object per
    sample."""

    lanes: IntArray  # (n,) int64 lane id
    offsets: IntArray  # (n,) int64 byte offset inside the lane
    nbytes: IntArray  # (n,) int64
    # Every row lies in this lane, when known (None: not known, maybe several): a step's rows
    # are freed without concatenating and reducing their lane ids (Lanes.free).
    lane: int | None = None

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def with_lane(self) -> Locations:
        """These rows, with `lane` set if they all lie in one lane (two reductions, once)."""
        if self.lane is not None or len(self) == 0:
            return self
        first, last = int(self.lanes.min()), int(self.lanes.max())
        if first != last:
            return self
        return Locations(self.lanes, self.offsets, self.nbytes, first)

    @staticmethod
    def empty() -> Locations:
        z = np.zeros(0, dtype=np.int64)
        return Locations(z, z, z)

    @staticmethod
    def in_lane(lane: int, offsets: IntArray, nbytes: IntArray) -> Locations:
        offsets = np.asarray(offsets, dtype=np.int64)
        return Locations(
            np.full(offsets.shape, lane, dtype=np.int64),
            offsets,
            np.asarray(nbytes, dtype=np.int64),
            lane,
        )

    @staticmethod
    def concat(parts: list[Locations]) -> Locations:
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return Locations.empty()
        return Locations(
            np.concatenate([p.lanes for p in parts]),
            np.concatenate([p.offsets for p in parts]),
            np.concatenate([p.nbytes for p in parts]),
            common_lane(parts),
        )

    def take(self, rows: IntArray | slice) -> Locations:
        return Locations(self.lanes[rows], self.offsets[rows], self.nbytes[rows], self.lane)

    def at(self, row: int) -> Location:
        return Location(int(self.lanes[row]), int(self.offsets[row]), int(self.nbytes[row]))


def common_lane(parts: list[Locations]) -> int | None:
    """The lane every row of `parts` lies in, if each part knows it is that one lane."""
    lane = parts[0].lane if parts else None
    if lane is None:
        return None
    for part in parts:
        if part.lane != lane:
            return None
    return lane
