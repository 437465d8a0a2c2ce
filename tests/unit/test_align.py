"""Where ranks restarted without a state_dict continue (odbclient.align): every rank where the
furthest one does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from odbclient.align import (
    EPOCH_END_STEP,
    JOB_END_EPOCH,
    NO_POSITION,
    Position,
    agreed_resume,
    position_of,
)
from odbclient.batch import Batch
from odbclient.errors import ProtocolError
from odbclient.stream import EpochEnd, JobEnd


def batch(epoch: int, step: int) -> Batch:
    return Batch(
        tensors={}, epoch=epoch, step=step, num_samples=1, num_tokens=1, global_num_samples=2,
        global_num_tokens=2, sample_ids=(0,), is_idle=False, loss_scale=1.0,
    )  # fmt: skip


def test_a_first_event_places_its_rank() -> None:
    assert position_of(batch(1, 4)) == Position(1, 4)
    assert position_of(EpochEnd(1, 9, 64, 64, {})) == Position(1, EPOCH_END_STEP)
    assert position_of(JobEnd(failed=False, reason="")) == Position(JOB_END_EPOCH, 0)
    assert position_of(object()) == NO_POSITION  # a failure: it takes part, then raises


def test_ranks_behind_continue_at_the_furthest_and_the_furthest_stays() -> None:
    everyone = [Position(0, 3), Position(0, 5)]
    assert agreed_resume(Position(0, 3), everyone) == Position(0, 5)
    assert agreed_resume(Position(0, 5), everyone) is None


def test_a_step_is_behind_its_epochs_end_and_every_epoch_behind_the_job_end() -> None:
    end_of_0 = Position(0, EPOCH_END_STEP)
    assert agreed_resume(Position(0, 6), [Position(0, 6), end_of_0]) == end_of_0
    assert agreed_resume(end_of_0, [end_of_0, Position(1, 0)]) == Position(1, 0)
    job_end = Position(JOB_END_EPOCH, 0)
    assert agreed_resume(Position(7, 2), [Position(7, 2), job_end]) == job_end


def test_a_rank_whose_first_event_is_an_error_keeps_it() -> None:
    assert agreed_resume(NO_POSITION, [NO_POSITION, Position(0, 5)]) is None


def test_an_impossible_position_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="impossible position"):
        agreed_resume(Position(0, 0), [Position(0, 0), Position(JOB_END_EPOCH + 1, 0)])


positions = st.builds(Position, st.integers(0, 3), st.integers(0, 9))


@given(st.lists(positions, min_size=2, max_size=8))
def test_after_agreeing_every_rank_continues_at_one_position(firsts: list[Position]) -> None:
    continued = [agreed_resume(own, firsts) or own for own in firsts]
    assert set(continued) == {max(firsts)}
