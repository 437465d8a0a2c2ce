"""Samples laid out in a fake arena segment, as producers place them: for tests and benchmarks
that collate without a daemon."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from odbclient.shm import align_up, encode_into, encoded_size


def write_samples(
    buffer: memoryview,
    base: int,
    samples: Sequence[dict[str, np.ndarray]],
    gaps: Collection[int] = (),
) -> tuple[list[int], int]:
    """Encodes `samples` one after another from `base`, each at an aligned offset, with 64 bytes
    more after each index in `gaps` (so the step is not evenly spaced); returns their offsets
    and the last one's encoded size."""
    offsets, pos, size = [], base, 0
    for i, sample in enumerate(samples):
        size = encoded_size(sample)
        encode_into(buffer[pos : pos + size], sample)
        offsets.append(pos)
        pos = align_up(pos + size) + (64 if i in gaps else 0)
    return offsets, size
