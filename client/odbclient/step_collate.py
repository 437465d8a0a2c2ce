"""A step whose samples share one header (same keys, dtypes and shapes) collated with a few
vectorised copies per key, straight out of the arena: no per-sample decode, view or loop.

Why: the per-sample path (decode every sample, then collate) costs a few microseconds of
Python per sample in the trainer process (issue 15). Here the step's rows are cut into runs
of evenly spaced offsets in one segment (a producer lays samples out one after another, so a
step is usually one or a few runs); each run is one strided numpy view per key, copied into
one preallocated array per key. The output arrays are fresh memory, never views of shared
memory (DESIGN.md section 6: the daemon recycles the step's allocations once it is delivered).

Anything else (headers that differ, e.g. variable lengths; a reference out of bounds) returns
None and the caller takes the per-sample path, which also names what is wrong.
Pure: arrays in, tensors out; imports no odbd.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from odbclient.collate import BatchForm, Collated, KeySchema, _to_torch
from odbclient.errors import CollateError
from odbclient.packing import LABEL_SEPARATOR, check_reserved_keys, offsets_key, sequence_fields
from odbclient.shm import SampleMeta, read_meta

_HEADER_BYTES_AT = 8  # u32 header_bytes in the encoded sample header (shm.SampleMeta)
_U32 = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class Run:
    """Rows [first, end) of a step lie at start + i * stride of one segment."""

    first: int
    end: int
    start: int
    stride: int


def runs(segments: np.ndarray, offsets: np.ndarray) -> list[Run]:
    """The step's rows as maximal runs of one segment and one stride (a lone row is a run)."""
    count = len(offsets)
    if count == 1:
        return [Run(0, 1, int(offsets[0]), 0)]
    diffs = np.diff(offsets.view(np.int64))
    # Row j + 1 starts a new run where the segment changes or the stride into it differs from
    # the stride into row j (then row j ends its run; a run of one row has any stride).
    breaks = np.empty(count - 1, np.bool_)
    breaks[0] = False
    np.not_equal(diffs[1:], diffs[:-1], out=breaks[1:])
    breaks |= segments[1:] != segments[:-1]
    bounds = [0, *(np.flatnonzero(breaks) + 1).tolist(), count]
    starts, strides = offsets.tolist(), diffs.tolist()
    found: list[Run] = []
    for first, end in zip(bounds[:-1], bounds[1:], strict=True):
        stride = strides[first] if end - first > 1 else 0
        last = found[-1] if found else None
        # A lone row before a run it is evenly spaced with joins it: one off-stride sample
        # (a gap in the lane) then costs one extra run, not two.
        if last is not None and last.end - last.first == 1:
            joins = end - first == 1 or strides[last.first] == stride
            if joins and segments[last.first] == segments[first]:
                found[-1] = Run(last.first, end, last.start, strides[last.first])
                continue
        found.append(Run(first, end, starts[first], stride))
    return found


class SegmentTable(NamedTuple):
    """The arena as step_collate reads it, built once per connection (by segment index)."""

    buffers: Sequence[memoryview]  # whole mappings
    starts: np.ndarray  # uint64: where each allocatable region starts (header_bytes)
    limits: np.ndarray  # uint64: each mapping's length


class _Plan(NamedTuple):
    """What every sample with one header shares (validated once, by read_meta)."""

    meta: SampleMeta
    header: np.ndarray  # uint8: the header bytes every sample of the step must repeat
    # Which header bytes carry meaning, None for all: the padding after each key name is not
    # written by encode_into, so two samples of one layout may differ there (reused memory).
    columns: np.ndarray | None


_PLAN_OF_HEADER: dict[bytes, _Plan] = {}
_MAX_PLANS = 4096  # like shm's caches: shapes that vary per sample would grow it


def collate_uniform(
    table: SegmentTable,
    segments: np.ndarray,  # uint32 per sample
    offsets: np.ndarray,  # uint64 per sample
    nbytes: np.ndarray,  # uint64 per sample
    *,
    form: BatchForm,
) -> Collated | None:
    """The step's batch if every sample has sample 0's header, else None (see the module).
    A handful of numpy calls per step and per key, whatever the number of samples."""
    count = len(offsets)
    first_segment = int(segments[0]) if count else len(table.buffers)
    if first_segment >= len(table.buffers):
        return None
    one_segment = count == 1 or not (segments != first_segment).any()
    step_runs = _runs_fast(segments, offsets, one_segment)
    if len(step_runs) == 1:  # its first and last rows bound it: no pass over the offsets
        run = step_runs[0]
        low, high = sorted((run.start, run.start + run.stride * (count - 1)))
        in_bounds = low >= int(table.starts[first_segment]) and high + int(nbytes.max()) <= int(
            table.limits[first_segment]
        )
    elif one_segment:
        in_bounds = int(offsets.min()) >= int(table.starts[first_segment]) and int(
            (offsets + nbytes).max()
        ) <= int(table.limits[first_segment])
    else:
        in_bounds = int(segments.max()) < len(table.buffers) and bool(
            (offsets >= table.starts[segments]).all()
            and (offsets + nbytes <= table.limits[segments]).all()
        )
    if not in_bounds:
        return None  # the per-sample path raises naming the bad reference
    plan = _plan(table.buffers[first_segment], int(offsets[0]), int(nbytes[0]))
    if plan is None or int(nbytes.min()) < plan.meta.total_bytes:
        return None
    header, columns = plan.header, plan.columns
    for run in step_runs:
        rows = _rows(table.buffers[int(segments[run.first])], run, 0, len(header))
        same = rows == header if columns is None else rows[:, columns] == header[columns]
        if not same.all():
            return None
    return _collate(plan.meta, count, step_runs, table.buffers, segments, form=form)


def _runs_fast(segments: np.ndarray, offsets: np.ndarray, one_segment: bool) -> list[Run]:
    """runs(), with the common case (one segment, one stride) in three numpy calls."""
    count = len(offsets)
    if count == 1:
        return [Run(0, 1, int(offsets[0]), 0)]
    if one_segment:
        signed = offsets.view(np.int64)
        diffs = signed[1:] - signed[:-1]
        stride = int(diffs[0])
        if not (diffs != stride).any():
            return [Run(0, count, int(offsets[0]), stride)]
    return runs(segments, offsets)


def _plan(buffer: memoryview, offset: int, nbytes: int) -> _Plan | None:
    """The plan of the sample at `offset`, cached by its header bytes (None: not a sample)."""
    if nbytes < _HEADER_BYTES_AT + 4:
        return None
    (header_len,) = _U32.unpack_from(buffer, offset + _HEADER_BYTES_AT)
    if header_len > nbytes:
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
        plan = _Plan(meta, np.frombuffer(header, np.uint8), _meaningful(meta, header_len))
        _PLAN_OF_HEADER[header] = plan
    return plan


def _meaningful(meta: SampleMeta, header_len: int) -> np.ndarray | None:
    """Positions of the header bytes that are not name padding (shm.SampleMeta's layout:
    a 24-byte header, then per key a 24-byte entry, 8 bytes per dimension and the name padded
    to 8 bytes)."""
    keep = np.ones(header_len, np.bool_)
    pos = 24
    for field in meta.fields:
        name_at = pos + 24 + 8 * len(field.shape)
        name_len = len(field.name.encode())
        pos = name_at + ((name_len + 7) & -8)
        keep[name_at + name_len : pos] = False
    return None if keep.all() else np.flatnonzero(keep)


def _rows(buffer: memoryview, run: Run, at: int, width: int) -> np.ndarray:
    """(rows of the run, width) bytes starting `at` into each row's sample: a view, only ever
    read (numpy checks that it stays inside the mapping)."""
    return np.ndarray(
        (run.end - run.first, width), np.uint8, buffer=buffer, offset=run.start + at,
        strides=(run.stride, 1),
    )  # fmt: skip


def _collate(
    meta: SampleMeta,
    count: int,
    step_runs: list[Run],
    buffers: Sequence[memoryview],
    segments: np.ndarray,
    *,
    form: BatchForm,
) -> Collated:
    keys = meta.keys
    if form.packed or form.concat_keys:
        check_reserved_keys(keys, form.concat_keys)
    tensors: dict[str, torch.Tensor | int] = {}
    schema = []
    for field in meta.fields:
        dtype = np.dtype("uint16" if field.dtype == "bfloat16" else field.dtype)
        array = np.empty((count, *field.shape), dtype)
        out = array.view(np.uint8).reshape(count, field.nbytes)
        for run in step_runs:
            buffer = buffers[int(segments[run.first])]
            out[run.first : run.end] = _rows(buffer, run, field.offset, field.nbytes)
        key, shape = field.name, field.shape
        if key in form.concat_keys:
            if not shape:
                raise CollateError(
                    f"--concat {key}: its arrays are scalars; a concatenated key needs a first "
                    f"dimension (rows, e.g. patches): fix preprocessing or drop --concat {key}"
                )
            array = array.reshape((count * shape[0], *shape[1:]))
            tensors[offsets_key(key)] = torch.arange(count + 1, dtype=torch.int64) * shape[0]
            key_schema = KeySchema(key, field.dtype, shape[1:], padded=False, concat=True)
        elif form.packed and len(shape) == 1:
            array = array.reshape(1, count * shape[0])
            if key == form.labels_key and shape[0]:
                if array.dtype.kind not in "if":
                    raise CollateError(
                        f"labels key {key!r} has dtype {array.dtype}, which cannot hold the "
                        "separator -100; store labels as a signed integer type"
                    )
                array[0, :: shape[0]] = LABEL_SEPARATOR
            key_schema = KeySchema(key, field.dtype, (), padded=True)
        elif len(shape) == 1:  # 1-D: padded, but every sample has the same length
            key_schema = KeySchema(key, field.dtype, shape[1:], padded=True)
        else:
            key_schema = KeySchema(key, field.dtype, shape, padded=False)
        tensors[key] = _to_torch(array, field.dtype)
        schema.append(key_schema)
    if form.packed:
        tensors.update(sequence_fields([meta.field(form.length_key).shape[0]] * count))
    return Collated(tensors, tuple(schema))
