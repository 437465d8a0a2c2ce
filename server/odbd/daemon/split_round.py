"""The round on the split planner, as the live daemons exchange it (issue 25): who computes what.

Two exchanges per round, each reduced by the hub to one small result for every node:

1. summaries: each node groups its own units (planner/summary.py) and sends a NodeSummary
   (summary_codec.py: ~40 bytes per unit plus the round's side facts). The hub alone decides the
   round from them (planner/decision.py) and merges the side facts; every node gets the same
   DecisionPayload: T, all_dry, select_fullest, company.py's cap profile and the merged facts,
   O(1) per node whatever the node count (the step order follows from T, the seed and the
   round, so it does not travel).
2. step totals: each node fits its own units to T steps (planner/node_plan.py) and sends its
   StepTotals (2 counts per step); the hub sums them (planner/completion.combine) and every node
   gets the RoundTotals, 16 bytes per step: exactly what exact loss scales and
   --tokens-per-update need, and 16 more per step for /metrics' step cost imbalance (the
   slowest and the summed rank cost). Each node then completes its own part (complete_node).

No node's samples leave it: the hub sends O(N x (1 + T)) bytes per round instead of N^2 offers,
and a node receives O(1 + T). The decision is the one plan_round makes from the same summaries
(tests/unit/test_split_round.py checks the parts against it byte for byte).

Payloads, version 2, little-endian, after summary_codec's u32 magic, u16 version, u16 kind:
    decision (kind 3): u32 round, u32 num_steps, u8 all_dry, u8 select_fullest,
        u16 reference length (0xffff: no cap), u32 facts bytes; then the cap profile (float64)
        and the facts as UTF-8 JSON {"epoch", "rejected", "resume", "ended", "invariant",
        "schema"} (RoundFacts)
    node totals (kind 5): u32 num_steps, RoundExtras, then summary_codec's StepTotals payload
    round totals (kind 4): u32 num_steps, u8 drained, u8 has_approx, u16 reserved; then
        num_steps int64 tokens, num_steps int64 samples [, num_steps float64 approx weights],
        then RoundExtras summed over the nodes
    RoundExtras: int64 offered samples, offered tokens, splits; then num_steps
        float64 slowest rank's cost, num_steps float64 summed cost (the /metrics imbalance);
        then the identities emitted (planner/identities.py): u32 n, num_steps int64 single
        views, n x (int64 step, int64 identity) of the repeated ones (EpochEnd.num_identities)
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from odbd.daemon import payload_checks, summary_codec
from odbd.daemon.rewind import fresh_node_failure
from odbd.errors import ConfigError, InvariantError
from odbd.ingest.schema_vote import schema_disagreement
from odbd.planner import assignment, company, windows
from odbd.planner.completion import RoundTotals, combine, complete_node
from odbd.planner.config import CostModel, PlannerConfig
from odbd.planner.cost_fit import CostFit, FitState
from odbd.planner.decision import decide_round
from odbd.planner.identities import IdentitySource, StepIdentities, no_identities, unite
from odbd.planner.node_plan import NodeDraft, plan_node
from odbd.planner.round import units_of_node
from odbd.planner.summary import GroupedUnit, group_unit, summarize
from odbd.planner.types import FloatArray, NodeRoundPlan, RoundDecision, StepTotals, UnitOffer
from odbd.round.config import max_payload_bytes

_MAGIC = 0x4F444253  # summary_codec's: one family of split-round payloads
_VERSION = 2  # 2: RoundExtras carry the identities emitted
_DECISION, _ROUND_TOTALS, _NODE_TOTALS = 3, 4, 5
_PREFIX = struct.Struct("<IHH")
_DECISION_HEAD = struct.Struct("<IIBBHI")
_TOTALS_HEAD = struct.Struct("<IBBH")
_NO_CAP = 0xFFFF
_EXTRAS_HEAD = struct.Struct("<qqq")
_COUNT = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class RoundFacts:
    """The round's side facts, merged by the hub from every node's summary, in node order."""

    epoch: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # this round's, every node
    resume: tuple[int, int] | None = None  # round 0 after a restart: where the trainers resume
    ended: tuple[tuple[int, int, int], ...] = ()  # (rank, epoch, step) end_job() points
    # Why the nodes cannot plan this round together (different epochs or resume points): every
    # daemon raises it, as each did when it compared the offers itself.
    invariant: str | None = None
    schema: str | None = None  # the nodes chose different sample schemas: the job fails
    # --cost-model: the hub's fit after this round's observations (cost_learning.py), which
    # every daemon adopts for the next round; None when the hub learns nothing
    fit: CostFit | None = None


@dataclass(frozen=True, slots=True)
class RoundExtras:
    """Round-wide facts for progress and /metrics: summed (maxed) by the hub over the nodes."""

    # samples of every unit's buffer this round, emitted or recirculated: the recirculated are
    # these less the plan's global samples
    offered_samples: int
    offered_tokens: int  # their loss tokens (round_loop's mean tokens per sample)
    splits: int  # groups split to reach T
    step_max_work: FloatArray  # (T,) the slowest rank's planned cost per step
    step_sum_work: FloatArray  # (T,) the ranks' summed cost per step
    # the identities each step emitted, summed and united by the hub (None: none known)
    identities: StepIdentities | None = None

    def step_identities(self) -> StepIdentities:
        steps = int(self.step_max_work.shape[0])
        return no_identities(steps) if self.identities is None else self.identities


@dataclass(frozen=True, slots=True)
class DecisionPayload:
    decision: RoundDecision | None  # None when facts.invariant says the round cannot be planned
    facts: RoundFacts


# -- what fits a round -----------------------------------------------------------------------

# Side facts of a summary beyond the units: rejection counts, the schema's description, end
# points (JSON), and at most cost_learning.MAX_OBSERVATIONS rows of 3 float64.
_SIDE_ALLOWANCE_BYTES = 4096 + 64 * 24


def summary_bytes_bound(config: PlannerConfig) -> int:
    """The largest summary a node sends: it follows the units, never the buffers (a unit's
    record is 19 bytes; only units company.py samples carry their profile)."""
    per_node = config.num_units // config.world.num_nodes
    step = -(-config.num_units // company.CAP_SAMPLE_UNITS)  # company.sampled_units' stride
    profiled = min(per_node, -(-per_node // step))
    head = 24 + 19 * per_node
    return head + 8 * company.PROFILE_DEPTH * profiled + _SIDE_ALLOWANCE_BYTES


def check_summary_fits(config: PlannerConfig) -> None:
    """Refuses at start-up a layout whose summaries would be refused at the first round (each
    node's payload must fit its share of one round message, round/config.py)."""
    nodes = config.world.num_nodes
    limit, need = max_payload_bytes(nodes), summary_bytes_bound(config)
    if need > limit:
        raise ConfigError(
            f"{nodes} nodes of {config.world.ranks_per_node} ranks make round summaries of up "
            f"to {need / 1024:.0f} KiB per node, over the {limit / 1024:.0f} KiB each of "
            f"{nodes} nodes may send in one round; the first round would fail. Run more "
            "ranks per node (--nproc-per-node), or --balance node"
        )


# -- the hub's two reductions --------------------------------------------------------------------


def hub_decide(
    payloads: Sequence[bytes],
    config: PlannerConfig,
    round_index: int,
    absorb: Callable[[list[np.ndarray]], CostFit] | None = None,
    label: int | None = None,
) -> bytes:
    """Exchange 1 at the hub: every node's summary in node order -> the round's decision.

    Each summary is range-checked first (payload_checks.summary_problem): a bad one fails the
    job naming its node, never the planner. `absorb` (CostLearner.absorb) takes every node's
    timed steps in node order; its fit goes to every daemon in the facts, so the cost model
    stays the same everywhere while only the hub holds the observation window. `label` is
    the round's number in messages (the loop's, without a restart's seed offset)."""
    shown = round_index if label is None else label
    summaries = [_summary_of(p, n, shown, config) for n, p in enumerate(payloads)]
    facts = merge_facts(summaries)
    if absorb is not None:
        facts = dataclasses.replace(facts, fit=absorb([s.observations for s in summaries]))
    if facts.invariant is not None:
        return encode_decision(DecisionPayload(None, facts), round_index)
    units = sorted((u for s in summaries for u in s.units), key=lambda u: u.unit)
    decision = decide_round(units, config, round_index)
    return encode_decision(DecisionPayload(decision, facts), round_index)


def _summary_of(
    payload: bytes, node: int, round_index: int, config: PlannerConfig
) -> summary_codec.NodeSummary:
    summary = payload_checks.decoded(
        summary_codec.decode_summary, payload, "summary", node, round_index
    )
    units = units_of_node(config, node)
    problem = payload_checks.summary_problem(summary, node, units, config.world.world_size)
    payload_checks.refuse_out_of_range(problem, "summary", node, round_index)
    return summary


def merge_facts(summaries: Sequence[summary_codec.NodeSummary]) -> RoundFacts:
    """The side facts every node used to read from every offer (round_loop's checks)."""
    epochs = sorted({s.epoch for s in summaries})
    points = {s.node: s.resume for s in summaries}
    invariant = None
    if len(epochs) != 1:
        invariant = f"nodes disagree on the epoch being planned: {epochs}"
    elif len(set(points.values())) != 1:
        fresh = [node for node, point in points.items() if point is None]
        invariant = (
            fresh_node_failure(fresh, points)
            if fresh
            else f"nodes resume at different steps {points}: every trainer must load the "
            "state_dict of the same checkpoint step"
        )
    rejected: Counter[str] = Counter()
    for s in summaries:
        rejected.update(s.rejected)
    chosen = {s.node: s.schema for s in summaries if s.schema is not None}
    return RoundFacts(
        epoch=epochs[0] if epochs else 0,
        rejected=dict(rejected),
        resume=summaries[0].resume if summaries and invariant is None else None,
        ended=tuple(e for s in summaries for e in s.ended),
        invariant=invariant,
        schema=schema_disagreement(chosen),
    )


def hub_combine(payloads: Sequence[bytes], num_steps: int) -> bytes:
    """Exchange 2 at the hub: every node's totals in node order -> the round's totals."""
    parts = [
        payload_checks.decoded(decode_node_totals, p, "round totals", n, None)
        for n, p in enumerate(payloads)
    ]
    bad = [n for n, (_, e) in enumerate(parts) if e.step_max_work.shape != (num_steps,)]
    if bad:
        raise InvariantError(f"nodes {bad} sent step costs for other than {num_steps} steps")
    totals = combine([t for t, _ in parts], num_steps)
    extras = [e for _, e in parts]
    zero = np.zeros(num_steps)
    merged = RoundExtras(
        offered_samples=sum(e.offered_samples for e in extras),
        offered_tokens=sum(e.offered_tokens for e in extras),
        splits=sum(e.splits for e in extras),
        step_max_work=np.max([e.step_max_work for e in extras], axis=0) if extras else zero,
        # cumsum adds node after node (a sum's order is numpy's choice)
        step_sum_work=np.cumsum([e.step_sum_work for e in extras], axis=0)[-1] if extras else zero,
        identities=unite([e.step_identities() for e in extras], num_steps),
    )
    return encode_round_totals(totals, merged)


# -- one node's three local phases -----------------------------------------------------------


def node_summary(
    summary: summary_codec.NodeSummary,
    offers: Sequence[UnitOffer],
    config: PlannerConfig,
    round_index: int,
) -> tuple[list[GroupedUnit], bytes]:
    """Phase 0: groups this node's units; `summary` holds the side facts (its units are
    replaced by the groups' summaries). Returns the groups (kept for phase 2) and the payload."""
    grouped = [group_unit(o, config, round_index) for o in offers]
    units = tuple(summarize(u, config.num_units) for u in grouped)
    payload = summary_codec.encode_summary(
        summary_codec.NodeSummary(
            summary.node,
            summary.epoch,
            units,
            summary.rejected,
            summary.resume,
            summary.observations,
            summary.schema,
            summary.ended,
        )
    )
    return grouped, payload


def node_totals(
    node: int,
    grouped: Sequence[GroupedUnit],
    decision: RoundDecision,
    config: PlannerConfig,
    source: IdentitySource | None = None,
) -> tuple[NodeDraft, bytes]:
    """Phase 2: this node's units fitted and placed; its totals payload for the hub: the
    StepTotals, and the round facts the daemons report over every node (RoundExtras).
    `source` names the identities of this node's views (None: the identities go untallied)."""
    draft = plan_node(node, grouped, decision, config)
    return draft, encode_node_totals(draft.totals, node_extras(draft, config, source))


def node_extras(
    draft: NodeDraft, config: PlannerConfig, source: IdentitySource | None = None
) -> RoundExtras:
    """This node's share of the round-wide facts the daemons used to read from every offer."""
    c = draft.columns
    work = config.cost.work(c["padded_tokens"], c["sum_sq"], c["patches"])
    steps = int(c["num_samples"].shape[0])
    offered = [(len(t), int(t.tokens.sum())) for u in draft.units for t in (u.emitted, u.leftover)]
    return RoundExtras(
        offered_samples=sum(n for n, _ in offered),
        offered_tokens=sum(t for _, t in offered),
        splits=sum(u.num_splits for u in draft.units),
        step_max_work=work.max(axis=1) if work.shape[1] else np.zeros(steps),
        step_sum_work=work.sum(axis=1) if work.shape[1] else np.zeros(steps),
        identities=None if source is None else source.of_steps(_step_keys(draft, config, steps)),
    )


def _step_keys(draft: NodeDraft, config: PlannerConfig, steps: int) -> list[np.ndarray]:
    """The view keys this node's units emit at each step of the draft (its step order)."""
    g = config.ranks_per_unit
    out = []
    for step in range(steps):
        parts = [
            u.emitted.views[int(u.slot_offsets[step * g]) : int(u.slot_offsets[(step + 1) * g])]
            for u in draft.units
        ]
        out.append(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
    return out


def node_complete(
    draft: NodeDraft, decision: RoundDecision, totals_payload: bytes, config: PlannerConfig
) -> tuple[NodeRoundPlan, RoundExtras]:
    """Phase 3: this node's loss scales and updates over the round's totals, and the round-wide
    extras with their steps in the plan's order (--tokens-per-update reorders and cuts)."""
    totals, extras = decode_round_totals(totals_payload, decision.num_steps)
    plan = complete_node(draft, decision, totals, config)
    max_work, sum_work = extras.step_max_work, extras.step_sum_work
    emitted = extras.step_identities()
    if config.windows and config.tokens_per_update > 0:  # complete_node's order of the steps
        order = windows.pack_order(totals.num_tokens, config.tokens_per_update)
        max_work, sum_work = max_work[order], sum_work[order]
        emitted = emitted.take(order)
    kept = slice(0, plan.num_steps)  # and its closed prefix
    return plan, dataclasses.replace(
        extras,
        step_max_work=max_work[kept],
        step_sum_work=sum_work[kept],
        identities=emitted.take(np.arange(plan.num_steps)),
    )


# -- codecs --------------------------------------------------------------------------------------


def encode_decision(payload: DecisionPayload, round_index: int) -> bytes:
    d, f = payload.decision, payload.facts
    facts = {
        "epoch": f.epoch,
        "rejected": f.rejected,
        "resume": list(f.resume) if f.resume else None,
        "ended": [list(e) for e in f.ended],
        "invariant": f.invariant,
        "schema": f.schema,
    }
    if f.fit is not None:  # floats as JSON round-trip exactly (repr), nan included
        facts["fit"] = [
            dataclasses.astuple(f.fit.model),
            f.fit.state.value,
            list(f.fit.seconds),
            f.fit.error,
            f.fit.fixed_error,
            f.fit.num_observations,
            f.fit.errors,
        ]
    blob = json.dumps(facts, separators=(",", ":")).encode()
    reference = np.zeros(0) if d is None or d.reference is None else d.reference
    has_cap = d is not None and d.reference is not None
    head = _DECISION_HEAD.pack(
        round_index,
        0 if d is None else d.num_steps,
        0 if d is None else d.all_dry,
        0 if d is None else d.select_fullest,
        len(reference) if has_cap else _NO_CAP,
        len(blob),
    )
    cap = np.ascontiguousarray(reference, dtype="<f8").tobytes()
    return _PREFIX.pack(_MAGIC, _VERSION, _DECISION) + head + cap + blob


def decode_decision(payload: bytes, config: PlannerConfig) -> DecisionPayload:
    _check_prefix(payload, _DECISION)
    pos = _PREFIX.size
    round_index, num_steps, all_dry, select_fullest, depth, blob_bytes = _DECISION_HEAD.unpack_from(
        payload, pos
    )
    pos += _DECISION_HEAD.size
    reference = None
    if depth != _NO_CAP:
        reference = np.frombuffer(payload, dtype="<f8", count=depth, offset=pos).copy()
        pos += 8 * depth
    raw = json.loads(payload[pos : pos + blob_bytes])
    pos += blob_bytes
    _check_end(payload, pos)
    resume = raw["resume"]
    facts = RoundFacts(
        epoch=int(raw["epoch"]),
        rejected={str(k): int(v) for k, v in raw["rejected"].items()},
        resume=(int(resume[0]), int(resume[1])) if resume else None,
        ended=tuple((int(r), int(e), int(s)) for r, e, s in raw["ended"]),
        invariant=raw["invariant"],
        schema=raw["schema"],
        fit=_fit_of(raw["fit"]) if "fit" in raw else None,
    )
    if facts.invariant is not None:
        return DecisionPayload(None, facts)
    order = assignment.step_order(num_steps, config.seed, round_index)
    decision = RoundDecision(
        round_index, num_steps, order, bool(all_dry), reference, bool(select_fullest)
    )
    return DecisionPayload(decision, facts)


def _encode_extras(extras: RoundExtras) -> bytes:
    counts = (extras.offered_samples, extras.offered_tokens, extras.splits)
    return b"".join(
        [
            _EXTRAS_HEAD.pack(*counts),
            np.ascontiguousarray(extras.step_max_work, dtype="<f8").tobytes(),
            np.ascontiguousarray(extras.step_sum_work, dtype="<f8").tobytes(),
            _encode_identities(extras.step_identities()),
        ]
    )


def _encode_identities(emitted: StepIdentities) -> bytes:
    return b"".join(
        [
            _COUNT.pack(len(emitted.repeated)),
            np.ascontiguousarray(emitted.singles, dtype="<i8").tobytes(),
            np.ascontiguousarray(emitted.repeated, dtype="<i8").tobytes(),
        ]
    )


def _decode_extras(payload: bytes, pos: int, steps: int) -> tuple[RoundExtras, int]:
    counts = _EXTRAS_HEAD.unpack_from(payload, pos)
    pos += _EXTRAS_HEAD.size
    max_work = np.frombuffer(payload, dtype="<f8", count=steps, offset=pos).copy()
    sum_work = np.frombuffer(payload, dtype="<f8", count=steps, offset=pos + 8 * steps).copy()
    pos += 16 * steps
    (repeated,) = _COUNT.unpack_from(payload, pos)
    pos += _COUNT.size
    singles = np.frombuffer(payload, dtype="<i8", count=steps, offset=pos).astype(np.int64)
    pos += 8 * steps
    rows = np.frombuffer(payload, dtype="<i8", count=2 * repeated, offset=pos).astype(np.int64)
    pos += 16 * repeated
    emitted = StepIdentities(singles, rows.reshape(-1, 2))
    samples, tokens, splits = (int(c) for c in counts)
    extras = RoundExtras(samples, tokens, splits, max_work, sum_work, emitted)
    return extras, pos


def encode_node_totals(totals: StepTotals, extras: RoundExtras) -> bytes:
    """A node's exchange-2 payload: u32 magic, u16 version, u16 kind 5, u32 steps, then its
    RoundExtras (3 int64, 2 x steps float64), then summary_codec's StepTotals payload."""
    steps = int(extras.step_max_work.shape[0])
    head = _PREFIX.pack(_MAGIC, _VERSION, _NODE_TOTALS) + struct.pack("<I", steps)
    return head + _encode_extras(extras) + summary_codec.encode_totals(totals)


def decode_node_totals(payload: bytes) -> tuple[StepTotals, RoundExtras]:
    _check_prefix(payload, _NODE_TOTALS)
    (steps,) = struct.unpack_from("<I", payload, _PREFIX.size)
    extras, pos = _decode_extras(payload, _PREFIX.size + 4, steps)
    return summary_codec.decode_totals(payload[pos:]), extras


def _fit_of(raw: list[Any]) -> CostFit:
    model, state, seconds, error, fixed_error, num_observations, errors = raw
    a, b, c = (float(x) for x in seconds)
    *coefficients, dense_rows = model
    return CostFit(
        model=CostModel(
            **{k: float(v) for k, v in zip("abcp", coefficients, strict=True)},
            dense_rows=bool(dense_rows),
        ),
        state=FitState(state),
        seconds=(a, b, c),
        error=float(error),
        fixed_error=float(fixed_error),
        num_observations=int(num_observations),
        errors={str(k): float(v) for k, v in errors.items()},
    )


def encode_round_totals(totals: RoundTotals, extras: RoundExtras) -> bytes:
    steps = int(totals.num_tokens.shape[0])
    has_approx = totals.approx_weights.size > 0
    parts = [
        _PREFIX.pack(_MAGIC, _VERSION, _ROUND_TOTALS),
        _TOTALS_HEAD.pack(steps, totals.drained, has_approx, 0),
        totals.num_tokens.astype("<i8").tobytes(),
        totals.num_samples.astype("<i8").tobytes(),
    ]
    if has_approx:
        parts.append(np.ascontiguousarray(totals.approx_weights, dtype="<f8").tobytes())
    parts.append(_encode_extras(extras))
    return b"".join(parts)


def decode_round_totals(payload: bytes, num_steps: int) -> tuple[RoundTotals, RoundExtras]:
    _check_prefix(payload, _ROUND_TOTALS)
    steps, drained, has_approx, _ = _TOTALS_HEAD.unpack_from(payload, _PREFIX.size)
    if steps != num_steps:
        raise InvariantError(
            f"the hub's round totals hold {steps} steps, the round has {num_steps}"
        )
    pos = _PREFIX.size + _TOTALS_HEAD.size
    tokens = np.frombuffer(payload, dtype="<i8", count=steps, offset=pos).astype(np.int64)
    samples = np.frombuffer(payload, "<i8", steps, offset=pos + 8 * steps).astype(np.int64)
    pos += 16 * steps
    approx = np.zeros(0)
    if has_approx:
        approx = np.frombuffer(payload, dtype="<f8", count=steps, offset=pos).copy()
        pos += 8 * steps
    extras, pos = _decode_extras(payload, pos, steps)
    _check_end(payload, pos)
    return RoundTotals(tokens, samples, approx, bool(drained)), extras


def _check_prefix(payload: bytes, kind: int) -> None:
    magic, version, got = _PREFIX.unpack_from(payload, 0)
    if magic != _MAGIC or version != _VERSION or got != kind:
        raise InvariantError(
            f"round result has magic {magic:#x} version {version} kind {got}, expected "
            f"{_MAGIC:#x} version {_VERSION} kind {kind}: every daemon of a job must run the "
            "same odbd release"
        )


def _check_end(payload: bytes, pos: int) -> None:
    if pos != len(payload):
        raise InvariantError(f"round result has {len(payload) - pos} trailing bytes")
