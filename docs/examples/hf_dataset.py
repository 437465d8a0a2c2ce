"""A Hugging Face `datasets.Dataset`, tokenized with `map`, served by odbd as it is.

    odbd ... --dataset docs/examples/hf_dataset.py:build --dataset-arg size=256

Everything is made on the spot, with no download: an in-memory corpus, a BPE tokenizer trained
on it with `tokenizers`, and `Dataset.from_dict(...).map(tokenize, batched=True)`. The rows come
back as Python lists (the default format), which the producer converts to int64 arrays; pass
`--dataset-arg format=numpy` or `format=torch` to serve them through `set_format` instead.
The raw `text` column is removed in `map`: odbd carries numbers only, and a str value is
refused (`unsupported_value`) with the fix.
"""

from __future__ import annotations

import random
from typing import Any

import datasets
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

WORDS = (
    "the model reads a batch of tokens and every rank steps together while daemons agree "
    "on groups of similar length so padding stays small and no sample is lost or repeated"
).split()


def corpus(size: int, seed: int) -> list[str]:
    """`size` sentences of 3 to 60 words: lengths vary, as in real text."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 60))) for _ in range(size)]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["[UNK]", "[PAD]"], show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def build(
    size: int = 256, vocab_size: int = 300, seed: int = 0, format: str = ""
) -> datasets.Dataset:
    """The tokenized dataset: `input_ids` (length key) and `labels` (= input_ids), both lists."""
    datasets.disable_progress_bars()  # each producer runs this: bars would flood the daemon log
    texts = corpus(size, seed)
    tokenizer = train_tokenizer(texts, vocab_size)

    def tokenize(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        ids = [e.ids for e in tokenizer.encode_batch(batch["text"])]
        return {"input_ids": ids, "labels": [list(row) for row in ids]}

    ds = datasets.Dataset.from_dict({"text": texts})
    ds = ds.map(tokenize, batched=True, remove_columns=["text"])
    if format:
        ds.set_format(format)
    return ds


if __name__ == "__main__":
    ds = build(size=8)
    print(len(ds), ds[0])
