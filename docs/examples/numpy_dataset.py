"""A plain numpy dataset for odbd: variable-length token sequences with a loss mask.

    odbd ... --dataset docs/examples/numpy_dataset.py:build --dataset-arg size=1000

`build(**args)` is the factory: it returns a map-style dataset (`len(ds)`, `ds[i]`) whose
samples are dicts of numpy arrays. `input_ids` is the length key (its first dimension is the
sample's token count); `labels` is -100 on the prompt, so only the answer carries loss.
Samples are made on demand from the index alone, so every producer process (and every rerun)
makes the same sample i without holding the dataset in memory.
"""

from __future__ import annotations

import numpy as np


class TokenSequences:
    """Sample i: a prompt and an answer of seeded random lengths and token ids."""

    def __init__(self, size: int, vocab_size: int, min_len: int, max_len: int, seed: int) -> None:
        if not 2 <= min_len <= max_len:
            raise ValueError(f"need 2 <= min_len <= max_len, got {min_len} and {max_len}")
        self.size, self.vocab_size = size, vocab_size
        self.min_len, self.max_len, self.seed = min_len, max_len, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} of a dataset of {self.size}")
        rng = np.random.default_rng((self.seed, index))  # the sample depends on its index only
        length = int(rng.integers(self.min_len, self.max_len + 1))
        input_ids = rng.integers(1, self.vocab_size, length, dtype=np.int64)
        labels = input_ids.copy()
        labels[: length // 2] = -100  # the prompt: no loss
        return {"input_ids": input_ids, "labels": labels}


def build(
    size: int = 1000, vocab_size: int = 32000, min_len: int = 8, max_len: int = 512, seed: int = 0
) -> TokenSequences:
    return TokenSequences(size, vocab_size, min_len, max_len, seed)


if __name__ == "__main__":
    ds = build(size=4)
    print(len(ds), {k: (v.dtype.name, v.shape) for k, v in ds[0].items()})
