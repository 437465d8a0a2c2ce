"""Collation pads 1-D keys per --pad, stacks fixed shapes, keeps dtypes and never aliases input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from odbclient.errors import CollateError, ProtocolError
from odbclient.shm import decode, encode_into, encoded_size
from odbclient.trainer.collate import (
    BatchForm,
    KeySchema,
    collate,
    filler_tensors,
    pad_value,
    parse_filler_schema,
)


def make_samples(lengths: list[int], *, image: bool = False) -> list[dict[str, np.ndarray]]:
    samples = []
    for i, n in enumerate(lengths):
        sample = {
            "input_ids": np.arange(1, n + 1, dtype=np.int64) + 100 * i,
            "labels": np.full(n, 7, dtype=np.int64),
        }
        if image:
            sample["pixel_values"] = np.full((3, 4, 4), i, dtype=np.float32)
        samples.append(sample)
    return samples


def test_one_dimensional_keys_are_right_padded_with_default_pads() -> None:
    out = collate(make_samples([3, 1, 2]), pads={})
    ids, labels = out.tensors["input_ids"], out.tensors["labels"]
    assert ids.shape == labels.shape == (3, 3)
    assert ids.tolist() == [[1, 2, 3], [101, 0, 0], [201, 202, 0]]
    assert labels.tolist() == [[7, 7, 7], [7, -100, -100], [7, 7, -100]]


def test_custom_pads_override_defaults_per_key() -> None:
    out = collate(make_samples([2, 1]), pads={"input_ids": 50256.0, "labels": -1.0})
    assert out.tensors["input_ids"].tolist() == [[1, 2], [101, 50256]]
    assert out.tensors["labels"].tolist() == [[7, 7], [7, -1]]
    assert pad_value("labels", {}) == -100 and pad_value("attention_mask", {}) == 0


def test_fixed_shape_keys_are_stacked() -> None:
    out = collate(make_samples([2, 4], image=True), pads={})
    pixels = out.tensors["pixel_values"]
    assert pixels.shape == (2, 3, 4, 4) and pixels.dtype == torch.float32
    assert pixels[1].eq(1).all()
    assert out.schema[2] == KeySchema("pixel_values", "float32", (3, 4, 4), padded=False)
    assert out.schema[0] == KeySchema("input_ids", "int64", (), padded=True)


def test_scalar_keys_are_stacked_to_one_dimension() -> None:
    samples = [{"ids": np.arange(2), "label": np.asarray(i, np.int64)} for i in range(3)]
    assert collate(samples, pads={}).tensors["label"].tolist() == [0, 1, 2]


def test_first_dimension_of_multi_dimensional_keys_is_padded() -> None:
    samples = [{"patches": np.ones((n, 2), np.float32)} for n in (1, 3)]
    patches = collate(samples, pads={"patches": -1.0}).tensors["patches"]
    assert patches.shape == (2, 3, 2)
    assert patches[0, 1:].eq(-1).all() and patches[1].eq(1).all()


def test_key_varying_in_another_dimension_is_an_error_naming_it() -> None:
    samples = [{"pixel_values": np.zeros((3, 4, w), np.float32)} for w in (4, 5)]
    with pytest.raises(CollateError, match="pixel_values.*other than the first"):
        collate(samples, pads={})


def test_mismatched_keys_or_dtypes_are_errors() -> None:
    with pytest.raises(CollateError, match="keys"):
        collate([{"a": np.zeros(2)}, {"b": np.zeros(2)}], pads={})
    with pytest.raises(CollateError, match="'a' mixes dtypes"):
        collate([{"a": np.zeros(2, np.int32)}, {"a": np.zeros(2, np.int64)}], pads={})
    with pytest.raises(CollateError, match="at least one sample"):
        collate([], pads={})


def test_pad_value_that_does_not_fit_the_dtype_is_an_error() -> None:
    with pytest.raises(CollateError, match="labels.*uint8"):
        collate([{"labels": np.zeros(n, np.uint8)} for n in (1, 2)], pads={})


@pytest.mark.parametrize(
    "dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
)
def test_dtypes_are_preserved(dtype: str) -> None:
    samples = [{"x": np.ones(n, dtype)} for n in (1, 2)]
    tensor = collate(samples, pads={}).tensors["x"]
    assert tensor.dtype == getattr(torch, dtype)
    assert tensor.tolist() == np.array([[1, 0], [1, 1]], dtype).tolist()


def test_bfloat16_arrives_as_bits_and_leaves_as_bfloat16() -> None:
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    sample = {"h": values}
    buf = memoryview(bytearray(encoded_size(sample)))
    encode_into(buf, sample)
    short = {"h": values[:1]}
    buf2 = memoryview(bytearray(encoded_size(short)))
    encode_into(buf2, short)
    out = collate([decode(buf), decode(buf2)], pads={"h": 0.5}, bfloat16_keys=frozenset({"h"}))
    tensor = out.tensors["h"]
    assert tensor.dtype == torch.bfloat16
    assert tensor.float().tolist() == [[1.5, -2.0, 3.25], [1.5, 0.5, 0.5]]
    assert out.schema[0].dtype == "bfloat16"


def test_tensors_are_copies_not_views_of_the_source() -> None:
    samples = make_samples([2, 2], image=True)
    out = collate(samples, pads={})
    before = {k: t.clone() for k, t in out.tensors.items()}
    for sample in samples:
        for array in sample.values():
            array[...] = 99
    for key, tensor in out.tensors.items():
        assert torch.equal(tensor, before[key]), key


def test_collates_zero_copy_views_of_a_shared_buffer_into_fresh_memory() -> None:
    sample = make_samples([4])[0]
    buf = memoryview(bytearray(encoded_size(sample)))
    encode_into(buf, sample)
    out = collate([decode(buf)], pads={})
    buf[:] = b"\x00" * len(buf)  # the daemon recycled the shared memory
    assert out.tensors["input_ids"].tolist() == [[1, 2, 3, 4]]


def test_filler_from_last_batch_schema_has_one_sample_of_zeros() -> None:
    schema = collate(make_samples([3, 5], image=True), pads={}).schema
    filler = filler_tensors(schema)
    assert filler["input_ids"].shape == (1, 1) and filler["input_ids"].dtype == torch.int64
    assert filler["pixel_values"].shape == (1, 3, 4, 4)
    # Zero labels, not -100: an all-ignored filler would make the mean loss NaN.
    assert all(t.eq(0).all() for t in filler.values())


def test_filler_from_daemon_schema() -> None:
    text = json.dumps([["input_ids", "int64", []], ["pixels", "bfloat16", [3, 2]]])
    schema = parse_filler_schema(text)
    assert schema == (
        KeySchema("input_ids", "int64", (), padded=True),
        KeySchema("pixels", "bfloat16", (3, 2), padded=False),
    )
    filler = filler_tensors(schema)
    assert filler["input_ids"].shape == (1, 1)
    assert filler["pixels"].shape == (1, 3, 2) and filler["pixels"].dtype == torch.bfloat16


@pytest.mark.parametrize("text", ["not json", '[["a", "int64"]]', '[["a", "complex64", []]]'])
def test_unreadable_filler_schema_is_a_protocol_error(text: str) -> None:
    with pytest.raises(ProtocolError):
        parse_filler_schema(text)


def test_packed_batch_is_one_row_per_one_dimensional_key_with_hf_sequence_fields() -> None:
    form = BatchForm(packed=True)
    out = collate(make_samples([3, 1, 2], image=True), pads={}, form=form)
    t = out.tensors
    assert t["input_ids"].tolist() == [[1, 2, 3, 101, 201, 202]]
    assert t["labels"].tolist() == [[-100, 7, 7, -100, -100, 7]]  # separator at each start
    assert t["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert t["position_ids"].dtype == torch.int64
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert t[key].tolist() == [0, 3, 4, 6] and t[key].dtype == torch.int32
    assert t["max_length_q"] == t["max_length_k"] == 3
    assert t["pixel_values"].shape == (3, 3, 4, 4)  # fixed shapes still stack
    filler = filler_tensors(out.schema, form)
    assert filler["input_ids"].shape == (1, 1) and filler["cu_seq_lens_q"].tolist() == [0, 1]
    assert filler["max_length_q"] == 1


def test_concat_keys_join_along_the_first_dimension_with_offsets() -> None:
    samples = make_samples([2, 3, 1])
    patches = [4, 0, 2]  # the second sample has no image
    for i, (s, n) in enumerate(zip(samples, patches, strict=True)):
        s["pixel_values"] = np.full((n, 5), i, dtype=np.float32)
    for packed in (False, True):
        form = BatchForm(packed=packed, concat_keys=frozenset({"pixel_values"}))
        out = collate(samples, pads={}, form=form)
        pixels, offsets = out.tensors["pixel_values"], out.tensors["pixel_values_offsets"]
        assert pixels.shape == (6, 5) and offsets.tolist() == [0, 4, 4, 6]
        for i in range(3):
            assert pixels[offsets[i] : offsets[i + 1]].eq(i).all()
        filler = filler_tensors(out.schema, form)
        assert filler["pixel_values"].shape == (0, 5)
        assert filler["pixel_values_offsets"].tolist() == [0, 0]


def test_concat_key_with_other_trailing_dims_is_an_error_naming_it() -> None:
    samples = make_samples([2, 3])
    samples[0]["pixel_values"] = np.zeros((4, 5), np.float32)
    samples[1]["pixel_values"] = np.zeros((4, 6), np.float32)
    form = BatchForm(concat_keys=frozenset({"pixel_values"}))
    with pytest.raises(CollateError, match="--concat pixel_values: sample 1"):
        collate(samples, pads={}, form=form)


def test_sample_keys_colliding_with_added_keys_are_an_error() -> None:
    samples = make_samples([2])
    samples[0]["position_ids"] = np.arange(2)
    with pytest.raises(CollateError, match="position_ids"):
        collate(samples, pads={}, form=BatchForm(packed=True))
