"""Where ranks restarted without a state_dict continue (odbclient.trainer.align): every rank
where the furthest one does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from odbclient.errors import ProtocolError
from odbclient.trainer import client as client_module
from odbclient.trainer.align import (
    EPOCH_END_STEP,
    JOB_END_EPOCH,
    NO_POSITION,
    Position,
    agreed_resume,
    position_of,
)
from odbclient.trainer.batch import Batch
from odbclient.trainer.client import ODBClient
from odbclient.trainer.stream import EpochEnd, JobEnd, Welcome


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


class _Stream:
    def __init__(self, world_size: int) -> None:
        self.welcome = Welcome(job_id="j", world_size=world_size, length_key="x", loss_scaling="")


@pytest.mark.parametrize(
    ("group_world", "daemon_world", "align_ranks", "aligns"),
    [
        (4, 4, True, True),
        (8, 4, True, False),  # tensor parallel x 2: half the group never iterates a client
        (1, 1, True, False),  # one process: nobody to agree with
        (4, 4, False, False),
    ],
)
def test_ranks_align_over_the_default_group_only_when_it_is_the_daemons_world(
    monkeypatch: pytest.MonkeyPatch,
    group_world: int,
    daemon_world: int,
    align_ranks: bool,
    aligns: bool,
) -> None:
    monkeypatch.setattr(client_module, "distributed_world", lambda: group_world)
    client = ODBClient(rank=0, socket="/nonexistent", align_ranks=align_ranks)
    stream = _Stream(daemon_world)
    assert client._aligns_over_the_default_group(stream) is aligns  # type: ignore[arg-type]
