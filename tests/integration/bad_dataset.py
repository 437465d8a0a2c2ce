"""A dataset with bad samples at known indices, for rejection tests (loaded by path)."""

import numpy as np

GOOD_LENGTH = 12


class BadSamples:
    """Index i % 8: 1 lacks input_ids, 2 has length 0, 3 has an unsupported dtype,
    4 has an extra key, 5 makes preprocessing raise; the rest are good."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        ids = np.arange(GOOD_LENGTH, dtype=np.int64) + index
        kind = index % 8
        if kind == 1:
            return {"labels": ids}
        if kind == 2:
            return {"input_ids": ids[:0], "labels": ids[:0]}
        if kind == 3:
            return {"input_ids": ids.astype(np.complex64), "labels": ids}
        if kind == 4:
            return {"input_ids": ids, "labels": ids, "extra": ids}
        if kind == 5:
            raise RuntimeError(f"preprocessing failed for sample {index}")
        return {"input_ids": ids, "labels": ids}


def make(size: int = 40) -> BadSamples:
    return BadSamples(size)


class OddFirst:
    """Issue 24: sample 0 (committed first under --no-shuffle) has another schema than the
    rest: `odd=int32` gives it int32 input_ids (promoted to int64 by the producer), `odd=key`
    an extra float key (rejected by the schema vote); the other samples are good. `int32_all`
    and `key_all` make every sample so (one node's dataset in the 2-node tests)."""

    def __init__(self, size: int, odd: str) -> None:
        self.size, self.odd = size, odd

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        ids = np.arange(GOOD_LENGTH, dtype=np.int64) + index
        if index == 0 and self.odd == "int32":
            return {"input_ids": ids.astype(np.int32), "labels": ids}
        if index == 0 and self.odd == "key":
            return {"input_ids": ids, "labels": ids, "score": np.ones(1, np.float32)}
        if self.odd == "int32_all":  # every sample (one node's data, in the 2-node tests)
            return {"input_ids": ids.astype(np.int32), "labels": ids.astype(np.int32)}
        if self.odd == "key_all":
            return {"input_ids": ids, "labels": ids, "score": np.ones(1, np.float32)}
        return {"input_ids": ids, "labels": ids}


def odd_first(size: int = 400, odd: str = "") -> OddFirst:
    return OddFirst(size, odd)


class FailingReads:
    """dataset[i] raises OSError for `percent` % of the ids (a storage outage), spread evenly."""

    def __init__(self, size: int, percent: int) -> None:
        self.size, self.percent = size, percent

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        if index % 100 < self.percent:
            raise OSError(f"read of shard for sample {index} failed: Input/output error")
        ids = np.arange(GOOD_LENGTH, dtype=np.int64) + index
        return {"input_ids": ids, "labels": ids}


def failing_reads(size: int = 400, percent: int = 85) -> FailingReads:
    return FailingReads(size, percent)


def empty() -> list:
    return []


class NanEvery:
    """Samples with a float key `score`; every `every`-th holds NaN (at index 1)."""

    def __init__(self, size: int, every: int) -> None:
        self.size, self.every = size, every

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        ids = np.arange(GOOD_LENGTH, dtype=np.int64) + index
        score = np.ones(3, np.float32)
        if index % self.every == 0:
            score[1] = np.nan
        return {"input_ids": ids, "labels": ids, "score": score}


def nan_every(size: int = 120, every: int = 40) -> NanEvery:
    return NanEvery(size, every)
