"""An epoch's step count as a round's steps carry it: one number per round, exact from the
round that plans the epoch's last step, and held between rounds while the new extrapolation
stays near it.

progress.step_progress extrapolates each step from the epoch's facts up to that step, so the
steps of one round carried different estimates (the steps before the epoch's last one, in the
same round, were not exact although the round knew the count), and with rounds of a step or two
the estimate followed every step's sample mix: 22 -> 32 -> 27 -> 23 over an epoch of 22 steps
(`odbd.demo.dataset:synthetic`, llava lengths, 500 samples). Here every step of a round takes
the estimate of the round's last step of its epoch, and an estimate made in an earlier round is
kept while the new one is within HOLD_TOLERANCE of it (one step for short epochs): the noise of
a mean over a few steps does not move it, a real drift does.

Every daemon plans the same rounds in the same order, so the held estimate is the same on every
daemon and every rank (a restarted daemon starts without one: it takes the first round's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from odbd.planner.progress import JobShape, ProgressColumns, StepFactsColumns, step_progress

HOLD_TOLERANCE = 0.1  # of the held estimate


def held_estimate(held: int | None, new: int, min_steps: int) -> int:
    """The estimate a round carries: `held` (the epoch's estimate from an earlier round) while it
    is still possible (at least `min_steps`) and within HOLD_TOLERANCE (at least one step) of
    the round's own extrapolation `new`; else `new`."""
    if held is None or held < min_steps:
        return new
    return held if abs(new - held) <= max(1.0, HOLD_TOLERANCE * held) else new


@dataclasses.dataclass(frozen=True, slots=True)
class RoundEstimates:
    progress: ProgressColumns  # the round's, with one estimate per epoch
    held: dict[int, int]  # epoch -> its estimate, for the next round (exact epochs dropped)


def round_estimates(
    job: JobShape,
    facts: StepFactsColumns,
    progress: ProgressColumns,
    held: Mapping[int, int],
) -> RoundEstimates:
    """`progress` (steps_progress of `facts`, one round's steps) with each epoch's steps taking
    the estimate of the epoch's last step in the round, exact for all of them if that step is
    the epoch's last, else held_estimate of it; the job's step estimate follows."""
    last_row: dict[int, int] = {}  # epoch -> its last row in the round
    for i, epoch in enumerate(facts.epoch):
        last_row[epoch] = i
    estimate, exact, next_held = {}, {}, dict(held)
    for epoch, i in last_row.items():
        end = step_progress(job, facts.row(i))
        exact[epoch] = end.epoch_steps_exact
        if end.epoch_steps_exact:
            estimate[epoch] = end.epoch_steps_estimate
            next_held.pop(epoch, None)
        else:
            min_steps = facts.step[i] + 2  # the round's steps and at least one more
            estimate[epoch] = held_estimate(held.get(epoch), end.epoch_steps_estimate, min_steps)
            next_held[epoch] = estimate[epoch]
    for epoch in [e for e in next_held if e < min(last_row, default=0)]:
        del next_held[epoch]  # an epoch this round no longer plans: it ended
    steps = [estimate[e] for e in facts.epoch]
    job_steps = progress.job_steps_estimate
    if job.epochs > 0:
        job_steps = [
            before + s * (job.epochs - e)
            for before, s, e in zip(facts.steps_before_epoch, steps, facts.epoch, strict=True)
        ]
    return RoundEstimates(
        dataclasses.replace(
            progress,
            epoch_steps_estimate=steps,
            epoch_steps_exact=[exact[e] for e in facts.epoch],
            job_steps_estimate=job_steps,
        ),
        next_held,
    )
