"""What a producer decides about one sample before writing it: accept (with its facts) or reject.

Pure: no I/O. The daemon decides the rest (0-length samples, schema mismatches across samples)
from the facts committed here: lengths and schema hashes.
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

from odbclient.shm import SampleEncodeError, UnsupportedDtypeError, encoded_size

_MAX_DETAIL_CHARS = 300
_UINT32_MAX = 0xFFFF_FFFF


class RejectReason(enum.StrEnum):
    """Why a producer could not make a sample (Rejection.reason on the wire)."""

    MISSING_LENGTH_KEY = "missing_length_key"  # no --length-key array, or it is a scalar
    UNSUPPORTED_DTYPE = "unsupported_dtype"  # an array dtype the shm layout cannot carry
    NOT_A_DICT = "not_a_dict"  # not a mapping of string keys to numpy arrays / torch tensors
    PREPROCESS_ERROR = "preprocess_error"  # dataset[identity] raised
    TOO_LARGE = "too_large"  # larger than the producer's whole lane: waiting would never help


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


def fetch_sample(dataset: Any, identity: int) -> Any:
    """`dataset[identity]`; whatever the user's preprocessing raises becomes a rejection."""
    try:
        return dataset[identity]
    except Exception as exc:
        raise SampleRejected(
            RejectReason.PREPROCESS_ERROR,
            f"dataset[{identity}] raised {type(exc).__name__}: {exc}",
        ) from exc


def inspect_sample(sample: Any, *, length_key: str, labels_key: str) -> SampleFacts:
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
    return SampleFacts(nbytes, length, loss_tokens, schema_hash(sample))


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
