"""The trainer's reader thread's work on one step, back to back: TrainerStream._batch of a
16 x 8 KiB StepBatch (collate out of a fake arena segment, sample ids, Batch), evenly spaced or
with two 64-byte gaps (one gather), and the data-path bench's per-step row check (issue 15).

    .venv/bin/python -m tests.bench.reader_step_cost

Prints the minimum over 5 rounds (each the best of 3 repeats) of us per call. Run it with
another tree's code first on PYTHONPATH (`PYTHONPATH=<tree>/server:<tree>/client:.`) to
compare.
"""

from __future__ import annotations

import socket
import timeit
from collections.abc import Callable

import numpy as np

from odbclient.trainer.collate import BatchForm
from odbclient.trainer.step_collate import SegmentTable
from odbclient.trainer.stream import TrainerStream
from odbclient.wire.odbd.v1 import trainer_pb2
from tests.bench.datapath_trainer import check_rows
from tests.shm_samples import write_samples

HEADER_BYTES = 4096
ROWS, TOKENS = 16, 1024  # 8 KiB of int64 per sample


def write_step(buffer: memoryview, base: int, gaps: tuple[int, ...]) -> trainer_pb2.StepBatch:
    """ROWS samples written from `base` on (64 bytes more after each index in `gaps`)."""
    samples = [{"input_ids": np.full(TOKENS, 1000 + i, np.int64)} for i in range(ROWS)]
    offsets, size = write_samples(buffer, base, samples, gaps)
    step = trainer_pb2.StepBatch(
        epoch=0, step=5, num_samples=ROWS, num_tokens=ROWS * TOKENS, global_num_samples=ROWS,
        global_num_tokens=ROWS * TOKENS, loss_scale=1.0,
        sample_ids=np.arange(1000, 1000 + ROWS, dtype="<i8").tobytes(),
        segments=np.zeros(ROWS, "<u4").tobytes(), offsets=np.array(offsets, "<u8").tobytes(),
        nbytes=np.full(ROWS, size, "<u8").tobytes(),
    )  # fmt: skip
    step.progress.epoch_steps_estimate = 100
    return step


def best_us(call: Callable[[], object], number: int) -> float:
    return min(min(timeit.repeat(call, number=number, repeat=3)) / number * 1e6 for _ in range(5))


def main() -> None:
    segment = np.zeros(16 << 20, np.uint8)
    buffer = memoryview(segment)
    ours, theirs = socket.socketpair()
    stream = TrainerStream(rank=0, socket="unused", connection=ours, prefetch=8)
    stream._segment_table = SegmentTable([buffer], [HEADER_BYTES], [len(segment)])
    stream._form = BatchForm(length_key="input_ids")
    try:
        for name, step in (
            ("evenly spaced", write_step(buffer, HEADER_BYTES, ())),
            ("two gaps (gathered)", write_step(buffer, 4 << 20, (5, 11))),
        ):
            us = best_us(lambda step=step: stream._batch(step), 2000)
            print(f"reader _batch, {ROWS} x 8 KiB, {name}: {us:.1f} us/step")
        batch = stream._batch(write_step(buffer, 8 << 20, ()))
        print(f"bench row check: {best_us(lambda: check_rows(batch), 5000):.1f} us/step")
    finally:
        stream.close()
        theirs.close()


if __name__ == "__main__":
    main()
