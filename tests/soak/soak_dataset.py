"""A tiny heavy-tailed dataset for the soak: ShareGPT-4o's lognormal lengths scaled down.

`--dataset tests/soak/soak_dataset.py:tiny_heavy_tail --dataset-arg size=200000` gives samples
{"input_ids": int64[l], "labels": int64[l]} with l = max(1, sharegpt4o length // scale): the
same shape of tail (CV 1.0) at a size two cores can move 200k times in a few minutes.
"""

from __future__ import annotations

import numpy as np

from odbd.simulate.distributions import sample_lengths


class TinyHeavyTail:
    def __init__(self, size: int, scale: int = 64, dist: str = "sharegpt4o", seed: int = 0) -> None:
        self.lengths = np.maximum(sample_lengths(dist, size, seed) // scale, 1).astype(np.int64)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        ids = np.arange(int(self.lengths[index]), dtype=np.int64) + index
        labels = ids.copy()
        labels[: len(ids) // 4] = -100  # a masked prompt
        return {"input_ids": ids, "labels": labels}


def tiny_heavy_tail(**kwargs: object) -> TinyHeavyTail:
    return TinyHeavyTail(**kwargs)  # type: ignore[arg-type]
