"""Datasets that break their producer on purpose (loaded by path), for the ingest fault tests.

`crashing(size, crash_at="5;17", how="exit")`: `__getitem__` of those indices ("*": all) kills the
process: `exit` calls sys.exit(3), `abort` os.abort() (SIGABRT, as a failed C assertion),
`segv` dereferences NULL through ctypes (SIGSEGV, as a crash in a C extension), `hang` never
returns (a deadlocked tokenizer, a read from a dead mount). Every other
index is a good 12-token sample. `tuples(size)`: every sample is a tuple, never a dict.
`leaking(size, leak_mib, limit_mib)`: every sample leaks `leak_mib` under an address-space limit
of `limit_mib` over the producer's size at its first sample (as `ulimit -v` would), so each
producer process runs out of memory after about limit / leak samples.
`short_labels(size, every)`: every `every`-th sample's labels are one entry shorter than its
input_ids (truncated apart, as a `map` that truncates one column may do).
"""

import ctypes
import os
import resource
import sys
import threading

import numpy as np

GOOD_LENGTH = 12


class Crashing:
    def __init__(self, size: int, crash_at: frozenset[int], how: str) -> None:
        self.size, self.crash_at, self.how = size, crash_at, how

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        if index in self.crash_at:
            if self.how == "exit":
                sys.exit(3)
            if self.how == "abort":
                os.abort()
            if self.how == "hang":
                threading.Event().wait()  # forever: only a signal ends this process
            ctypes.string_at(0)  # SIGSEGV
        ids = np.arange(GOOD_LENGTH, dtype=np.int64) + index
        return {"input_ids": ids, "labels": ids}


def crashing(size: int = 40, crash_at: str | int = "", how: str = "exit") -> Crashing:
    """`crash_at`: indices separated by ';', or '*' for every index."""
    text = str(crash_at)
    at = frozenset(range(size)) if text == "*" else frozenset(int(i) for i in text.split(";") if i)
    return Crashing(size, at, how)


class Tuples:
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple:
        ids = np.arange(GOOD_LENGTH, dtype=np.int64) + index
        return ids, ids


def tuples(size: int = 40) -> Tuples:
    return Tuples(size)


_LEAKED: list[bytearray] = []


class Leaking(Crashing):
    def __init__(self, size: int, leak_mib: int, limit_mib: int) -> None:
        super().__init__(size, frozenset(), "")
        self.leak_mib, self.limit_mib, self.limited = leak_mib, limit_mib, False

    def __getitem__(self, index: int) -> dict:
        if not self.limited:  # in the producer only: the daemon calls len(), never [i]
            with open("/proc/self/status") as f:
                vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
            limit = vm_kib * 1024 + self.limit_mib * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
            self.limited = True
        _LEAKED.append(bytearray(self.leak_mib * 2**20))
        return super().__getitem__(index)


def leaking(size: int = 40, leak_mib: int = 1, limit_mib: int = 64) -> Leaking:
    return Leaking(size, leak_mib, limit_mib)


class ShortLabels(Crashing):
    def __init__(self, size: int, every: int) -> None:
        super().__init__(size, frozenset(), "")
        self.every = every

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        if index % self.every == 0:
            sample["labels"] = sample["labels"][:-1]
        return sample


def short_labels(size: int = 40, every: int = 10) -> ShortLabels:
    return ShortLabels(size, every)
