"""What the trainer process and its reader process (odbclient.reader_process) share: a control
page, staging slots, and the packets on the socket pair between them.

Why a reader process (issue 15): in a GPU job the trainer process's Python thread is the
scarcest resource, and a reader thread in that process costs it the reader's CPU plus a GIL
hand-off per step. The reader process reads the daemon's step socket and collates each step
into a staging slot; the trainer copies a ready slot into fresh memory and wraps it.

Staging slots: `num_slots` memfds, used round-robin by batch number (batch n in slot
n % num_slots). The reader process creates a slot's memfd, and a bigger one when a batch does
not fit, and passes it with the packet of that batch (SCM_RIGHTS). A slot is written only once
the trainer has taken the batch that used it before (`consumed` in the control page), and the
trainer copies a batch out before it counts it taken, so no tensor ever views a slot.
A slot holds the tensors' bytes, each at a multiple of 64, then the batch's facts (pickled).

Control page: one 4096-byte memfd the trainer creates, little-endian:

    offset size field
         0    8 layout_version (u64), CONTROL_LAYOUT_VERSION
         8    8 consumed (u64): batches the trainer has copied out of their slots
        16    8 seq (u64): the report record's seqlock, odd while the trainer writes it
        24    8 reported (u64): steps handed to the user so far (each is reported Delivered)
        32    8 epoch (u64) of the last step handed out
        40    8 step (u64) of the last step handed out
        48    8 wait_s (f64): sum over the steps handed out of the time next() blocked
        56    8 compute_s (f64): sum of the time between next() calls
        64    8 parked (u64): 1 while the reader process waits for data alone: the trainer's
                  next report must wake it with a packet (DeliveryReports' park, in shm)

Concurrency: one writer per field (the trainer, except `parked`, which both write). The report
record is read under its seqlock (x86 keeps stores in order and loads in order, and each
pack/unpack is one C call). `parked` is a Dekker-style flag: the reader process sets it, then
reads `reported` again; the trainer writes `reported`, then reads `parked`. A store may pass a
later load, so rarely both miss: then reports wait for the next step message or the trainer's
flush once next() has blocked for 1 ms, never longer.

Packets (SOCK_SEQPACKET, one pickled list of items each):
- reader process -> trainer: ("slot", index, size) with the memfd attached; ("batch", slot,
  facts_at, facts_nbytes); ("event", obj) for Welcome, EpochEnd, JobEnd, StreamEnd; ("failure",
  exception); ("exited", why): the reader process ends on its own (the daemon stream ended).
- trainer -> reader process: b"F" flush reports now, b"C" close, b"M" + pickled (epoch, step,
  compute_s) for report_compute.
"""

from __future__ import annotations

import functools
import mmap
import struct
from typing import Any, NamedTuple

import numpy as np
import torch

from odbclient.trainer.batch import (
    BATCH_FACTS,
    PROGRESS_FIELDS,
    Batch,
    assemble_batch,
    assemble_progress,
)

CONTROL_LAYOUT_VERSION = 1
CONTROL_BYTES = 4096
SLOT_ALIGN_BYTES = 64
MAX_PACKET_BYTES = 64 << 10  # a packet above this is split (SO_SNDBUF is ~208 KiB)

_U64 = struct.Struct("<Q")
_REPORT = struct.Struct("<QQQdd")  # reported, epoch, step, wait_s, compute_s
_CONSUMED_AT, _SEQ_AT, _REPORT_AT, _PARKED_AT = 8, 16, 24, 64

FLUSH, CLOSE, MEASURED = b"F", b"C", b"M"
END_JOB = b"E"  # then pickled (epoch, step): ODBClient.end_job, after the reports


class Report(NamedTuple):
    reported: int
    epoch: int
    step: int
    wait_s: float
    compute_s: float


class ControlPage:
    """The control page's fields (see the module), over a mapping of its memfd."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._map = mapping
        self._seq = 0  # the trainer's own copy: it is the only writer

    @classmethod
    def create(cls, fd: int) -> ControlPage:
        """Sizes a new memfd and writes the version (the trainer)."""
        import os

        os.ftruncate(fd, CONTROL_BYTES)
        page = cls(mmap.mmap(fd, CONTROL_BYTES))
        _U64.pack_into(page._map, 0, CONTROL_LAYOUT_VERSION)
        return page

    @classmethod
    def attach(cls, fd: int) -> ControlPage:
        """Maps the trainer's page (the reader process); refuses another layout version."""
        page = cls(mmap.mmap(fd, CONTROL_BYTES))
        (version,) = _U64.unpack_from(page._map, 0)
        if version != CONTROL_LAYOUT_VERSION:
            raise RuntimeError(
                f"odbclient control page has layout version {version}, this reader process "
                f"speaks {CONTROL_LAYOUT_VERSION}: the trainer and its reader process come "
                "from different odbclient installs; reinstall odbclient"
            )
        return page

    # the trainer
    def set_consumed(self, consumed: int) -> None:
        _U64.pack_into(self._map, _CONSUMED_AT, consumed)

    def write_report(self, report: Report) -> None:
        self._seq += 1
        _U64.pack_into(self._map, _SEQ_AT, self._seq)  # odd: being written
        _REPORT.pack_into(self._map, _REPORT_AT, *report)
        self._seq += 1
        _U64.pack_into(self._map, _SEQ_AT, self._seq)

    def take_parked(self) -> bool:
        """True (and clears it) if the reader process is parked: the caller must wake it."""
        if _U64.unpack_from(self._map, _PARKED_AT)[0]:
            _U64.pack_into(self._map, _PARKED_AT, 0)
            return True
        return False

    # the reader process
    def consumed(self) -> int:
        return int(_U64.unpack_from(self._map, _CONSUMED_AT)[0])

    def read_report(self) -> Report:
        while True:
            (before,) = _U64.unpack_from(self._map, _SEQ_AT)
            if before % 2:
                continue  # the trainer is inside write_report: a few instructions
            report = Report(*_REPORT.unpack_from(self._map, _REPORT_AT))
            if _U64.unpack_from(self._map, _SEQ_AT)[0] == before:
                return report

    def set_parked(self, parked: bool) -> None:
        _U64.pack_into(self._map, _PARKED_AT, int(parked))


# A staged batch's facts, pickled after its tensors: (layout, facts, progress), plain tuples
# (a dict or a NamedTuple costs the trainer ~2-3 us more per step to unpickle):
# - layout: per key, (key, dtype, shape, at, nbytes): the tensor's `nbytes` at byte `at` of
#   the slot, dtype a numpy name or "bfloat16" (stored as its uint16 bits); or (key, int) for
#   a plain int (packed batches' max_length_q/k);
# - facts: Batch's fields in FACTS order; progress: Progress's fields in PROGRESS order.
FACTS = BATCH_FACTS
PROGRESS = PROGRESS_FIELDS


def staged_batch(data: np.ndarray, facts: tuple[Any, ...]) -> Batch:
    """The Batch of a staged batch: `data` is the trainer's fresh copy of the slot's tensor
    bytes, `facts` its unpickled (layout, facts, progress). Built slot by slot
    (odbclient.batch.assemble_batch: Batch.__init__ cost ~16 us per step here)."""
    layout, values, progress_values = facts
    return assemble_batch(wrap_tensors(data, layout), assemble_progress(progress_values), values)


def align(nbytes: int) -> int:
    return (nbytes + SLOT_ALIGN_BYTES - 1) & -SLOT_ALIGN_BYTES


def wrap_tensors(data: np.ndarray, layout: tuple[tuple[Any, ...], ...]) -> dict[str, Any]:
    """Tensors over `data` (the trainer's fresh copy of a slot): views of memory the batch
    owns, never of the slot. A (key, int) entry is a plain int (packed batches' max_length)."""
    tensors: dict[str, Any] = {}
    for entry in layout:
        if len(entry) == 2:
            tensors[entry[0]] = entry[1]
            continue
        key, dtype, shape, at, nbytes = entry
        raw = data[at : at + nbytes]
        if dtype == "bfloat16":
            tensors[key] = torch.from_numpy(raw.view(np.uint16).reshape(shape)).view(torch.bfloat16)
        else:
            tensors[key] = torch.from_numpy(raw.view(_numpy_dtype(dtype)).reshape(shape))
    return tensors


@functools.cache
def _numpy_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(name)
