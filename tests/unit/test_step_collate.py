"""collate_uniform (one header per step, a few copies per key) gives exactly what the
per-sample path (decode, then collate) gives, for every batch form and any placement of the
samples: evenly spaced, in runs, irregular offsets, two segments; and refuses what it cannot
do."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from odbclient.shm import align_up, decode, encode_into, encoded_size, read_meta
from odbclient.trainer import step_collate
from odbclient.trainer.collate import BatchForm, collate
from odbclient.trainer.step_collate import SegmentTable, _layout, collate_uniform

HEADER_BYTES = 4096
FORMS = {
    "padded": BatchForm(),
    "packed": BatchForm(packed=True),
    "concat": BatchForm(concat_keys=frozenset({"pixels"})),
}


@pytest.fixture(autouse=True, params=["bytes", "numpy"], ids=["bytes-check", "numpy-check"])
def header_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test runs with both header checks: joined bytes (few samples) and the numpy
    gather under a mask (many samples)."""
    saved = step_collate._BYTES_CHECK_MAX_SLICES
    step_collate._BYTES_CHECK_MAX_SLICES = saved if request.param == "bytes" else -1
    try:
        yield
    finally:
        step_collate._BYTES_CHECK_MAX_SLICES = saved


def sample(i: int, length: int = 5) -> dict[str, object]:
    return {
        "input_ids": np.arange(length, dtype=np.int64) + 100 * i,
        "labels": np.arange(length, dtype=np.int64) - i,
        "pixels": np.full((2, 3), i, np.float32),
        "weights": torch.full((length,), float(i), dtype=torch.bfloat16),
        "score": np.array(i * 0.5),
    }


def table(segments: list[np.ndarray]) -> SegmentTable:
    return SegmentTable(
        [memoryview(s) for s in segments],
        [HEADER_BYTES] * len(segments),
        [len(s) for s in segments],
    )


def place(
    samples: list[dict[str, object]], gaps: list[int], *, reverse: bool = False
) -> tuple[list[np.ndarray], list]:
    """Two segments; sample i goes to segment i % 2 when gaps say -1, else after gap * 64
    bytes; `reverse` hands the references over in reverse order (descending offsets)."""
    segments = [np.zeros(1 << 18, np.uint8), np.zeros(1 << 18, np.uint8)]
    cursor = [HEADER_BYTES, HEADER_BYTES]
    refs = []
    for i, (s, gap) in enumerate(zip(samples, gaps, strict=True)):
        seg = i % 2 if gap < 0 else 0
        offset = cursor[seg] + max(gap, 0) * 64
        size = encoded_size(s)
        encode_into(memoryview(segments[seg])[offset : offset + size], s)
        refs.append((seg, offset, size))
        cursor[seg] = align_up(offset + size)
    return segments, refs[::-1] if reverse else refs


def both(samples: list[dict[str, object]], gaps: list[int], form: BatchForm, **kw: bool):
    segments, refs = place(samples, gaps, **kw)
    seg = np.array([r[0] for r in refs], np.uint32)
    off = np.array([r[1] for r in refs], np.uint64)
    nb = np.array([r[2] for r in refs], np.uint64)
    fast = collate_uniform(table(segments), seg, off, nb, form=form)
    views = [decode(memoryview(segments[s])[o : o + n]) for s, o, n in refs]
    first = memoryview(segments[refs[0][0]])[refs[0][1] :]
    bf16 = frozenset(f.name for f in read_meta(first).fields if f.dtype == "bfloat16")
    slow = collate(views, pads={}, bfloat16_keys=bf16, form=form)
    return fast, slow, segments


@pytest.mark.parametrize("form_name", sorted(FORMS))
@pytest.mark.parametrize(
    "gaps",
    [[0] * 6, [0, 0, 3, 0, 0, 7], [-1] * 6, [5, 0, 1, 2, 0, 0], [0]],
    ids=["one-run", "three-runs", "two-segments", "irregular", "one-sample"],
)
@pytest.mark.parametrize("reverse", [False, True], ids=["ascending", "descending"])
def test_uniform_steps_match_the_per_sample_path(
    form_name: str, gaps: list[int], reverse: bool
) -> None:
    form = FORMS[form_name]
    samples = [sample(i) for i in range(len(gaps))]
    fast, slow, segments = both(samples, gaps, form, reverse=reverse)
    assert fast is not None
    assert fast.schema == slow.schema
    assert set(fast.tensors) == set(slow.tensors)
    for key, value in slow.tensors.items():
        got = fast.tensors[key]
        if isinstance(value, int):
            assert got == value, key
        else:
            assert isinstance(got, torch.Tensor)
            assert got.dtype == value.dtype and torch.equal(got, value), key
    # Fresh memory: wiping the arena leaves the batch intact.
    kept = {k: v.clone() for k, v in fast.tensors.items() if isinstance(v, torch.Tensor)}
    for segment in segments:
        segment[:] = 0
    assert all(torch.equal(fast.tensors[k], v) for k, v in kept.items())


@pytest.mark.parametrize("gaps", [[0] * 3, [0, 2, 0]], ids=["strided", "rows"])
def test_empty_keys_collate_like_the_per_sample_path(gaps: list[int]) -> None:
    fast, slow, _ = both([sample(i, length=0) for i in range(3)], gaps, BatchForm())
    assert fast is not None
    for key, value in slow.tensors.items():
        got = fast.tensors[key]
        assert isinstance(got, torch.Tensor) and isinstance(value, torch.Tensor)
        assert got.shape == value.shape and got.dtype == value.dtype and torch.equal(got, value)


@pytest.mark.parametrize(
    "gaps", [[0, 0, 0], [0, 0, 3], [-1, -1, -1]], ids=["strided", "rows", "two-segments"]
)
def test_steps_of_different_headers_go_the_per_sample_way(gaps: list[int]) -> None:
    samples = [sample(0, length=5), sample(1, length=5), sample(2, length=7)]
    fast, slow, _ = both(samples, gaps, BatchForm())
    assert fast is None and slow.tensors["input_ids"].shape == (3, 7)


def test_a_reference_out_of_bounds_goes_the_per_sample_way() -> None:
    segments, refs = place([sample(0)], [0])
    for offset in (HEADER_BYTES - 64, (1 << 18) - 64):
        out = collate_uniform(
            table(segments), np.array([0], np.uint32),
            np.array([offset], np.uint64), np.array([refs[0][2]], np.uint64), form=BatchForm(),
        )  # fmt: skip
        assert out is None


def test_layout_is_strided_when_evenly_spaced_in_one_segment_and_names_several_segments() -> None:
    segments = table([np.zeros(1 << 16, np.uint8), np.zeros(1 << 16, np.uint8)])
    base = HEADER_BYTES
    even = [base, base + 128, base + 256]
    assert _layout(segments, [0, 0, 0], even, [100] * 3) == (0, 128)
    assert _layout(segments, [1], [base], [100]) == (1, 1)
    assert _layout(segments, [0, 0, 0], [base, base + 128, base + 320], [100] * 3) == (0, 0)
    assert _layout(segments, [0, 0, 0], even[::-1], [100] * 3) == (0, 0)  # descending
    assert _layout(segments, [0, 1, 0], even, [100] * 3) == (-1, 0)  # two segments
    # Any reference outside its segment's allocatable region: None (the per-sample path).
    assert _layout(segments, [0, 0], [base - 64, base], [100, 100]) is None
    assert _layout(segments, [0, 0], [base, (1 << 16) - 64], [100, 100]) is None
    assert _layout(segments, [0, 0], [base, base + 128], [100, (1 << 16) - base]) is None
    assert _layout(segments, [0, 2], [base, base], [100, 100]) is None  # no segment 2
    assert _layout(segments, [1, 0], [base, (1 << 16) - 64], [100, 100]) is None


def test_steps_given_as_numpy_arrays_or_lists_collate_alike() -> None:
    segments, refs = place([sample(i) for i in range(3)], [0, 2, 0])
    lists = ([r[0] for r in refs], [r[1] for r in refs], [r[2] for r in refs])
    arrays = (np.array(lists[0], np.uint32), np.array(lists[1], np.uint64), np.array(lists[2]))
    from_lists = collate_uniform(table(segments), *lists, form=BatchForm())
    from_arrays = collate_uniform(table(segments), *arrays, form=BatchForm())
    assert from_lists is not None and from_arrays is not None
    assert torch.equal(from_lists.tensors["pixels"], from_arrays.tensors["pixels"])


@pytest.mark.parametrize("gaps", [[0] * 4, [0, 2, 0, 0]], ids=["strided", "rows"])
def test_stale_bytes_in_name_padding_do_not_split_a_layout(gaps: list[int]) -> None:
    """encode_into leaves the padding after each key name as it was; in recycled shared memory
    two samples of one layout then differ there, and must still collate together."""
    samples = [sample(i) for i in range(4)]
    segments, refs = place(samples, gaps)
    for index, (seg, offset, _) in enumerate(refs):
        name_end = offset + 24 + 24 + 8 + len(b"input_ids")  # first key: 1-D "input_ids"
        segments[seg][name_end : name_end + 7] = index + 1  # garbage, different per sample
    seg = np.array([r[0] for r in refs], np.uint32)
    off = np.array([r[1] for r in refs], np.uint64)
    nb = np.array([r[2] for r in refs], np.uint64)
    fast = collate_uniform(table(segments), seg, off, nb, form=BatchForm())
    assert fast is not None
    assert fast.tensors["input_ids"][:, 0].tolist() == [0, 100, 200, 300]


def name_padding(header_len: int) -> set[int]:
    """The header bytes of sample() that are name padding (encode_into does not write them)."""
    meta = read_meta(memoryview(encode(sample(0))))
    keep = step_collate._meaningful(meta, header_len)
    return {i for i in range(header_len) if not keep[i]}


def encode(s: dict[str, object]) -> np.ndarray:
    out = np.zeros(encoded_size(s), np.uint8)
    encode_into(memoryview(out), s)
    return out


@given(at=st.integers(0, 10_000), victim=st.integers(0, 3), value=st.integers(1, 255))
def test_any_meaningful_header_byte_that_differs_splits_the_step(
    at: int, victim: int, value: int
) -> None:
    """A byte flipped in one sample's header: name padding still collates together, any
    other byte sends the step the per-sample way (which decodes each sample by itself)."""
    samples = [sample(i) for i in range(4)]
    segments, refs = place(samples, [0, 0, 2, 0])
    (header_len,) = np.frombuffer(segments[0][refs[0][1] + 8 : refs[0][1] + 12], "<u4")
    at %= int(header_len)
    seg, offset, _ = refs[victim]
    segments[seg][offset + at] ^= value
    out = collate_uniform(
        table(segments), [r[0] for r in refs], [r[1] for r in refs], [r[2] for r in refs],
        form=BatchForm(),
    )  # fmt: skip
    assert (out is not None) == (at in name_padding(int(header_len)))


@given(
    st.integers(1, 12),
    st.integers(0, 300),
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
    st.booleans(),
    st.booleans(),
)
def test_rows_of_copies_each_sample_s_bytes_into_fresh_writable_memory(
    width: int, at: int, gaps: list[int], strided: bool, big: bool
) -> None:
    """_rows_of against one slice per row, for a strided step and a gathered one, copied as
    void items (holding the GIL) or, past _GIL_HELD_COPY_BYTES, as uint8s (releasing it); the
    copy survives the arena being wiped."""
    arena = np.random.default_rng(width + at).integers(0, 256, 1 << 14, dtype=np.uint8)
    stride = at + width + 7
    if strided:
        offsets = [64 + i * stride for i in range(len(gaps))]
    else:
        offsets = np.cumsum([64] + [stride + g * 5 for g in gaps[1:]]).tolist()
    layout = step_collate._Layout(0, stride if strided else 0)
    segments = [0] * len(offsets)
    with pytest.MonkeyPatch.context() as patch:
        if big:  # every copy counts as big: the uint8 path
            patch.setattr(step_collate, "_GIL_HELD_COPY_BYTES", 0)
        rows = step_collate._rows_of(layout, [memoryview(arena)], segments, offsets, at, width)
    expected = [arena[o + at : o + at + width].tolist() for o in offsets]
    assert rows.dtype == np.uint8 and rows.shape == (len(offsets), width)
    assert rows.tolist() == expected and rows.flags.writeable
    arena[:] = 0
    assert rows.tolist() == expected
