"""What a producer decides about one sample before writing it: accept (with its facts) or reject.

Pure: no I/O. The daemon decides the rest (0-length samples, schema mismatches across samples)
from the facts committed here: lengths and schema hashes.

Value types (`as_arrays`, docs/datasets.md): numpy arrays and torch tensors are kept as they
are (their dtype is the user's choice); numpy scalars become 0-d arrays of their dtype; Python
values become numpy arrays with these dtypes:
- int -> int64: what torch.tensor(int) gives and what embedding lookups and cross-entropy
  targets take; token ids outgrow int16, and int32 would need a cast on the trainer;
- float -> float32: torch's default float dtype; float64 would double the bytes in shared
  memory and make the model's first op upcast (or fail on a float32 weight);
- bool -> bool;
- a scalar becomes a 0-d array (collated to shape (B,), like torch's default_collate), not
  shape [1], so a per-sample number stays a number;
- a list or tuple (nested: rectangular) becomes an array of the shape of its nesting, with the
  element dtype above (any float makes it float32; ints and bools mixed make it int64);
  an empty list becomes int64 of shape (0,) (an empty token list).
Anything else (str, None, dict, ragged nesting, ints beyond int64) is refused with
RejectReason.UNSUPPORTED_VALUE and one line naming the key, the type and the fix.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from odbclient.shm import (
    FieldMeta,
    SampleEncodeError,
    SampleMeta,
    UnsupportedDtypeError,
    encoded_size,
)

_MAX_DETAIL_CHARS = 300
_UINT32_MAX = 0xFFFF_FFFF


class RejectReason(enum.StrEnum):
    """Why a producer could not make a sample (Rejection.reason on the wire)."""

    MISSING_LENGTH_KEY = "missing_length_key"  # no --length-key array, or it is a scalar
    UNSUPPORTED_DTYPE = "unsupported_dtype"  # an array dtype the shm layout cannot carry
    NOT_A_DICT = "not_a_dict"  # not a mapping of string keys to numpy arrays / torch tensors
    PREPROCESS_ERROR = "preprocess_error"  # dataset[identity] raised
    TOO_LARGE = "too_large"  # larger than the producer's whole lane: waiting would never help
    UNSUPPORTED_VALUE = "unsupported_value"  # str, None, dict, ragged list: not numbers
    LENGTH_KEY_NOT_1D = "length_key_not_1d"  # e.g. (1, L) from return_tensors="pt"
    BAD_CONCAT_KEY = "bad_concat_key"  # a --concat key is missing or has no first dimension
    BAD_PATCH_COUNT = "bad_patch_count"  # the patch key / count key is missing or not a count
    PACKED_LENGTH_MISMATCH = "packed_length_mismatch"  # packed: a 1-D key of another length
    NON_FINITE = "non_finite"  # --check-finite: a float array holds NaN or inf


class SampleRejected(Exception):
    """A sample that will not be committed; `detail` is one line naming the key or exception."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = one_line(detail)


@dataclass(frozen=True, slots=True)
class SampleFacts:
    """What the daemon needs to plan with a sample, without reading its bytes."""

    nbytes: int  # encoded size (odbclient.shm layout)
    length: int  # first dimension of the length-key array
    loss_tokens: int  # labels != -100, or the length when there is no labels key
    schema_hash: int  # schema_hash(sample), a u64
    patches: int = 0  # vision patches (--max-patches), from the welcome's patch source


def fetch_sample(dataset: Any, identity: int) -> Any:
    """`dataset[identity]` with its values as arrays (`as_arrays`); whatever the user's
    preprocessing raises becomes a rejection, but MemoryError, which ends the producer."""
    try:
        sample = dataset[identity]
    except MemoryError:
        # The process, not the sample: a leak in the dataset or a memory limit (ulimit -v, a
        # cgroup) would fail every later sample too. Rejecting them lost the rest of the epoch
        # (251 of 300 in one run); the producer exits instead, odbd restarts it with fresh
        # memory and makes the sample again (quarantined if a fresh producer fails on it too).
        raise
    except Exception as exc:
        raise SampleRejected(
            RejectReason.PREPROCESS_ERROR,
            f"dataset[{identity}] raised {type(exc).__name__}: {exc}",
        ) from exc
    # type() first: isinstance against the Mapping ABC is 3x the cost, per sample
    return as_arrays(sample) if type(sample) is dict or isinstance(sample, Mapping) else sample


# Integer dtypes a token id or label fits in losslessly as int64 (uint64 may not).
_PROMOTED_INTS = frozenset({"int8", "int16", "int32", "uint8", "uint16", "uint32"})


def promote_token_ids(sample: Any, keys: tuple[str, ...]) -> Any:
    """`sample` with the integer arrays of `keys` (the daemon's --length-key and --labels-key:
    token ids and labels) widened to int64, losslessly.

    A tokenizer that returns int32 ids for some samples (or on one node) gave them another
    schema than the int64 rest, and they were rejected as schema_mismatch, or, arriving first,
    got every other sample rejected. int64 is what embedding lookups and cross-entropy targets
    take (F.cross_entropy refuses int32 targets), so widening changes no value and nothing the
    trainer can do with the batch. Other keys keep their dtype: an int32 attention mask is the
    user's choice, and uint8 pixels would grow eightfold. Not a mapping: returned as is (the
    planner rejects it)."""
    if not isinstance(sample, Mapping):
        return sample
    widened: dict[str, Any] | None = None
    for key in keys:
        value: Any = sample.get(key)
        if getattr(value, "dtype", None) is None or _dtype_name(value) not in _PROMOTED_INTS:
            continue
        if widened is None:
            widened = dict(sample)
        widened[key] = value.astype(np.int64) if isinstance(value, np.ndarray) else value.long()
    return sample if widened is None else widened


def as_arrays(sample: Mapping[str, Any]) -> Mapping[str, Any]:
    """`sample` with every Python or numpy-scalar value made a numpy array (dtypes above).

    A sample of arrays and tensors only is returned as is, not copied: this runs per sample on
    the producer's hot path. Raises SampleRejected(UNSUPPORTED_VALUE) for a value that is not
    numbers.
    """
    converted: dict[str, Any] | None = None
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported
    for key, value in sample.items():
        if isinstance(value, np.ndarray):  # subclasses too: a slice of an np.memmap is one
            if value.dtype.kind in _NOT_NUMBER_KINDS:
                raise _unsupported_array(key, value)
            continue
        if torch is not None and isinstance(value, torch.Tensor):
            continue
        if converted is None:
            converted = dict(sample)
        converted[key] = _array_of_value(key, value)
    return sample if converted is None else converted


# numpy dtype kinds that are not numbers: str, bytes, object (None, dicts, ragged rows), void
_NOT_NUMBER_KINDS = frozenset("USOV")
_PYTHON_SCALARS: dict[type, np.dtype] = {
    bool: np.dtype(np.bool_),
    int: np.dtype(np.int64),
    float: np.dtype(np.float32),
}
_NUMBER_TYPES = (bool, int, float, np.number, np.bool_)


def _array_of_value(key: str, value: Any) -> np.ndarray:
    """One non-array value as a numpy array, or SampleRejected naming the key and the fix."""
    scalar_dtype = _PYTHON_SCALARS.get(type(value))
    if scalar_dtype is not None:
        try:
            return np.asarray(value, scalar_dtype)
        except OverflowError:
            raise _unsupported(key, value, f"the int {value}, beyond int64") from None
    if isinstance(value, np.generic):
        if value.dtype.kind in _NOT_NUMBER_KINDS:
            raise _unsupported(key, value, f"a numpy {type(value).__name__}")
        return np.asarray(value)
    if not isinstance(value, list | tuple):
        raise _unsupported(key, value, _type_name(value))
    if not value:
        return np.zeros(0, np.int64)  # an empty token list; numpy would make it float64
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):  # numpy >= 1.24 refuses ragged nesting outright
        raise _unsupported(key, value, f"a ragged nested {type(value).__name__}") from None
    kind = array.dtype.kind
    if kind == "f" and array.dtype.itemsize == 8:
        return array.astype(np.float32)
    if kind in "biuf" and array.dtype != np.uint64:
        return array
    bad = _first_non_number(value)
    if bad is _ALL_NUMBERS:
        raise _unsupported(key, value, f"a {type(value).__name__} of ints beyond int64")
    if isinstance(bad, list | tuple):
        raise _unsupported(key, value, f"a ragged nested {type(value).__name__}")
    raise _unsupported(key, bad, f"a {type(value).__name__} holding {_type_name(bad)}")


def _unsupported_array(key: str, value: np.ndarray) -> SampleRejected:
    """The refusal of a numpy array of strings or objects (HF's numpy format of a ragged
    nested column is an object array of arrays)."""
    items = value.ravel().tolist()
    if any(isinstance(item, np.ndarray | list | tuple) for item in items):
        return _unsupported(key, value, "a ragged numpy array of arrays (dtype object)")
    culprit = _first_non_number(items) if items else value
    return _unsupported(key, culprit, f"a numpy array of dtype {value.dtype}")


_ALL_NUMBERS = object()


def _first_non_number(value: list | tuple) -> Any:
    """The first element of a (nested) list that is not a number, else _ALL_NUMBERS."""
    for item in value:
        if isinstance(item, list | tuple):
            inner = _first_non_number(item)
            if inner is not _ALL_NUMBERS:
                return inner
        elif not isinstance(item, _NUMBER_TYPES):
            return item
    return _ALL_NUMBERS


def _type_name(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _unsupported(key: str, culprit: Any, what: str) -> SampleRejected:
    """The refusal of a value that is not numbers; `culprit` picks the fix."""
    if isinstance(culprit, str | bytes | np.str_ | np.bytes_):
        fix = f"drop it with `dataset.remove_columns([{key!r}])` or tokenize it"
    elif isinstance(culprit, Mapping):
        fix = f"flatten it into top-level keys of numbers (e.g. '{key}.x') or drop it"
    elif culprit is None:
        fix = "give it a value in every sample or drop the key"
    elif "ragged" in what:
        fix = "pad its rows to one length in preprocessing, or split it into separate keys"
    else:
        fix = "convert it to numbers in preprocessing or drop it"
    return SampleRejected(
        RejectReason.UNSUPPORTED_VALUE,
        f"sample key {key!r} holds {what}: odbd carries numbers only (ints, floats, bools as "
        f"lists, numpy arrays or tensors); {fix}",
    )


@dataclass(frozen=True, slots=True)
class SampleForm:
    """What the daemon's batch form asks of every sample (IngestWelcome, issue 13)."""

    patch_key: str = ""  # patch count = this key's first dimension
    patch_count_key: str = ""  # or the integer value of this key
    concat_keys: tuple[str, ...] = ()  # must be present with a first dimension
    packed: bool = False  # --collate packed: 1-D keys must have the length key's length
    check_finite: bool = False  # --check-finite: float arrays must hold no NaN or inf


PLAIN_SAMPLES = SampleForm()  # no --concat, no patch budget


def inspect_sample(
    sample: Any, *, length_key: str, labels_key: str, form: SampleForm = PLAIN_SAMPLES
) -> SampleFacts:
    """The facts of a valid sample; raises SampleRejected with the reason otherwise."""
    if not isinstance(sample, Mapping):
        raise SampleRejected(
            RejectReason.NOT_A_DICT,
            f"the dataset returned a {type(sample).__name__}; return a dict of arrays",
        )
    try:
        nbytes = encoded_size(sample)  # validates every key and value
    except UnsupportedDtypeError as exc:
        raise SampleRejected(RejectReason.UNSUPPORTED_DTYPE, str(exc)) from None
    except SampleEncodeError as exc:
        raise SampleRejected(RejectReason.NOT_A_DICT, str(exc)) from None
    length = _length(sample, length_key)
    labels = sample.get(labels_key) if labels_key else None
    loss_tokens = length if labels is None else count_loss_tokens(labels)
    _check_concat_keys(sample, form.concat_keys)
    if form.packed:
        _check_packed_lengths(sample, length_key, length, form.concat_keys)
    patches = _patch_count(sample, form)
    return SampleFacts(nbytes, length, loss_tokens, schema_hash(sample), patches)


_FLOAT_KINDS = frozenset("fc")


def check_finite(sample: Mapping[str, Any]) -> None:
    """Raises SampleRejected(NON_FINITE) naming the first float key holding NaN or inf, how
    many and where (--check-finite). Integer and bool keys cannot hold either: not scanned."""
    torch = sys.modules.get("torch")
    for key, value in sample.items():
        if torch is not None and isinstance(value, torch.Tensor):
            if not (value.is_floating_point() or value.is_complex()):
                continue
            bad = ~torch.isfinite(value.detach().cpu())
            count = int(bad.sum())
            first = int(torch.nonzero(bad.reshape(-1))[0]) if count else 0
        else:
            array = np.asarray(value)
            if array.dtype.kind not in _FLOAT_KINDS:
                continue
            if array.dtype.kind == "f" and np.isfinite(array).all():  # the usual sample: 1 scan
                continue
            bad_np = ~np.isfinite(array)
            count = int(np.count_nonzero(bad_np))
            first = int(np.flatnonzero(bad_np.reshape(-1))[0]) if count else 0
        if count:
            raise SampleRejected(
                RejectReason.NON_FINITE,
                f"key {key!r} holds {count} NaN or inf values of {int(np.prod(value.shape))} "
                f"(the first at flat index {first}); fix the preprocessing that makes them, or "
                "drop the daemon's --check-finite if they are meant",
            )


def _check_concat_keys(sample: Mapping[str, Any], concat_keys: tuple[str, ...]) -> None:
    for key in concat_keys:
        value = sample.get(key)
        if value is None or len(value.shape) == 0:
            what = "no such key" if value is None else "a scalar"
            raise SampleRejected(
                RejectReason.BAD_CONCAT_KEY,
                f"--concat {key}: the sample has {what} (keys {sorted(sample)[:8]}); every "
                f"sample needs {key} with a first dimension (a sample without images: an "
                f"empty array of shape [0, ...]), or drop --concat {key}",
            )


def _check_packed_lengths(
    sample: Mapping[str, Any], length_key: str, length: int, concat_keys: tuple[str, ...]
) -> None:
    """--collate packed joins every 1-D key into one row that position_ids and cu_seq_lens cut
    by the length key's lengths; a 1-D key of another length (labels truncated apart from
    input_ids) shifted every later sample's entries against its tokens, silently, or failed in
    the model on a shape mismatch."""
    for key, value in sample.items():
        if key == length_key or key in concat_keys or len(value.shape) != 1:
            continue
        if int(value.shape[0]) != length:
            raise SampleRejected(
                RejectReason.PACKED_LENGTH_MISMATCH,
                f"key {key!r} has {int(value.shape[0])} entries but length key {length_key!r} "
                f"has {length}: --collate packed joins every 1-D key into one row aligned token "
                f"by token with {length_key!r}; make them equal in preprocessing (truncate "
                f"{key!r} with {length_key!r}), pass a per-sample vector with --concat {key}, "
                "or use --collate padded, which pads each key on its own",
            )


def _patch_count(sample: Mapping[str, Any], form: SampleForm) -> int:
    if not (form.patch_key or form.patch_count_key):
        return 0
    key = form.patch_count_key or form.patch_key
    value = sample.get(key)
    if value is not None and form.patch_key and len(value.shape) > 0:
        return int(value.shape[0])
    if value is not None and form.patch_count_key and int(np.prod(value.shape)) == 1:
        count = np.asarray(value).reshape(-1)[0]
        if float(count) == int(count) and 0 <= int(count) <= _UINT32_MAX:
            return int(count)
    flag = "--patch-count-key" if form.patch_count_key else "--patch-key"
    need = "one non-negative integer" if form.patch_count_key else "an array with a first dimension"
    raise SampleRejected(
        RejectReason.BAD_PATCH_COUNT,
        f"{flag} {key}: the sample has "
        f"{'no such key' if value is None else f'shape {list(value.shape)}'}, but --max-patches "
        f"counts patches from {need}; fix preprocessing or the daemon's {flag}",
    )


def _length(sample: Mapping[str, Any], length_key: str) -> int:
    value = sample.get(length_key)
    if value is None:
        raise SampleRejected(
            RejectReason.MISSING_LENGTH_KEY,
            f"no length key {length_key!r} among the sample keys {sorted(sample)[:8]}",
        )
    if len(value.shape) == 0:
        raise SampleRejected(
            RejectReason.MISSING_LENGTH_KEY,
            f"length key {length_key!r} is a scalar; it needs a first dimension (the sequence)",
        )
    if len(value.shape) > 1:
        shape = tuple(value.shape)
        hint = (
            ": a leading 1 looks like a batch of one, e.g. tokenizer(..., return_tensors='pt'); "
            f"return {length_key}[0] or drop return_tensors"
            if shape[0] == 1
            else "; return its tokens as one 1-D array (move per-token features to another key)"
        )
        raise SampleRejected(
            RejectReason.LENGTH_KEY_NOT_1D,
            f"length key {length_key!r} has shape {list(shape)}, but odbd counts a sample's "
            f"tokens as the length of a 1-D array{hint}",
        )
    if value.shape[0] > _UINT32_MAX:
        raise SampleRejected(RejectReason.TOO_LARGE, f"length {value.shape[0]} exceeds 2**32-1")
    return int(value.shape[0])


def count_loss_tokens(labels: Any) -> int:
    """Entries of `labels` that carry loss: everything but -100 (the ignore index)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(labels, torch.Tensor):
        return int(torch.count_nonzero(labels != -100))
    return int(np.count_nonzero(np.asarray(labels) != -100))


def schema_hash(sample: Mapping[str, Any]) -> int:
    """A stable u64 of the sample's structure, identical in every process and run.

    blake2b-64 over the keys in sorted order, each as (key, dtype name, ndim, shape[1:]):
    the first dimension is left out because collation right-pads it, so samples that differ
    only there batch together; dtype names are the shm ones ("int64", "bfloat16"), so a numpy
    and a torch array of the same dtype hash alike.
    """
    return _hash_of(
        tuple(
            (key, _dtype_name(v), v.ndim, tuple(v.shape[1:])) for key, v in sorted(sample.items())
        )
    )


def schema_difference(
    first: SampleMeta, other: SampleMeta, reference: str = "the first sample"
) -> str:
    """One line naming what makes `other` hash unlike `first` (the keys, dtypes and dimensions
    after the first that schema_hash covers), with both shapes and dtypes; `reference` names
    what `first` stands for."""
    mine = {f.name: f for f in first.fields}
    theirs = {f.name: f for f in other.fields}
    if set(mine) != set(theirs):
        extra, missing = sorted(set(theirs) - set(mine)), sorted(set(mine) - set(theirs))
        parts = [f"has key {k!r} ({_field_text(theirs[k])})" for k in extra]
        parts += [f"lacks key {k!r} ({_field_text(mine[k])})" for k in missing]
        return f"this sample {' and '.join(parts)} unlike {reference}"
    for key, f in mine.items():
        g = theirs[key]
        if (f.dtype, len(f.shape), f.shape[1:]) != (g.dtype, len(g.shape), g.shape[1:]):
            return (
                f"key {key!r} is {_field_text(g)} here but {_field_text(f)} in {reference}; "
                "only the first dimension may differ between samples"
            )
    return f"keys, dtypes and shapes match {reference} but the schema hashes differ"


def _field_text(field: FieldMeta) -> str:
    return f"{field.dtype} of shape {list(field.shape)}"


@functools.lru_cache(maxsize=256)
def _hash_of(structure: tuple[tuple[str, str, int, tuple[int, ...]], ...]) -> int:
    text = "\n".join(
        f"{key}\t{dtype}\t{ndim}\t{list(trailing)}" for key, dtype, ndim, trailing in structure
    )
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _dtype_name(value: Any) -> str:
    if isinstance(value, np.ndarray | np.generic):
        # Cached: numpy computes `dtype.name` in Python on every access, which was ~5 % of a
        # producer's time with 8 KiB samples.
        name = _NUMPY_DTYPE_NAMES.get(value.dtype)
        if name is None:
            name = _NUMPY_DTYPE_NAMES[value.dtype] = value.dtype.name
        return name
    return str(value.dtype).removeprefix("torch.")


_NUMPY_DTYPE_NAMES: dict[np.dtype, str] = {}


def one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _MAX_DETAIL_CHARS else line[: _MAX_DETAIL_CHARS - 3] + "..."
