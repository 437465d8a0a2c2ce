"""One node's full offers as bytes: the round payload before the split round (protocol 2).

The live daemons send summaries now (summary_codec.py, split_round.py); `odbd simulate
--planning-time` still encodes full offers to show what the split saves, and payload_checks.py
decodes them for its fuzz tests.

Layout, version 3 (all numbers little-endian):
    u32 magic 0x4f444252 ("ODBR"), u16 version, u16 reserved, u32 header_bytes
    header: UTF-8 JSON {"node", "epoch", "rejected": {reason: count}, "units": [[unit, dry, n]],
            "observations": m, "schema": [hash, text] | null, and "ended": [[rank, epoch, step]]
            once a rank called end_job}
    then per unit, n rows each of: int64 views, int32 lengths, int32 tokens, int32 ages,
    int32 patches (columns one after another)
    then m rows of float64 [padded tokens, sum of squared lengths, seconds]: this node's timed
    rank-steps since its last offer (cost_learning.py; at most MAX_OBSERVATIONS, ~1.5 KiB)
Every daemon decodes every node's payload and feeds the same UnitOffers to plan_round, so the
encoding must be exact (floats travel as their IEEE bytes, never as text) and the unit order
fixed. Version 1 had no observations, version 2 no patches. "schema" is the node's sample
schema once its vote chose one (ingest/schema_vote.py), so every daemon can check that the nodes
agree; an offer without the key (a release before it) reads as null.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from odbd.errors import InvariantError
from odbd.planner.types import SampleTable, UnitOffer

_MAGIC = 0x4F444252
_VERSION = 3
_PREFIX = struct.Struct("<IHHI")
_COLUMNS = (
    ("views", "<i8"),
    ("lengths", "<i4"),
    ("tokens", "<i4"),
    ("ages", "<i4"),
    ("patches", "<i4"),
)
ROW_BYTES = sum(np.dtype(dtype).itemsize for _, dtype in _COLUMNS)  # 24 per buffered sample
# Header JSON (node, epoch, rejected counts, units) and cost observations (<= 64 x 24 B).
_HEAD_ALLOWANCE_BYTES = 4096


def full_buffer_offer_bytes(buffered_samples: int) -> int:
    """A node's payload when its buffers hold `buffered_samples` (--buffer x ranks per node)."""
    return _PREFIX.size + _HEAD_ALLOWANCE_BYTES + ROW_BYTES * buffered_samples


@dataclass(frozen=True, slots=True)
class NodeOffer:
    node: int
    epoch: int  # the epoch this node is planning; must agree across nodes
    units: tuple[UnitOffer, ...]
    rejected: dict[str, int]  # samples rejected at ingest since the previous round, by reason
    resume: tuple[int, int] | None = None  # first round after a restart: trainers' (epoch, step)
    # (m, 3) float64 [padded, sum_sq, seconds]: rank-steps timed by this node's trainers
    observations: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    schema: tuple[int, str] | None = None  # (schema hash, description) once the node chose one
    # ODBClient.end_job() of this node's ranks so far: (rank, epoch, step) each, the first step
    # the rank did not train (daemon/end_requests.py); in the header only when non-empty
    ended: tuple[tuple[int, int, int], ...] = ()


def encode(offer: NodeOffer) -> bytes:
    header = {
        "node": offer.node,
        "epoch": offer.epoch,
        "rejected": offer.rejected,
        "resume": list(offer.resume) if offer.resume else None,
        "units": [[u.unit, u.dry, len(u.samples)] for u in offer.units],
        "observations": int(offer.observations.shape[0]),
        "schema": list(offer.schema) if offer.schema else None,
    }
    if offer.ended:
        header["ended"] = [list(e) for e in offer.ended]
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [_PREFIX.pack(_MAGIC, _VERSION, 0, len(head)), head]
    for unit in offer.units:
        for name, dtype in _COLUMNS:
            parts.append(getattr(unit.samples, name).astype(dtype).tobytes())
    parts.append(np.ascontiguousarray(offer.observations, dtype="<f8").tobytes())
    return b"".join(parts)


def decode(payload: bytes) -> NodeOffer:
    magic, version, _, head_len = _PREFIX.unpack_from(payload, 0)
    if magic != _MAGIC or version != _VERSION:
        raise InvariantError(
            f"round payload has magic {magic:#x} version {version}, expected {_MAGIC:#x} "
            f"version {_VERSION}: every daemon of a job must run the same odbd release"
        )
    pos = _PREFIX.size
    header = json.loads(payload[pos : pos + head_len])
    pos += head_len
    units = []
    for unit, dry, n in header["units"]:
        columns = []
        for _, dtype in _COLUMNS:
            width = np.dtype(dtype).itemsize * n
            columns.append(
                np.frombuffer(payload, dtype=dtype, count=n, offset=pos).astype(np.int64)
            )
            pos += width
        units.append(UnitOffer(int(unit), SampleTable(*columns), bool(dry)))
    m = int(header.get("observations", 0))
    observations = np.frombuffer(payload, dtype="<f8", count=3 * m, offset=pos)
    pos += 24 * m
    if pos != len(payload):
        raise InvariantError(f"round payload has {len(payload) - pos} trailing bytes")
    resume = header.get("resume")
    schema = header.get("schema")
    return NodeOffer(
        int(header["node"]),
        int(header["epoch"]),
        tuple(units),
        header["rejected"],
        tuple(resume) if resume else None,  # type: ignore[arg-type]
        observations.astype(np.float64).reshape(m, 3),
        (int(schema[0]), str(schema[1])) if schema else None,
        tuple((int(r), int(e), int(s)) for r, e, s in header.get("ended", [])),
    )
