"""The split round's two payloads (planner/summary.py lists the phases), encoded as bytes.

Summary payload, version 1 (little-endian), instead of offer_codec's samples:
    u32 magic 0x4f444253 ("ODBS"), u16 version, u16 kind (1 = summary), u32 header_bytes
    header: UTF-8 JSON {"node", "epoch", "rejected", "resume",
            "units": [[unit, dry, num_samples, num_groups, max_length, profile_len]],
            "observations": m}
    then per unit profile_len float64 (its costliest groups' work, descending)
    then m rows of float64 [padded tokens, sum of squared lengths, seconds] (cost_learning.py)
Totals payload, version 1:
    u32 magic, u16 version, u16 kind (2 = totals), u32 node, u32 num_steps, u8 drained,
    u8 has_approx, u8 count_bytes (4 or 8), u8 reserved
    then num_steps loss tokens, num_steps samples (int32 when every count fits, else int64),
    [num_steps float64 approx weights]

Sizes do not grow with the buffer: ~0.6 KiB per unit plus 8 bytes per step, against offer
codec's 20 bytes per buffered sample (164 KiB per 8-rank node at --buffer 1024). Floats travel
as their IEEE bytes, so every daemon decides from bit-identical summaries.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from odbd.errors import InvariantError
from odbd.planner.types import StepTotals, UnitSummary

_MAGIC = 0x4F444253
_VERSION = 1
_SUMMARY, _TOTALS = 1, 2
_PREFIX = struct.Struct("<IHHI")
_TOTALS_HEAD = struct.Struct("<IHHIIBBBB")
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class NodeSummary:
    """One node's first payload of a round: its units' summaries and the round's side facts."""

    node: int
    epoch: int
    units: tuple[UnitSummary, ...]
    rejected: dict[str, int] = field(default_factory=dict)
    resume: tuple[int, int] | None = None
    observations: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))


def encode_summary(summary: NodeSummary) -> bytes:
    header = {
        "node": summary.node,
        "epoch": summary.epoch,
        "rejected": summary.rejected,
        "resume": list(summary.resume) if summary.resume else None,
        "units": [
            [u.unit, u.dry, u.num_samples, u.num_groups, u.max_length, len(u.profile)]
            for u in summary.units
        ],
        "observations": int(summary.observations.shape[0]),
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [_PREFIX.pack(_MAGIC, _VERSION, _SUMMARY, len(head)), head]
    parts += [np.ascontiguousarray(u.profile, dtype="<f8").tobytes() for u in summary.units]
    parts.append(np.ascontiguousarray(summary.observations, dtype="<f8").tobytes())
    return b"".join(parts)


def decode_summary(payload: bytes) -> NodeSummary:
    head_len = _check_prefix(payload, _SUMMARY)
    pos = _PREFIX.size
    header = json.loads(payload[pos : pos + head_len])
    pos += head_len
    units = []
    for unit, dry, num_samples, num_groups, max_length, depth in header["units"]:
        profile = np.frombuffer(payload, dtype="<f8", count=depth, offset=pos)
        pos += 8 * depth
        units.append(
            UnitSummary(
                int(unit), bool(dry), int(num_samples), int(num_groups), int(max_length),
                profile.astype(np.float64),
            )
        )  # fmt: skip
    m = int(header["observations"])
    observations = np.frombuffer(payload, dtype="<f8", count=3 * m, offset=pos)
    pos += 24 * m
    _check_end(payload, pos)
    resume = header["resume"]
    return NodeSummary(
        int(header["node"]),
        int(header["epoch"]),
        tuple(units),
        header["rejected"],
        (int(resume[0]), int(resume[1])) if resume else None,
        observations.astype(np.float64).reshape(m, 3),
    )


def encode_totals(totals: StepTotals) -> bytes:
    steps = int(totals.num_tokens.shape[0])
    has_approx = totals.approx_weights.size > 0
    # A node's tokens per step fit int32 unless its ranks hold ~2^31 tokens in one step: half
    # the bytes nearly always, exact always.
    largest = max(int(totals.num_tokens.max(initial=0)), int(totals.num_samples.max(initial=0)))
    width = 4 if largest <= _INT32_MAX else 8
    head = _TOTALS_HEAD.pack(
        _MAGIC, _VERSION, _TOTALS, totals.node, steps, totals.drained, has_approx, width, 0
    )
    parts = [head, totals.num_tokens.astype(f"<i{width}").tobytes()]
    parts.append(totals.num_samples.astype(f"<i{width}").tobytes())
    if has_approx:
        parts.append(np.ascontiguousarray(totals.approx_weights, dtype="<f8").tobytes())
    return b"".join(parts)


def decode_totals(payload: bytes) -> StepTotals:
    _check_prefix(payload, _TOTALS)
    _, _, _, node, steps, drained, has_approx, width, _ = _TOTALS_HEAD.unpack_from(payload, 0)
    if width not in (4, 8):
        raise InvariantError(f"step totals payload of node {node} has {width}-byte counts")
    pos = _TOTALS_HEAD.size
    columns = []
    for dtype in (f"<i{width}", f"<i{width}") + (("<f8",) if has_approx else ()):
        columns.append(np.frombuffer(payload, dtype=dtype, count=steps, offset=pos))
        pos += np.dtype(dtype).itemsize * steps
    _check_end(payload, pos)
    approx = columns[2].astype(np.float64) if has_approx else np.zeros(0)
    return StepTotals(
        int(node), columns[0].astype(np.int64), columns[1].astype(np.int64), approx, bool(drained)
    )


def _check_prefix(payload: bytes, kind: int) -> int:
    """Checks magic, version and kind; returns the u32 after them (header bytes or node)."""
    magic, version, got, value = _PREFIX.unpack_from(payload, 0)
    if magic != _MAGIC or version != _VERSION or got != kind:
        raise InvariantError(
            f"round payload has magic {magic:#x} version {version} kind {got}, expected "
            f"{_MAGIC:#x} version {_VERSION} kind {kind}: every daemon of a job must run the "
            "same odbd release"
        )
    return int(value)


def _check_end(payload: bytes, pos: int) -> None:
    if pos != len(payload):
        raise InvariantError(f"round payload has {len(payload) - pos} trailing bytes")
