"""Fixed-size samples for the node data-path benchmark (`--dataset PATH:fixed_size`).

Every sample is `{"input_ids": int64[nbytes // 8]}`: one array, which is also the length key,
so a sample's payload is exactly `nbytes` bytes like a slot of the raw shm ring
(tests/bench/shm_ring.py). Every `dataset[i]` returns a fresh array filled with `i` (issue 15:
the same samples for odbd and torch's DataLoader, which must not see one reused buffer), so
a consumer can check that every entry of a row carries its own sample id; making it is one
allocation and one fill, the cheapest preprocessing a real dataset could have.
"""

from __future__ import annotations

import numpy as np


class FixedSizeDataset:
    def __init__(self, size: int, nbytes: int) -> None:
        if size < 1 or nbytes < 8 or nbytes % 8:
            raise ValueError(f"size={size} must be >= 1, nbytes={nbytes} a multiple of 8")
        self.size = size
        self.num_tokens = nbytes // 8

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"input_ids": np.full(self.num_tokens, index, np.int64)}


def fixed_size(size: int, nbytes: int) -> FixedSizeDataset:
    """Factory for `--dataset tests/bench/datapath_dataset.py:fixed_size`."""
    return FixedSizeDataset(size, nbytes)
