"""The split round's two payloads (planner/summary.py lists the phases), encoded as bytes.

Summary payload, version 1 (little-endian), instead of offer_codec's samples:
    u32 magic 0x4f444253 ("ODBS"), u16 version, u16 kind (1 = summary), u32 node,
    u32 epoch, u16 num_units, u16 side_bytes, u32 observations (m)
    then num_units records of u32 unit, u8 dry, u32 num_samples, u32 num_groups, u32 max_length,
    u16 profile_len
    then side_bytes of UTF-8 JSON {"rejected": {reason: count}, "resume": [epoch, step] | null,
    and "schema": [hash, text], "ended": [[rank, epoch, step]] when set} (0 bytes in the usual
    round: nothing rejected, no restart, no schema chosen yet or none sent, nobody ended)
    then per unit profile_len float64 (its costliest groups' work, descending)
    then m rows of float64 [padded tokens, sum of squared lengths, seconds] (cost_learning.py)
Totals payload, version 1:
    u32 magic, u16 version, u16 kind (2 = totals), u32 node, u32 num_steps, u8 drained,
    u8 has_approx, u8 count_bytes (4 or 8), u8 reserved
    then num_steps loss tokens, num_steps samples (int32 when every count fits, else int64),
    [num_steps float64 approx weights]

Sizes do not grow with the buffer: at most ~8 KiB per unit (company.py's profile of PROFILE_DEPTH
float64s) plus 8 bytes per step, against offer
codec's 24 bytes per buffered sample (192 KiB per 8-rank node at --buffer 1024). Floats travel
as their IEEE bytes, so every daemon decides from bit-identical summaries.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from odbd.errors import InvariantError
from odbd.planner.types import StepTotals, UnitSummary

_MAGIC = 0x4F444253
_VERSION = 1
_SUMMARY, _TOTALS = 1, 2
_PREFIX = struct.Struct("<IHHI")
_SUMMARY_HEAD = struct.Struct("<IHHI")
_UNIT = struct.Struct("<IBIIIH")
_TOTALS_HEAD = struct.Struct("<IHHIIBBBB")
_INT32_MAX = 2**31 - 1
_COUNT_DTYPES: dict[int, np.dtype[Any]] = {4: np.dtype("<i4"), 8: np.dtype("<i8")}


@dataclass(frozen=True, slots=True)
class NodeSummary:
    """One node's first payload of a round: its units' summaries and the round's side facts."""

    node: int
    epoch: int
    units: tuple[UnitSummary, ...]
    rejected: dict[str, int] = field(default_factory=dict)
    resume: tuple[int, int] | None = None
    observations: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    # The live round's other side facts (daemon/split_round.py), in the side JSON when set:
    # the node's chosen sample schema (hash, description) and its ranks' end_job() points.
    schema: tuple[int, str] | None = None
    ended: tuple[tuple[int, int, int], ...] = ()


def encode_summary(summary: NodeSummary) -> bytes:
    side = b""
    if summary.rejected or summary.resume or summary.schema or summary.ended:
        facts: dict[str, Any] = {"rejected": summary.rejected, "resume": summary.resume}
        if summary.schema:
            facts["schema"] = list(summary.schema)
        if summary.ended:
            facts["ended"] = [list(e) for e in summary.ended]
        side = json.dumps(facts, separators=(",", ":")).encode()
    m = int(summary.observations.shape[0])
    parts = [
        _PREFIX.pack(_MAGIC, _VERSION, _SUMMARY, summary.node),
        _SUMMARY_HEAD.pack(summary.epoch, len(summary.units), len(side), m),
    ]
    parts += [
        _UNIT.pack(u.unit, u.dry, u.num_samples, u.num_groups, u.max_length, len(u.profile))
        for u in summary.units
    ]
    parts.append(side)
    parts += [np.ascontiguousarray(u.profile, dtype="<f8").tobytes() for u in summary.units]
    parts.append(np.ascontiguousarray(summary.observations, dtype="<f8").tobytes())
    return b"".join(parts)


def decode_summary(payload: bytes) -> NodeSummary:
    """Binary records rather than a JSON header: a daemon decodes one payload per node and
    round, ~1,000 of them at W = 8192, so each must cost a few microseconds."""
    node = _check_prefix(payload, _SUMMARY)
    epoch, num_units, side_bytes, m = _SUMMARY_HEAD.unpack_from(payload, _PREFIX.size)
    pos = _PREFIX.size + _SUMMARY_HEAD.size
    records = list(_UNIT.iter_unpack(payload[pos : pos + num_units * _UNIT.size]))
    pos += num_units * _UNIT.size
    facts = json.loads(payload[pos : pos + side_bytes]) if side_bytes else {}
    pos += side_bytes
    units = []
    for unit, dry, num_samples, num_groups, max_length, depth in records:
        profile = np.frombuffer(payload, dtype="<f8", count=depth, offset=pos)
        pos += 8 * depth
        units.append(UnitSummary(unit, bool(dry), num_samples, num_groups, max_length, profile))
    observations = np.frombuffer(payload, dtype="<f8", count=3 * m, offset=pos)
    pos += 24 * m
    _check_end(payload, pos)
    resume = facts.get("resume")
    schema = facts.get("schema")
    return NodeSummary(
        node,
        epoch,
        tuple(units),
        facts.get("rejected", {}),
        (int(resume[0]), int(resume[1])) if resume else None,
        observations.reshape(m, 3),
        (int(schema[0]), str(schema[1])) if schema else None,
        tuple((int(r), int(e), int(s)) for r, e, s in facts.get("ended", [])),
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
    count = _COUNT_DTYPES.get(width)
    if count is None:
        raise InvariantError(f"step totals payload of node {node} has {width}-byte counts")
    pos = _TOTALS_HEAD.size
    tokens = np.frombuffer(payload, dtype=count, count=steps, offset=pos).astype(np.int64)
    samples = np.frombuffer(payload, count, steps, offset=pos + width * steps).astype(np.int64)
    pos += 2 * width * steps
    approx = np.zeros(0)
    if has_approx:
        approx = np.frombuffer(payload, dtype="<f8", count=steps, offset=pos)
        pos += 8 * steps
    _check_end(payload, pos)
    return StepTotals(node, tokens, samples, approx, bool(drained))


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
