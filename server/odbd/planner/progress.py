"""How far an epoch and the job are after a planned step: what a trainer's LR schedule and
progress bar need, computed from facts every daemon has, so every rank reads the same numbers.

An epoch's length is decided online (samples per step follow the token budget and the lengths
that arrive), so its step count is extrapolated from the steps planned so far: with `c` of the
epoch's N dataset views consumed (emitted, or rejected by a producer) after step k, the epoch
needs about (k + 1) * N / c steps. The estimate tightens as rounds are planned and is exact once
the step known to be the epoch's last is planned (non-join: the step that reaches the quota;
join: the last step of the flush round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JobShape:
    dataset_size: int  # N: dataset views per epoch
    epochs: int  # --epochs; 0 = endless


@dataclass(frozen=True, slots=True)
class StepFacts:
    """One planned step, with the epoch's running totals up to and including it."""

    epoch: int
    step: int  # index within the epoch
    consumed: int  # of the epoch's N views: emitted by its steps so far, or rejected
    emitted: int  # samples emitted by the epoch's steps so far (rejections excluded)
    tokens: int  # loss-bearing tokens of the epoch's steps so far
    last: bool  # known to be the epoch's last step
    steps_before_epoch: int  # steps of the job's earlier epochs


@dataclass(frozen=True, slots=True)
class Progress:
    epoch_steps_estimate: int
    epoch_steps_exact: bool
    epoch_sample_fraction: float
    epoch_token_fraction: float
    epoch_tokens: int
    job_fraction: float
    job_steps_estimate: int  # 0: endless job


def step_progress(job: JobShape, facts: StepFacts) -> Progress:
    """Where the epoch and the job stand once `facts.step` is trained."""
    done_steps = facts.step + 1
    sample_fraction = 1.0 if facts.last else _fraction(facts.consumed, job.dataset_size)
    steps = done_steps if facts.last else _epoch_steps(job.dataset_size, done_steps, facts)
    return Progress(
        epoch_steps_estimate=steps,
        epoch_steps_exact=facts.last,
        epoch_sample_fraction=sample_fraction,
        epoch_token_fraction=1.0 if facts.last else _token_fraction(job.dataset_size, facts),
        epoch_tokens=facts.tokens,
        job_fraction=_job_fraction(job, facts.epoch, sample_fraction, facts.last),
        job_steps_estimate=(
            facts.steps_before_epoch + steps * (job.epochs - facts.epoch) if job.epochs else 0
        ),
    )


def _fraction(part: int, whole: int) -> float:
    # Below 1 until the last step is known: a schedule must not reach its floor early.
    return min(part / whole, math.nextafter(1.0, 0.0)) if whole > 0 else 0.0


def _epoch_steps(dataset_size: int, done_steps: int, facts: StepFacts) -> int:
    """Steps so far plus the remaining views at the epoch's rate so far; not last: one more."""
    remaining = max(dataset_size - facts.consumed, 0)
    if facts.consumed <= 0:
        return done_steps + 1
    return done_steps + max(math.ceil(remaining * done_steps / facts.consumed), 1)


def _token_fraction(dataset_size: int, facts: StepFacts) -> float:
    """Tokens so far over those plus the remaining views at the mean tokens per sample so far,
    i.e. emitted / (emitted + remaining): it never decreases, and it runs ahead of the sample
    fraction by the rejected views (which carry no tokens)."""
    remaining = max(dataset_size - facts.consumed, 0)
    if facts.emitted <= 0:
        return 0.0  # no length seen yet
    return _fraction(facts.emitted, facts.emitted + remaining)


def _job_fraction(job: JobShape, epoch: int, epoch_fraction: float, last: bool) -> float:
    if job.epochs <= 0:
        return 0.0
    if last and epoch + 1 >= job.epochs:
        return 1.0
    return min((epoch + epoch_fraction) / job.epochs, math.nextafter(1.0, 0.0))
