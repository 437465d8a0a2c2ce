"""Raw shared-memory slot ring: the node data-path baseline of DESIGN.md section 5.

A producer process fills fixed-size slots of a shm ring and notifies the consumer (the calling
process) through an eventfd, or a pipe where eventfd is missing; the consumer copies each slot
out and hands it back. Exactly 2 processes run: the caller (consumer) and one producer child.

`mode="raw"`: plain memcpy into and out of the slots, no framing: the baseline.
`mode="arena"`: the same loop through odbd's data plane: the slots are allocations of an
`odbd.ingest.arena.Arena`, the producer encodes a one-array sample into its allocation with
`encode_into`, the consumer `decode`s, copies the array out, then frees and reallocates it.

The producer child runs this file as a script (`python shm_ring.py produce CONFIG_JSON`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from odbclient.shm import SHM_DIR, align_up, decode, encode_into, encoded_size, map_segment

ONE_ARRAY_KEY = "x"


@dataclass(frozen=True, slots=True)
class RingResult:
    mode: str  # "raw" | "arena"
    notify: str  # "eventfd" | "pipe"
    slot_bytes: int  # payload bytes per sample
    num_samples: int
    seconds: float  # first credit handed to the producer -> last sample copied out

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.num_samples * self.slot_bytes / self.seconds / 1e9


class Notifier:
    """A counter across processes: post(n) adds n, wait() blocks until > 0 and takes it all."""

    def __init__(self, kind: str, read_fd: int, write_fd: int) -> None:
        self.kind, self.read_fd, self.write_fd = kind, read_fd, write_fd

    @classmethod
    def new(cls, kind: str) -> Notifier:
        if kind == "eventfd":
            fd = os.eventfd(0)
            return cls(kind, fd, fd)
        read_fd, write_fd = os.pipe()
        return cls(kind, read_fd, write_fd)

    def post(self, n: int) -> None:
        if self.kind == "eventfd":
            os.eventfd_write(self.write_fd, n)
        else:
            os.write(self.write_fd, b"\x00" * n)

    def wait(self) -> int:
        if self.kind == "eventfd":
            return os.eventfd_read(self.read_fd)
        return len(os.read(self.read_fd, 1 << 16))

    def close(self) -> None:
        for fd in {self.read_fd, self.write_fd}:
            os.close(fd)


def default_notify() -> str:
    return "eventfd" if hasattr(os, "eventfd") else "pipe"


def run_ring(
    *, slot_bytes: int, num_samples: int, num_slots: int = 16, mode: str = "raw", notify: str = ""
) -> RingResult:
    """Streams `num_samples` samples of `slot_bytes` from a producer child to this process."""
    notify = notify or default_notify()
    with _Ring(mode, slot_bytes, num_slots) as ring:
        filled, freed = Notifier.new(notify), Notifier.new(notify)
        config = {
            "mode": mode, "notify": notify, "slot_bytes": slot_bytes, "num_samples": num_samples,
            "path": ring.path, "offsets": ring.offsets, "length": ring.length,
            "filled": [filled.read_fd, filled.write_fd], "freed": [freed.read_fd, freed.write_fd],
        }  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, __file__, "produce", json.dumps(config)],
            pass_fds=(filled.write_fd, freed.read_fd),
            stdout=subprocess.PIPE,
            text=True,
        )
        # A dead producer would leave us blocked in wait(): wake up and let the sequence check fail.
        watcher = threading.Thread(target=_wake_if_failed, args=(proc, filled), daemon=True)
        watcher.start()
        try:
            seconds = _consume(proc, ring, filled, freed, num_samples)
            if proc.wait(timeout=60) != 0:
                raise RuntimeError(f"ring producer exited with {proc.returncode}")
        finally:
            proc.kill()
            proc.wait()
            watcher.join()  # before closing: it may still post to `filled`
            assert proc.stdout is not None
            proc.stdout.close()
            filled.close()
            freed.close()
    return RingResult(mode, notify, slot_bytes, num_samples, seconds)


class _Ring:
    """The consumer's side of the slots, raw or arena-backed; always unlinked on exit."""

    def __init__(self, mode: str, slot_bytes: int, num_slots: int) -> None:
        if slot_bytes % 8 or mode not in ("raw", "arena"):
            raise ValueError(f"slot_bytes must be a multiple of 8 and mode raw|arena: {mode}")
        self.mode, self.slot_bytes, self.arena = mode, slot_bytes, None
        self.out = np.empty(slot_bytes, np.uint8)
        if mode == "raw":
            self.length = slot_bytes
            name = f"odbd-bench-ring-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.path = os.path.join(SHM_DIR, name)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.posix_fallocate(fd, 0, num_slots * align_up(slot_bytes))
            os.close(fd)
            self.offsets = [i * align_up(slot_bytes) for i in range(num_slots)]
            self.buf = map_segment(self.path, name=name)
        else:
            from odbd.ingest.arena import Arena  # the raw baseline never imports odbd

            self.length = encoded_size({ONE_ARRAY_KEY: np.empty(slot_bytes // 8, np.int64)})
            job_id = f"bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.arena = Arena.create(job_id, 0, num_slots * align_up(self.length))
            self.allocations = [self.arena.allocate(self.length) for _ in range(num_slots)]
            self.path = os.path.join(SHM_DIR, self.arena.segment_names[0])
            self.offsets = [a.offset for a in self.allocations]  # type: ignore[union-attr]
            self.buf = map_segment(self.path, name=self.arena.segment_names[0])
        self.slots = [self.buf[off : off + self.length] for off in self.offsets]
        self.raw_slots = [np.frombuffer(s, np.uint8) for s in self.slots]

    def take(self, slot: int) -> int:
        """Copies one slot out (and recycles its allocation); returns the sequence number."""
        if self.arena is None:
            np.copyto(self.out, self.raw_slots[slot])
            return int(self.out[:8].view(np.int64)[0])
        out = self.out.view(np.int64)
        np.copyto(out, decode(self.slots[slot])[ONE_ARRAY_KEY])
        old = self.allocations[slot]
        self.arena.free(old)  # type: ignore[arg-type]
        new = self.arena.allocate(self.length)
        assert new == old, "the only free extent is the one just freed"
        self.allocations[slot] = new
        return int(out[0])

    def __enter__(self) -> _Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.arena is not None:
            self.arena.close()
        elif os.path.exists(self.path):
            os.unlink(self.path)


def _consume(
    proc: subprocess.Popen, ring: _Ring, filled: Notifier, freed: Notifier, num_samples: int
) -> float:
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("ring producer failed to start")
    num_slots, received = len(ring.slots), 0
    start = time.perf_counter()
    freed.post(num_slots)
    while received < num_samples:
        ready = filled.wait()
        for _ in range(ready):
            seq = ring.take(received % num_slots)
            if seq != received:
                raise RuntimeError(f"slot carried sample {seq}, expected {received}")
            received += 1
        freed.post(ready)
    return time.perf_counter() - start


def _wake_if_failed(proc: subprocess.Popen, filled: Notifier) -> None:
    if proc.wait() != 0:
        filled.post(1)


def _produce(config: dict[str, Any]) -> None:
    filled = Notifier(config["notify"], *config["filled"])
    freed = Notifier(config["notify"], *config["freed"])
    buf = map_segment(config["path"], name=config["path"])
    slots = [buf[off : off + config["length"]] for off in config["offsets"]]
    payload = np.zeros(config["slot_bytes"] // 8, np.int64)
    sample, raw_slots = {ONE_ARRAY_KEY: payload}, [np.frombuffer(s, np.int64) for s in slots]
    arena_mode = config["mode"] == "arena"
    print("ready", flush=True)
    credits = 0
    for seq in range(config["num_samples"]):
        if credits == 0:
            credits = freed.wait()
        slot = seq % len(slots)
        payload[0] = seq
        if arena_mode:
            encode_into(slots[slot], sample)
        else:
            np.copyto(raw_slots[slot][: payload.size], payload)
        credits -= 1
        filled.post(1)


def memcpy_gb_per_s(nbytes: int, working_set_bytes: int = 64 << 20) -> float:
    """Single-process np.copyto bandwidth, `nbytes` at a time through a working set larger than
    the caches (context for the ring numbers, not a target)."""
    num_chunks = max(2, working_set_bytes // nbytes)
    src, dst = np.ones((num_chunks, nbytes), np.uint8), np.zeros((num_chunks, nbytes), np.uint8)
    srcs, dsts = list(src), list(dst)
    for _ in range(2):  # the first pass pays the page faults of `dst`
        start = time.perf_counter()
        for s, d in zip(srcs, dsts, strict=True):
            np.copyto(d, s)
        seconds = time.perf_counter() - start
    return num_chunks * nbytes / seconds / 1e9


if __name__ == "__main__" and sys.argv[1:2] == ["produce"]:
    _produce(json.loads(sys.argv[2]))
