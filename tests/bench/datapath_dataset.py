"""Fixed-size samples for the node data-path benchmark (`--dataset PATH:fixed_size`).

Every sample is `{"input_ids": int64[nbytes // 8]}`: one array, which is also the length key,
so a sample's payload is exactly `nbytes` bytes like a slot of the raw shm ring
(tests/bench/shm_ring.py). Preprocessing costs nothing: the array is made once and only its
first entry changes (the identity), so the producer's time is the data path's, not the
dataset's. Safe to reuse the array: the producer encodes a sample into shared memory before it
asks for the next one.
"""

from __future__ import annotations

import numpy as np


class FixedSizeDataset:
    def __init__(self, size: int, nbytes: int) -> None:
        if size < 1 or nbytes < 8 or nbytes % 8:
            raise ValueError(f"size={size} must be >= 1, nbytes={nbytes} a multiple of 8")
        self.size = size
        self._ids = np.zeros(nbytes // 8, np.int64)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        self._ids[0] = index
        return {"input_ids": self._ids}


def fixed_size(size: int, nbytes: int) -> FixedSizeDataset:
    """Factory for `--dataset tests/bench/datapath_dataset.py:fixed_size`."""
    return FixedSizeDataset(size, nbytes)
