"""odbd.planner.progress.steps_progress: a round's progress at once equals step_progress's."""

from __future__ import annotations

import dataclasses
import math
import struct
from collections import Counter
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.daemon.round_loop import RoundLoop
from odbd.planner.estimate import round_estimates
from odbd.planner.progress import (
    JobShape,
    Progress,
    ProgressColumns,
    StepFacts,
    StepFactsColumns,
    step_progress,
    steps_progress,
)


def _bits(progress: Progress) -> tuple[object, ...]:
    """Every field, floats by their bits (0.0 == -0.0 would hide a sign)."""
    return tuple(
        struct.pack("<d", v) if isinstance(v, float) else (type(v), v)
        for v in dataclasses.astuple(progress)
    )


def _assert_same(job: JobShape, rows: list[StepFacts]) -> None:
    got = steps_progress(job, StepFactsColumns.of_rows(rows))
    assert len(got.epoch_steps_estimate) == len(rows)
    for i, facts in enumerate(rows):
        assert _bits(got.row(i)) == _bits(step_progress(job, facts)), facts


def _facts(limit: int) -> st.SearchStrategy[StepFacts]:
    return st.builds(
        StepFacts,
        epoch=st.integers(0, 40),
        step=st.integers(0, limit),
        consumed=st.integers(-5, limit),
        emitted=st.integers(-2, limit),
        tokens=st.integers(0, limit),
        last=st.booleans(),
        steps_before_epoch=st.integers(0, limit),
    )


@settings(max_examples=400, deadline=None)
@given(
    st.integers(0, 10**6),
    st.integers(0, 50),
    st.lists(_facts(10**6), max_size=70),
)
def test_steps_progress_is_step_progress_row_by_row(
    n: int, epochs: int, rows: list[StepFacts]
) -> None:
    _assert_same(JobShape(dataset_size=n, epochs=epochs), rows)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**70),
    st.integers(0, 2**62),
    st.lists(_facts(2**66), min_size=1, max_size=20),
)
def test_huge_counts_take_the_exact_path(n: int, epochs: int, rows: list[StepFacts]) -> None:
    """Counts past float64's exact integers go row by row, so they still agree."""
    _assert_same(JobShape(dataset_size=n, epochs=epochs), rows)


def test_fractions_stay_below_one_until_the_last_step() -> None:
    job = JobShape(dataset_size=10, epochs=2)
    facts = [StepFacts(1, 4, 10, 10, 50, False, 5), StepFacts(1, 5, 10, 10, 50, True, 5)]
    _assert_same(job, facts)
    got = steps_progress(job, StepFactsColumns([1, 1], [4, 5], [10, 10], [10, 10], [50, 50],
                                               [False, True], [5, 5]))  # fmt: skip
    assert got.epoch_sample_fraction == [math.nextafter(1.0, 0.0), 1.0]
    assert got.job_fraction == [math.nextafter(1.0, 0.0), 1.0]


def test_no_steps() -> None:
    empty = steps_progress(JobShape(10, 1), StepFactsColumns([], [], [], [], [], [], []))
    assert empty == ProgressColumns([], [], [], [], [], [], [])


# -- RoundLoop._plan_progress against the per-step loop it replaced ------------------------


def _reference_plan_progress(
    loop: SimpleNamespace,
    global_samples: list[int],
    global_tokens: list[int],
    final: bool,
    quota_before: int,
    step_epochs: list[int],
    step_numbers: list[int],
) -> list[Progress]:
    """The per-step code of the daemon's third pass (5e0274c), verbatim but for `self`."""
    n = loop.state.dataset_size
    job = JobShape(dataset_size=n, epochs=loop.config.epochs)
    rejected = sum(loop.tally.rejected.values())
    quota = quota_before
    progress = []
    steps_before: dict[int, int] = {}
    for i, (epoch, number) in enumerate(zip(step_epochs, step_numbers, strict=True)):
        if epoch not in steps_before:
            steps_before[epoch] = sum(c for e, c in loop.steps_in_epoch.items() if e < epoch)
        samples = global_samples[i]
        loop.epoch_emitted[epoch] += samples
        loop.epoch_tokens[epoch] += global_tokens[i]
        quota += samples
        if loop.config.join:
            consumed = loop.epoch_emitted[epoch] + rejected
            last = final and i == len(step_epochs) - 1
        else:
            consumed, last = quota - epoch * n, quota >= (epoch + 1) * n
        facts = StepFacts(
            epoch=epoch,
            step=number,
            consumed=consumed,
            emitted=loop.epoch_emitted[epoch],
            tokens=loop.epoch_tokens[epoch],
            last=last,
            steps_before_epoch=steps_before[epoch],
        )
        progress.append(step_progress(job, facts))
        loop.facts.append(facts)
    return progress


def _fake_loop(n: int, epochs: int, join: bool, rejected: int) -> SimpleNamespace:
    return SimpleNamespace(
        state=SimpleNamespace(dataset_size=n),
        config=SimpleNamespace(epochs=epochs, join=join),
        tally=SimpleNamespace(rejected=Counter({"bad": rejected})),
        steps_in_epoch=Counter(),
        epoch_emitted=Counter(),
        epoch_tokens=Counter(),
        quota_consumed=0,
        planned_samples=0,
        planned_tokens=0,
        token_floor={},
        _mean_tokens=lambda plan: 0.0,  # no offers here: the pre-issue-23 token fraction
        held_estimates={},  # RoundLoop's, for planner.estimate
        facts=[],  # the reference's StepFacts of the last round
    )


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 400),
    epochs=st.integers(0, 4),
    join=st.booleans(),
    rejected=st.integers(0, 30),
    rounds=st.lists(
        st.tuples(st.lists(st.integers(0, 40), max_size=12), st.booleans()), max_size=12
    ),
)
def test_plan_progress_is_the_per_step_loop(
    n: int,
    epochs: int,
    join: bool,
    rejected: int,
    rounds: list[tuple[list[int], bool]],
) -> None:
    """Round after round, the daemon's progress (and its running per-epoch totals) equal
    the per-step code it replaced."""
    ours, theirs = _fake_loop(n, epochs, join, rejected), _fake_loop(n, epochs, join, rejected)
    quota = 0
    for per_step, final in rounds:
        samples = np.asarray(per_step, dtype=np.int64)
        plan = SimpleNamespace(
            global_num_samples=samples, global_num_tokens=samples * 7, final=final
        )
        if join:  # one epoch per round but for a flush: a second epoch's steps after it
            step_epochs = sorted(quota // n + k % 2 for k in range(len(per_step)))
        else:  # as RoundLoop._step_epochs: by the quota before each step
            before = quota + np.concatenate([[0], np.cumsum(samples)[:-1]]).astype(np.int64)
            step_epochs = (before // n).tolist() if len(per_step) else []
        numbers = []
        for e in step_epochs:
            numbers.append(ours.steps_in_epoch[e])
            ours.steps_in_epoch[e] += 1
        theirs.steps_in_epoch = Counter(ours.steps_in_epoch)  # as _number_steps left them
        got = RoundLoop._plan_progress(ours, plan, quota, step_epochs, numbers)  # type: ignore[arg-type]
        theirs.facts = []
        per_step = _reference_plan_progress(
            theirs, samples.tolist(), (samples * 7).tolist(), final, quota, step_epochs, numbers
        )
        # then one estimate per round and epoch (planner/estimate.py), as the daemon does
        job = JobShape(dataset_size=n, epochs=epochs)
        settled = round_estimates(
            job,
            StepFactsColumns.of_rows(theirs.facts),
            ProgressColumns.of_rows(per_step),
            theirs.held_estimates,
        )
        theirs.held_estimates = settled.held
        want = [settled.progress.row(i) for i in range(len(per_step))]
        assert [_bits(got.row(i)) for i in range(len(want))] == [_bits(p) for p in want]
        assert ours.epoch_emitted == theirs.epoch_emitted
        assert ours.epoch_tokens == theirs.epoch_tokens
        quota += int(samples.sum())
