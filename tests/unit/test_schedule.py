"""odbclient.adapters.schedule: LR factors over odbd's job fraction."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from odbclient.adapters.schedule import SCHEDULES, Schedule, lr_factor


def test_cosine_warms_up_by_steps_then_decays_to_its_floor_at_fraction_one() -> None:
    cosine = Schedule("cosine", warmup_steps=4, min_lr_rate=0.1)
    assert [lr_factor(cosine, 0.0, s) for s in range(4)] == [0.0, 0.25, 0.5, 0.75]
    assert lr_factor(cosine, 0.0, 4) == 1.0
    assert lr_factor(cosine, 0.5, 50) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(cosine, 1.0, 100) == pytest.approx(0.1)


def test_warmup_ratio_follows_the_fraction() -> None:
    linear = Schedule("linear", warmup_fraction=0.1)
    assert lr_factor(linear, 0.05, 7) == pytest.approx(0.5)
    assert lr_factor(linear, 0.5, 7) == pytest.approx(0.5)  # the decay is below the warm-up
    assert lr_factor(linear, 1.0, 70) == 0.0


@given(
    kind=st.sampled_from(SCHEDULES),
    a=st.floats(0.0, 1.0),
    b=st.floats(0.0, 1.0),
    step=st.integers(0, 10_000),
)
def test_past_warm_up_the_factor_never_rises_as_the_job_advances(
    kind: str, a: float, b: float, step: int
) -> None:
    schedule = Schedule(kind, min_lr_rate=0.05)
    lo, hi = sorted((a, b))
    assert lr_factor(schedule, hi, step) <= lr_factor(schedule, lo, step) + 1e-12
    assert 0.0 <= lr_factor(schedule, hi, step) <= 1.0
    if kind.startswith(("linear", "cosine")):
        assert math.isclose(lr_factor(schedule, 1.0, step), 0.05)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "polynomial"}, "cannot follow odbd's progress; use one of constant"),
        ({"kind": "cosine", "warmup_fraction": 1.0}, "fraction in \\[0, 1\\)"),
        ({"kind": "cosine", "min_lr_rate": 2.0}, "must be in \\[0, 1\\]"),
    ],
)
def test_schedules_it_cannot_follow_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Schedule(**kwargs)
