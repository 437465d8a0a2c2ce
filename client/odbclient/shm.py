"""Shared-memory byte layouts (segment header, encoded sample) and the attach side of the arena.

The node daemon owns one bounded arena made of POSIX shm segments under /dev/shm, named
`odbd-<job_id>-<node_rank>-<index>` (mode 0600). It creates, carves and unlinks them
(`odbd.ingest.arena`); producers and trainers only attach (`ArenaView`) and never unlink. A
sample is a dict of arrays encoded in place into one allocation (`encode_into`) and read back
as zero-copy numpy views (`decode`). This module never imports `odbd` and imports torch lazily.

Lifetime (DESIGN.md section 6 hazard): a mapping is never unmapped while views may be alive.
`ArenaView` maps every segment once for the process lifetime and has no close(); numpy views
hold a buffer export of the mapping, so the mapping outlives them. `decode_torch` goes through
`torch.from_numpy`, which keeps the numpy view (and so the export) alive; never use
`torch.frombuffer` on a mapping: it keeps no export, and reading it after an unmap segfaults.
The daemon recycles an allocation only after the trainer released the batch that used it.
"""

from __future__ import annotations

import enum
import math
import mmap
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

SHM_DIR = "/dev/shm"
ALIGN_BYTES = 64  # every allocation and every array starts on a cache line


def align_up(nbytes: int, alignment: int = ALIGN_BYTES) -> int:
    """Rounds up to a multiple of `alignment` (a power of two)."""
    return (nbytes + alignment - 1) & -alignment


class ShmLayoutError(ValueError):
    """Bytes in shared memory do not follow the layout (bad magic, version or bounds)."""


class SampleEncodeError(ValueError):
    """A sample cannot be encoded: a value is not an array, a key is invalid, or it does not fit."""


class UnsupportedDtypeError(SampleEncodeError):
    """A sample array has a dtype the shm layout cannot carry."""


class ShmAttachError(RuntimeError):
    """A segment advertised by the daemon cannot be mapped."""


@dataclass(frozen=True, slots=True)
class Allocation:
    """One allocation of the arena: `length` bytes at byte `offset` of segment `segment`."""

    segment: str  # segment name (file name under /dev/shm)
    offset: int  # from the start of the segment file; a multiple of ALIGN_BYTES
    length: int  # bytes requested; the arena reserves align_up(length)


# --- segment header ----------------------------------------------------------------------------

SEGMENT_MAGIC = b"ODBDSEG\x00"
SEGMENT_LAYOUT_VERSION = 1
SEGMENT_HEADER_BYTES = 4096  # the allocatable region starts page-aligned after the header
_SEGMENT_HEADER = struct.Struct("<8sIIQqQ16sQIII64s")


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentHeader:
    """Header at byte 0 of every segment; little-endian, 140 bytes, padded to 4096.

    offset size field
         0    8 magic b"ODBDSEG\\0" (written last: a segment without it is half-created)
         8    4 layout_version (u32); this module reads and writes version 1
        12    4 header_bytes (u32): where the allocatable region starts
        16    8 capacity_bytes (u64): size of the segment file, header included
        24    8 owner_pid (i64): pid of the daemon that created the segment
        32    8 owner_start_ticks (u64): /proc/<pid>/stat starttime, guards against pid reuse
        40   16 boot_id: /proc/sys/kernel/random/boot_id of the creating boot
        56    8 created_unix_ns (u64)
        64    4 node_rank (u32)
        68    4 segment_index (u32)
        72    4 num_segments (u32) of the arena
        76   64 job_id (utf-8, NUL padded)
    Offsets 0..56 are frozen for every future version, so any odbd can tell whether the owner
    of a segment of another version is alive before reclaiming it.
    """

    layout_version: int = SEGMENT_LAYOUT_VERSION
    header_bytes: int = SEGMENT_HEADER_BYTES
    capacity_bytes: int
    owner_pid: int
    owner_start_ticks: int
    boot_id: bytes
    created_unix_ns: int
    node_rank: int
    segment_index: int
    num_segments: int
    job_id: str

    def pack_into(self, buf: memoryview) -> None:
        _SEGMENT_HEADER.pack_into(
            buf, 0, b"\x00" * 8, self.layout_version, self.header_bytes, self.capacity_bytes,
            self.owner_pid, self.owner_start_ticks, self.boot_id, self.created_unix_ns,
            self.node_rank, self.segment_index, self.num_segments, self.job_id.encode(),
        )  # fmt: skip
        buf[0:8] = SEGMENT_MAGIC

    @staticmethod
    def unpack(buf: memoryview | bytes, *, name: str = "segment") -> SegmentHeader:
        if len(buf) < _SEGMENT_HEADER.size or bytes(buf[0:8]) != SEGMENT_MAGIC:
            raise ShmLayoutError(f"{name} has no odbd segment header (half-created or foreign)")
        fields = _SEGMENT_HEADER.unpack_from(buf, 0)
        return SegmentHeader(
            layout_version=fields[1], header_bytes=fields[2], capacity_bytes=fields[3],
            owner_pid=fields[4], owner_start_ticks=fields[5], boot_id=fields[6],
            created_unix_ns=fields[7], node_rank=fields[8], segment_index=fields[9],
            num_segments=fields[10], job_id=fields[11].rstrip(b"\x00").decode(errors="replace"),
        )  # fmt: skip


# --- attach side -------------------------------------------------------------------------------


class ArenaView:
    """The segments of one arena, mapped read-write once for the lifetime of the process."""

    def __init__(self, buffers: Mapping[str, memoryview], headers: Mapping[str, SegmentHeader]):
        self._buffers = dict(buffers)  # segment name -> memoryview of the whole mapping
        self._headers = dict(headers)

    @classmethod
    def attach(cls, segment_names: Sequence[str], *, shm_dir: str = SHM_DIR) -> ArenaView:
        buffers, headers = {}, {}
        for name in segment_names:
            buffers[name] = map_segment(os.path.join(shm_dir, name), name=name)
            headers[name] = SegmentHeader.unpack(buffers[name], name=f"shm segment {name}")
            if headers[name].layout_version != SEGMENT_LAYOUT_VERSION:
                raise ShmAttachError(
                    f"shm segment {name} uses layout version {headers[name].layout_version} but "
                    f"this odbclient reads version {SEGMENT_LAYOUT_VERSION}; samples cannot be "
                    "exchanged; install the same odbd version for the daemon and its clients"
                )
        return cls(buffers, headers)

    @property
    def segment_names(self) -> tuple[str, ...]:
        return tuple(self._buffers)

    def header(self, segment: str) -> SegmentHeader:
        return self._headers[segment]

    def buffer(self, segment: str, offset: int, length: int) -> memoryview:
        """A writable memoryview of `length` bytes at `offset` of `segment` (no copy)."""
        whole = self._buffers[segment]
        if offset < self._headers[segment].header_bytes or offset + length > len(whole):
            raise ShmLayoutError(
                f"bytes [{offset}, {offset + length}) are outside the allocatable region of shm "
                f"segment {segment} ({len(whole)} bytes); the reference is corrupt or stale"
            )
        return whole[offset : offset + length]

    def mapping(self, segment: str) -> memoryview:
        """The whole mapping of `segment` (no copy; it lives as long as the process). Readers
        check bounds against header(segment).header_bytes and its length themselves."""
        return self._buffers[segment]

    def view(self, allocation: Allocation) -> memoryview:
        return self.buffer(allocation.segment, allocation.offset, allocation.length)


def map_segment(path: str, *, name: str) -> memoryview:
    """Maps a whole segment file read-write; the fd is closed, the mapping stays. The file
    must be a regular file of this user (or root) that group and others cannot access
    (odbclient.local_trust.check_segment): another user's file could feed forged samples."""
    from odbclient.local_trust import check_segment

    try:
        # O_NOFOLLOW: a symlink planted under the segment's name is refused (ELOOP), not mapped.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ShmAttachError(
            f"shm segment {name} does not exist: the daemon that advertised it exited or "
            "restarted; reconnect to the daemon to get its current segments"
        ) from None
    except PermissionError:
        raise ShmAttachError(
            f"shm segment {name} belongs to another user (mode 0600); run producers and "
            "trainers as the user of the odbd daemon"
        ) from None
    except OSError as error:
        raise ShmAttachError(
            f"shm segment {name} cannot be opened ({path}): {os.strerror(error.errno or 0)}; "
            "it must be a regular file the daemon made (not a symbolic link); restart the "
            "daemon to recreate its segments"
        ) from None
    try:
        check_segment(fd, name)
        return memoryview(mmap.mmap(fd, os.fstat(fd).st_size))
    finally:
        os.close(fd)


# --- sample layout -----------------------------------------------------------------------------


class DType(enum.IntEnum):
    """dtype codes of the sample layout; names match numpy's and torch's dtype names."""

    BOOL = 1
    UINT8 = 2
    INT8 = 3
    INT16 = 4
    INT32 = 5
    INT64 = 6
    FLOAT16 = 7
    BFLOAT16 = 8  # torch only; numpy sees the raw bits as uint16
    FLOAT32 = 9
    FLOAT64 = 10


# Plain-int tables: enum lookups cost microseconds, and these run for every key of every sample.
_NAME_OF_CODE = {int(code): code.name.lower() for code in DType}
_CODE_OF_NAME = {name: code for code, name in _NAME_OF_CODE.items()}
_NUMPY_OF_NAME = {
    name: np.dtype("uint16" if name == "bfloat16" else name) for name in _CODE_OF_NAME
}
_CODE_OF_NUMPY = {_NUMPY_OF_NAME[name]: code for name, code in _CODE_OF_NAME.items()}
del _CODE_OF_NUMPY[np.dtype(np.uint16)]  # uint16 is unsupported; bf16 only borrows its width
_CODE_OF_TORCH: dict[Any, int] = {}  # torch.dtype -> code, filled on first sight (lazy torch)
DTYPE_NAMES = frozenset(_CODE_OF_NAME)

SAMPLE_MAGIC = b"ODBS"
SAMPLE_LAYOUT_VERSION = 1
_SAMPLE_HEADER = struct.Struct("<4sHHIIQ")  # magic, version, num_keys, header_bytes, 0, total
_FIELD_ENTRY = struct.Struct("<HBBIQQ")  # name_bytes, dtype, ndim, 0, data offset, data nbytes
_MAX_NDIM = 64
# Shapes are unsigned on the wire: a corrupt "negative" dimension reads as >= 2**63 and fails
# the size checks, so readers need no separate sign test.
_SHAPE = [struct.Struct(f"<{ndim}Q") for ndim in range(_MAX_NDIM + 1)]


class FieldMeta(NamedTuple):
    """One array of an encoded sample (a NamedTuple: built per key per sample, so it is cheap)."""

    name: str
    dtype: str  # one of DTYPE_NAMES, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # from the start of the sample; a multiple of ALIGN_BYTES
    nbytes: int


@dataclass(frozen=True, slots=True)
class SampleMeta:
    """Keys, dtypes and shapes of an encoded sample, read from its header alone.

    Encoded sample layout (little-endian, native to the node; starts 64-byte aligned):
    offset size field
         0    4 magic b"ODBS"
         4    2 layout_version (u16) = 1
         6    2 num_keys (u16)
         8    4 header_bytes (u32): end of the last key entry
        12    4 reserved, 0
        16    8 total_bytes (u64): end of the last array (= encoded_size)
        24      num_keys key entries, each:
                  2 name_bytes (u16), 1 dtype code (DType), 1 ndim, 4 reserved,
                  8 data offset (u64, from the sample start, multiple of 64), 8 data nbytes (u64),
                  8 * ndim shape (u64 each), name (utf-8) padded to a multiple of 8
                then each array's raw C-order bytes at its data offset.
    Readers validate every offset and size against the buffer, so garbage (the allocation of
    a producer killed mid-write) raises ShmLayoutError instead of reading out of bounds.
    """

    fields: tuple[FieldMeta, ...]
    total_bytes: int  # encoded size: the end of the last array

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(f.dtype for f in self.fields)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(f.shape for f in self.fields)

    def field(self, name: str) -> FieldMeta:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"sample has no key {name!r}; it has {list(self.keys)}")


def encoded_size(sample: Mapping[str, Any]) -> int:
    """Bytes `encode_into` writes for `sample` (header plus 64-byte aligned arrays)."""
    return _plan(sample)[2]


def encode_into(buf: memoryview, sample: Mapping[str, Any]) -> None:
    """Encodes `sample` at the start of `buf` with one copy per array, no intermediate bytes."""
    fields, header_bytes, total_bytes = _plan(sample)
    if len(buf) < total_bytes:
        raise SampleEncodeError(
            f"the sample needs {total_bytes} bytes but the buffer holds {len(buf)}; "
            "allocate encoded_size(sample) bytes"
        )
    _SAMPLE_HEADER.pack_into(
        buf, 0, SAMPLE_MAGIC, SAMPLE_LAYOUT_VERSION, len(fields), header_bytes, 0, total_bytes
    )
    pos = _SAMPLE_HEADER.size
    for meta, code, name, value in fields:
        ndim = len(meta.shape)
        _FIELD_ENTRY.pack_into(buf, pos, len(name), code, ndim, 0, meta.offset, meta.nbytes)
        pos += _FIELD_ENTRY.size
        _SHAPE[ndim].pack_into(buf, pos, *meta.shape)
        pos += 8 * ndim
        buf[pos : pos + len(name)] = name
        pos += align_up(len(name), 8)
        _copy_array(_numpy_view(buf, meta), value)


def read_meta(buf: memoryview | bytes | bytearray) -> SampleMeta:
    """Parses and validates the header of an encoded sample; touches no array bytes."""
    if len(buf) < _SAMPLE_HEADER.size:
        raise ShmLayoutError(f"{len(buf)} bytes cannot hold an encoded sample header")
    magic, version, num_keys, header_bytes, _, total_bytes = _SAMPLE_HEADER.unpack_from(buf, 0)
    if magic != SAMPLE_MAGIC or version != SAMPLE_LAYOUT_VERSION:
        raise ShmLayoutError(
            f"not an encoded sample of layout version {SAMPLE_LAYOUT_VERSION} "
            f"(magic {magic!r}, version {version}); producer and reader versions differ"
        )
    if not header_bytes <= total_bytes <= len(buf):
        raise ShmLayoutError(
            f"sample claims {header_bytes} header and {total_bytes} total bytes in a "
            f"{len(buf)}-byte buffer"
        )
    # The meta is a function of the header bytes alone (they include total_bytes, and every
    # check above that involves len(buf) ran already), so samples of one structure, which a
    # batch mostly is, parse and validate their header once (issue 15: 2.1 -> ~0.6 us).
    header = bytes(buf[:header_bytes])
    meta = _META_OF_HEADER.get(header)
    if meta is None:
        pos, fields = _SAMPLE_HEADER.size, []
        for _ in range(num_keys):
            field, pos = _read_field(buf, pos, header_bytes, total_bytes)
            fields.append(field)
        meta = SampleMeta(tuple(fields), total_bytes)
        _remember(_META_OF_HEADER, header, meta)
    return meta


def decode(buf: memoryview | bytes | bytearray) -> dict[str, np.ndarray]:
    """Zero-copy numpy views of an encoded sample (bfloat16 arrays appear as uint16 bits)."""
    return {f.name: _numpy_view(buf, f) for f in read_meta(buf).fields}


def decode_torch(buf: memoryview | bytearray) -> dict[str, Any]:
    """Zero-copy torch tensors of an encoded sample; `buf` must be writable."""
    import torch

    tensors = {}
    for f in read_meta(buf).fields:
        tensor = torch.from_numpy(_numpy_view(buf, f))  # keeps the numpy view and its export
        tensors[f.name] = tensor.view(torch.bfloat16) if f.dtype == "bfloat16" else tensor
    return tensors


_Planned = tuple[FieldMeta, int, bytes, Any]  # meta, dtype code, utf-8 name, source array


class _KeyPlan(NamedTuple):
    """What every sample of one structure shares for one key: all but its first dimension."""

    key: str
    name: bytes  # utf-8
    code: int
    dtype_name: str
    ndim: int
    row_bytes: int  # bytes per index of the first dimension (the item size for a 0-d array)


# Structure of a sample of numpy arrays -> its key plans and header size. Key: per key (name,
# dtype, shape after the first dimension, ndim); a hit skips validation, which depends on
# nothing else (issue 15: the layout is planned once per schema, not per sample).
_Structure = tuple[tuple[str, np.dtype, tuple[int, ...], int], ...]
_PLAN_OF_STRUCTURE: dict[_Structure, tuple[tuple[_KeyPlan, ...], int]] = {}
_META_OF_HEADER: dict[bytes, SampleMeta] = {}
_MAX_CACHED = 4096  # per cache; variable dimensions other than the first could grow it


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    """Bounded insert: dropping everything at once is crude, but a hit rate that low means
    structures vary per sample, where no cache helps."""
    if len(cache) >= _MAX_CACHED:
        cache.clear()
    cache[key] = value


def _structure(sample: Mapping[str, Any]) -> _Structure | None:
    """The cache key of a sample whose values are all numpy arrays; None otherwise (torch
    tensors, lists and scalars take the checked path every time)."""
    structure = []
    for key, value in sample.items():
        if type(value) is not np.ndarray:
            return None
        shape = value.shape
        structure.append((key, value.dtype, shape[1:], len(shape)))
    return tuple(structure)


def _plan(sample: Mapping[str, Any]) -> tuple[list[_Planned], int, int]:
    """Field metas (with data offsets), header size and total size of an encoded sample."""
    structure = _structure(sample)
    cached = _PLAN_OF_STRUCTURE.get(structure) if structure is not None else None
    if cached is None:
        planned, header_bytes, total_bytes = _plan_checked(sample)
        if structure is not None:
            _remember(_PLAN_OF_STRUCTURE, structure, _key_plans(planned, header_bytes))
        return planned, header_bytes, total_bytes
    key_plans, header_bytes = cached
    end, planned = header_bytes, []
    # zip without strict: the structure matched, so both have one entry per key.
    for (key, name, code, dtype_name, ndim, row_bytes), array in zip(
        key_plans, sample.values(), strict=False
    ):
        shape = array.shape
        offset = (end + ALIGN_BYTES - 1) & -ALIGN_BYTES
        end = offset + (row_bytes * shape[0] if ndim else row_bytes)
        planned.append((FieldMeta(key, dtype_name, shape, offset, end - offset), code, name, array))
    return planned, header_bytes, end


def _key_plans(planned: list[_Planned], header_bytes: int) -> tuple[tuple[_KeyPlan, ...], int]:
    plans = []
    for meta, code, name, _ in planned:
        itemsize = _NUMPY_OF_NAME[meta.dtype].itemsize
        row_bytes = itemsize * math.prod(meta.shape[1:])
        plans.append(_KeyPlan(meta.name, name, code, meta.dtype, len(meta.shape), row_bytes))
    return tuple(plans), header_bytes


def _plan_checked(sample: Mapping[str, Any]) -> tuple[list[_Planned], int, int]:
    """_plan from scratch, validating every key and value."""
    if len(sample) > 0xFFFF:
        raise SampleEncodeError(f"a sample holds at most 65535 keys, this one {len(sample)}")
    header_bytes, arrays = _SAMPLE_HEADER.size, []
    for key, value in sample.items():
        name = _name_bytes(key)
        code, shape, array = _array_of(key, value)
        header_bytes += _FIELD_ENTRY.size + 8 * len(shape) + ((len(name) + 7) & -8)
        arrays.append((key, name, code, shape, array))
    end, planned = header_bytes, []
    for key, name, code, shape, array in arrays:
        offset = (end + ALIGN_BYTES - 1) & -ALIGN_BYTES
        dtype_name = _NAME_OF_CODE[code]
        nbytes = math.prod(shape) * _NUMPY_OF_NAME[dtype_name].itemsize
        planned.append((FieldMeta(key, dtype_name, shape, offset, nbytes), code, name, array))
        end = offset + nbytes
    return planned, header_bytes, end


def _name_bytes(key: object) -> bytes:
    name = key.encode() if isinstance(key, str) else b""
    if not name or len(name) > 0xFFFF:
        raise SampleEncodeError(
            f"sample key {key!r} is not a non-empty string of at most 65535 utf-8 bytes; "
            "rename it in the dataset"
        )
    return name


def _array_of(key: str, value: Any) -> tuple[int, tuple[int, ...], Any]:
    """dtype code, shape and the array (numpy or torch) behind one sample value."""
    if type(value) is not np.ndarray and isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        code = _CODE_OF_NUMPY.get(value.dtype) or _code_of(key, value.dtype.name, "numpy")
        if code == DType.BFLOAT16:
            raise UnsupportedDtypeError(
                f"sample key {key!r} is a numpy bfloat16 array; pass bfloat16 as a torch tensor"
            )
        return code, value.shape, value
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype not in _CODE_OF_TORCH:
            name = str(value.dtype).removeprefix("torch.")
            _CODE_OF_TORCH[value.dtype] = _code_of(key, name, "torch")
        return _CODE_OF_TORCH[value.dtype], tuple(value.shape), value.detach()
    raise SampleEncodeError(
        f"sample key {key!r} holds a {type(value).__name__}; encoded samples map keys to "
        "numpy arrays or torch tensors (odbclient.samples.as_arrays converts lists and numbers)"
    )


def _code_of(key: str, dtype_name: str, library: str) -> int:
    """The code of a dtype by name (byte-swapped numpy dtypes land here too)."""
    code = _CODE_OF_NAME.get(dtype_name)
    if code is None or (library == "numpy" and dtype_name == "uint16"):
        raise UnsupportedDtypeError(
            f"sample key {key!r} has {library} dtype {dtype_name}, which the shm layout cannot "
            f"carry; convert it to one of {sorted(DTYPE_NAMES)} in preprocessing"
        )
    return code


def _copy_array(dst: np.ndarray, value: Any) -> None:
    """The one copy per array: strided, byte-swapped or on another device sources included."""
    if isinstance(value, np.ndarray):
        np.copyto(dst, value, casting="equiv")
        return
    import torch

    out = torch.from_numpy(dst)
    (out.view(torch.bfloat16) if value.dtype == torch.bfloat16 else out).copy_(value)


def _numpy_view(buf: memoryview | bytes | bytearray, meta: FieldMeta) -> np.ndarray:
    dtype = _NUMPY_OF_NAME[meta.dtype]
    return np.frombuffer(buf, dtype, meta.nbytes // dtype.itemsize, meta.offset).reshape(meta.shape)


def _read_field(
    buf: memoryview | bytes | bytearray, pos: int, header_bytes: int, total_bytes: int
) -> tuple[FieldMeta, int]:
    """One key entry at `pos`, validated against the header and buffer bounds."""
    if pos + _FIELD_ENTRY.size > header_bytes:
        raise ShmLayoutError(f"key entry at byte {pos} runs past the header ({header_bytes} bytes)")
    name_bytes, code, ndim, _, offset, nbytes = _FIELD_ENTRY.unpack_from(buf, pos)
    shape_at = pos + _FIELD_ENTRY.size
    name_at = shape_at + 8 * ndim
    end = name_at + align_up(name_bytes, 8)
    dtype_name = _NAME_OF_CODE.get(code)
    if dtype_name is None or ndim > _MAX_NDIM or end > header_bytes:
        raise ShmLayoutError(f"corrupt key entry at byte {pos}")
    shape = _SHAPE[ndim].unpack_from(buf, shape_at)
    try:
        name = str(buf[name_at : name_at + name_bytes], "utf-8")
    except UnicodeDecodeError:
        raise ShmLayoutError(f"key name at byte {name_at} is not utf-8") from None
    itemsize, count = _NUMPY_OF_NAME[dtype_name].itemsize, math.prod(shape)
    if (
        count * itemsize != nbytes
        or offset < header_bytes
        or offset + nbytes > total_bytes
        or (count == 0 and math.prod(d for d in shape if d) * itemsize >= 1 << 63)  # numpy limit
    ):
        raise ShmLayoutError(f"key {name!r}: shape {shape} and bytes [{offset}, +{nbytes}) invalid")
    return FieldMeta(name, dtype_name, shape, offset, nbytes), end
