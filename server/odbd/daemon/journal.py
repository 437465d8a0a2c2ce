"""The --state-dir journal: what each round handed to trainers, so a restarted job resumes.

A restarted daemon cannot trust shared memory (its arena died with it), so it rebuilds its
bookkeeping from this journal and the trainers' resume point (their `ODBClient.state_dict()`):
views trained in steps before the resume point stay emitted; every other view of the epoch goes
back to pending and is produced again; rejected views stay rejected.

File layout, version 1: frames of u32 little-endian length + body; body = u32 header length,
UTF-8 JSON header, then the record's int64 arrays. Records:
    {"kind": "header", "version": 1, "fingerprint": {...}, "views_per_iteration": M}
    {"kind": "round", "round": r, "steps": [[epoch, step, global_samples], ...],
     "counts": n, "rejected": {reason: n}}  + arrays keys (n,), counts (steps * W,),
                                              rejected_keys (this node's, since last round)
    {"kind": "resume", "epoch": e, "step": s}   a restart: steps >= (e, s) before it never ran
Each round is appended and fsynced before its steps are queued, so any step a trainer saw is in
the journal.
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from odbd.errors import ConfigError

VERSION = 1
_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class JournalStep:
    epoch: int
    step: int
    global_samples: int
    keys_by_rank: tuple[np.ndarray, ...]  # (W,) view keys of each global rank


@dataclass(slots=True)
class ResumeState:
    """Bookkeeping of the trained prefix, rebuilt from the journal (pure result of replay)."""

    epoch: int
    step: int
    trained_steps: list[JournalStep] = field(default_factory=list)
    rejected_keys: list[int] = field(default_factory=list)  # this node's
    rejected: Counter[str] = field(default_factory=Counter)  # every node's, all rounds
    incarnation: int = 0  # restarts so far, this one included


class Journal:
    def __init__(self, directory: Path, node_rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = directory / f"node{node_rank}.journal"
        self._file: BinaryIO | None = None

    def exists(self) -> bool:
        return self.path.exists() and self.path.stat().st_size > 0

    def open(self, fingerprint: dict[str, str], views_per_iteration: int) -> None:
        fresh = not self.exists()
        self._file = open(self.path, "ab")  # noqa: SIM115 (closed in close())
        os.chmod(self.path, 0o600)
        if fresh:
            header = {"kind": "header", "version": VERSION, "fingerprint": fingerprint}
            header["views_per_iteration"] = views_per_iteration
            self._append(header, [])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def append_round(
        self,
        round_index: int,
        steps: list[list[int]],  # [epoch, step, global samples] per kept step
        keys: np.ndarray,
        counts: np.ndarray,
        rejected_keys: list[int],
        rejected: dict[str, int],
    ) -> None:
        header = {"kind": "round", "round": round_index, "steps": steps, "rejected": rejected}
        rejected_arr = np.asarray(rejected_keys, dtype=np.int64)
        self._append(header, [keys, counts.reshape(-1), rejected_arr])

    def append_resume(self, epoch: int, step: int) -> None:
        self._append({"kind": "resume", "epoch": epoch, "step": step}, [])

    def _append(self, header: dict, arrays: list[np.ndarray]) -> None:
        assert self._file is not None
        header = dict(header, shapes=[int(a.shape[0]) for a in arrays])
        head = json.dumps(header, separators=(",", ":")).encode()
        body = _LEN.pack(len(head)) + head + b"".join(a.astype("<i8").tobytes() for a in arrays)
        self._file.write(_LEN.pack(len(body)) + body)
        self._file.flush()
        os.fsync(self._file.fileno())

    def records(self) -> list[tuple[dict, list[np.ndarray]]]:
        """Every complete record; a torn last frame (crash mid-write) is ignored."""
        data = self.path.read_bytes() if self.path.exists() else b""
        out, pos = [], 0
        while pos + _LEN.size <= len(data):
            (length,) = _LEN.unpack_from(data, pos)
            if pos + _LEN.size + length > len(data):
                break
            body = data[pos + _LEN.size : pos + _LEN.size + length]
            (head_len,) = _LEN.unpack_from(body, 0)
            header = json.loads(body[_LEN.size : _LEN.size + head_len])
            arrays, at = [], _LEN.size + head_len
            for n in header.get("shapes", []):
                arrays.append(np.frombuffer(body, dtype="<i8", count=n, offset=at).astype(np.int64))
                at += 8 * n
            out.append((header, arrays))
            pos += _LEN.size + length
        return out


def check_header(records: list[tuple[dict, list[np.ndarray]]], fingerprint: dict[str, str]) -> None:
    if not records or records[0][0].get("kind") != "header":
        raise ConfigError("the --state-dir journal has no header; remove it to start afresh")
    header = records[0][0]
    if header.get("version") != VERSION:
        raise ConfigError(
            f"the --state-dir journal has version {header.get('version')}, this odbd writes "
            f"{VERSION}; resume with the odbd release that wrote it or start afresh"
        )
    theirs = header.get("fingerprint", {})
    for key in sorted(set(fingerprint) | set(theirs)):
        if fingerprint.get(key) != theirs.get(key):
            raise ConfigError(
                f"the --state-dir journal was written with {key}={theirs.get(key)!r}, this daemon "
                f"runs {key}={fingerprint.get(key)!r}; resume with the same flags or start afresh "
                "with an empty --state-dir"
            )


def replay(
    records: list[tuple[dict, list[np.ndarray]]], world_size: int, epoch: int, step: int
) -> ResumeState:
    """The trained prefix: every journaled step before (epoch, step), as the trainers report."""
    steps: list[JournalStep] = []
    state = ResumeState(epoch, step)
    for header, arrays in records:
        kind = header["kind"]
        if kind == "resume":
            cut = (header["epoch"], header["step"])
            steps = [s for s in steps if (s.epoch, s.step) < cut]
            state.incarnation += 1
        elif kind == "round":
            steps.extend(_round_steps(header, arrays, world_size))
            state.rejected_keys.extend(arrays[2].tolist())
            state.rejected.update(header["rejected"])
    state.trained_steps = [s for s in steps if (s.epoch, s.step) < (epoch, step)]
    recorded = sum(1 for s in state.trained_steps if s.epoch == epoch)
    if recorded != step:
        raise ConfigError(
            f"trainers resume at epoch {epoch} step {step}, but the --state-dir journal records "
            f"{recorded} steps of that epoch; resume from a checkpoint this journal has seen, "
            "or start afresh with an empty --state-dir"
        )
    state.incarnation += 1
    return state


def _round_steps(header: dict, arrays: list[np.ndarray], world_size: int) -> list[JournalStep]:
    keys, counts = arrays[0], arrays[1].reshape(-1, world_size)
    bounds = np.concatenate([[0], np.cumsum(counts.reshape(-1))])
    out = []
    for i, (epoch, step, global_samples) in enumerate(header["steps"]):
        per_rank = tuple(
            keys[bounds[i * world_size + r] : bounds[i * world_size + r + 1]]
            for r in range(world_size)
        )
        out.append(JournalStep(epoch, step, global_samples, per_rank))
    return out
