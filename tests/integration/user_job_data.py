"""The dataset of the user-job test, built the way a user builds one: no odbd types anywhere.

    odbd ... --dataset tests/integration/user_job_data.py:build --dataset-arg size=48

A BPE tokenizer is trained on the spot with `tokenizers` (nothing is downloaded) on a synthetic
corpus of sentences whose lengths follow a long tail; a Hugging Face `datasets.Dataset` made
in memory is tokenized with `map`, exactly as a fine-tuning script would. Rows come back as
Python lists (the `datasets` default format): odbd must take them as they are.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = (
    "the a model token batch padding rank step epoch daemon shared memory round budget "
    "gradient loss scale sample length tail group node world trainer producer plan"
).split()
VOCAB_SIZE = 96
PAD, EOS = "<pad>", "<eos>"


def sentences(size: int, seed: int) -> list[str]:
    """`size` texts of 3..~150 words, long-tailed like chat data."""
    rng = random.Random(seed)
    texts = []
    for _ in range(size):
        words = min(150, 3 + int(rng.paretovariate(1.3) * 6))
        texts.append(" ".join(rng.choice(WORDS) for _ in range(words)))
    return texts


def train_tokenizer(texts: list[str]) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[PAD, EOS, "<unk>"])
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def build(size: int = 48, seed: int = 0) -> Any:
    """The tokenized `datasets.Dataset`: input_ids, attention_mask, labels (lists of ints)."""
    from datasets import Dataset

    texts = sentences(size, seed)
    tokenizer = train_tokenizer(texts)
    eos = tokenizer.token_to_id(EOS)

    def tokenize(row: dict[str, str]) -> dict[str, list[int]]:
        ids = tokenizer.encode(row["text"]).ids + [eos]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)}

    dataset = Dataset.from_dict({"text": texts})
    return dataset.map(tokenize, remove_columns=["text"])


def vocab_size() -> int:
    return VOCAB_SIZE
