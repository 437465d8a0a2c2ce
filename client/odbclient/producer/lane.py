"""A producer's bookkeeping, pure: its lane of the arena, pending commits, and lease credits."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from odbclient.alloc import FreeList
from odbclient.errors import ProtocolError
from odbclient.samples import RejectReason, SampleFacts
from odbclient.shm import ALIGN_BYTES, align_up
from odbclient.wire.odbd.v1 import ingest_pb2

# A lane starts with a header the producer writes and the daemon reads once the producer is
# gone: bytes 0..8 hold the view key the producer is making (int64 LE), IDLE between samples.
# One 8-byte store per sample and no message, so the daemon knows exactly which id was in
# flight when a producer died (and quarantines one that kills producers). Samples follow it.
LANE_HEADER_BYTES = 64
IDLE = -1


class InFlightMark:
    """The producer's side of the lane header: which view key `dataset[i]` is running for."""

    def __init__(self, lane_buffer: memoryview) -> None:
        self._word = np.frombuffer(lane_buffer, dtype="<i8", count=1)  # a writable view

    def set(self, view_key: int) -> None:
        self._word[0] = view_key

    def clear(self) -> None:
        self._word[0] = IDLE


class LaneAllocator:
    """First-fit allocation inside one lane; offsets are lane-relative.

    Every offset handed out is 64-byte aligned in the segment (not just in the lane), because
    the sample layout aligns its arrays relative to the sample start. The first `header_bytes`
    of the lane are never handed out (LANE_HEADER_BYTES for a producer's lane).
    """

    def __init__(self, lane_offset: int, lane_size: int, header_bytes: int = 0) -> None:
        # lane-relative start of aligned space after the header
        first = align_up(lane_offset + header_bytes) - lane_offset
        self.capacity_bytes = max(0, lane_size - first) & -ALIGN_BYTES
        self._free = (
            FreeList([first], [self.capacity_bytes]) if self.capacity_bytes else FreeList([], [])
        )
        self._live: dict[int, int] = {}  # lane offset -> reserved bytes
        self.used_bytes = 0

    def fits_ever(self, nbytes: int) -> bool:
        """False for a sample larger than the whole lane: waiting for frees would never help."""
        return max(nbytes, 1) <= self.capacity_bytes  # the capacity is aligned: no align_up

    def fits_now(self, nbytes: int) -> bool:
        return align_up(max(nbytes, 1)) <= self._free.largest()

    def allocate(self, nbytes: int) -> int | None:
        """A lane offset for `nbytes`, or None while the lane is full (wait for a FreeBatch)."""
        size = align_up(max(nbytes, 1))
        offset = self._free.take(size)
        if offset is not None:
            self._live[offset] = size
            self.used_bytes += size
        return offset

    def free(self, offset: int) -> None:
        self.free_many([offset])

    def free_many(self, offsets: list[int]) -> None:
        """Frees a FreeBatch's offsets. Adjacent samples are joined into one extent first, so
        the free list is searched once per run, not once per sample: the daemon frees samples
        in about the order they were made, so a batch is mostly one or a few runs."""
        runs: list[list[int]] = []  # [start, size], address order, adjacent ones joined
        try:
            for offset in sorted(offsets):
                size = self._live.pop(offset, None)
                if size is None:
                    raise ProtocolError(
                        f"odbd freed lane offset {offset}, which this producer did not allocate "
                        "or already got back; the daemon and odbclient versions differ or the "
                        "daemon has a bug; restart the producer"
                    )
                if runs and runs[-1][0] + runs[-1][1] == offset:
                    runs[-1][1] += size
                else:
                    runs.append([offset, size])
        finally:  # on a bad offset, the ones before it are freed (as one at a time would)
            for start, size in runs:
                self._free.give(start, size)
                self.used_bytes -= size

    @property
    def num_live(self) -> int:
        return len(self._live)


@dataclass(slots=True)
class CommitBuffer:
    """Commits and rejections waiting to be sent, flushed by count or by age."""

    max_rows: int
    interval_s: float
    _view_keys: list[int] = field(default_factory=list)
    _offsets: list[int] = field(default_factory=list)
    _nbytes: list[int] = field(default_factory=list)
    _lengths: list[int] = field(default_factory=list)
    _loss_tokens: list[int] = field(default_factory=list)
    _hashes: list[int] = field(default_factory=list)
    _patches: list[int] = field(default_factory=list)
    _rejections: list[ingest_pb2.Rejection] = field(default_factory=list)
    _oldest_s: float | None = None  # when the oldest pending row was added

    def add(self, view_key: int, offset: int, facts: SampleFacts, now_s: float) -> None:
        self._view_keys.append(view_key)
        self._offsets.append(offset)
        self._nbytes.append(facts.nbytes)
        self._lengths.append(facts.length)
        self._loss_tokens.append(facts.loss_tokens)
        self._hashes.append(facts.schema_hash)
        self._patches.append(facts.patches)
        self._touch(now_s)

    def reject(self, view_key: int, reason: RejectReason, detail: str, now_s: float) -> None:
        self._rejections.append(
            ingest_pb2.Rejection(view_key=view_key, reason=reason, detail=detail)
        )
        self._touch(now_s)

    def __len__(self) -> int:
        return len(self._view_keys) + len(self._rejections)

    def due(self, now_s: float) -> bool:
        if self._oldest_s is None:
            return False
        return len(self) >= self.max_rows or now_s - self._oldest_s >= self.interval_s

    def take(self) -> list[ingest_pb2.ProducerMessage]:
        """The pending rows as at most one CommitBatch and one RejectBatch message; clears."""
        messages = []
        if self._view_keys:
            commit = ingest_pb2.CommitBatch(
                view_keys=np.array(self._view_keys, "<i8").tobytes(),
                offsets=np.array(self._offsets, "<u8").tobytes(),
                nbytes=np.array(self._nbytes, "<u8").tobytes(),
                lengths=np.array(self._lengths, "<u4").tobytes(),
                loss_tokens=np.array(self._loss_tokens, "<u4").tobytes(),
                schema_hashes=np.array(self._hashes, "<u8").tobytes(),
                # Only when counted (--max-patches): empty reads as all 0 at the daemon.
                patches=np.array(self._patches, "<u4").tobytes() if any(self._patches) else b"",
            )
            messages.append(ingest_pb2.ProducerMessage(commit=commit))
        if self._rejections:
            reject = ingest_pb2.RejectBatch(rejections=self._rejections)
            messages.append(ingest_pb2.ProducerMessage(reject=reject))
        for rows in (self._view_keys, self._offsets, self._nbytes, self._lengths):
            rows.clear()
        self._loss_tokens.clear()
        self._hashes.clear()
        self._patches.clear()
        self._rejections = []
        self._oldest_s = None
        return messages

    def _touch(self, now_s: float) -> None:
        if self._oldest_s is None:
            self._oldest_s = now_s


@dataclass(slots=True)
class LeaseCredits:
    """Keeps about `hold_s` of work in hand: granted-but-unprocessed ids plus requested credits.

    The target adapts to the measured time per sample, between `min_ids` and `max_ids`: cheap
    samples need many ids in hand to cover a grant's round trip (or the producer idles waiting
    for it), while expensive ones need few, so ids are not hoarded by one producer while the
    others starve at an epoch's end. Asks again only once half the target is used, so credits
    go out in batches rather than one message per sample.
    """

    max_ids: int
    hold_s: float = 0.02
    min_ids: int = 4
    outstanding: int = 0  # requested, not yet granted
    sample_s: float | None = None  # moving average of one sample's work; None: not measured

    @property
    def target(self) -> int:
        if self.sample_s is None:
            wanted = _FIRST_REQUEST  # unmeasured: a modest first request
        else:
            wanted = int(self.hold_s / max(self.sample_s, 1e-7))
        return max(min(wanted, self.max_ids), min(self.min_ids, self.max_ids))

    def observe(self, seconds: float) -> None:
        """One sample's work took `seconds` (fetch, validate, encode)."""
        if self.sample_s is None:
            self.sample_s = seconds
        else:
            self.sample_s += _SMOOTHING * (seconds - self.sample_s)

    def request(self, in_hand: int) -> int:
        """How many more ids to ask for now (0: none); counts them as outstanding."""
        target = self.target
        held = self.outstanding + in_hand
        if held > target // 2:
            return 0
        count = target - held
        self.outstanding += count
        return count

    def granted(self, count: int) -> None:
        self.outstanding = max(0, self.outstanding - count)


_SMOOTHING = 0.05  # weight of the newest sample in LeaseCredits.sample_s
_FIRST_REQUEST = 32  # ids asked for before any sample was timed
