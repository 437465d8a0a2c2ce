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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from odbclient.collate import BatchForm, Collated, KeySchema, _to_torch
from odbclient.errors import CollateError
from odbclient.packing import LABEL_SEPARATOR, check_reserved_keys, offsets_key, sequence_fields
from odbclient.shm import SampleMeta, read_meta

_HEADER_BYTES_AT = 8  # u32 header_bytes in the encoded sample header (shm.SampleMeta)


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
    diffs = np.diff(offsets.astype(np.int64))
    same_segment = segments[1:] == segments[:-1]
    # A row continues the run of the row before it when both diffs into and out of that row
    # agree; breaks are where the stride or the segment changes.
    cut = np.flatnonzero(~same_segment | np.r_[False, diffs[1:] != diffs[:-1]]) + 1
    bounds = [0, *cut.tolist(), count]
    found = []
    for first, end in zip(bounds[:-1], bounds[1:], strict=True):
        stride = int(diffs[first]) if end - first > 1 else 0
        found.append(Run(first, end, int(offsets[first]), stride))
    return found


def collate_uniform(
    segment_arrays: Sequence[np.ndarray],  # uint8 views of each whole segment, by index
    header_bytes: Sequence[int],  # where each segment's allocatable region starts
    segments: np.ndarray,  # uint32 per sample
    offsets: np.ndarray,  # uint64 per sample
    nbytes: np.ndarray,  # uint64 per sample
    *,
    form: BatchForm,
) -> Collated | None:
    """The step's batch if every sample has sample 0's header, else None (see the module)."""
    count = len(offsets)
    if not count or int(segments.max()) >= len(segment_arrays):
        return None
    limits = np.array([len(a) for a in segment_arrays], np.uint64)[segments]
    starts = np.array(header_bytes, np.uint64)[segments]
    if not ((offsets >= starts).all() and (offsets + nbytes <= limits).all()):
        return None  # the per-sample path raises naming the bad reference
    first = segment_arrays[int(segments[0])]
    offset0 = int(offsets[0])
    meta = _meta(first, offset0, int(nbytes[0]))
    if meta is None or not (nbytes >= meta.total_bytes).all():
        return None
    header_len = int(
        first[offset0 + _HEADER_BYTES_AT : offset0 + _HEADER_BYTES_AT + 4].view("<u4")[0]
    )
    header = first[offset0 : offset0 + header_len]
    step_runs = runs(segments, offsets)
    for run in step_runs:
        rows = _strided(segment_arrays[int(segments[run.first])], run, 0, header_len)
        if not (rows == header).all():
            return None
    return _collate(meta, count, step_runs, segment_arrays, segments, form=form)


def _meta(segment: np.ndarray, offset: int, nbytes: int) -> SampleMeta | None:
    try:
        return read_meta(memoryview(segment[offset : offset + nbytes]))  # type: ignore[arg-type]
    except ValueError:
        return None


def _strided(segment: np.ndarray, run: Run, at: int, width: int) -> np.ndarray:
    """(rows of the run, width) bytes starting `at` into each row's sample: a view."""
    base = segment[run.start + at :]
    return np.lib.stride_tricks.as_strided(
        base, shape=(run.end - run.first, width), strides=(run.stride, 1), writeable=False
    )


def _collate(
    meta: SampleMeta,
    count: int,
    step_runs: list[Run],
    segment_arrays: Sequence[np.ndarray],
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
        out = np.empty((count, field.nbytes), np.uint8)
        for run in step_runs:
            segment = segment_arrays[int(segments[run.first])]
            out[run.first : run.end] = _strided(segment, run, field.offset, field.nbytes)
        dtype = np.dtype("uint16" if field.dtype == "bfloat16" else field.dtype)
        array = out.view(dtype).reshape((count, *field.shape))
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
