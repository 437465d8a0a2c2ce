"""--align updates on the split planner (issue 26 on issue 25's live round): a third exchange.

Under --align updates each unit's groups of an update are dealt again over its ranks by cost
(planner/update_align.py), and an update then spans as many steps as the busiest rank of any
node runs micro-steps. No node knows that alone, nor the world's samples and tokens per step
of the new grid (progress, /metrics), so a round is three exchanges, each reduced by the hub:

1. summaries -> the decision (split_round.py, unchanged).
2. step totals -> round totals, for two alternatives: the step plan (groups split to fill the
   round's slots) and the whole plan (no group split, short units leave slots idle; their
   ranks skip them). A node that split nothing sends the same totals twice.
3. each node's deal of every update, for both alternatives: per update its longest run and its
   slowest rank's time, per position of a run its samples, loss tokens, slowest and summed
   rank cost (update_align.NodeDeal) -> the grid (update_align.UpdateGrid): which alternative
   the round takes (the one whose updates end sooner, the split one on a tie), each update's
   length, and per step of the grid the world's samples, tokens and costs.

Each node then moves its own part of the chosen alternative onto the grid (align_node). The
parts are plan_round's byte for byte (tests/unit/test_split_round.py). Loss scales are set
before the deal, over each update's totals, which the deal does not change (a group keeps its
samples and its update), so they stay exact. A node receives O(1 + T) per exchange, as before.

Payloads, after split_round's u32 magic, u16 version, u16 kind:
    node alternatives (kind 6), round alternatives (kind 7): u32 count, then per alternative
        u32 bytes and split_round's node totals (kind 5) or round totals (kind 4) payload
    node deals (kind 8): u32 count; per alternative u32 W, u32 positions, W int64 lengths,
        W float64 times, then positions int64 samples, int64 tokens, float64 slowest cost,
        float64 summed cost
    grid (kind 9): u32 chosen, u32 W, u32 steps, float64 time, W int64 lengths, then steps
        int64 samples, int64 tokens, float64 slowest cost, float64 summed cost
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

import numpy as np

from odbd.daemon import split_round
from odbd.daemon.payload_checks import decoded
from odbd.errors import InvariantError
from odbd.planner.config import Align, PlannerConfig
from odbd.planner.identities import IdentitySource, StepIdentities
from odbd.planner.node_plan import NodeDraft, plan_node
from odbd.planner.summary import GroupedUnit
from odbd.planner.types import NodeRoundPlan, RoundDecision
from odbd.planner.update_align import (
    NodeDeal,
    UpdateGrid,
    align_node,
    deal_node,
    pick_grid,
    reduce_deals,
)
from odbd.planner.windows import Windows

_NODE_ALTERNATIVES, _ROUND_ALTERNATIVES, _NODE_DEALS, _GRID = 6, 7, 8, 9
_U32 = struct.Struct("<I")
_DEALS_HEAD = struct.Struct("<II")
_GRID_HEAD = struct.Struct("<IIId")
Completed = tuple[NodeRoundPlan, split_round.RoundExtras]


def exchanges_per_round(config: PlannerConfig) -> int:
    """Barrier exchanges per planner round: 3 with --align updates, else 2 (split_round)."""
    return 3 if config.align is Align.UPDATES else 2


# -- exchange 2, two alternatives -----------------------------------------------------------


def node_totals(
    node: int,
    grouped: Sequence[GroupedUnit],
    decision: RoundDecision,
    config: PlannerConfig,
    source: IdentitySource | None = None,
) -> tuple[list[NodeDraft], bytes]:
    """Phase 2 for both alternatives: the split (step) plan's draft and the whole one's
    (`source`: this node's views' identities, for EpochEnd's count)."""
    split = plan_node(node, grouped, decision, dataclasses.replace(config, align=Align.STEPS))
    # no group split: the whole plan is the same (alignment.fit_groups pads alike)
    split_any = any(u.num_splits for u in split.units)
    whole = plan_node(node, grouped, decision, config) if split_any else split
    drafts = [split, whole]
    payloads = [
        split_round.encode_node_totals(d.totals, split_round.node_extras(d, config, source))
        for d in drafts
    ]
    return drafts, _pack(_NODE_ALTERNATIVES, payloads)


def hub_combine(payloads: Sequence[bytes], num_steps: int) -> bytes:
    """Exchange 2 at the hub: each alternative's node totals summed (split_round.hub_combine)."""
    per_node = [_decoded_alternatives(p, n, _NODE_ALTERNATIVES) for n, p in enumerate(payloads)]
    count = len(per_node[0]) if per_node else 0
    bad = [n for n, alts in enumerate(per_node) if len(alts) != count]
    if bad or count == 0:
        raise InvariantError(f"nodes {bad} sent other than {count} alternatives' step totals")
    combined = [
        split_round.hub_combine([alts[i] for alts in per_node], num_steps) for i in range(count)
    ]
    return _pack(_ROUND_ALTERNATIVES, combined)


def node_complete(
    drafts: Sequence[NodeDraft], decision: RoundDecision, payload: bytes, config: PlannerConfig
) -> list[Completed]:
    """Phase 3 for both alternatives: this node's loss scales and updates over their totals."""
    results = _unpack(payload, _ROUND_ALTERNATIVES)
    if len(results) != len(drafts):
        raise InvariantError(
            f"the hub sent {len(results)} alternatives' round totals, this node planned "
            f"{len(drafts)}"
        )
    steps = dataclasses.replace(config, align=Align.STEPS)
    return [
        split_round.node_complete(d, decision, r, steps)
        for d, r in zip(drafts, results, strict=True)
    ]


# -- exchange 3, the deals -> the grid ----------------------------------------------------------


def node_deals(
    parts: Sequence[Completed], first: int, config: PlannerConfig
) -> tuple[list[NodeDeal], bytes]:
    """Every update of each alternative dealt over this node's ranks (first = its first rank)."""
    deals = [deal_node(p.stats, p.units, p.windows, first, config) for p, _ in parts]
    return deals, encode_deals(deals)


def hub_grid(payloads: Sequence[bytes], windows: Sequence[Windows]) -> bytes:
    """Exchange 3 at the hub: every node's deals -> the round's grid (`windows`: each
    alternative's updates, the same on every node)."""
    per_node = [decoded(decode_deals, p, "update deals", n, None) for n, p in enumerate(payloads)]
    for n, deals in enumerate(per_node):
        sizes = [len(d.lengths) for d in deals]
        if sizes != [len(w) for w in windows]:
            raise InvariantError(
                f"node {n} dealt {sizes} updates, the round's alternatives have "
                f"{[len(w) for w in windows]}"
            )
    grids = [reduce_deals([deals[i] for deals in per_node], w) for i, w in enumerate(windows)]
    chosen = pick_grid(grids)
    return encode_grid(chosen, grids[chosen])


def node_align(
    parts: Sequence[Completed],
    deals: Sequence[NodeDeal],
    payload: bytes,
    first: int,
    config: PlannerConfig,
) -> Completed:
    """This node's part of the chosen alternative on the round's grid, and the round's extras
    with the grid's per-step costs."""
    chosen, grid = decode_grid(payload)
    if not 0 <= chosen < len(parts):
        raise InvariantError(f"the hub chose alternative {chosen} of {len(parts)}")
    plan, extras = parts[chosen]
    if grid.lengths.shape != (len(plan.windows),):
        raise InvariantError(
            f"the hub's grid holds {grid.lengths.shape[0]} updates, the round has "
            f"{len(plan.windows)}"
        )
    aligned = align_node(plan, first, deals[chosen], grid, config)
    moved = dataclasses.replace(
        extras,
        step_max_work=grid.max_work,
        step_sum_work=grid.sum_work,
        identities=_identities_on_grid(extras.identities, plan.windows, grid.lengths),
    )
    return aligned, moved


def _identities_on_grid(
    identities: StepIdentities | None, windows: Windows, lengths: np.ndarray
) -> StepIdentities | None:
    """The round's identities per step moved onto the grid: each update's at its first step
    (a round is kept or cut whole updates at a time, and an update lies in one epoch, so the
    epoch's count is the same wherever in its update a step's identities are counted)."""
    if identities is None:
        return None
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    new_step = np.zeros(identities.num_steps, dtype=np.int64)
    for w in range(len(windows)):
        new_step[int(windows.starts[w]) : int(windows.ends[w])] = starts[w]
    singles = np.zeros(int(lengths.sum()), dtype=np.int64)
    np.add.at(singles, new_step, identities.singles)
    rows = identities.repeated.copy()
    if len(rows):
        rows[:, 0] = new_step[rows[:, 0]]
    return StepIdentities(singles, np.unique(rows, axis=0) if len(rows) else rows)


# -- codecs --------------------------------------------------------------------------------------


def _pack(kind: int, payloads: Sequence[bytes]) -> bytes:
    parts = [split_round._PREFIX.pack(split_round._MAGIC, split_round._VERSION, kind)]
    parts.append(_U32.pack(len(payloads)))
    for p in payloads:
        parts += [_U32.pack(len(p)), p]
    return b"".join(parts)


def _unpack(payload: bytes, kind: int) -> list[bytes]:
    split_round._check_prefix(payload, kind)
    pos = split_round._PREFIX.size
    (count,) = _U32.unpack_from(payload, pos)
    pos += _U32.size
    out = []
    for _ in range(count):
        (size,) = _U32.unpack_from(payload, pos)
        pos += _U32.size
        if pos + size > len(payload):
            raise InvariantError(f"round payload cut short: {size} bytes announced")
        out.append(payload[pos : pos + size])
        pos += size
    split_round._check_end(payload, pos)
    return out


def _decoded_alternatives(payload: bytes, node: int, kind: int) -> list[bytes]:
    return decoded(lambda p: _unpack(p, kind), payload, "update alternatives", node, None)


def encode_deals(deals: Sequence[NodeDeal]) -> bytes:
    parts = [
        split_round._PREFIX.pack(split_round._MAGIC, split_round._VERSION, _NODE_DEALS),
        _U32.pack(len(deals)),
    ]
    for d in deals:
        parts += [
            _DEALS_HEAD.pack(len(d.lengths), len(d.num_samples)),
            d.lengths.astype("<i8").tobytes(),
            d.times.astype("<f8").tobytes(),
            *_columns_bytes(d.num_samples, d.num_tokens, d.max_work, d.sum_work),
        ]
    return b"".join(parts)


def decode_deals(payload: bytes) -> list[NodeDeal]:
    split_round._check_prefix(payload, _NODE_DEALS)
    pos = split_round._PREFIX.size
    (count,) = _U32.unpack_from(payload, pos)
    pos += _U32.size
    out = []
    for _ in range(count):
        num_windows, positions = _DEALS_HEAD.unpack_from(payload, pos)
        pos += _DEALS_HEAD.size
        lengths = _ints(payload, pos, num_windows)
        times = _floats(payload, pos + 8 * num_windows, num_windows)
        pos += 16 * num_windows
        if int(lengths.sum()) != positions or (lengths < 0).any():
            raise InvariantError(
                f"a deal of {positions} positions has update lengths summing to "
                f"{int(lengths.sum())}"
            )
        if not np.isfinite(times).all() or (times < 0).any():
            raise InvariantError("a deal's update times are negative or not finite")
        columns, pos = _read_columns(payload, pos, positions)
        out.append(NodeDeal((), lengths, times, *columns))
    split_round._check_end(payload, pos)
    return out


def encode_grid(chosen: int, grid: UpdateGrid) -> bytes:
    steps = int(grid.num_samples.shape[0])
    return b"".join(
        [
            split_round._PREFIX.pack(split_round._MAGIC, split_round._VERSION, _GRID),
            _GRID_HEAD.pack(chosen, len(grid.lengths), steps, grid.time),
            grid.lengths.astype("<i8").tobytes(),
            *_columns_bytes(grid.num_samples, grid.num_tokens, grid.max_work, grid.sum_work),
        ]
    )


def decode_grid(payload: bytes) -> tuple[int, UpdateGrid]:
    split_round._check_prefix(payload, _GRID)
    pos = split_round._PREFIX.size
    chosen, num_windows, steps, time = _GRID_HEAD.unpack_from(payload, pos)
    pos += _GRID_HEAD.size
    lengths = _ints(payload, pos, num_windows)
    pos += 8 * num_windows
    if int(lengths.sum()) != steps:
        raise InvariantError(f"the hub's grid of {steps} steps has updates of {lengths.tolist()}")
    (samples, tokens, max_work, sum_work), pos = _read_columns(payload, pos, steps)
    split_round._check_end(payload, pos)
    return chosen, UpdateGrid(lengths, samples, tokens, max_work, sum_work, time)


def _columns_bytes(*columns: np.ndarray) -> list[bytes]:
    s, t, mx, sm = columns
    return [
        s.astype("<i8").tobytes(),
        t.astype("<i8").tobytes(),
        np.ascontiguousarray(mx, dtype="<f8").tobytes(),
        np.ascontiguousarray(sm, dtype="<f8").tobytes(),
    ]


def _read_columns(
    payload: bytes, pos: int, n: int
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], int]:
    columns = (
        _ints(payload, pos, n),
        _ints(payload, pos + 8 * n, n),
        _floats(payload, pos + 16 * n, n),
        _floats(payload, pos + 24 * n, n),
    )
    return columns, pos + 32 * n


def _ints(payload: bytes, pos: int, n: int) -> np.ndarray:
    if pos + 8 * n > len(payload):
        raise InvariantError(f"round payload cut short: {n} values announced")
    return np.frombuffer(payload, dtype="<i8", count=n, offset=pos).astype(np.int64)


def _floats(payload: bytes, pos: int, n: int) -> np.ndarray:
    if pos + 8 * n > len(payload):
        raise InvariantError(f"round payload cut short: {n} values announced")
    return np.frombuffer(payload, dtype="<f8", count=n, offset=pos).astype(np.float64)
