"""Datasets that break their producer on purpose (loaded by path), for the ingest fault tests.

`crashing(size, crash_at="5;17", how="exit")`: `__getitem__` of those indices ("*": all) kills the
process: `exit` calls sys.exit(3), `abort` os.abort() (SIGABRT, as a failed C assertion),
`segv` dereferences NULL through ctypes (SIGSEGV, as a crash in a C extension), `hang` never
returns (a deadlocked tokenizer, a read from a dead mount). Every other
index is a good 12-token sample. `tuples(size)`: every sample is a tuple, never a dict.
"""

import ctypes
import os
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
