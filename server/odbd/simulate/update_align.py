"""`odbd simulate --align updates`: the same samples planned with ranks aligned at micro-steps
and at optimizer updates (planner/update_align.py), timed under the cost model.

Times are the cost model's token-equivalents: an update takes the sum over its steps of the
slowest rank's step (--align steps), or the slowest rank's sum over its own micro-steps
(--align updates); the ideal is simulate's bound (report.summarize) of the steps run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from odbd.planner.config import CostModel
from odbd.planner.update_align import rank_runs, update_times

if TYPE_CHECKING:
    from odbd.planner.epoch import SimulationResult


@dataclass(frozen=True, kw_only=True, slots=True)
class AlignComparison:
    updates: int  # optimizer updates of the run (the same under both alignments)
    steps_time: float  # --align steps: sum over updates of sum over steps of max over ranks
    updates_time: float  # --align updates: sum over updates of max over ranks of its own sum
    ideal_time: float  # report.summarize's bound on the same samples
    rank_steps_steps: int  # micro-steps run, summed over ranks (idle fillers included)
    rank_steps_updates: int
    updates_with_uneven_micro_steps: int  # updates whose ranks ran different micro-step counts

    @property
    def speedup(self) -> float:
        return self.steps_time / self.updates_time if self.updates_time > 0 else 1.0

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "speedup": self.speedup,
            "steps_efficiency": _ratio(self.ideal_time, self.steps_time),
            "updates_efficiency": _ratio(self.ideal_time, self.updates_time),
        }


def compare_align(
    steps: SimulationResult, updates: SimulationResult, cost: CostModel, ideal_time: float
) -> AlignComparison:
    """Times two join-mode runs over the same samples, planned with --align steps and
    --align updates."""
    steps_time = updates_time = 0.0
    num_updates = rank_steps_steps = rank_steps_updates = uneven = 0
    for plan, kept in zip(steps.rounds, steps.steps_kept, strict=True):
        if kept:
            steps_time += float(update_times(plan, cost.c).sum())
            rank_steps_steps += plan.num_steps * plan.stats.num_samples.shape[1]
    for plan, kept in zip(updates.rounds, updates.steps_kept, strict=True):
        if kept == 0:
            continue
        if plan.micro_steps is None:
            raise ValueError("compare_align: the second run was not planned with --align updates")
        updates_time += float(update_times(plan, cost.c).sum())
        num_updates += len(plan.windows)
        rank_steps_updates += int(rank_runs(plan).sum())
        uneven += int((plan.micro_steps.min(axis=1) != plan.micro_steps.max(axis=1)).sum())
    return AlignComparison(
        updates=num_updates,
        steps_time=steps_time,
        updates_time=updates_time,
        ideal_time=ideal_time,
        rank_steps_steps=rank_steps_steps,
        rank_steps_updates=rank_steps_updates,
        updates_with_uneven_micro_steps=uneven,
    )


def render_align(c: AlignComparison) -> str:
    j = c.as_json()
    return "\n".join(
        [
            f"--align updates vs steps over {c.updates:,} updates: time {c.updates_time:,.0f} vs "
            f"{c.steps_time:,.0f} (x{c.speedup:.3f}); efficiency {j['updates_efficiency']:.3f} "
            f"vs {j['steps_efficiency']:.3f}",
            f"  rank micro-steps {c.rank_steps_updates:,} vs {c.rank_steps_steps:,}; "
            f"{c.updates_with_uneven_micro_steps:,} updates with uneven micro-steps per rank",
        ]
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 1.0
