"""A VLM-like dataset (Qwen2-VL style): 0 to 4 images per sample, each of its own size.

    odbd ... --dataset docs/examples/vlm_dataset.py:build --dataset-arg size=500 \\
        --concat pixel_values --concat image_grid_thw --max-patches 1024

A vision encoder cuts each image into patches (an h x w grid here, h and w even); a 2 x 2 merge
turns every 4 patches into one image token in the text. Keys:
- input_ids (L,) int64: [BOS, (IMAGE * h*w/4) per image, question, answer];
- labels (L,) int64: -100 on BOS, the image tokens and the question: loss on the answer only;
- pixel_values (P, PATCH_DIM) float32: every image's patches one after another, P = sum h*w
  (0 rows for a sample without images); with `--concat pixel_values` a batch holds every
  sample's rows joined, and `pixel_values_offsets` says whose rows are whose;
- image_grid_thw (n_images, 3) int64: (t, h, w) of each image, t = 1 (0 rows without images).

The patch count of a sample (what `--max-patches` budgets) is pixel_values' first dimension,
the default patch source when pixel_values is the first --concat key. Every value is a pure
function of (seed, index), so a trainer can check what it got against `build(...)[i]`.
"""

from __future__ import annotations

import numpy as np

BOS, IMAGE_TOKEN = 1, 2  # ids below 3 are special; text tokens are drawn from [3, vocab_size)
PATCH_DIM = 24  # 3 channels x 2 x 2 pixels per patch, say; small to keep the example light
GRID_SIDES = (2, 4, 6, 8)  # h and w of an image in patches
MERGE = 4  # patches per image token (2 x 2 merge)


class ImagesAndText:
    def __init__(self, size: int, vocab_size: int, max_images: int, seed: int) -> None:
        self.size, self.vocab_size, self.max_images, self.seed = size, vocab_size, max_images, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} of a dataset of {self.size}")
        rng = np.random.default_rng((self.seed, index))
        num_images = int(rng.integers(0, self.max_images + 1))
        grids = np.asarray(
            [[1, *rng.choice(GRID_SIDES, size=2)] for _ in range(num_images)], dtype=np.int64
        ).reshape(num_images, 3)
        patches = int(grids.prod(axis=1).sum())
        question = rng.integers(3, self.vocab_size, int(rng.integers(4, 48)), dtype=np.int64)
        answer = rng.integers(3, self.vocab_size, int(rng.integers(1, 96)), dtype=np.int64)
        prompt = np.concatenate([[BOS], np.full(patches // MERGE, IMAGE_TOKEN), question])
        return {
            "input_ids": np.concatenate([prompt, answer]).astype(np.int64),
            "labels": np.concatenate([np.full(len(prompt), -100), answer]).astype(np.int64),
            "pixel_values": rng.standard_normal((patches, PATCH_DIM), dtype=np.float32),
            "image_grid_thw": grids,
        }


def build(
    size: int = 500, vocab_size: int = 32000, max_images: int = 4, seed: int = 0
) -> ImagesAndText:
    if max_images < 0:
        raise ValueError(f"max_images must be >= 0, got {max_images}")
    return ImagesAndText(size, vocab_size, max_images, seed)


if __name__ == "__main__":
    ds = build(size=4)
    print(len(ds), [{k: (v.dtype.name, v.shape) for k, v in ds[i].items()} for i in range(4)])
