"""What a dataset may return per key (issue 10): Python lists and numbers, numpy, torch; and the
one-line refusal of everything else, naming the key, the type and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from odbclient.samples import (
    RejectReason,
    SampleForm,
    SampleRejected,
    as_arrays,
    fetch_sample,
    inspect_sample,
    schema_hash,
)
from odbclient.shm import decode, encode_into, encoded_size


@pytest.mark.parametrize(
    ("value", "dtype", "shape"),
    [
        ([5, 6, 7], np.int64, (3,)),
        ((5, 6, 7), np.int64, (3,)),
        ([0.5, 1], np.float32, (2,)),  # any float makes the list float32
        ([True, False], np.bool_, (2,)),
        ([True, 2], np.int64, (2,)),
        ([[1, 2, 3], [4, 5, 6]], np.int64, (2, 3)),
        ([[0.5], [1.5]], np.float32, (2, 1)),
        ([], np.int64, (0,)),
        (7, np.int64, ()),
        (0.25, np.float32, ()),
        (False, np.bool_, ()),
        (np.int32(3), np.int32, ()),  # numpy scalars keep their dtype
        (np.float64(0.5), np.float64, ()),
    ],
)
def test_python_values_become_arrays_of_the_documented_dtype(
    value: Any, dtype: type, shape: tuple[int, ...]
) -> None:
    array = as_arrays({"x": value})["x"]
    assert isinstance(array, np.ndarray)
    assert (array.dtype, array.shape) == (np.dtype(dtype), shape)
    np.testing.assert_array_equal(array, np.asarray(value, dtype))


def test_a_sample_of_arrays_and_tensors_is_returned_as_is_without_a_copy() -> None:
    sample = {"input_ids": np.arange(4), "pixel": torch.zeros(2, 3), "f64": np.zeros(2)}
    assert as_arrays(sample) is sample


def test_numpy_array_subclasses_such_as_a_memmap_slice_are_kept(tmp_path: Path) -> None:
    tokens = np.memmap(tmp_path / "tokens.bin", np.int32, mode="w+", shape=(100,))
    tokens[:] = np.arange(100)
    sample = {"input_ids": tokens[10:20]}  # what a memmap-backed dataset returns
    assert as_arrays(sample) is sample
    facts = inspect_sample(sample, length_key="input_ids", labels_key="")
    assert facts.length == 10
    del tokens, sample


def test_a_converted_sample_leaves_the_datasets_dict_untouched() -> None:
    row = {"input_ids": [1, 2, 3], "labels": np.arange(3)}
    out = as_arrays(row)
    assert row["input_ids"] == [1, 2, 3] and out["labels"] is row["labels"]
    assert list(out) == ["input_ids", "labels"]


@pytest.mark.parametrize(
    ("value", "holds", "fix"),
    [
        ("a cat", "holds a str", "dataset.remove_columns(['v'])` or tokenize it"),
        (b"raw", "holds a bytes", "remove_columns"),
        (np.str_("a"), "holds a numpy str_", "remove_columns"),
        (np.array(["a", "b"]), "numpy array of dtype <U1", "remove_columns"),
        (["a", "b"], "holds a list holding a str", "remove_columns"),
        (None, "holds None", "give it a value in every sample or drop the key"),
        ([1, None], "holds a list holding None", "give it a value"),
        (np.array([1, None]), "dtype object", "give it a value"),
        ({"a": 1}, "holds a dict", "flatten it into top-level keys"),
        ([[1, 2], [3]], "holds a ragged nested list", "pad its rows to one length"),
        ([1, [2, 3]], "holds a ragged nested list", "pad its rows"),
        (np.array([np.arange(2), np.arange(1)], dtype=object), "ragged numpy array", "pad its"),
        ([2**64], "ints beyond int64", "convert it to numbers"),
        (2**64, "beyond int64", "convert it to numbers"),
        ({1, 2}, "holds a set", "convert it to numbers"),
    ],
)
def test_values_that_are_not_numbers_are_refused_in_one_line(
    value: Any, holds: str, fix: str
) -> None:
    with pytest.raises(SampleRejected) as info:
        as_arrays({"input_ids": np.arange(3), "v": value})
    rejected = info.value
    assert rejected.reason == RejectReason.UNSUPPORTED_VALUE
    assert rejected.detail.startswith("sample key 'v' "), rejected.detail
    assert holds in rejected.detail and fix in rejected.detail, rejected.detail
    assert "odbd carries numbers only" in rejected.detail and "\n" not in rejected.detail
    assert rejected.__cause__ is None  # a refusal, not a crash: the producer logs no traceback


def test_fetch_sample_converts_what_the_dataset_returns_and_the_sample_encodes() -> None:
    rows = [{"input_ids": [3, 4, 5], "labels": [-100, 4, 5], "score": 0.5, "keep": True}]
    sample = fetch_sample(rows, 0)
    facts = inspect_sample(sample, length_key="input_ids", labels_key="labels")
    assert (facts.length, facts.loss_tokens) == (3, 2)
    buf = bytearray(encoded_size(sample))
    encode_into(memoryview(buf), sample)
    decoded = decode(buf)
    assert {k: (v.dtype.name, v.shape) for k, v in decoded.items()} == {
        "input_ids": ("int64", (3,)),
        "labels": ("int64", (3,)),
        "score": ("float32", ()),
        "keep": ("bool", ()),
    }
    np.testing.assert_array_equal(decoded["labels"], [-100, 4, 5])


def test_lists_numpy_and_torch_of_one_sample_hash_alike() -> None:
    """A HF dataset as lists, with set_format('numpy') or ('torch') is one schema."""
    as_lists = fetch_sample([{"input_ids": [1, 2], "score": 0.5}], 0)
    as_numpy = {"input_ids": np.array([1, 2]), "score": np.float32(0.5)}
    as_torch = {"input_ids": torch.tensor([1, 2]), "score": torch.tensor(0.5)}
    hashes = {schema_hash(as_arrays(s)) for s in (as_lists, as_numpy, as_torch)}
    assert len(hashes) == 1


@pytest.mark.parametrize(
    ("ids", "hint"),
    [
        (torch.zeros(1, 9, dtype=torch.int64), "a leading 1 looks like a batch of one"),
        ([[1, 2, 3]], "return_tensors"),
        (np.zeros((9, 4), np.int64), "one 1-D array"),
    ],
)
def test_a_length_key_that_is_not_1d_is_refused_naming_its_shape(ids: Any, hint: str) -> None:
    with pytest.raises(SampleRejected) as info:
        inspect_sample(fetch_sample([{"input_ids": ids}], 0), length_key="input_ids", labels_key="")
    assert info.value.reason == RejectReason.LENGTH_KEY_NOT_1D
    shape = list(np.asarray(ids).shape)
    assert f"length key 'input_ids' has shape {shape}" in info.value.detail
    assert hint in info.value.detail


def test_a_hf_dataset_row_with_its_text_column_is_refused_naming_the_column() -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["a cat"], "input_ids": [[5, 6]]})
    with pytest.raises(SampleRejected) as info:
        fetch_sample(ds, 0)
    assert info.value.detail.startswith("sample key 'text' holds a str: odbd carries numbers only")
    assert "dataset.remove_columns(['text'])" in info.value.detail
    accepted = fetch_sample(ds.remove_columns(["text"]), 0)
    assert accepted["input_ids"].dtype == np.int64


PACKED = SampleForm(packed=True, concat_keys=("pixel_values",))


def test_packed_refuses_a_1d_key_of_another_length_than_the_length_key() -> None:
    sample = fetch_sample([{"input_ids": np.arange(12), "labels": np.arange(11)}], 0)
    with pytest.raises(SampleRejected) as caught:
        inspect_sample(
            sample, length_key="input_ids", labels_key="labels", form=SampleForm(packed=True)
        )
    assert caught.value.reason is RejectReason.PACKED_LENGTH_MISMATCH
    assert "key 'labels' has 11 entries but length key 'input_ids' has 12" in caught.value.detail
    # padded batches pad each key on its own: the same sample is accepted there
    inspect_sample(sample, length_key="input_ids", labels_key="labels")


def test_packed_accepts_equal_lengths_concat_keys_and_keys_that_are_not_1d() -> None:
    sample = fetch_sample(
        [
            {
                "input_ids": np.arange(12),
                "labels": np.arange(12),
                "pixel_values": np.zeros(3, dtype=np.float32),  # --concat: rows of its own
                "image": np.zeros((2, 2), dtype=np.float32),
                "score": 0.5,
            }
        ],
        0,
    )
    facts = inspect_sample(sample, length_key="input_ids", labels_key="labels", form=PACKED)
    assert facts.length == 12
