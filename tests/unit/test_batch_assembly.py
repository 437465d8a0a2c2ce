"""The reader builds each Batch slot by slot (odbclient.trainer.batch.assemble_batch, issue 15): the
result must be the Batch that keyword __init__ builds, from any StepBatch, and its tensors must
own their memory."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odbclient.errors import ProtocolError
from odbclient.trainer.batch import (
    BATCH_FACTS,
    PROGRESS_FIELDS,
    Batch,
    Progress,
    assemble_batch,
    assemble_progress,
)
from odbclient.trainer.collate import BatchForm
from odbclient.trainer.step_collate import SegmentTable
from odbclient.trainer.stream import TrainerStream, int_list
from odbclient.wire.odbd.v1 import trainer_pb2
from tests.shm_samples import write_samples

u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
fraction = st.floats(0.0, 1.0)


def assert_same_batch(got: Batch, want: Batch) -> None:
    assert type(got) is Batch and type(got.progress) is Progress
    for name in (*BATCH_FACTS, "progress"):
        assert getattr(got, name) == getattr(want, name), name
        assert type(getattr(got, name)) is type(getattr(want, name)), name
    assert got.tensors.keys() == want.tensors.keys()
    for key, tensor in want.tensors.items():
        assert isinstance(tensor, torch.Tensor)
        assert torch.equal(got.tensors[key], tensor)  # type: ignore[arg-type]


@given(
    facts=st.tuples(
        u32,
        u64,
        u32,
        u64,
        u64,
        u64,
        st.lists(u64, max_size=4).map(tuple),
        st.booleans(),
        st.floats(allow_nan=False),
        st.booleans(),
        u64,
        u32,
        u32,
        u64,
        u64,
        st.booleans(),
        st.booleans(),
        st.booleans(),
        st.booleans(),
        u32,
    ),  # fmt: skip
    progress=st.tuples(u64, st.booleans(), fraction, fraction, u64, fraction, u64),
)
def test_assembled_batch_is_the_keyword_built_batch(
    facts: tuple[object, ...], progress: tuple[object, ...]
) -> None:
    tensors: dict[str, torch.Tensor | int] = {"input_ids": torch.arange(6).reshape(2, 3)}
    want_progress = Progress(**dict(zip(PROGRESS_FIELDS, progress, strict=True)))  # type: ignore[arg-type]
    want = Batch(
        tensors=tensors,
        progress=want_progress,
        **dict(zip(BATCH_FACTS, facts, strict=True)),  # type: ignore[arg-type]
    )
    got = assemble_batch(tensors, assemble_progress(progress), facts)
    assert got == want and hash(got.progress) == hash(want_progress)
    assert repr(got) == repr(want)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.step = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.progress.job_fraction = 0.5  # type: ignore[misc]


def test_assembly_refuses_a_wrong_number_of_facts() -> None:
    with pytest.raises(ValueError):
        assemble_batch({}, Progress(), (0, 1))
    with pytest.raises(ValueError):
        assemble_progress((1, True))


@given(values=st.lists(u32, max_size=40))
def test_int_list_reads_little_endian_u32(values: list[int]) -> None:
    assert int_list(np.array(values, "<u4").tobytes(), "I") == values


@given(values=st.lists(u64, max_size=40))
def test_int_list_reads_little_endian_u64(values: list[int]) -> None:
    assert int_list(np.array(values, "<u8").tobytes(), "Q") == values


@given(values=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40))
def test_int_list_reads_little_endian_i64(values: list[int]) -> None:
    assert int_list(np.array(values, "<i8").tobytes(), "q") == values


def test_int_list_names_a_cut_array() -> None:
    with pytest.raises(ProtocolError, match="not a multiple of 8"):
        int_list(b"\0" * 12, "Q")


# --- TrainerStream._batch against the keyword-built Batch ------------------------------------

HEADER_BYTES = 4096
ROWS, TOKENS = 4, 16


@pytest.fixture
def stream() -> Iterator[tuple[TrainerStream, np.ndarray, trainer_pb2.StepBatch]]:
    """A stream with no daemon: one fake arena segment holding ROWS samples, and their step."""
    segment = np.zeros(1 << 20, np.uint8)
    buffer = memoryview(segment)
    samples = [{"input_ids": np.full(TOKENS, 100 + i, np.int64)} for i in range(ROWS)]
    offsets, size = write_samples(buffer, HEADER_BYTES, samples)
    ours, theirs = socket.socketpair()
    trainer = TrainerStream(rank=0, socket="unused", connection=ours, prefetch=2)
    trainer._segment_table = SegmentTable([buffer], [HEADER_BYTES], [len(segment)])
    trainer._form = BatchForm(length_key="input_ids")
    step = trainer_pb2.StepBatch(
        epoch=2, step=9, num_samples=ROWS, num_tokens=ROWS * TOKENS, global_num_samples=8,
        global_num_tokens=8 * TOKENS, loss_scale=0.5,
        sample_ids=np.arange(100, 100 + ROWS, dtype="<i8").tobytes(),
        segments=np.zeros(ROWS, "<u4").tobytes(), offsets=np.array(offsets, "<u8").tobytes(),
        nbytes=np.full(ROWS, size, "<u8").tobytes(),
    )  # fmt: skip
    step.progress.epoch_steps_estimate = 40
    step.progress.epoch_sample_fraction = 0.25
    step.progress.epoch_tokens = 1234
    try:
        yield trainer, segment, step
    finally:
        trainer.close()
        theirs.close()


def keyword_batch(step: trainer_pb2.StepBatch, tensors: dict[str, torch.Tensor | int]) -> Batch:
    """What stream.py built before issue 15, field by field by name: the specification."""
    p = step.progress
    update: dict[str, object] = {
        "update_index": step.step,
        "update_tokens": step.global_num_tokens,
        "update_samples": step.global_num_samples,
    }
    if step.HasField("update"):
        u = step.update
        update = {
            "update_end": u.end,
            "update_index": u.index,
            "update_num_steps": u.num_steps,
            "update_step": u.step_in_update,
            "update_tokens": u.num_tokens,
            "update_samples": u.num_samples,
            "update_short": u.short,
            "windowed": True,
            "update_per_rank": u.per_rank,
            "update_skip": u.skip,
            "update_skipped_after": u.skipped_after,
        }
    return Batch(
        tensors=tensors,
        epoch=step.epoch,
        step=step.step,
        num_samples=step.num_samples,
        num_tokens=step.num_tokens,
        global_num_samples=step.global_num_samples,
        global_num_tokens=step.global_num_tokens,
        sample_ids=tuple(np.frombuffer(step.sample_ids, "<i8").tolist()),
        is_idle=step.is_idle,
        loss_scale=step.loss_scale,
        progress=Progress(
            epoch_steps_estimate=p.epoch_steps_estimate,
            epoch_steps_exact=p.epoch_steps_exact,
            epoch_sample_fraction=p.epoch_sample_fraction,
            epoch_token_fraction=p.epoch_token_fraction,
            epoch_tokens=p.epoch_tokens,
            job_fraction=p.job_fraction,
            job_steps_estimate=p.job_steps_estimate,
        ),
        **update,  # type: ignore[arg-type]
    )


def test_a_step_without_update_facts_is_its_own_update(
    stream: tuple[TrainerStream, np.ndarray, trainer_pb2.StepBatch],
) -> None:
    trainer, _, step = stream
    batch = trainer._batch(step)
    assert_same_batch(batch, keyword_batch(step, batch.tensors))
    assert batch.update_end and not batch.windowed and batch.update_index == step.step
    assert batch.sample_ids == (100, 101, 102, 103)


# The fixture is only read (each example copies the step), so sharing it is safe.
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    update=st.tuples(u64, st.booleans(), u32, u32, u64, u64, st.booleans()),
    per_rank=st.tuples(st.booleans(), st.booleans(), u32),
    is_last=st.booleans(),
)
def test_a_windowed_step_carries_its_update(
    stream: tuple[TrainerStream, np.ndarray, trainer_pb2.StepBatch],
    update: tuple[int, bool, int, int, int, int, bool],
    per_rank: tuple[bool, bool, int],
    is_last: bool,
) -> None:
    trainer, _, template = stream
    step = trainer_pb2.StepBatch()
    step.CopyFrom(template)
    u = step.update
    u.index, u.end, u.num_steps, u.step_in_update, u.num_tokens, u.num_samples, u.short = update
    u.per_rank, u.skip, u.skipped_after = per_rank  # --align updates (issue 26)
    step.progress.epoch_steps_exact = is_last
    batch = trainer._batch(step)
    assert_same_batch(batch, keyword_batch(step, batch.tensors))
    assert batch.windowed


def test_the_batch_owns_its_memory(
    stream: tuple[TrainerStream, np.ndarray, trainer_pb2.StepBatch],
) -> None:
    trainer, segment, step = stream
    batch = trainer._batch(step)
    rows = batch["input_ids"]
    assert isinstance(rows, torch.Tensor)
    expected = torch.arange(100, 100 + ROWS).unsqueeze(1).expand(ROWS, TOKENS)
    segment[:] = 0xAB  # the daemon recycles the step's shared memory once it is delivered
    assert torch.equal(rows, expected)


# --- steps past this rank's end_job() point are never read ------------------------------------


def _event(step: trainer_pb2.StepBatch, at: int) -> trainer_pb2.TrainerEvent:
    event = trainer_pb2.TrainerEvent()
    event.steps.steps.add().CopyFrom(step)
    event.steps.steps[0].step = at
    return event


def test_steps_from_the_end_job_point_on_are_dropped_unread(
    stream: tuple[TrainerStream, np.ndarray, trainer_pb2.StepBatch],
) -> None:
    """Once the EndJob left, the daemon gives those steps' memory back to its producers: a
    step read from it then is garbage or, as CI saw, a ShmLayoutError out of end_job()."""
    trainer, segment, step = stream
    before = list(trainer._handle(_event(step, 8)))
    trainer.send_end_job(2, 9)
    segment[:] = 0  # a producer reuses the regions
    assert [b.step for b in before] == [8]
    assert list(trainer._handle(_event(step, 9))) == []
    assert list(trainer._handle(_event(step, 10))) == []


def test_a_step_being_read_when_end_job_is_called_is_dropped(
    stream: tuple[TrainerStream, np.ndarray, trainer_pb2.StepBatch],
) -> None:
    """The trainer thread sends end_job() while the reader thread reads a later step, and the
    daemon reuses its memory at once: whatever the read raised or returned, it is dropped."""
    trainer, segment, step = stream
    read = trainer._batch

    def read_during_end_job(s: trainer_pb2.StepBatch) -> Batch:
        trainer.send_end_job(2, 9)
        segment[:] = 0
        return read(s)

    trainer._batch = read_during_end_job  # type: ignore[method-assign]
    assert list(trainer._handle(_event(step, 9))) == []


def test_a_bad_step_before_the_end_job_point_still_raises(
    stream: tuple[TrainerStream, np.ndarray, trainer_pb2.StepBatch],
) -> None:
    trainer, segment, step = stream
    trainer.send_end_job(2, 9)
    segment[:] = 0
    with pytest.raises(ProtocolError, match="step 8"):
        list(trainer._handle(_event(step, 8)))
