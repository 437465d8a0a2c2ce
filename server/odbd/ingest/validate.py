"""Checks on what a producer sends, before any of it reaches NodeState (pure, no I/O).

A producer is a local process of the same user, but a buggy or mismatched one must not corrupt
the node's bookkeeping: a commit that points outside its lane, or packed arrays that do not
decode, would otherwise be buffered and later read by a trainer as garbage (or crash the
service mid-update). Each violation raises MalformedMessage, which the service turns into
INVALID_ARGUMENT for that producer's stream; its leases then go back to the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from odbclient.producer.lane import LANE_HEADER_BYTES
from odbclient.samples import RejectReason
from odbclient.wire.odbd.v1 import ingest_pb2
from odbd.errors import OdbdError

# Reasons a producer may send; the daemon adds its own (zero_length, schema_mismatch).
PRODUCER_REASONS = frozenset(r.value for r in RejectReason)
_COLUMNS = (  # CommitBatch field -> little-endian element type (ingest.proto)
    ("view_keys", "<i8"),
    ("offsets", "<u8"),
    ("nbytes", "<u8"),
    ("lengths", "<u4"),
    ("loss_tokens", "<u4"),
    ("schema_hashes", "<u8"),
)


class MalformedMessage(OdbdError):
    """A producer message breaks the ingest protocol; the producer's stream is refused."""


@dataclass(frozen=True, slots=True)
class CommitRows:
    """One CommitBatch decoded: every array has one row per committed sample."""

    view_keys: np.ndarray  # (n,) int64
    offsets: np.ndarray  # (n,) uint64, lane-relative
    nbytes: np.ndarray  # (n,) uint64
    lengths: np.ndarray  # (n,) uint32
    loss_tokens: np.ndarray  # (n,) uint32
    schema_hashes: np.ndarray  # (n,) uint64
    patches: np.ndarray  # (n,) uint32 vision patches; zeros when the producer sent none


def decode_commit(batch: ingest_pb2.CommitBatch, lane_bytes: int, live: set[int]) -> CommitRows:
    """The commit's rows, once every sample lies inside the lane and none overlaps a live one."""
    columns = {name: _column(batch, name, dtype) for name, dtype in _COLUMNS}
    patches = _column(batch, "patches", "<u4")
    if len(patches):  # optional: a producer counts patches only under --max-patches
        columns["patches"] = patches
    counts = {name: len(column) for name, column in columns.items()}
    if len(set(counts.values())) != 1:
        raise MalformedMessage(f"CommitBatch arrays have different lengths: {counts}")
    if not len(patches):
        columns["patches"] = np.zeros(len(columns["view_keys"]), dtype="<u4")
    rows = CommitRows(**columns)
    offsets, nbytes = rows.offsets, rows.nbytes
    outside = (nbytes == 0) | (offsets < LANE_HEADER_BYTES) | (offsets > lane_bytes)
    outside |= ~outside & (nbytes > lane_bytes - np.minimum(offsets, lane_bytes))  # no overflow
    # Elementwise masks and one any(), not min/max: a numpy reduction costs ~3 elementwise
    # operations on rows this short.
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise MalformedMessage(
            f"a committed sample at lane offset {int(offsets[i])} with {int(nbytes[i])} bytes "
            f"does not lie inside the producer's {lane_bytes}-byte lane after its "
            f"{LANE_HEADER_BYTES}-byte header"
        )
    listed = offsets.tolist()  # set operations in C: no sort (np.unique) per commit
    if len(set(listed)) != len(listed) or not live.isdisjoint(listed):
        raise MalformedMessage(
            "a CommitBatch reuses a lane offset that holds a live sample; a producer may only "
            "reuse offsets the daemon freed"
        )
    return rows


def _column(batch: ingest_pb2.CommitBatch, name: str, dtype: str) -> np.ndarray:
    data = getattr(batch, name)
    itemsize = np.dtype(dtype).itemsize
    if len(data) % itemsize:
        raise MalformedMessage(
            f"CommitBatch.{name} has {len(data)} bytes, not a multiple of {itemsize} "
            f"({np.dtype(dtype).name} values)"
        )
    return np.frombuffer(data, dtype=dtype)


def check_rejections(batch: ingest_pb2.RejectBatch) -> None:
    """Reasons form a closed set: they become metric labels and EpochEnd keys."""
    for rejection in batch.rejections:
        if rejection.reason not in PRODUCER_REASONS:
            raise MalformedMessage(
                f"unknown rejection reason {rejection.reason[:64]!r}; producers send one of "
                f"{sorted(PRODUCER_REASONS)}"
            )
