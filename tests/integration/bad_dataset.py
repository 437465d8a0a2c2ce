"""A dataset with bad samples at known indices, for rejection tests (loaded by path)."""

import numpy as np

GOOD_LENGTH = 12


class BadSamples:
    """Index i % 8: 1 lacks input_ids, 2 has length 0, 3 has an unsupported dtype,
    4 has an extra key, 5 makes preprocessing raise; the rest are good."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        ids = np.arange(GOOD_LENGTH, dtype=np.int64) + index
        kind = index % 8
        if kind == 1:
            return {"labels": ids}
        if kind == 2:
            return {"input_ids": ids[:0], "labels": ids[:0]}
        if kind == 3:
            return {"input_ids": ids.astype(np.complex64), "labels": ids}
        if kind == 4:
            return {"input_ids": ids, "labels": ids, "extra": ids}
        if kind == 5:
            raise RuntimeError(f"preprocessing failed for sample {index}")
        return {"input_ids": ids, "labels": ids}


def make(size: int = 40) -> BadSamples:
    return BadSamples(size)
