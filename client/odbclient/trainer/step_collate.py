"""A step whose samples share one header (same keys, dtypes and shapes) collated with a few
copies per key, straight out of the arena: no per-sample decode or numpy view.

Why: every numpy call costs ~1 us of Python in the trainer process, whatever its size, and at
16 x 8 KiB per step the trainer's CPU per sample is mostly such fixed costs (issue 15). So the
step's references are plain lists, checked with list and bytes operations, and the rows are
copied in one of three ways:
- strided: every sample in one segment, evenly spaced (a producer lays samples out one after
  another): one strided numpy view per key, copied into one preallocated array per key;
- gathered: any other placement in one segment: one numpy fancy index per key over a view
  whose row r starts at byte r of the segment, indexed by the samples' offsets (no cutting
  into runs); across segments: one memoryview slice assignment (a memcpy) per sample and key.
The output arrays are fresh memory, never views of shared memory (DESIGN.md section 6: the
daemon recycles the step's allocations once it is delivered).

Anything else (headers that differ, e.g. variable lengths; a reference out of bounds) returns
None and the caller takes the per-sample path, which also names what is wrong.
Pure: arrays in, tensors out; imports no odbd.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from odbclient.errors import CollateError
from odbclient.shm import SampleMeta, read_meta
from odbclient.trainer.collate import BatchForm, Collated, KeySchema
from odbclient.trainer.packing import (
    LABEL_SEPARATOR,
    check_reserved_keys,
    offsets_key,
    sequence_fields,
)

_HEADER_BYTES_AT = 8  # u32 header_bytes in the encoded sample header (shm.SampleMeta)
_U32 = struct.Struct("<I")
_WORD = 8  # headers are compared as u64 words: a header is a multiple of 8 bytes long


class SegmentTable(NamedTuple):
    """The arena as step_collate reads it, built once per connection (by segment index)."""

    buffers: Sequence[memoryview]  # whole mappings, format "B"
    starts: Sequence[int]  # where each allocatable region starts (header_bytes)
    limits: Sequence[int]  # each mapping's length


class _Plan(NamedTuple):
    """What every sample with one header shares (validated once, by read_meta)."""

    meta: SampleMeta
    header: np.ndarray  # uint64: the header words every sample of the step must repeat
    # Which header bits carry meaning, None for all: the padding after each key name is not
    # written by encode_into, so two samples of one layout may differ there (reused memory).
    mask: np.ndarray | None  # uint64, like header
    # The same as byte ranges [start, end) of the header, and their bytes joined: a step of
    # few samples compares these as bytes (_headers_match).
    ranges: tuple[tuple[int, int], ...]
    meaningful: bytes
    by_form: dict[int, tuple[BatchForm, tuple[_KeyPlan, ...]]]  # _key_plans_of's cache


class _Layout(NamedTuple):
    """Where a step's rows lie: all in segment `segment` (-1: in several segments), and if
    `stride` > 0 at offsets[0] + i * stride (strided); else each at its own offset."""

    segment: int
    stride: int


_PLAN_OF_HEADER: dict[bytes, _Plan] = {}
_MAX_PLANS = 4096  # like shm's caches: shapes that vary per sample would grow it


def collate_uniform(
    table: SegmentTable,
    segments: Sequence[int],  # per sample: index into table
    offsets: Sequence[int],  # per sample: byte offset in that segment
    nbytes: Sequence[int],  # per sample: allocation size
    *,
    form: BatchForm,
) -> Collated | None:
    """The step's batch if every sample has sample 0's header, else None (see the module).
    Lists or arrays in; a fixed handful of numpy calls per step and per key."""
    segments, offsets, nbytes = _as_list(segments), _as_list(offsets), _as_list(nbytes)
    count = len(offsets)
    if not count or not len(segments) == len(nbytes) == count:
        return None
    layout = _layout(table, segments, offsets, nbytes)
    if layout is None:
        return None  # the per-sample path raises naming the bad reference
    plan = _plan(table.buffers[segments[0]], offsets[0], nbytes[0])
    if plan is None or min(nbytes) < plan.meta.total_bytes:
        return None
    if not _headers_match(plan, layout, table.buffers, segments, offsets):
        return None
    return _collate(plan, layout, table.buffers, segments, offsets, form=form)


def _as_list(values: Sequence[int]) -> list[int]:
    if isinstance(values, list):
        return values  # only read
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


# Up to this many header slices (samples x meaningful ranges) a step's headers are compared as
# joined bytes (~2 us for 16 samples back to back); above it, gathered into one numpy array
# and compared under the mask (~9 us whatever the count, 3 numpy calls and a gather).
_BYTES_CHECK_MAX_SLICES = 64


def _headers_match(
    plan: _Plan,
    layout: _Layout,
    buffers: Sequence[memoryview],
    segments: list[int],
    offsets: list[int],
) -> bool:
    """Whether every sample's header is plan's, up to the bytes that carry no meaning."""
    ranges, count = plan.ranges, len(offsets)
    if count * len(ranges) <= _BYTES_CHECK_MAX_SLICES:
        if layout.segment >= 0:
            buffer = buffers[layout.segment]
            if len(ranges) == 1:
                start, end = ranges[0]
                got = [buffer[o + start : o + end] for o in offsets]
            else:
                got = [buffer[o + a : o + b] for o in offsets for a, b in ranges]
        else:
            got = [
                buffers[s][o + a : o + b]
                for s, o in zip(segments, offsets, strict=True)
                for a, b in ranges
            ]
        return b"".join(got) == plan.meaningful * count
    width = len(plan.header) * _WORD
    headers = _rows_of(layout, buffers, segments, offsets, 0, width).view(np.uint64)
    differ = headers != plan.header if plan.mask is None else (headers ^ plan.header) & plan.mask
    return not differ.any()


def _layout(
    table: SegmentTable, segments: list[int], offsets: list[int], nbytes: list[int]
) -> _Layout | None:
    """How the rows lie, or None if a reference leaves its segment's allocatable region."""
    count, first = len(offsets), segments[0]
    if segments.count(first) == count:  # one segment: its bounds once
        if first >= len(table.buffers):
            return None
        ends = nbytes[0] + max(offsets) if nbytes.count(nbytes[0]) == count else None
        if ends is None:
            ends = max(map(operator.add, offsets, nbytes))
        if min(offsets) < table.starts[first] or ends > table.limits[first]:
            return None
        stride = offsets[1] - offsets[0] if count > 1 else 1
        # Evenly spaced, ascending: the same list as a range (compared in C).
        if stride > 0 and offsets == list(range(offsets[0], offsets[0] + stride * count, stride)):
            return _Layout(first, stride)
        return _Layout(first, 0)
    num_segments, starts, limits = len(table.buffers), table.starts, table.limits
    for segment, offset, size in zip(segments, offsets, nbytes, strict=True):
        if segment >= num_segments or offset < starts[segment] or offset + size > limits[segment]:
            return None
    return _Layout(-1, 0)


def _plan(buffer: memoryview, offset: int, nbytes: int) -> _Plan | None:
    """The plan of the sample at `offset`, cached by its header bytes (None: not a sample)."""
    if nbytes < _HEADER_BYTES_AT + 4:
        return None
    (header_len,) = _U32.unpack_from(buffer, offset + _HEADER_BYTES_AT)
    if header_len > nbytes or header_len % _WORD:
        return None
    header = bytes(buffer[offset : offset + header_len])
    plan = _PLAN_OF_HEADER.get(header)
    if plan is None:
        try:
            meta = read_meta(buffer[offset : offset + nbytes])
        except ValueError:
            return None
        if len(_PLAN_OF_HEADER) >= _MAX_PLANS:
            _PLAN_OF_HEADER.clear()
        keep = _meaningful(meta, header_len)
        ranges = _ranges(keep)
        plan = _Plan(
            meta,
            np.frombuffer(header, np.uint64),
            None if keep.all() else keep.view(np.uint64),
            ranges,
            b"".join(header[a:b] for a, b in ranges),
            {},
        )
        _PLAN_OF_HEADER[header] = plan
    return plan


def _meaningful(meta: SampleMeta, header_len: int) -> np.ndarray:
    """A uint8 mask (0xFF or 0) of the header bytes that are not name padding
    (shm.SampleMeta's layout: a 24-byte header, then per key a 24-byte entry, 8 bytes per
    dimension and the name padded to 8 bytes)."""
    keep = np.full(header_len, 0xFF, np.uint8)
    pos = 24
    for field in meta.fields:
        name_at = pos + 24 + 8 * len(field.shape)
        name_len = len(field.name.encode())
        pos = name_at + ((name_len + 7) & -8)
        keep[name_at + name_len : pos] = 0
    return keep


def _ranges(keep: np.ndarray) -> tuple[tuple[int, int], ...]:
    """The runs [start, end) of kept (nonzero) bytes of a uint8 mask, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], keep != 0, [0])).astype(np.int8)))
    return tuple((int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True))


_ROW_DTYPES: dict[int, np.dtype[Any]] = {}


def _row_dtype(width: int) -> np.dtype[Any]:
    """The void dtype of one `width`-byte row (cached: np.dtype() is ~0.5 us)."""
    row = _ROW_DTYPES.get(width)
    if row is None:
        if len(_ROW_DTYPES) >= _MAX_PLANS:
            _ROW_DTYPES.clear()
        row = _ROW_DTYPES[width] = np.dtype((np.void, width))
    return row


# Up to this many bytes per key, a step's rows are copied as one void item each, which numpy
# does holding the GIL: a (count, width) uint8 copy releases it around the memcpy and then waits
# to take it back from the trainer thread, a GIL hand-off per step (issue 15). A bigger copy
# keeps releasing it: holding the GIL through an 8 MiB step (1 MiB samples, ~1 ms) would stop
# the trainer thread from launching its work for that long.
_GIL_HELD_COPY_BYTES = 1 << 20


def _strided_rows(
    buffer: memoryview, start: int, stride: int, count: int, at: int, width: int, whole: bool
) -> np.ndarray:
    """The `count` rows of `width` bytes at `at` into samples `stride` apart from `start`, each
    one void item if `whole`, else `width` uint8s: a view, only ever read (numpy checks that it
    stays inside the mapping)."""
    if whole:
        return np.ndarray((count,), _row_dtype(width), buffer=buffer, offset=start + at,
                          strides=(stride,))  # fmt: skip
    return np.ndarray((count, width), np.uint8, buffer=buffer, offset=start + at,
                      strides=(stride, 1))  # fmt: skip


def _sliding_rows(buffer: memoryview, at: int, width: int, whole: bool) -> np.ndarray:
    """Row r = the `width` bytes at r + at of the mapping (one void item if `whole`, else `width`
    uint8s): indexed by sample offsets, one numpy call gathers any rows of one segment (a view,
    only ever read; bounds checked)."""
    rows = len(buffer) - at - width + 1
    if whole:
        return np.ndarray((rows,), _row_dtype(width), buffer=buffer, offset=at, strides=(1,))
    return np.ndarray((rows, width), np.uint8, buffer=buffer, offset=at, strides=(1, 1))


class _KeyPlan(NamedTuple):
    """One key of a plan in one batch form: all that collating it needs besides the rows."""

    key: str
    at: int  # where its bytes start in a sample
    width: int  # its bytes per sample
    dtype: np.dtype[Any]  # how the bytes read (bfloat16 as its uint16 bits)
    shape: tuple[int, ...]  # per sample
    schema: KeySchema
    bfloat16: bool
    labels: bool  # packed labels: each sample's first token becomes the separator


def _key_plans(meta: SampleMeta, form: BatchForm) -> tuple[_KeyPlan, ...]:
    """Per key, what does not change from step to step (raises what a batch of this layout
    cannot be)."""
    if form.packed or form.concat_keys:
        check_reserved_keys(meta.keys, form.concat_keys)
    plans = []
    for field in meta.fields:
        dtype = np.dtype("uint16" if field.dtype == "bfloat16" else field.dtype)
        key, shape, labels = field.name, field.shape, False
        if key in form.concat_keys:
            if not shape:
                raise CollateError(
                    f"--concat {key}: its arrays are scalars; a concatenated key needs a first "
                    f"dimension (rows, e.g. patches): fix preprocessing or drop --concat {key}"
                )
            schema = KeySchema(key, field.dtype, shape[1:], padded=False, concat=True)
        elif form.packed and len(shape) == 1:
            labels = key == form.labels_key and shape[0] > 0
            if labels and dtype.kind not in "if":
                raise CollateError(
                    f"labels key {key!r} has dtype {dtype}, which cannot hold the "
                    "separator -100; store labels as a signed integer type"
                )
            schema = KeySchema(key, field.dtype, (), padded=True)
        elif len(shape) == 1:  # 1-D: padded, but every sample has the same length
            schema = KeySchema(key, field.dtype, shape[1:], padded=True)
        else:
            schema = KeySchema(key, field.dtype, shape, padded=False)
        bfloat16 = field.dtype == "bfloat16"
        plans.append(
            _KeyPlan(key, field.offset, field.nbytes, dtype, shape, schema, bfloat16, labels)
        )
    return tuple(plans)


def _key_plans_of(plan: _Plan, form: BatchForm) -> tuple[_KeyPlan, ...]:
    """_key_plans, cached in the plan per form (a stream keeps one form: one lookup)."""
    cached = plan.by_form.get(id(form))
    if cached is not None and cached[0] is form:
        return cached[1]
    keys = _key_plans(plan.meta, form)
    plan.by_form[id(form)] = (form, keys)  # holds the form: its id is not reused meanwhile
    return keys


def _collate(
    plan: _Plan,
    layout: _Layout,
    buffers: Sequence[memoryview],
    segments: list[int],
    offsets: list[int],
    *,
    form: BatchForm,
) -> Collated:
    count = len(offsets)
    keys = _key_plans_of(plan, form)
    tensors: dict[str, torch.Tensor | int] = {}
    for k in keys:
        array = _rows_of(layout, buffers, segments, offsets, k.at, k.width).view(k.dtype)
        if k.schema.concat:
            array = array.reshape((count * k.shape[0], *k.shape[1:]))
            tensors[offsets_key(k.key)] = torch.arange(count + 1, dtype=torch.int64) * k.shape[0]
        elif form.packed and len(k.shape) == 1:
            array = array.reshape(1, count * k.shape[0])
            if k.labels:
                array[0, :: k.shape[0]] = LABEL_SEPARATOR
        else:
            array = array.reshape((count, *k.shape))
        tensor = torch.from_numpy(array)  # fresh memory (_rows_of), never shared memory
        tensors[k.key] = tensor.view(torch.bfloat16) if k.bfloat16 else tensor
    if form.packed:
        tensors.update(sequence_fields([plan.meta.field(form.length_key).shape[0]] * count))
    return Collated(tensors, tuple(k.schema for k in keys))


def _rows_of(
    layout: _Layout,
    buffers: Sequence[memoryview],
    segments: list[int],
    offsets: list[int],
    at: int,
    width: int,
) -> np.ndarray:
    """A fresh (count, width) uint8 array of the bytes at `at` of each sample: one strided
    copy, one gather in one segment, or one memcpy per row (a memoryview slice assignment)
    across segments. Always numpy's allocation: it asks for huge pages from 4 MiB on (a
    1 MiB-sample step then faults 2 MiB pages, not 4 KiB; a joined bytearray did not)."""
    count = len(offsets)
    if layout.segment >= 0 and width:
        buffer, whole = buffers[layout.segment], count * width <= _GIL_HELD_COPY_BYTES
        if layout.stride:
            view = _strided_rows(buffer, offsets[0], layout.stride, count, at, width, whole)
            rows = np.empty(view.shape, view.dtype)
            rows[:] = view
        else:
            rows = _sliding_rows(buffer, at, width, whole)[offsets]
        return rows.view(np.uint8).reshape(count, width)
    array = np.empty((count, width), np.uint8)
    out, pos = array.reshape(-1).data, 0
    for segment, offset in zip(segments, offsets, strict=True):
        out[pos : pos + width] = buffers[segment][offset + at : offset + at + width]
        pos += width
    return array
