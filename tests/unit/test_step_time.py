"""adapters/step_time.py: what the adapters report as a rank's own compute (issue 27)."""

from __future__ import annotations

import pytest

from odbclient.adapters.step_time import BACKWARD_PER_FORWARD, StepTime


def test_a_wait_free_backward_counts_as_measured() -> None:
    assert StepTime(forward=0.1, backward=0.25, optimizer=0.05).own_seconds == pytest.approx(0.4)


def test_a_backward_that_ran_the_all_reduce_counts_as_twice_the_forward() -> None:
    """Its measured time includes waits for the slowest rank: never reported as this rank's."""
    timed = StepTime(forward=0.1, backward=None, optimizer=0.05)
    assert timed.own_seconds == pytest.approx(0.1 + BACKWARD_PER_FORWARD * 0.1 + 0.05)


def test_the_optimizer_step_is_the_per_step_constant() -> None:
    """The same batch with and without the optimizer differs by its time: the fit's c."""
    bare = StepTime(forward=0.1, backward=None)
    assert StepTime(0.1, None, 0.03).own_seconds - bare.own_seconds == pytest.approx(0.03)
