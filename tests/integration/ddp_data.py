"""A long-tailed, learnable token dataset for the DDP tests and benchmarks (numpy + torch only).

`odbd --dataset tests/integration/ddp_data.py:make --dataset-arg size=256 ...` spawns producers
over it; the baselines index the same class in-process, so every loader sees identical samples.

Lengths are log-normal (median `median_len`, shape `sigma`) clipped to [min_len, max_len]: most
samples are short, a few are long, as in chat fine-tuning data. Each sequence counts up from a
random start with a random stride (mod vocab), so a small causal model can learn it and the
loss falls well below log(vocab); a fixed seed makes every sample identical in every process.

Labels are pre-shifted (the next-token choice): labels[t] = input_ids[t + 1] is the target of
position t, the last position has no target (-100) and the first `prompt_fraction` positions
are a masked prompt (-100). So `labels != -100` counts exactly the loss terms of the sample,
which is what odbd counts as its loss-bearing tokens t_r (DESIGN.md 3.4). With `label_shift=0`
the labels are Hugging Face's (labels = input_ids, the model shifts): the loss terms are then
labels[1:] != -100, which equals odbd's count because labels[0] is always a masked prompt
token; see docs/training.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

IGNORE_INDEX = -100
STRIDES = (1, 2, 3, 5, 7)


def long_tail_lengths(
    size: int, *, seed: int, median_len: float, sigma: float, min_len: int, max_len: int
) -> np.ndarray:
    rng = np.random.default_rng([seed, 1])
    raw = np.exp(rng.normal(np.log(median_len), sigma, size=size))
    return np.clip(np.rint(raw), min_len, max_len).astype(np.int64)


class LongTailTokens:
    """Map-style dataset: `ds[i] -> {"input_ids": int64[l], "labels": int64[l]}`."""

    def __init__(
        self,
        size: int = 256,
        seed: int = 0,
        vocab: int = 64,
        median_len: float = 24.0,
        sigma: float = 0.9,
        min_len: int = 4,
        max_len: int = 384,
        prompt_fraction: float = 0.25,
        as_torch: int = 0,
        label_shift: int = 1,
        skew: int = 0,
    ) -> None:
        if min_len < 4 or max_len < min_len or size < 0 or not 0.25 <= prompt_fraction < 1:
            raise ValueError(
                "need 4 <= min_len <= max_len, size >= 0 and 0.25 <= prompt_fraction < 1 (so "
                f"every sample has a masked prompt token), got {locals()}"
            )
        self.lengths = long_tail_lengths(
            size, seed=seed, median_len=median_len, sigma=sigma, min_len=min_len, max_len=max_len
        )
        if skew > 0:
            # Node-skewed (the migration tests, with odbd --shuffle off, where view i goes to
            # rank i % W): samples whose index % skew falls in the first half are 4x longer,
            # the others half as long, so the nodes of the first ranks hold the long ones.
            heavy = np.arange(size) % skew < skew // 2
            self.lengths = np.where(
                heavy,
                np.minimum(self.lengths * 4, max_len),
                np.maximum(self.lengths // 2, min_len),
            ).astype(np.int64)
        self.seed = seed
        self.vocab = vocab
        self.prompt_fraction = prompt_fraction
        self.as_torch = bool(as_torch)  # the paper's ODBDataLoader only measures torch tensors
        self.label_shift = label_shift  # 1: pre-shifted; 0: Hugging Face's (the model shifts)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        length = int(self.lengths[index])
        rng = np.random.default_rng([self.seed, 2, index])
        start = int(rng.integers(0, self.vocab))
        stride = STRIDES[int(rng.integers(0, len(STRIDES)))]
        ids = (start + stride * np.arange(length, dtype=np.int64)) % self.vocab
        if self.label_shift:
            labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
            labels[:-1] = ids[1:]  # the last position has no next token
        else:
            labels = ids.copy()
        labels[: int(length * self.prompt_fraction)] = IGNORE_INDEX
        sample = {"input_ids": ids, "labels": labels}
        if self.as_torch:
            import torch

            return {k: torch.from_numpy(v) for k, v in sample.items()}
        return sample

    def loss_tokens(self, index: int) -> int:
        """What odbd counts for sample `index`: its labels != -100."""
        return int(np.count_nonzero(self[index]["labels"] != IGNORE_INDEX))


def make(**kwargs: Any) -> LongTailTokens:
    """Factory for `--dataset tests/integration/ddp_data.py:make` (args from --dataset-arg)."""
    return LongTailTokens(**kwargs)


def dataset_args(**kwargs: Any) -> list[str]:
    """`--dataset-arg KEY=VALUE` flags for the daemon, in the same spelling as `make` takes."""
    args: list[str] = []
    for key, value in kwargs.items():
        args += ["--dataset-arg", f"{key}={value}"]
    return args
