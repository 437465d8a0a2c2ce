"""A synthetic, already-preprocessed dataset for the demo, tests and benchmarks.

`odbd --dataset odbd.demo.dataset:synthetic --dataset-arg dist=sharegpt4o --dataset-arg size=2000`
gives samples {"input_ids": int64[l], "labels": int64[l]} whose lengths l follow a named
distribution of ../shared/data/distributions.md; the first `prompt_fraction` of each sample's
labels are -100 (a masked prompt), as chat templates produce.
"""

from __future__ import annotations

import time

import numpy as np

from odbd.simulate.distributions import sample_lengths


class SyntheticDataset:
    def __init__(
        self,
        dist: str = "sharegpt4o",
        size: int = 2000,
        seed: int = 0,
        vocab: int = 32000,
        prompt_fraction: float = 0.25,
        delay_s: float = 0.0,
        zero_length_every: int = 0,
    ) -> None:
        if not isinstance(size, int) or size < 1:
            # Said here, naming this factory's own argument: sample_lengths' message named
            # the simulator's --num-samples, which neither odbd nor this factory has.
            raise ValueError(
                f"size must be an integer >= 1 (the number of samples), got {size!r}; "
                "pass --dataset-arg size=N"
            )
        self.lengths = sample_lengths(dist, size, seed)
        if zero_length_every > 0:
            self.lengths[::zero_length_every] = 0  # bad input, for rejection tests
        self.seed = seed
        self.vocab = vocab
        self.prompt_fraction = prompt_fraction
        self.delay_s = delay_s  # simulated preprocessing cost per sample

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if self.delay_s:
            time.sleep(self.delay_s)
        length = int(self.lengths[index])
        rng = np.random.default_rng([self.seed, index])
        ids = rng.integers(0, self.vocab, size=length, dtype=np.int64)
        labels = ids.copy()
        labels[: int(length * self.prompt_fraction)] = -100
        return {"input_ids": ids, "labels": labels}


def synthetic(**kwargs: object) -> SyntheticDataset:
    """Factory for --dataset odbd.demo.dataset:synthetic (keyword args from --dataset-arg)."""
    return SyntheticDataset(**kwargs)  # type: ignore[arg-type]
