"""Phase 1 of a round (summary.py lists the phases): what every daemon decides from summaries.

Input: one UnitSummary per unit (~40 bytes, 8 KiB with company.py's profile); output: the
round's step count T, the shared step order, company.py's cap profile, and whether the round
selects its fullest groups (selection.py: T lowered by its reserve). Cost O(units +
min(units, CAP_SAMPLE_UNITS) x PROFILE_DEPTH), no sample is looked at, and every daemon
computes the same RoundDecision from the same summaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from odbd.errors import InvariantError
from odbd.planner import alignment, assignment, company, selection, windows
from odbd.planner.config import Collate, Grouping, PlannerConfig
from odbd.planner.types import FloatArray, IntArray, RoundDecision, UnitSummary


def decide_round(
    summaries: Sequence[UnitSummary], config: PlannerConfig, round_index: int
) -> RoundDecision:
    """Phase 1: T, the step order and the company cap from every unit's summary."""
    _check_summaries(summaries, config)
    all_dry = all(s.dry for s in summaries)
    cap, held = _cap_and_holds(summaries, config)
    target = _target_steps(summaries, config, held)
    reserve = _reserve_steps(summaries, config, target)
    num_steps = windows.round_step_count(target - reserve, config.accumulate, all_dry)
    order = assignment.step_order(num_steps, config.seed, round_index)
    return RoundDecision(round_index, num_steps, order, all_dry, cap, reserve > 0)


def _reserve_steps(summaries: Sequence[UnitSummary], config: PlannerConfig, target: int) -> int:
    """selection.py: steps a round of few padded min-time groups gives up while every unit
    fills and no sample is over the budget (0: the round runs its greedy groups as cut)."""
    if (
        config.grouping is Grouping.PAPER
        or config.collate is Collate.PACKED
        or config.max_patches > 0
        or any(s.dry for s in summaries)
        or any(s.max_length > config.token_budget for s in summaries)
    ):
        return 0
    per_group = min(s.num_samples / max(s.num_groups, 1) for s in summaries)
    return selection.reserve_steps(target, config.ranks_per_unit, per_group)


def _cap_and_holds(
    summaries: Sequence[UnitSummary], config: PlannerConfig
) -> tuple[FloatArray | None, IntArray | None]:
    """company.py's cap profile and every unit's held count (0 for units it does not sample),
    in min-time rounds while every unit still fills: every such round with enough units
    (company.caps_every_round), else those that hold a giant (a sample over the budget); no
    group waits in the others."""
    no_giant = all(s.max_length <= config.token_budget for s in summaries)
    if (
        config.grouping is Grouping.PAPER
        or any(s.dry for s in summaries)
        or (no_giant and not company.caps_every_round(config))
        or (config.migrate and not no_giant)  # migration.py holds the giants instead
    ):
        return None, None
    sample = company.sampled_units(len(summaries))
    matrix, lengths = company.profile_matrix([s.profile for s in summaries[sample]])
    cap = company.cap_profile(matrix, config.ranks_per_unit, company.outsized_work(config))
    if len(cap) == 0:
        return None, None
    if no_giant:  # the cap only paces ordinary groups: near-equal costs run (PACING_SLACK)
        cap = company.pacing_cap(cap)
    held = np.zeros(len(summaries), dtype=np.int64)
    held[sample] = company.held_counts(matrix, lengths, cap)
    if all(s.num_groups <= h for s, h in zip(summaries, held, strict=True)):
        # Every group would wait: the round would plan no step, and a round without steps
        # ages nothing, so the same groups would wait again forever (a livelock hypothesis
        # found: packed groups whose patch work puts them all over the cap). Nothing waits.
        return None, None
    return cap, held


def _target_steps(
    summaries: Sequence[UnitSummary], config: PlannerConfig, held: IntArray | None
) -> int:
    counts = [s.num_groups for s in summaries]
    if held is not None:  # T: what every sampled unit fills without its held groups
        counts = [c - h for c, h in zip(counts, held.tolist(), strict=True)]
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
