"""Phase 1 of a round (summary.py lists the phases): what every daemon decides from summaries.

Input: one UnitSummary per unit (a few hundred bytes each); output: the round's step count T,
the shared step order, and company.py's reference profile. Cost O(units x PROFILE_DEPTH), no
sample is looked at, and every daemon computes the same RoundDecision from the same summaries.
"""

from __future__ import annotations

from collections.abc import Sequence

from odbd.errors import InvariantError
from odbd.planner import alignment, assignment, company, windows
from odbd.planner.config import Grouping, PlannerConfig
from odbd.planner.types import FloatArray, RoundDecision, UnitSummary

# Groups a unit may hold back per rank in one round (company.py); it bounds the search. On
# bench-planner's oracle workloads at W=128 units held back 1-2 per rank at the 90th percentile,
# 4.4 at most, and this cap measured the same ratios as none.
MAX_WAITS_PER_RANK = 4


def decide_round(
    summaries: Sequence[UnitSummary], config: PlannerConfig, round_index: int
) -> RoundDecision:
    """Phase 1: T, the step order and the company reference from every unit's summary."""
    _check_summaries(summaries, config)
    all_dry = all(s.dry for s in summaries)
    num_steps = windows.round_step_count(
        _target_steps(summaries, config), config.accumulate, all_dry
    )
    order = assignment.step_order(num_steps, config.seed, round_index)
    reference = _reference(summaries, config, num_steps * config.ranks_per_unit)
    return RoundDecision(round_index, num_steps, order, all_dry, reference)


def max_waits(config: PlannerConfig) -> int:
    """Groups one unit may hold back in a round (company.py)."""
    return MAX_WAITS_PER_RANK * config.ranks_per_unit


def _reference(
    summaries: Sequence[UnitSummary], config: PlannerConfig, num_slots: int
) -> FloatArray | None:
    """company.py's reference profile, in min-time rounds that hold a giant (a sample over the
    budget) and in which some unit has more groups than slots; None otherwise."""
    giants = any(s.max_length > config.token_budget for s in summaries)
    if (
        config.grouping is Grouping.PAPER
        or not giants
        or num_slots == 0
        or all(s.num_groups <= num_slots for s in summaries)
    ):
        return None
    return company.reference_profile([s.profile for s in summaries], num_slots)


def _target_steps(summaries: Sequence[UnitSummary], config: PlannerConfig) -> int:
    counts = [s.num_groups for s in summaries]
    if config.grouping is Grouping.PAPER:
        samples = [s.num_samples for s in summaries]
        return alignment.paper_target_steps(
            counts, samples, config.ranks_per_unit, config.max_steps_per_round
        )
    dry = [s.dry for s in summaries]
    return alignment.min_time_target_steps(
        counts, dry, config.ranks_per_unit, config.max_steps_per_round
    )


def _check_summaries(summaries: Sequence[UnitSummary], config: PlannerConfig) -> None:
    units = [s.unit for s in summaries]
    if units != list(range(config.num_units)):
        raise InvariantError(
            f"a round needs one offer per unit in order 0..{config.num_units - 1}, got {units}"
        )
