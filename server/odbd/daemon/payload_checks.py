"""Range checks of a member's decoded round offer, before any of it reaches the planner (pure).

Every daemon decodes every node's offer and plans from all of them, so one bad value (a NaN
observation, a count that is a string, a length of 2^31-1, twenty thousand invented rejection
reasons) would crash every daemon of the job deep in the planner or the cost fit, reported as
an internal error. Each field is checked here instead: finite, non-negative, of its type, and
bounded; the first problem fails the job on every daemon with one message naming the node.
The limits are far above anything a real daemon sends, so they never refuse a real offer.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from odbd.daemon import offer_codec
from odbd.daemon.cost_learning import MAX_OBSERVATIONS
from odbd.daemon.offer_codec import NodeOffer
from odbd.daemon.summary_codec import NodeSummary
from odbd.errors import InvariantError, OdbdError
from odbd.ingest.rejections import REJECT_FIXES
from odbd.planner.company import PROFILE_DEPTH

T = TypeVar("T")

MAX_EPOCH = 2**31 - 1
MAX_COUNT = 2**48  # rejection counts, resume points: far above any dataset
MAX_SAMPLE_TOKENS = 2**24  # one sample's length, loss tokens or patches (16 Mi)
MAX_AGE = 2**31 - 1  # rounds a sample was recirculated
MAX_REASONS = 64  # distinct rejection reasons in one offer (the known set has 14)
MAX_PADDED_TOKENS = 2.0**48  # one observation's padded tokens
MAX_SUM_SQUARES = 2.0**96  # one observation's sum of squared lengths
MAX_SECONDS = 1e6  # one observation's step time (11 days)
ITERATIONS_AHEAD = 4
MIN_SECONDS = 1e-9  # a timed step's least plausible duration (0: not timed)
_OBSERVATION_MAX = np.array([MAX_PADDED_TOKENS, MAX_SUM_SQUARES, MAX_SECONDS])


class BadPayloadError(OdbdError):
    """A member of the job sent an offer with a value out of range: the job stops, naming it."""


@dataclass(frozen=True, slots=True)
class OfferLimits:
    """What a valid offer of node `n` may hold in this job (the same on every daemon)."""

    units_of_node: Sequence[Sequence[int]]  # node -> its unit ids, in order
    # Views of one sampler iteration (sampler.num_views). A view key is iteration * this +
    # view (node_state.py), and a node buffers at most an iteration or two past its epoch, so
    # every key of an offer for epoch e is below (e + ITERATIONS_AHEAD) * this.
    views_per_iteration: int
    reasons: Collection[str] = tuple(REJECT_FIXES)


def decode_offer(payload: bytes, node: int, round_index: int, limits: OfferLimits) -> NodeOffer:
    """Node `node`'s offer of round `round_index`; raises an OdbdError naming the node if the
    bytes are not an offer or a field is out of range (never anything else)."""
    offer = decoded(offer_codec.decode, payload, "offer", node, round_index)
    refuse_out_of_range(offer_problem(offer, node, limits), "offer", node, round_index)
    return offer


def decoded(
    decode: Callable[[bytes], T], payload: bytes, kind: str, node: int, round_index: int | None
) -> T:
    """`decode(payload)`, node `node`'s round payload of `kind` (offer, summary...); any parse
    failure raises InvariantError naming the node: the peer sent something else. (The hub's
    later reductions do not know the round's index: None.)"""
    try:
        return decode(payload)
    except Exception as error:  # any parse failure: the peer sent something else
        which = "round" if round_index is None else f"round {round_index}"
        raise InvariantError(
            f"node {node} sent a {which} payload that is not an odbd "
            f"{kind} ({type(error).__name__}: {str(error)[:200]}); every daemon of a job must "
            "run the same odbd release, and only this job's daemons may hold its token"
        ) from None


def refuse_out_of_range(problem: str | None, kind: str, node: int, round_index: int) -> None:
    """Raises BadPayloadError naming the node if a range check of its `kind` found `problem`."""
    if problem is not None:
        raise BadPayloadError(
            f"node {node} sent a round {round_index} {kind} with a value out of range: "
            f"{problem}. Every daemon stops this job; every daemon of a job must run the "
            "same odbd release, and only this job's daemons may hold its token"
        )


def offer_problem(offer: NodeOffer, node: int, limits: OfferLimits) -> str | None:
    """The first out-of-range field of node `node`'s offer, or None if every field is valid."""
    return (
        _header_problem(offer, node)
        or _rejected_problem(offer.rejected, limits.reasons)
        or _units_problem(
            offer,
            limits.units_of_node[node],
            (offer.epoch + ITERATIONS_AHEAD) * limits.views_per_iteration,
        )
        or _observations_problem(offer.observations)
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _header_problem(offer: NodeOffer, node: int) -> str | None:
    if offer.node != node:
        return f"it calls itself node {offer.node!r}"
    if not _is_int(offer.epoch) or not 0 <= offer.epoch <= MAX_EPOCH:
        return f"its epoch {offer.epoch!r} is not an integer in 0..{MAX_EPOCH}"
    resume = offer.resume
    if resume is not None and (
        len(resume) != 2 or not all(_is_int(v) and 0 <= v <= MAX_COUNT for v in resume)
    ):
        return f"its resume point {resume!r} is not two integers in 0..{MAX_COUNT}"
    return None


def _rejected_problem(rejected: object, reasons: Collection[str]) -> str | None:
    if not isinstance(rejected, dict):
        return f"its rejection counts are a {type(rejected).__name__}, not a mapping"
    if len(rejected) > MAX_REASONS:
        return f"it names {len(rejected)} rejection reasons, over the {MAX_REASONS} allowed"
    for reason, count in rejected.items():
        if reason not in reasons:
            return f"its rejection reason {str(reason)[:64]!r} is not one odbd knows"
        if not _is_int(count) or not 0 <= count <= MAX_COUNT:
            return (
                f"its count of {reason} rejections, {str(count)[:32]!r}, is not in 0..{MAX_COUNT}"
            )
    return None


def _units_problem(offer: NodeOffer, expected: Sequence[int], view_keys: int) -> str | None:
    units = [u.unit for u in offer.units]
    if units != list(expected):
        return f"it offers units {units[:8]}, but its units are {list(expected)[:8]}"
    for unit in offer.units:
        t = unit.samples
        rows = {len(c) for c in (t.views, t.lengths, t.tokens, t.ages, t.patches)}
        if len(rows) != 1:
            return f"unit {unit.unit}'s sample columns have different row counts {sorted(rows)}"
    if not offer.units:
        return None
    # One reduction per column over every unit: a daemon checks every node's offer each round.
    for name, low, high in (
        ("views", 0, view_keys - 1),
        ("lengths", 1, MAX_SAMPLE_TOKENS),  # ingest rejects empty samples before any offer
        ("tokens", 0, MAX_SAMPLE_TOKENS),
        ("ages", 0, MAX_AGE),
        ("patches", 0, MAX_SAMPLE_TOKENS),
    ):
        parts = [getattr(u.samples, name) for u in offer.units]
        column = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if column.size and (int(column.min()) < low or int(column.max()) > high):
            bad = int(column[(column < low) | (column > high)][0])
            return f"a sample's {name} value {bad} is outside {low}..{high}"
    return None


def _observations_problem(observations: np.ndarray) -> str | None:
    if observations.ndim != 2 or observations.shape[1] != 3:
        return f"its cost observations have shape {observations.shape}, not (m, 3)"
    if observations.shape[0] > MAX_OBSERVATIONS:
        return (
            f"it sends {observations.shape[0]} cost observations, over the {MAX_OBSERVATIONS} "
            "a round carries"
        )
    if not observations.size:
        return None
    if not np.isfinite(observations).all():
        return "a cost observation is not a finite number (NaN or infinity)"
    if observations.min() < 0 or (observations.max(axis=0) > _OBSERVATION_MAX).any():
        for column, what in enumerate(("padded tokens", "sum of squared lengths", "seconds")):
            values, high = observations[:, column], _OBSERVATION_MAX[column]
            if values.min() < 0 or values.max() > high:
                return f"a cost observation's {what} is outside 0..{high:g}"
    seconds = observations[:, 2]
    if ((seconds > 0) & (seconds < MIN_SECONDS)).any():
        # No step runs in under a nanosecond; the fit divides by the measured time.
        return f"a cost observation's seconds is above 0 but below {MIN_SECONDS:g}"
    return None


# -- the split round's summaries (issue 25): checked by the hub, which alone decides from them --

MAX_SCHEMA_CHARS = 1 << 16  # a schema's description, as node_state.describe_schema writes it


def summary_problem(
    summary: NodeSummary, node: int, units: Sequence[int], world_size: int
) -> str | None:
    """The first out-of-range field of node `node`'s summary, or None if every field is valid
    (the summary's units must be `units`; end points name ranks below `world_size`)."""
    return (
        _header_problem(summary, node)  # type: ignore[arg-type]  # node, epoch, resume alike
        or _rejected_problem(summary.rejected, tuple(REJECT_FIXES))
        or _unit_summaries_problem(summary, units)
        or _observations_problem(summary.observations)
        or _side_problem(summary, world_size)
    )


def _unit_summaries_problem(summary: NodeSummary, expected: Sequence[int]) -> str | None:
    units = [u.unit for u in summary.units]
    if units != list(expected):
        return f"it summarizes units {units[:8]}, but its units are {list(expected)[:8]}"
    for u in summary.units:
        if not 0 <= u.num_groups <= u.num_samples <= MAX_COUNT:
            return (
                f"unit {u.unit} has {u.num_groups} groups of {u.num_samples} samples (groups "
                f"must be 0..samples, samples 0..{MAX_COUNT})"
            )
        if not 0 <= u.max_length <= MAX_SAMPLE_TOKENS:
            longest = u.max_length
            return f"unit {u.unit}'s longest sample, {longest}, is outside 0..{MAX_SAMPLE_TOKENS}"
        profile = u.profile
        if len(profile) > PROFILE_DEPTH:
            return f"unit {u.unit}'s cost profile has {len(profile)} values, over {PROFILE_DEPTH}"
        if profile.size and not (np.isfinite(profile).all() and profile.min() >= 0):
            return f"unit {u.unit}'s cost profile holds a negative or non-finite value"
    return None


def _side_problem(summary: NodeSummary, world_size: int) -> str | None:
    schema = summary.schema
    if schema is not None and (
        not _is_int(schema[0])
        or not isinstance(schema[1], str)
        or len(schema[1]) > MAX_SCHEMA_CHARS
    ):
        return "its sample schema is not a (hash, description) of at most 64 Ki characters"
    for point in summary.ended:
        rank, epoch, step = point
        if not 0 <= rank < world_size or not 0 <= epoch <= MAX_EPOCH or not 0 <= step <= MAX_COUNT:
            return f"its end_job() point {point} names no rank of the job or no step"
    return None
