"""The migration exchange's payloads on the split planner (issue 26 item 1 a), and the hub's
reduction: every node's digest (planner/migration_digest.py) -> the round's moves.

Digest payload, version 1 (little-endian), one per node:
    u32 magic 0x4f444253 (summary_codec's family), u16 version, u16 kind 6, u32 node,
    u32 num_units; then per unit: u32 unit, u8 dry, u32 num_buckets, then that many
    int32 bucket, uint32 count, int64 summed length, int64 summed patches, int64 summed bytes,
    uint16 oldest age (34 bytes a bucket: a few hundred buckets per node, never per sample);
    then u16 length and the UTF-8 "host:port" of the node's bulk port (round/bulk.py)
Moves payload, version 1 (kind 7), the hub's result:
    u32 round, u16 bins, u16 flags (bit 0: dealt), f64 gain s, f64 move s, u32 num_units; then
    a table of num_units (u32 unit, u32 byte offset of its section); then per unit: u32 sends,
    u32 holds, sends x (int32 bucket, uint32 target unit, uint32 count), holds x (int32 bucket,
    u32 count)
    then the nodes' bulk addresses (UTF-8 JSON list, node order), then u32 its length
A node decodes only its own units' sections (the table says where they are): what it reads is
O(its moves). The barrier broadcasts the hub's one result (round/barrier.py exchange_reduced),
so every node still receives every section: O(units x moved buckets), counts, never samples.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import numpy as np

from odbd.daemon.payload_checks import decoded, refuse_out_of_range
from odbd.errors import InvariantError
from odbd.planner.config import PlannerConfig
from odbd.planner.migration import LinkModel
from odbd.planner.migration_digest import MoveDecision, UnitDigest, UnitMoves, hub_moves
from odbd.planner.round import units_of_node

_MAGIC = 0x4F444253
_VERSION = 1
_DIGEST, _MOVES = 6, 7
_PREFIX = struct.Struct("<IHH")
_DIGEST_HEAD = struct.Struct("<II")
_UNIT_HEAD = struct.Struct("<IBI")
_BUCKET = np.dtype(
    [("b", "<i4"), ("n", "<u4"), ("len", "<i8"), ("pat", "<i8"), ("by", "<i8"), ("age", "<u2")]
)
_MOVES_HEAD = struct.Struct("<IHHddI")
_ENTRY = struct.Struct("<II")
_DEALT = 1  # the moves payload's flags
_SEND = np.dtype([("b", "<i4"), ("to", "<u4"), ("n", "<u4")])
_HOLD = np.dtype([("b", "<i4"), ("n", "<u4")])


def encode_digest(node: int, digests: Sequence[UnitDigest], address: str = "") -> bytes:
    parts = [_PREFIX.pack(_MAGIC, _VERSION, _DIGEST), _DIGEST_HEAD.pack(node, len(digests))]
    for d in digests:
        rows = np.zeros(d.buckets.shape[0], dtype=_BUCKET)
        rows["b"], rows["n"], rows["len"] = d.buckets, d.counts, d.lengths
        rows["pat"], rows["by"], rows["age"] = d.patches, d.nbytes, np.minimum(d.ages, 0xFFFF)
        parts += [_UNIT_HEAD.pack(d.unit, d.dry, rows.shape[0]), rows.tobytes()]
    where = address.encode()
    parts += [struct.pack("<H", len(where)), where]
    return b"".join(parts)


def decode_digest(payload: bytes) -> tuple[int, list[UnitDigest]]:
    node, digests, _ = decode_digest_addressed(payload)
    return node, digests


def decode_digest_addressed(payload: bytes) -> tuple[int, list[UnitDigest], str]:
    _check_prefix(payload, _DIGEST)
    node, num_units = _DIGEST_HEAD.unpack_from(payload, _PREFIX.size)
    pos = _PREFIX.size + _DIGEST_HEAD.size
    out = []
    for _ in range(num_units):
        unit, dry, k = _UNIT_HEAD.unpack_from(payload, pos)
        pos += _UNIT_HEAD.size
        rows = np.frombuffer(payload, dtype=_BUCKET, count=k, offset=pos)
        pos += k * _BUCKET.itemsize
        out.append(
            UnitDigest(
                unit,
                bool(dry),
                rows["b"].astype(np.int64),
                rows["n"].astype(np.int64),
                rows["len"].astype(np.int64),
                rows["pat"].astype(np.int64),
                rows["by"].astype(np.int64),
                rows["age"].astype(np.int64),
            )  # fmt: skip
        )
    (size,) = struct.unpack_from("<H", payload, pos)
    address = payload[pos + 2 : pos + 2 + size].decode()
    pos += 2 + size
    if pos != len(payload):
        raise InvariantError(f"digest of node {node} has {len(payload) - pos} trailing bytes")
    return node, out, address


def digest_problem(node: int, digests: Sequence[UnitDigest], config: PlannerConfig) -> str | None:
    """Why a node's digest cannot be planned from, or None: its units must be its own, each
    bucket's counts positive and ascending buckets, its samples no more than a buffer holds."""
    mine = units_of_node(config, node)
    if [d.unit for d in digests] != list(mine):
        return f"units {[d.unit for d in digests]}, expected {list(mine)}"
    for d in digests:
        if (d.counts < 1).any() or (np.diff(d.buckets) <= 0).any():
            return f"unit {d.unit}: empty or unordered buckets"
        if d.num_samples > 4 * config.unit_capacity + 1024:
            return (
                f"unit {d.unit}: {d.num_samples} samples, its buffer holds {config.unit_capacity}"
            )
        if (d.lengths < d.counts).any() or (d.nbytes < d.counts).any() or (d.patches < 0).any():
            return f"unit {d.unit}: a bucket's lengths or bytes below one per sample"
    return None


def hub_migrate(
    payloads: Sequence[bytes], config: PlannerConfig, link: LinkModel, round_index: int
) -> bytes:
    """The hub's reduction: every node's digest in node order -> the round's moves payload.
    A digest that cannot be read or is out of range fails the job naming its node."""
    digests: list[UnitDigest] = []
    addresses: list[str] = []
    for n, p in enumerate(payloads):
        node, mine, address = decoded(
            decode_digest_addressed, p, "migration digest", n, round_index
        )
        problem = digest_problem(n, mine, config) if node == n else f"it claims node {node}"
        refuse_out_of_range(problem, "migration digest", n, round_index)
        digests += mine
        addresses.append(address)
    return encode_moves(hub_moves(digests, config, link), round_index, addresses)


def encode_moves(decision: MoveDecision, round_index: int, addresses: Sequence[str] = ()) -> bytes:
    sections = []
    for m in decision.moves:
        sends = np.zeros(m.send_buckets.shape[0], dtype=_SEND)
        sends["b"], sends["to"], sends["n"] = m.send_buckets, m.send_targets, m.send_counts
        holds = np.zeros(m.hold_buckets.shape[0], dtype=_HOLD)
        holds["b"], holds["n"] = m.hold_buckets, m.hold_counts
        sections.append(_ENTRY.pack(len(sends), len(holds)) + sends.tobytes() + holds.tobytes())
    head = _PREFIX.pack(_MAGIC, _VERSION, _MOVES) + _MOVES_HEAD.pack(
        round_index,
        decision.bins,
        _DEALT if decision.dealt else 0,
        decision.gain_s,
        decision.move_s,
        len(sections),
    )
    start = len(head) + _ENTRY.size * len(sections)
    table, offsets = [], start
    for m, s in zip(decision.moves, sections, strict=True):
        table.append(_ENTRY.pack(m.unit, offsets))
        offsets += len(s)
    blob = json.dumps(list(addresses)).encode()
    trailer = blob + struct.pack("<I", len(blob))
    return head + b"".join(table) + b"".join(sections) + trailer


def decode_addresses(payload: bytes) -> list[str]:
    """The nodes' bulk addresses, node order, from the hub's moves payload."""
    _check_prefix(payload, _MOVES)
    (size,) = struct.unpack_from("<I", payload, len(payload) - 4)
    raw = json.loads(payload[len(payload) - 4 - size : len(payload) - 4])
    return [str(a) for a in raw]


def decision_of_moves(payload: bytes) -> str:
    """What the hub decided, for /metrics: "none" (no sample moves; some may wait), "balanced"
    (cost levels evened, migration.py) or "dealt" (the world's groups dealt, migration_deal.py)."""
    _check_prefix(payload, _MOVES)
    _, bins, flags, _, _, _ = _MOVES_HEAD.unpack_from(payload, _PREFIX.size)
    if flags & _DEALT:
        return "dealt"
    return "balanced" if bins else "none"


def decode_moves(payload: bytes, units: Sequence[int]) -> tuple[int, list[UnitMoves]]:
    """(round, the moves of `units` only): a node reads its own sections, skipping the rest."""
    _check_prefix(payload, _MOVES)
    round_index, _bins, _, _gain, _move, n = _MOVES_HEAD.unpack_from(payload, _PREFIX.size)
    pos = _PREFIX.size + _MOVES_HEAD.size
    where = dict(_ENTRY.iter_unpack(payload[pos : pos + n * _ENTRY.size]))
    out = []
    for unit in units:
        if unit not in where:
            raise InvariantError(f"the hub's moves of round {round_index} omit unit {unit}")
        at = where[unit]
        sends_n, holds_n = _ENTRY.unpack_from(payload, at)
        at += _ENTRY.size
        sends = np.frombuffer(payload, dtype=_SEND, count=sends_n, offset=at)
        holds = np.frombuffer(payload, _HOLD, holds_n, at + sends_n * _SEND.itemsize)
        out.append(
            UnitMoves(
                unit,
                sends["b"].astype(np.int64),
                sends["to"].astype(np.int64),
                sends["n"].astype(np.int64),
                holds["b"].astype(np.int64),
                holds["n"].astype(np.int64),
            )  # fmt: skip
        )
    return int(round_index), out


def _check_prefix(payload: bytes, kind: int) -> None:
    magic, version, got = _PREFIX.unpack_from(payload, 0)
    if magic != _MAGIC or version != _VERSION or got != kind:
        raise InvariantError(
            f"migration payload has magic {magic:#x} version {version} kind {got}, expected "
            f"{_MAGIC:#x} version {_VERSION} kind {kind}: every daemon of a job must run the "
            "same odbd release"
        )


# -- round 0 after a restart: view keys beside the digests and the moves ------------------

_KEYS_HEAD = struct.Struct("<Q")


def with_keys(keys: np.ndarray, payload: bytes) -> bytes:
    """`payload` after a section of view keys (u64 count, int64 keys): round 0's moves
    exchange carries each node's trained foreign views, its result their union."""
    return _KEYS_HEAD.pack(len(keys)) + keys.astype("<i8").tobytes() + payload


def split_keys(payload: bytes) -> tuple[np.ndarray, bytes]:
    """(keys, the rest) of a with_keys payload; InvariantError if it cannot hold them."""
    if len(payload) < _KEYS_HEAD.size:
        raise InvariantError(
            "round 0's moves exchange carried no trained-views section; every daemon of a "
            "job must run the same odbd release"
        )
    (n,) = _KEYS_HEAD.unpack_from(payload, 0)
    end = _KEYS_HEAD.size + 8 * n
    if end > len(payload):
        raise InvariantError(
            f"round 0's moves exchange names {n} trained views in {len(payload)} bytes; "
            "every daemon of a job must run the same odbd release"
        )
    keys = np.frombuffer(payload, dtype="<i8", count=n, offset=_KEYS_HEAD.size)
    return keys.astype(np.int64), payload[end:]
