"""The sample byte layout round-trips every supported dtype and rejects everything else."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odbclient.shm import (
    ALIGN_BYTES,
    DTYPE_NAMES,
    SEGMENT_HEADER_BYTES,
    SampleEncodeError,
    SegmentHeader,
    ShmLayoutError,
    UnsupportedDtypeError,
    decode,
    decode_torch,
    encode_into,
    encoded_size,
    read_meta,
)

NUMPY_DTYPES = sorted(DTYPE_NAMES - {"bfloat16"})
SHAPES = [(), (0,), (5,), (2, 0, 3), (3, 4), (2, 3, 5)]


def make_array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 100).astype(dtype)


def encode(sample: Mapping[str, object]) -> memoryview:
    buf = memoryview(bytearray(encoded_size(sample)))
    encode_into(buf, sample)
    return buf


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_numpy_round_trip_keeps_dtype_shape_and_values(dtype: str, shape: tuple[int, ...]) -> None:
    sample = {"x": make_array(dtype, shape), "tail": np.arange(3, dtype=np.int64)}
    out = decode(encode(sample))
    assert list(out) == ["x", "tail"]
    for key, value in sample.items():
        assert out[key].dtype == value.dtype and out[key].shape == value.shape
        np.testing.assert_array_equal(out[key], value)


@pytest.mark.parametrize("dtype", sorted(DTYPE_NAMES))
@pytest.mark.parametrize("shape", [(), (0,), (4, 3)])
def test_torch_round_trip_including_bfloat16(dtype: str, shape: tuple[int, ...]) -> None:
    tensor = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 100).to(
        getattr(torch, dtype)
    )
    out = decode_torch(encode({"t": tensor}))["t"]
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)


def test_bfloat16_decodes_to_its_uint16_bits_in_numpy() -> None:
    tensor = torch.tensor([1.0, -2.5, 3.0], dtype=torch.bfloat16)
    buf = encode({"b": tensor})
    assert read_meta(buf).dtypes == ("bfloat16",)
    np.testing.assert_array_equal(decode(buf)["b"], tensor.view(torch.uint16).numpy())


def test_non_contiguous_and_byte_swapped_inputs_round_trip() -> None:
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    sample = {
        "strided": base[::2, 1::3],
        "transposed": base.T,
        "swapped": np.arange(7, dtype=">i4"),
        "torch_t": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),
        "scalar": np.float64(2.5),
        "grad": torch.ones(3, requires_grad=True),
    }
    out = decode_torch(encode(sample))
    np.testing.assert_array_equal(out["strided"].numpy(), base[::2, 1::3])
    np.testing.assert_array_equal(out["transposed"].numpy(), base.T)
    np.testing.assert_array_equal(out["swapped"].numpy(), np.arange(7))
    assert torch.equal(out["torch_t"], sample["torch_t"])  # type: ignore[arg-type]
    assert out["scalar"].shape == () and float(out["scalar"]) == 2.5
    assert torch.equal(out["grad"], torch.ones(3))


def test_arrays_are_aligned_and_decoded_without_copies() -> None:
    sample = {"a": np.ones(3, np.int8), "bb": np.ones((5, 7), np.float64), "c": np.ones(1, bool)}
    buf = encode(sample)
    meta = read_meta(buf)
    assert meta.total_bytes == len(buf) == encoded_size(sample)
    assert all(f.offset % ALIGN_BYTES == 0 for f in meta.fields)
    assert meta.keys == ("a", "bb", "c")
    assert meta.shapes == ((3,), (5, 7), (1,))
    assert meta.dtypes == ("int8", "float64", "bool")
    out = decode(buf)
    out["bb"][0, 0] = 42.0  # a view: writes land in the buffer
    assert decode(buf)["bb"][0, 0] == 42.0


def test_empty_sample_round_trips() -> None:
    assert decode(encode({})) == {}


@pytest.mark.parametrize(
    ("value", "dtype_name"),
    [
        (np.zeros(2, np.complex64), "complex64"),
        (np.zeros(2, np.uint16), "uint16"),
        (np.zeros(2, np.uint64), "uint64"),
        (np.array(["x"]), "str"),
        (np.array([object()]), "object"),
        (torch.zeros(2, dtype=torch.complex64), "complex64"),
    ],
)
def test_unsupported_dtype_error_names_key_and_dtype(value: object, dtype_name: str) -> None:
    with pytest.raises(UnsupportedDtypeError, match=rf"'bad'.*{dtype_name}") as info:
        encoded_size({"ok": np.zeros(1), "bad": value})
    assert isinstance(info.value, ValueError)


def test_numpy_bfloat16_like_and_non_array_values_are_rejected() -> None:
    with pytest.raises(SampleEncodeError, match="'n'.*list"):
        encoded_size({"n": [1, 2, 3]})
    with pytest.raises(SampleEncodeError, match="key"):
        encoded_size({"": np.zeros(1)})


def test_too_small_buffer_is_rejected_before_writing() -> None:
    sample = {"x": np.ones(100, np.float32)}
    buf = bytearray(encoded_size(sample) - 1)
    with pytest.raises(SampleEncodeError, match="needs"):
        encode_into(memoryview(buf), sample)
    assert not any(buf)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_corrupt_bytes_raise_layout_error_or_decode_in_bounds(data: st.DataObject) -> None:
    """A half-written allocation (killed producer) must never crash a reader."""
    sample = {"ids": np.arange(9, dtype=np.int64), "mask": np.ones((2, 3), bool)}
    buf = bytearray(encode(sample))
    for _ in range(data.draw(st.integers(1, 8))):
        buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    try:
        out = decode(memoryview(buf)[:cut])
    except ShmLayoutError:
        return
    assert all(a.nbytes <= cut for a in out.values())


def test_empty_array_with_absurd_dimensions_is_a_layout_error() -> None:
    buf = encode({"e": np.zeros((0, 2), np.int64)})
    shape_at = 24 + 24 + 8  # sample header, key entry, first dimension
    buf[shape_at : shape_at + 8] = (2**62).to_bytes(8, "little")
    with pytest.raises(ShmLayoutError):
        decode(buf)


def test_negative_dimensions_are_a_layout_error_even_when_their_product_fits() -> None:
    buf = encode({"m": np.zeros((2, 4), np.int64)})
    shape_at = 24 + 24
    buf[shape_at : shape_at + 16] = (-2).to_bytes(8, "little", signed=True) + (-4).to_bytes(
        8, "little", signed=True
    )
    with pytest.raises(ShmLayoutError):
        decode(buf)


@given(st.binary(max_size=512))
def test_random_bytes_are_not_a_sample(raw: bytes) -> None:
    with pytest.raises(ShmLayoutError):
        read_meta(raw)


def test_segment_header_round_trips_and_magic_marks_completion() -> None:
    header = SegmentHeader(
        capacity_bytes=SEGMENT_HEADER_BYTES + 4096, owner_pid=123, owner_start_ticks=456,
        boot_id=bytes(range(16)), created_unix_ns=789, node_rank=2, segment_index=1,
        num_segments=3, job_id="job-1",
    )  # fmt: skip
    buf = memoryview(bytearray(SEGMENT_HEADER_BYTES))
    with pytest.raises(ShmLayoutError, match="half-created"):
        SegmentHeader.unpack(buf)
    header.pack_into(buf)
    assert SegmentHeader.unpack(buf) == header


# --- per-structure plans and per-header metas (issue 15: planned once per schema) --------------


def test_planned_once_per_structure_matches_a_fresh_plan_for_every_first_dimension() -> None:
    """A cached structure (keys, dtypes, dims after the first) lays out samples of other
    lengths exactly as planning from scratch does: the bytes are identical."""
    from odbclient import shm

    def sample(length: int) -> dict[str, np.ndarray]:
        return {
            "input_ids": np.arange(length, dtype=np.int64),
            "pixels": np.ones((length % 3, 2, 5), np.float16),
            "score": np.array(length, np.float32),  # 0-d
            "labels": np.full(length, -100, np.int32),
        }

    shm._PLAN_OF_STRUCTURE.clear()
    for length in (7, 0, 1, 100, 7):
        cached = bytes(encode(sample(length)))
        shm._PLAN_OF_STRUCTURE.clear()
        assert bytes(encode(sample(length))) == cached
        out = decode(memoryview(bytearray(cached)))
        assert np.array_equal(out["input_ids"], np.arange(length))
        assert out["pixels"].shape == (length % 3, 2, 5)
    assert len(shm._PLAN_OF_STRUCTURE) == 1


def test_a_cached_structure_never_skips_the_checks_of_other_value_types() -> None:
    """Only samples of numpy arrays are cached; a list under the same key is still refused
    and a byte-swapped array still gets its own (checked) plan."""
    encode({"n": np.arange(3, dtype=np.int64)})
    with pytest.raises(SampleEncodeError, match="'n'.*list"):
        encoded_size({"n": [1, 2, 3]})
    swapped = np.arange(3, dtype=">i8")
    assert decode(encode({"n": swapped}))["n"].tolist() == [0, 1, 2]


def test_cached_header_meta_still_checks_the_buffer_it_reads() -> None:
    """The meta of a header is cached, the bounds of each buffer are not: a truncated copy of
    a sample whose header was seen before is still a layout error."""
    buf = encode({"ids": np.arange(64, dtype=np.int64)})
    assert read_meta(buf) is read_meta(bytes(buf))  # parsed once
    with pytest.raises(ShmLayoutError, match="total bytes"):
        read_meta(buf[: len(buf) - 8])


def test_the_caches_stay_bounded() -> None:
    from odbclient import shm

    for k in range(shm._MAX_CACHED + 10):
        read_meta(encode({"x": np.zeros((1, k + 1), np.int8)}))
    assert len(shm._META_OF_HEADER) <= shm._MAX_CACHED
    assert len(shm._PLAN_OF_STRUCTURE) <= shm._MAX_CACHED
