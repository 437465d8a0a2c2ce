"""Trainer-side collate of one step: odbclient.trainer.step_collate (a few numpy calls per key)
against the per-sample path (decode every sample, then odbclient.trainer.collate), on samples in
one fake arena segment, evenly spaced (one strided copy per key) or not (one gather per key;
issue 15).

    .venv/bin/python tests/bench/step_collate_cost.py

Prints, per case, the minimum over 15 rounds (each the best of 3 repeats) of us per step for
both paths, alternated round by round; a loaded machine inflates medians, not minimums.
"""

from __future__ import annotations

import timeit
from functools import partial

import numpy as np

from odbclient.shm import decode, read_meta
from odbclient.trainer.collate import BatchForm, collate
from odbclient.trainer.step_collate import SegmentTable, _layout, collate_uniform
from tests.shm_samples import write_samples

HEADER_BYTES = 4096
CASES = (  # samples per step, payload bytes per sample, samples after which a 64-byte gap falls
    (16, 8192, ()),
    (16, 8192, (5, 11)),
    (128, 1024, ()),
    (128, 1024, (40, 90)),
    (8, 1 << 20, ()),
)


def per_sample_path(buffer: memoryview, offsets: list[int], size: int) -> object:
    """What stream.py does for a step collate_uniform declines."""
    views = [buffer[o : o + size] for o in offsets]
    bf16 = frozenset(f.name for f in read_meta(views[0]).fields if f.dtype == "bfloat16")
    return collate([decode(v) for v in views], pads={}, bfloat16_keys=bf16)


def main() -> None:
    segment = np.zeros(64 << 20, np.uint8)
    buffer = memoryview(segment)
    table = SegmentTable([buffer], [HEADER_BYTES], [len(segment)])
    for count, nbytes, gaps in CASES:
        samples = [{"input_ids": np.full(nbytes // 8, i, np.int64)} for i in range(count)]
        offsets_list, size = write_samples(buffer, HEADER_BYTES, samples, gaps)
        segments = np.zeros(count, np.uint32)
        offsets = np.array(offsets_list, np.uint64)
        sizes = np.full(count, size, np.uint64)

        vectorised = partial(collate_uniform, table, segments, offsets, sizes, form=BatchForm())
        per_sample = partial(per_sample_path, buffer, offsets_list, size)
        assert vectorised() is not None
        number = max(1, 2000 // count) if nbytes < (1 << 20) else 5
        slow, fast = [], []
        for _ in range(15):
            slow.append(min(timeit.repeat(per_sample, number=number, repeat=3)) / number * 1e6)
            fast.append(min(timeit.repeat(vectorised, number=number, repeat=3)) / number * 1e6)
        layout = (
            "strided"
            if _layout(table, [0] * count, offsets_list, [size] * count)[1]
            else "gathered"
        )
        print(
            f"{count} x {nbytes} B, {layout}: per-sample path "
            f"{min(slow):.1f} us/step, step_collate {min(fast):.1f} us/step "
            f"({min(fast) / min(slow):.2f}x)"
        )


if __name__ == "__main__":
    main()
