"""LR schedules that follow odbd's progress instead of a step count known in advance.

odbd decides an epoch's steps online, so a schedule over `num_training_steps` would follow a
guess. These follow `Batch.progress.job_fraction` (0 -> 1.0 exactly on the job's last step), so
the decay ends on the last step whatever the step estimate said earlier, and every rank gets the
same LR (the fraction is identical on every rank). Plain PyTorch:

    cosine, fraction = Schedule("cosine", warmup_steps=100), 0.0   # fraction: of the last batch
    sched = LambdaLR(optimizer, lambda step: lr_factor(cosine, fraction, step))
    for batch in client:
        ...; optimizer.step(); fraction = batch.progress.job_fraction; sched.step()

Pure functions, no torch or transformers import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Hugging Face `lr_scheduler_type` names this module implements over the job fraction.
SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr")


@dataclass(frozen=True, slots=True)
class Schedule:
    kind: str  # one of SCHEDULES
    warmup_steps: int = 0  # optimizer steps of linear warm-up (counted, not estimated)
    warmup_fraction: float = 0.0  # or: warm up over this fraction of the job
    min_lr_rate: float = 0.0  # floor of the decay, as a fraction of the peak LR

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(
                f"lr schedule {self.kind!r} cannot follow odbd's progress; use one of "
                f"{', '.join(SCHEDULES)}"
            )
        if self.warmup_steps < 0 or not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(
                f"warm-up of {self.warmup_steps} steps / fraction {self.warmup_fraction}: steps "
                "must be >= 0 and the fraction in [0, 1)"
            )
        if not 0.0 <= self.min_lr_rate <= 1.0:
            raise ValueError(f"min_lr_rate {self.min_lr_rate} must be in [0, 1]")


def lr_factor(schedule: Schedule, fraction: float, step: int) -> float:
    """The LR multiplier for optimizer step `step` once a `fraction` of the job is trained."""
    fraction = min(max(fraction, 0.0), 1.0)
    warm = _warmup(schedule, fraction, step)
    if schedule.kind in ("constant", "constant_with_warmup"):
        return warm
    floor = schedule.min_lr_rate
    if schedule.kind == "linear":
        decay = 1.0 - fraction
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * fraction))
    return min(warm, floor + (1.0 - floor) * decay)


def _warmup(schedule: Schedule, fraction: float, step: int) -> float:
    if schedule.kind == "constant":
        return 1.0
    if schedule.warmup_steps > 0 and step < schedule.warmup_steps:
        return step / schedule.warmup_steps  # Hugging Face's: step 0 trains at LR 0
    if schedule.warmup_fraction > 0.0 and fraction < schedule.warmup_fraction:
        return fraction / schedule.warmup_fraction
    return 1.0
