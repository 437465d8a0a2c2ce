"""Samples (dicts of numpy views of shared memory) -> batch tensors, and idle filler tensors.

Pure: no I/O, no daemon. Rules, per key:
- every sample has the same keys and, per key, the same dtype and number of dimensions;
- a key whose shape is identical in every sample and has 0 or 2+ dimensions is stacked:
  (B, *shape);
- a 1-D key, or a key whose first dimension varies, is right-padded along its first dimension
  to the batch maximum with the key's pad value: (B, max_len, *trailing);
- a key whose shape varies in any other dimension is an error naming the key and shapes;
- a `--concat` key is joined along its first dimension instead, with `KEY_offsets` (packing.py);
- packed (`--collate packed`): every 1-D key is one (1, T) row instead, with position_ids and
  cumulative lengths (packing.py has the conventions).
Output tensors are fresh memory, never views of the input: the input lives in shared memory
that the daemon recycles once the batch is delivered (DESIGN.md section 6).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from odbclient.errors import CollateError, ProtocolError
from odbclient.shm import DTYPE_NAMES
from odbclient.trainer.packing import (
    check_reserved_keys,
    concat_rows,
    offsets_key,
    pack_rows,
    sequence_fields,
)

DEFAULT_PADS: Mapping[str, float] = {"labels": -100.0}  # every other key pads with 0


@dataclass(frozen=True, slots=True)
class KeySchema:
    """One key of a batch, enough to build an idle filler of the same structure."""

    key: str
    dtype: str  # shm dtype name, e.g. "int64", "bfloat16"
    shape: tuple[int, ...]  # padded, concat: the dims after the first; stacked: the whole shape
    padded: bool  # the first dimension varies and is right-padded to the batch maximum
    concat: bool = False  # --concat: joined along the first dimension, no batch dimension


@dataclass(frozen=True, slots=True)
class BatchForm:
    """How the daemon's batches are built (TrainerWelcome: --collate, --concat, the keys)."""

    packed: bool = False  # --collate packed
    concat_keys: frozenset[str] = frozenset()
    length_key: str = "input_ids"  # its lengths give position_ids and cu_seq_lens when packed
    labels_key: str = "labels"  # gets the -100 separator at each sample's start when packed


@dataclass(frozen=True, slots=True)
class Collated:
    # key -> (B, ...) tensor in fresh memory; packed: also max_length_q/k, Python ints (as HF)
    tensors: dict[str, torch.Tensor | int]
    schema: tuple[KeySchema, ...]  # in the key order of the first sample


def pad_value(key: str, pads: Mapping[str, float]) -> float:
    """The daemon's --pad for `key`, else the default (labels -100, everything else 0)."""
    return pads.get(key, DEFAULT_PADS.get(key, 0.0))


def collate(
    samples: Sequence[Mapping[str, np.ndarray]],
    *,
    pads: Mapping[str, float],
    bfloat16_keys: frozenset[str] = frozenset(),
    form: BatchForm = BatchForm(),
) -> Collated:
    """Pads, stacks, packs or concatenates every key of `samples` per `form` (bfloat16 arrays
    arrive as uint16 bit patterns)."""
    if not samples:
        raise CollateError("a batch needs at least one sample; the daemon sent an empty step")
    keys = list(samples[0])
    _check_same_keys(samples, keys)
    if form.packed or form.concat_keys:
        check_reserved_keys(keys, form.concat_keys)
    tensors: dict[str, torch.Tensor | int] = {}
    schema = []
    for key in keys:
        arrays = [sample[key] for sample in samples]
        dtype_name = "bfloat16" if key in bfloat16_keys else arrays[0].dtype.name
        if key in form.concat_keys:
            out, offsets = concat_rows(key, arrays)
            tensors[offsets_key(key)] = torch.from_numpy(offsets)
            key_schema = KeySchema(key, dtype_name, out.shape[1:], padded=False, concat=True)
        elif form.packed and arrays[0].ndim == 1:
            separator = key == form.labels_key
            out = pack_rows(key, arrays, separator_at_starts=separator)
            key_schema = KeySchema(key, dtype_name, (), padded=True)
        else:
            out, key_schema = _collate_key(key, dtype_name, arrays, pads)
        tensors[key] = _to_torch(out, dtype_name)
        schema.append(key_schema)
    if form.packed:
        tensors.update(sequence_fields([len(s[form.length_key]) for s in samples]))
    return Collated(tensors, tuple(schema))


def filler_tensors(
    schema: Sequence[KeySchema], form: BatchForm = BatchForm()
) -> dict[str, torch.Tensor | int]:
    """A batch of one sample of `schema`: padded keys get length 1, stacked keys their shape,
    concatenated keys no rows; packed, the sample is one token long.

    Every value is zero, not the pad value: a filler whose labels are all -100 would make a
    mean cross-entropy 0/0 = NaN, and NaN * loss_scale 0 is still NaN, which would poison the
    DDP all-reduce. Zero labels give a finite loss that loss_scale 0 cancels exactly.
    """
    tensors: dict[str, torch.Tensor | int] = {}
    for ks in schema:
        if ks.concat or ks.key in form.concat_keys:
            # The daemon's schema (parse_filler_schema) gives a whole sample shape.
            shape: tuple[int, ...] = (0, *(ks.shape if ks.concat else ks.shape[1:]))
            tensors[offsets_key(ks.key)] = torch.zeros(2, dtype=torch.int64)
        else:
            shape = (1, 1, *ks.shape) if ks.padded else (1, *ks.shape)
        tensors[ks.key] = _to_torch(np.zeros(shape, _numpy_dtype(ks.dtype)), ks.dtype)
    if form.packed:
        tensors.update(sequence_fields([1]))
    return tensors


def parse_filler_schema(text: str) -> tuple[KeySchema, ...]:
    """StepBatch.filler_schema: JSON `[[key, dtype, dims], ...]` from the daemon.

    `dims` is `[]` for a 1-D key (padded; the filler gets length 1) and the whole per-sample
    shape for any other key (stacked). A 0-d key also reads as `[]`, so its filler is (1, 1)
    where real batches have (B,): the format cannot tell the two apart.
    """
    try:
        schema = tuple(
            KeySchema(str(key), str(dtype), tuple(int(d) for d in dims), padded=not dims)
            for key, dtype, dims in json.loads(text)
        )
    except (ValueError, TypeError) as exc:
        raise ProtocolError(
            f"the daemon sent an unreadable idle filler schema {text[:200]!r} ({exc}); the "
            "daemon and odbclient versions differ; install the same odbd release for both"
        ) from None
    for ks in schema:
        if ks.dtype not in DTYPE_NAMES or any(d < 0 for d in ks.shape):
            raise ProtocolError(f"idle filler schema entry {ks} has an unknown dtype or shape")
    return schema


def _check_same_keys(samples: Sequence[Mapping[str, np.ndarray]], keys: list[str]) -> None:
    expected = set(keys)
    for index, sample in enumerate(samples):
        if set(sample) != expected:
            raise CollateError(
                f"sample {index} of the batch has keys {sorted(sample)} but sample 0 has "
                f"{sorted(expected)}; every sample must have the same keys (the daemon should "
                "have rejected the mismatch: report this)"
            )


def _collate_key(
    key: str, dtype_name: str, arrays: list[np.ndarray], pads: Mapping[str, float]
) -> tuple[np.ndarray, KeySchema]:
    first = arrays[0]
    for array in arrays:
        if array.dtype != first.dtype or array.ndim != first.ndim:
            raise CollateError(
                f"key {key!r} mixes dtypes/ranks in one batch ({first.dtype}{list(first.shape)} "
                f"and {array.dtype}{list(array.shape)}); make it consistent in preprocessing"
            )
    shapes = [array.shape for array in arrays]
    if first.ndim != 1 and all(shape == first.shape for shape in shapes):
        return np.stack(arrays), KeySchema(key, dtype_name, first.shape, padded=False)
    if first.ndim == 0 or any(shape[1:] != first.shape[1:] for shape in shapes):
        raise CollateError(
            f"key {key!r} varies in a dimension other than the first (shapes "
            f"{sorted(set(shapes))[:4]}); only the first dimension may vary (it is right-padded); "
            "pad or resize that dimension to a fixed size in preprocessing"
        )
    max_len = max(shape[0] for shape in shapes)
    pad = _pad_scalar(key, pad_value(key, pads), dtype_name, first.dtype)
    # Only the tail past each sample is padded: filling the whole batch first (np.full) would
    # write every byte twice, which costs a third of the trainer's time with 1 MiB samples.
    out = np.empty((len(arrays), max_len, *first.shape[1:]), first.dtype)
    for row, array in zip(out, arrays, strict=True):
        row[: len(array)] = array
        if len(array) < max_len:
            row[len(array) :] = pad
    return out, KeySchema(key, dtype_name, first.shape[1:], padded=True)


def _pad_scalar(key: str, value: float, dtype_name: str, dtype: np.dtype) -> int | float | bool:
    """The pad value in the array's dtype; a value the dtype cannot hold is an error."""
    if dtype_name == "bfloat16":  # the array holds bf16 bit patterns as uint16
        return int(torch.tensor(value, dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    if dtype.kind == "b":
        return bool(value)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if value != int(value) or not info.min <= value <= info.max:
            raise CollateError(
                f"pad value {value:g} of key {key!r} does not fit its dtype {dtype.name}; "
                f"change the daemon's --pad {key}=VALUE"
            )
        return int(value)
    return value


def _numpy_dtype(dtype_name: str) -> np.dtype:
    return np.dtype("uint16" if dtype_name == "bfloat16" else dtype_name)


def _to_torch(array: np.ndarray, dtype_name: str) -> torch.Tensor:
    tensor = torch.from_numpy(array)  # shares the fresh numpy array, never shared memory
    return tensor.view(torch.bfloat16) if dtype_name == "bfloat16" else tensor
