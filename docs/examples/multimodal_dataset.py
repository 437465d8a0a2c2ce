"""A multimodal-like dataset: text with an image whose visual tokens vary per sample.

    odbd ... --dataset docs/examples/multimodal_dataset.py:build --dataset-arg size=500

Each sample is a prompt `<image> question`, then an answer. The one `<image>` placeholder is
expanded to the image's visual token count (16 to 576, as a resolution-dependent vision
encoder would give), so `input_ids` (the length key) counts text and image tokens together,
which is what the model's sequence holds and what the token budget must count. Keys:
- input_ids (L,) int64: [BOS, IMAGE * n_visual, question, answer];
- labels (L,) int64: -100 on BOS, the image tokens and the question: loss on the answer only;
- pixel_values (3, 32, 32) float32: a fixed-shape per-sample array, stacked to (B, 3, 32, 32);
- num_image_tokens () int64: n_visual, a 0-d array, collated to (B,).
"""

from __future__ import annotations

import numpy as np

BOS, IMAGE_TOKEN = 1, 2  # ids below 3 are special; text tokens are drawn from [3, vocab_size)
IMAGE_SHAPE = (3, 32, 32)


class ImageTextPairs:
    def __init__(self, size: int, vocab_size: int, max_visual: int, seed: int) -> None:
        self.size, self.vocab_size, self.max_visual, self.seed = size, vocab_size, max_visual, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} of a dataset of {self.size}")
        rng = np.random.default_rng((self.seed, index))
        n_visual = int(rng.integers(16, self.max_visual + 1))
        question = rng.integers(3, self.vocab_size, int(rng.integers(4, 64)), dtype=np.int64)
        answer = rng.integers(3, self.vocab_size, int(rng.integers(1, 128)), dtype=np.int64)
        prompt = np.concatenate([[BOS], np.full(n_visual, IMAGE_TOKEN), question])
        input_ids = np.concatenate([prompt, answer]).astype(np.int64)
        labels = np.concatenate([np.full(len(prompt), -100), answer]).astype(np.int64)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "pixel_values": rng.standard_normal(IMAGE_SHAPE, dtype=np.float32),
            "num_image_tokens": np.asarray(n_visual, np.int64),
        }


def build(
    size: int = 500, vocab_size: int = 32000, max_visual: int = 576, seed: int = 0
) -> ImageTextPairs:
    if max_visual < 16:
        raise ValueError(f"max_visual must be >= 16 (the fewest visual tokens), got {max_visual}")
    return ImageTextPairs(size, vocab_size, max_visual, seed)


if __name__ == "__main__":
    ds = build(size=4)
    print(len(ds), {k: (v.dtype.name, v.shape) for k, v in ds[0].items()})
