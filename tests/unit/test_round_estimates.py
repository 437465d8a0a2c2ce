"""odbd.planner.estimate: one epoch-length estimate per round, exact from the round holding the
epoch's last step, held between rounds while the new extrapolation stays near it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from odbd.planner.estimate import held_estimate, round_estimates
from odbd.planner.progress import JobShape, StepFacts, StepFactsColumns, steps_progress


def rounds_of(
    job: JobShape, per_step: list[int], round_sizes: list[int]
) -> list[tuple[list[int], list[bool]]]:
    """(estimates, exact flags) of each round, one epoch of steps emitting per_step samples."""
    held: dict[int, int] = {}
    out, consumed, k = [], 0, 0
    for size in round_sizes:
        rows = []
        for _ in range(size):
            consumed += per_step[k]
            rows.append(StepFacts(0, k, consumed, consumed, consumed * 10,
                                  k == len(per_step) - 1, 0))  # fmt: skip
            k += 1
        facts = StepFactsColumns.of_rows(rows)
        settled = round_estimates(job, facts, steps_progress(job, facts), held)
        held = settled.held
        out.append((settled.progress.epoch_steps_estimate, settled.progress.epoch_steps_exact))
    return out


def test_a_round_holding_the_epochs_last_step_makes_every_step_of_it_exact() -> None:
    per_step = [23, 9, 24, 18, 20, 37, 41, 13]
    job = JobShape(dataset_size=sum(per_step), epochs=1)
    [(estimates, exact)] = rounds_of(job, per_step, [8])
    assert estimates == [8] * 8 and all(exact)  # was: exact on the last step only
    (_, first_exact), (late, late_exact) = rounds_of(job, per_step, [5, 3])
    assert not any(first_exact) and late == [8, 8, 8] and all(late_exact)


def test_the_estimate_holds_through_a_steps_noise_and_follows_a_drift() -> None:
    # One-step rounds of the samples per step seen from odbd.demo.dataset:synthetic (llava):
    # per-step extrapolation said 22 32 27 28 27 23 21 ... for an epoch of 22 steps.
    per_step = [23, 9, 24, 18, 20, 37, 41, 13, 32, 21, 21, 34, 29, 16, 27, 3, 19, 30, 17, 15,
                25, 26]  # fmt: skip
    job = JobShape(dataset_size=sum(per_step), epochs=2)
    rounds = rounds_of(job, per_step, [1] * len(per_step))
    estimates = [e[0] for e, _ in rounds]
    raw = steps_progress(job, StepFactsColumns.of_rows([
        StepFacts(0, k, sum(per_step[: k + 1]), sum(per_step[: k + 1]), 0,
                  k == len(per_step) - 1, 0) for k in range(len(per_step))
    ])).epoch_steps_estimate  # fmt: skip
    changes = sum(a != b for a, b in zip(estimates, estimates[1:], strict=False))
    raw_changes = sum(a != b for a, b in zip(raw, raw[1:], strict=False))
    assert changes < raw_changes / 2, (estimates, raw)
    assert estimates[-1] == len(per_step) and rounds[-1][1] == [True]
    assert all(e >= k + 2 for k, e in enumerate(estimates[:-1]))  # never says "ended" early
    # A drift well past the tolerance is followed at once.
    assert held_estimate(20, 30, 5) == 30 and held_estimate(20, 21, 5) == 20
    assert held_estimate(20, 22, 21) == 22  # held no longer possible: the new one


@settings(max_examples=200, deadline=None)
@given(
    per_step=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=40),
)
def test_estimates_are_possible_one_per_round_and_exact_at_the_end(
    per_step: list[int], cuts: list[int]
) -> None:
    sizes, left = [], len(per_step)
    for c in cuts * len(per_step):
        if left == 0:
            break
        sizes.append(min(c, left))
        left -= sizes[-1]
    job = JobShape(dataset_size=sum(per_step), epochs=1)
    rounds = rounds_of(job, per_step, sizes)
    k = 0
    for (estimates, exact), size in zip(rounds, sizes, strict=True):
        assert len(set(estimates)) == 1 and len(set(exact)) == 1
        k += size
        if exact[0]:
            assert estimates[0] == len(per_step) == k
        else:
            assert estimates[0] >= k + 1
    assert rounds[-1][1][-1] and rounds[-1][0][-1] == len(per_step)
