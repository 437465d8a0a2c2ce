"""odbd.planner.progress: the epoch/job progress every StepBatch carries."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.planner.progress import JobShape, Progress, StepFacts, step_progress


def run_epochs(job: JobShape, steps: list[list[tuple[int, int, int]]]) -> list[list[Progress]]:
    """Progress of every step of every epoch; a step is (emitted, rejected, tokens) and the
    last step of each epoch is known to be last, as odbd learns it."""
    out, steps_before = [], 0
    for epoch, epoch_steps in enumerate(steps):
        emitted = consumed = tokens = 0
        row = []
        for k, (e, r, t) in enumerate(epoch_steps):
            emitted, consumed, tokens = emitted + e, consumed + e + r, tokens + t
            facts = StepFacts(
                epoch=epoch,
                step=k,
                consumed=consumed,
                emitted=emitted,
                tokens=tokens,
                last=k == len(epoch_steps) - 1,
                steps_before_epoch=steps_before,
            )
            row.append(step_progress(job, facts))
        out.append(row)
        steps_before += len(epoch_steps)
    return out


@st.composite
def epochs_of_steps(draw: st.DrawFn) -> tuple[JobShape, list[list[tuple[int, int, int]]]]:
    """A dataset of N views split into steps (emitted, rejected, tokens) for each epoch."""
    n = draw(st.integers(1, 300))
    num_epochs = draw(st.integers(1, 3))
    epochs = []
    for _ in range(num_epochs):
        left, steps = n, []
        while left > 0:
            emitted = draw(st.integers(0, min(left, 40)))
            rejected = draw(st.integers(0, left - emitted)) if draw(st.booleans()) else 0
            if emitted + rejected == 0:
                emitted = 1
            left -= emitted + rejected
            steps.append((emitted, rejected, emitted * draw(st.integers(0, 50))))
        epochs.append(steps)
    return JobShape(dataset_size=n, epochs=num_epochs), epochs


@settings(max_examples=200, deadline=None)
@given(epochs_of_steps())
def test_fractions_never_decrease_and_are_exact_at_the_end(
    case: tuple[JobShape, list[list[tuple[int, int, int]]]],
) -> None:
    job, steps = case
    progress = run_epochs(job, steps)
    for row in progress:
        for a, b in itertools.pairwise(row):
            assert b.epoch_sample_fraction >= a.epoch_sample_fraction
            assert b.epoch_token_fraction >= a.epoch_token_fraction
            assert b.epoch_tokens >= a.epoch_tokens
        assert row[-1].epoch_sample_fraction == 1.0 and row[-1].epoch_token_fraction == 1.0
        assert row[-1].epoch_steps_exact and row[-1].epoch_steps_estimate == len(row)
        for k, p in enumerate(row[:-1]):
            assert not p.epoch_steps_exact
            assert p.epoch_sample_fraction < 1.0 and p.epoch_token_fraction < 1.0
            assert p.epoch_steps_estimate >= k + 2  # not last: at least one more step
    flat = [p for row in progress for p in row]
    for a, b in itertools.pairwise(flat):
        assert b.job_fraction >= a.job_fraction
    assert flat[-1].job_fraction == 1.0
    assert all(p.job_fraction < 1.0 for p in flat[:-1])
    assert flat[-1].job_steps_estimate == len(flat)


def test_estimate_extrapolates_the_rate_so_far() -> None:
    job = JobShape(dataset_size=1000, epochs=2)
    facts = StepFacts(
        epoch=0, step=9, consumed=100, emitted=100, tokens=5000, last=False, steps_before_epoch=0
    )
    p = step_progress(job, facts)
    # 10 steps took 100 of 1000 samples: 100 steps for the epoch, 200 for the two epochs.
    assert (p.epoch_steps_estimate, p.job_steps_estimate) == (100, 200)
    assert p.epoch_sample_fraction == 0.1 and p.job_fraction == 0.05
    assert p.epoch_tokens == 5000 and not p.epoch_steps_exact


def test_rejected_views_count_for_samples_not_tokens() -> None:
    job = JobShape(dataset_size=100, epochs=1)
    facts = StepFacts(
        epoch=0, step=0, consumed=50, emitted=10, tokens=80, last=False, steps_before_epoch=0
    )
    p = step_progress(job, facts)
    assert p.epoch_sample_fraction == 0.5
    # 10 emitted and 50 views left at that mean: 10 of 60 samples' tokens are trained.
    assert abs(p.epoch_token_fraction - 10 / 60) < 1e-12


def test_endless_job_has_no_job_fraction() -> None:
    job = JobShape(dataset_size=10, epochs=0)
    facts = StepFacts(
        epoch=5, step=0, consumed=10, emitted=10, tokens=1, last=True, steps_before_epoch=50
    )
    p = step_progress(job, facts)
    assert (p.job_fraction, p.job_steps_estimate) == (0.0, 0)
    assert p.epoch_steps_exact and p.epoch_steps_estimate == 1
