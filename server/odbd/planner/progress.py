"""How far an epoch and the job are after a planned step: what a trainer's LR schedule and
progress bar need, computed from facts every daemon has, so every rank reads the same numbers.

An epoch's length is decided online (samples per step follow the token budget and the lengths
that arrive), so its step count is extrapolated from the steps planned so far: with `c` of the
epoch's N dataset views consumed (emitted, or rejected by a producer) after step k, the epoch
needs about (k + 1) * N / c steps. The estimate tightens as rounds are planned and is exact once
the step known to be the epoch's last is planned (non-join: the step that reaches the quota;
join: the last step of the flush round).

The job's fraction (the LR schedule's clock) counts loss-bearing tokens, not samples: a step
holds about the token budget whatever its sample count, so the fraction advances about evenly
per step, while one step of many short samples moved the sample fraction by a quarter (found:
an LR driven by it dropped 27 % in one step). The epoch's tokens still to come are its views
left times the mean tokens per sample of every sample ingested so far (`mean_tokens`: trained
ones and those buffered, which arrive in sampler order, so the planner's choice of short or
long samples first does not bias it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import numpy as np


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
    # Loss tokens per sample over every sample ingested so far (0.0: unknown, then the epoch's
    # tokens are extrapolated from its trained samples alone, as before issue 23)
    mean_tokens: float = 0.0
    # The epoch's token fraction after the previous round: a new round's mean may be higher
    # (longer samples arrived), and the fraction must never go back.
    token_floor: float = 0.0


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
    token_fraction = 1.0 if facts.last else _token_fraction(job.dataset_size, facts)
    return Progress(
        epoch_steps_estimate=steps,
        epoch_steps_exact=facts.last,
        epoch_sample_fraction=sample_fraction,
        epoch_token_fraction=token_fraction,
        epoch_tokens=facts.tokens,
        job_fraction=_job_fraction(job, facts.epoch, token_fraction, facts.last),
        job_steps_estimate=(
            facts.steps_before_epoch + steps * (job.epochs - facts.epoch) if job.epochs else 0
        ),
    )


def _fraction(part: int, whole: float) -> float:
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
    if facts.mean_tokens > 0:
        if facts.tokens <= 0:
            return facts.token_floor
        by_tokens = _fraction(facts.tokens, facts.tokens + remaining * facts.mean_tokens)
        return max(by_tokens, facts.token_floor)
    if facts.emitted <= 0:
        return 0.0  # no length seen yet
    return _fraction(facts.emitted, facts.emitted + remaining)


def _job_fraction(job: JobShape, epoch: int, epoch_fraction: float, last: bool) -> float:
    if job.epochs <= 0:
        return 0.0
    if last and epoch + 1 >= job.epochs:
        return 1.0
    return min((epoch + epoch_fraction) / job.epochs, math.nextafter(1.0, 0.0))


def capped_job_progress(
    max_updates: int,
    updates_before: int,
    steps_before: int,
    update_ends: list[bool],
    update_shares: list[float],
) -> tuple[list[float], list[int]]:
    """job_fraction and job_steps_estimate of a round's steps in a step-based job (odbd
    --max-updates N): exact from the first step, since the job's length is N updates.

    Step i is (updates finished before it + its share of its own update) / N: without
    accumulation each step is a whole update, so step k of the job reads (k + 1) / N; with
    windows, micro-step j of an n-step update adds (j + 1) / n. 1.0 exactly on the job's last
    step, below it before. `updates_before`, `steps_before`: of the job's earlier rounds;
    `update_ends`, `update_shares`: per step, whether it ends its update and (j + 1) / n.
    The step count is exact without windows (N); with them, the steps so far plus the
    updates left at the mean steps per update so far."""
    below_one = math.nextafter(1.0, 0.0)
    fractions: list[float] = []
    steps: list[int] = []
    finished = updates_before
    for i, (end, share) in enumerate(zip(update_ends, update_shares, strict=True)):
        done_steps = steps_before + i + 1
        if end and finished + 1 >= max_updates:
            fractions.append(1.0)
            steps.append(done_steps)
        else:
            fractions.append(min((finished + share) / max_updates, below_one))
            per_update = done_steps / (finished + share)
            left = max_updates - finished - share
            steps.append(done_steps + max(round(left * per_update), 1))
        finished += end
    return fractions, steps


@dataclass(frozen=True, slots=True)
class StepFactsColumns:
    """A round's steps' StepFacts, one list per field (entry i is step i)."""

    epoch: list[int]
    step: list[int]
    consumed: list[int]
    emitted: list[int]
    tokens: list[int]
    last: list[bool]
    steps_before_epoch: list[int]
    mean_tokens: list[float] = field(default_factory=list)  # empty: 0.0 for every step
    token_floor: list[float] = field(default_factory=list)  # empty: 0.0 for every step

    def row(self, i: int) -> StepFacts:
        return _row(self, StepFacts, i)

    @staticmethod
    def of_rows(rows: list[StepFacts]) -> StepFactsColumns:
        return _columns(StepFactsColumns, rows)


@dataclass(frozen=True, slots=True)
class ProgressColumns:
    """The Progress of each of a round's steps, one list per field (entry i is step i)."""

    epoch_steps_estimate: list[int]
    epoch_steps_exact: list[bool]
    epoch_sample_fraction: list[float]
    epoch_token_fraction: list[float]
    epoch_tokens: list[int]
    job_fraction: list[float]
    job_steps_estimate: list[int]

    def row(self, i: int) -> Progress:
        return _row(self, Progress, i)

    @staticmethod
    def of_rows(rows: list[Progress]) -> ProgressColumns:
        return _columns(ProgressColumns, rows)


_Row = TypeVar("_Row")
_Columns = TypeVar("_Columns")


def _row(columns: object, row_type: type[_Row], i: int) -> _Row:
    """Entry i of every column of `columns`, as one `row_type` (the same fields in the same
    order: checked below)."""
    columns_of = [getattr(columns, f.name) for f in fields(columns)]  # type: ignore[arg-type]
    while columns_of and not columns_of[-1]:
        columns_of.pop()  # an optional trailing column left empty: the row's default
    return row_type(*(column[i] for column in columns_of))


def _columns(columns_type: type[_Columns], rows: list[Any]) -> _Columns:
    """The column of each field of `rows`, as one `columns_type`."""
    names = [f.name for f in fields(columns_type)]  # type: ignore[arg-type]
    return columns_type(*([getattr(r, name) for r in rows] for name in names))


for _rows_type, _columns_type in ((StepFacts, StepFactsColumns), (Progress, ProgressColumns)):
    if [f.name for f in fields(_rows_type)] != [f.name for f in fields(_columns_type)]:
        raise ImportError(f"{_columns_type.__name__} must have {_rows_type.__name__}'s fields")


# float64 holds every integer below 2**53 exactly: there, numpy's division of two int64 arrays
# (each converted to float64, then one correctly rounded division) equals Python's int / int.
_EXACT_INT = 1 << 53


def steps_progress(job: JobShape, facts: StepFactsColumns) -> ProgressColumns:
    """step_progress of every step at once, with a few numpy operations per round instead of
    Python arithmetic per step (a round plans up to --steps-ahead steps). Equal, value for
    value, to step_progress on each row; counts where a float64 would not hold the ints
    exactly take step_progress's path row by row."""
    if not facts.step:
        return ProgressColumns([], [], [], [], [], [], [])
    if not _exact_in_float64(job, facts):
        return ProgressColumns.of_rows(
            [step_progress(job, facts.row(i)) for i in range(len(facts.step))]
        )
    n = job.dataset_size
    below_one = math.nextafter(1.0, 0.0)
    done = np.asarray(facts.step, dtype=np.int64) + 1
    consumed = np.asarray(facts.consumed, dtype=np.int64)
    emitted = np.asarray(facts.emitted, dtype=np.int64)
    last = np.asarray(facts.last, dtype=bool)
    remaining = np.maximum(n - consumed, 0)
    # _epoch_steps: done + max(ceil(remaining * done / consumed), 1); done + 1 if nothing consumed
    extra = np.maximum(np.ceil(remaining * done / np.where(consumed > 0, consumed, 1)), 1)
    estimate = np.where(consumed > 0, done + extra.astype(np.int64), done + 1)
    steps = np.where(last, done, estimate)
    if n > 0:
        sample = np.where(last, 1.0, np.minimum(consumed / n, below_one))
    else:
        sample = np.where(last, 1.0, 0.0)
    # _token_fraction: tokens / (tokens + remaining * mean_tokens) with a mean, else
    # emitted / (emitted + remaining); 0.0 before any token (sample) was emitted
    whole = np.where(emitted > 0, emitted + remaining, 1)
    token = np.where(emitted > 0, np.minimum(emitted / whole, below_one), 0.0)
    if facts.mean_tokens:
        mean = np.asarray(facts.mean_tokens, dtype=np.float64)
        tokens = np.asarray(facts.tokens, dtype=np.int64)
        by_tokens = tokens / np.where(tokens > 0, tokens + remaining * mean, 1.0)
        by_tokens = np.where(tokens > 0, np.minimum(by_tokens, below_one), 0.0)
        if facts.token_floor:
            by_tokens = np.maximum(by_tokens, np.asarray(facts.token_floor, dtype=np.float64))
        token = np.where(mean > 0, by_tokens, token)
    token = np.where(last, 1.0, token)
    steps_list = steps.tolist()
    epochs = job.epochs
    if epochs > 0:
        epoch = np.asarray(facts.epoch, dtype=np.int64)
        share = np.minimum((epoch + token) / epochs, below_one)
        job_fraction: list[float] = np.where(last & (epoch + 1 >= epochs), 1.0, share).tolist()
        job_steps = [
            before + s * (epochs - e)
            for before, s, e in zip(facts.steps_before_epoch, steps_list, facts.epoch, strict=True)
        ]
    else:
        job_fraction = [0.0] * len(steps_list)
        job_steps = [0] * len(steps_list)
    return ProgressColumns(
        epoch_steps_estimate=steps_list,
        epoch_steps_exact=list(facts.last),
        epoch_sample_fraction=sample.tolist(),
        epoch_token_fraction=token.tolist(),
        epoch_tokens=list(facts.tokens),
        job_fraction=job_fraction,
        job_steps_estimate=job_steps,
    )


def _exact_in_float64(job: JobShape, facts: StepFactsColumns) -> bool:
    """Whether every int the vectorized path turns into a float64 (or multiplies in int64)
    is below 2**53: then its floats are step_progress's, bit for bit."""
    n = job.dataset_size
    done_max = max(facts.step) + 1
    remaining_max = n - min(0, min(facts.consumed))
    return (
        0 <= n
        and job.epochs < _EXACT_INT
        and 0 <= min(facts.step) <= max(facts.step) < _EXACT_INT - 2  # done + 1 in int64
        and max(facts.consumed) < _EXACT_INT
        and remaining_max * done_max < _EXACT_INT  # remaining * done, and remaining itself
        and -_EXACT_INT < min(facts.emitted)
        and max(facts.emitted) + remaining_max < _EXACT_INT  # emitted + remaining
        and 0 <= min(facts.epoch) < max(facts.epoch) + 1 < _EXACT_INT
        and 0 <= min(facts.tokens) <= max(facts.tokens) < _EXACT_INT
    )
