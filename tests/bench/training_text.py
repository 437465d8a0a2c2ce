"""The user-baselines benchmark's data: long-tailed texts, a BPE tokenizer trained on the spot.

    odbd ... --dataset tests/bench/training_text.py:make --dataset-arg size=1024 ...

Every process (daemon producer, each trainer rank, the GPU script) builds the same dataset from
the same seed: a synthetic corpus whose word counts follow a log-normal tail (most texts short,
a few long, like chat fine-tuning data), a byte-level BPE tokenizer trained on it with
`tokenizers` (nothing is downloaded; training is deterministic for a fixed corpus), and
samples `{"input_ids", "labels"}` as int64 numpy arrays with Hugging Face's label convention
(labels = input_ids, the model shifts), truncated to `max_len` tokens.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

WORDS = (
    "the a model token batch padding rank step epoch daemon shared memory round budget "
    "gradient loss scale sample length tail group node world trainer producer plan kernel "
    "attention row packed sequence boundary position optimizer update window buffer queue "
    "barrier alignment protocol replica cluster shard offset prefix suffix ratio median"
).split()
EOS = "<eos>"


def _word_counts(size: int, seed: int, median_words: float, sigma: float) -> np.ndarray:
    rng = np.random.default_rng([seed, 7])
    raw = np.exp(rng.normal(np.log(median_words), sigma, size=size))
    return np.clip(np.rint(raw), 2, 10_000).astype(np.int64)


def _texts(size: int, seed: int, median_words: float, sigma: float) -> list[str]:
    rng = np.random.default_rng([seed, 8])
    counts = _word_counts(size, seed, median_words, sigma)
    # A bigram-ish drift so BPE finds merges and the model has something to learn.
    return [
        " ".join(WORDS[(int(rng.integers(len(WORDS))) + 3 * k) % len(WORDS)] for k in range(n))
        for n in counts.tolist()
    ]


@cache
def _encoded(
    size: int, seed: int, vocab: int, median_words: float, sigma: float, max_len: int
) -> tuple[np.ndarray, ...]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = _texts(size, seed, median_words, sigma)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", EOS, "<unk>"], show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eos = tokenizer.token_to_id(EOS)
    encoded = tokenizer.encode_batch(texts)
    return tuple(np.asarray((e.ids + [eos])[:max_len], dtype=np.int64) for e in encoded)


class TextTokens:
    """Map-style dataset: `ds[i] -> {"input_ids": int64[l], "labels": int64[l]}` (HF labels)."""

    def __init__(
        self,
        size: int = 1024,
        seed: int = 0,
        vocab: int = 512,
        median_words: float = 30.0,
        sigma: float = 1.0,
        max_len: int = 512,
    ) -> None:
        self._rows = _encoded(size, seed, vocab, median_words, sigma, max_len)
        self.vocab = vocab
        self.lengths = np.fromiter((len(r) for r in self._rows), dtype=np.int64)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids = self._rows[index]
        return {"input_ids": ids, "labels": ids.copy()}


def make(**kwargs: Any) -> TextTokens:
    """Factory for `--dataset tests/bench/training_text.py:make` (args from --dataset-arg)."""
    return TextTokens(**kwargs)
