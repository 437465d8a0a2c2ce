"""Staging between a reader process and its trainer (odbclient.trainer.staging), both ends in one
process: a staged batch comes back equal and in fresh memory, slots grow, reports add up."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch

from odbclient.trainer.batch import Batch, Progress
from odbclient.trainer.reader_process import StagingReader
from odbclient.trainer.staged_stream import StagedStream
from odbclient.trainer.staging import FACTS, ControlPage, Report

pytestmark = pytest.mark.timeout(60)


def make_batch(step: int, rows: int = 4, **tensors: Any) -> Batch:
    tensors = tensors or {
        "input_ids": torch.arange(rows * 8, dtype=torch.int64).reshape(rows, 8) + step,
        "pixels": torch.full((rows, 3), 0.5 + step, dtype=torch.bfloat16),
        "mask": torch.ones(rows, 8, dtype=torch.bool),
        "max_length_q": 8,
    }
    return Batch(
        tensors=tensors,
        epoch=1,
        step=step,
        num_samples=rows,
        num_tokens=rows * 8,
        global_num_samples=2 * rows,
        global_num_tokens=16 * rows,
        sample_ids=tuple(range(step * rows, step * rows + rows)),
        is_idle=False,
        loss_scale=0.25,
        progress=Progress(epoch_steps_estimate=10, epoch_sample_fraction=0.1 * step),
        update_index=step,
    )


@pytest.fixture
def ends():
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = os.memfd_create("test-control")
    page = ControlPage.create(fd)
    reader = StagingReader(
        None,  # type: ignore[arg-type]  # staging needs no daemon stream
        theirs,
        ControlPage.attach(fd),
        num_slots=2,
        report_every=4,
        parent_pid=os.getppid(),
    )
    stream = StagedStream(rank=0, socket="test", peer=mine, page=page, process=None)  # type: ignore[arg-type]
    yield reader, stream
    os.close(fd)
    mine.close()
    theirs.close()


def assert_same(got: object, want: Batch) -> None:
    assert isinstance(got, Batch)
    for name in (*FACTS, "progress"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.keys() == want.keys()
    for key, value in want.tensors.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value


def test_a_staged_batch_comes_back_equal_in_memory_the_batch_owns(ends):
    reader, stream = ends
    batches = [make_batch(0), make_batch(1)]
    for batch in batches:
        reader._stage(batch)
    reader._send_items()
    first = stream.take(5.0)
    assert_same(first, batches[0])
    assert_same(stream.take(5.0), batches[1])
    # The slot is reused: the first batch's tensors must not change with it.
    reader._stage(make_batch(2))
    reader._send_items()
    assert_same(stream.take(5.0), make_batch(2))
    assert_same(first, batches[0])


def test_a_batch_bigger_than_its_slot_gets_a_new_one(ends):
    reader, stream = ends
    small, big = make_batch(0), make_batch(1, rows=40_000)
    for batch in (small, make_batch(5), big):
        if batch is big:
            assert stream.take(5.0) is not None  # the trainer frees slot 0 first
        reader._stage(batch)
        reader._send_items()
    assert_same(stream.take(5.0), make_batch(5))
    assert_same(stream.take(5.0), big)


def test_reports_reach_the_reader_process_as_running_sums(ends):
    reader, stream = ends
    for step in range(3):
        assert stream.reports.add(0, step, wait_s=0.5, compute_s=1.0) == 0
    assert reader.page.read_report() == Report(3, 0, 2, 1.5, 3.0)
