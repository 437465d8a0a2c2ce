"""The --state-dir journal: what each round handed to trainers, so a restarted job resumes.

A restarted daemon cannot trust shared memory (its arena died with it), so it rebuilds its
bookkeeping from this journal and the trainers' resume point (their `ODBClient.state_dict()`):
views trained in steps before the resume point stay emitted; every other view of the epoch goes
back to pending and is produced again; rejected views stay rejected.

File layout, version 2 (little-endian):
    b"ODBDJRNL", u32 layout version
    frames: u32 body length n, u32 crc32 of (the length bytes + body), body (n bytes)
    body:   u32 header length, UTF-8 JSON header, then the record's int64 arrays
Records:
    {"kind": "header", "version": 2, "fingerprint": {...}, "views_per_iteration": M}
    {"kind": "round", "round": r, "steps": [[epoch, step, global_samples], ...],
     "counts": n, "rejected": {reason: n},
     "identities": [[singles, [identity, ...]], ...]}  (per step, every node's; optional)
                                            + arrays keys (n,), counts (steps * W,),
                                              rejected_keys (this node's, since last round)
    {"kind": "resume", "epoch": e, "step": s}   a restart: steps >= (e, s) before it never ran
    {"kind": "moved", "round": r, "target": n}  + arrays keys: views this node sent to node n
                                            (--migrate auto), written before their bytes go
Each round is appended and fsynced before its steps are queued, so any step a trainer saw is in
the journal. A crash mid-append leaves a torn last frame: reading stops at the first frame that
is short or fails its checksum, and `open` cuts the file there before appending, so a later
record can never be read through the remains of a torn one. Version 1 (frames without a
checksum) is refused: a torn tail there cannot be told from data.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import struct
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from odbclient.local_trust import private_dir_problem
from odbd.errors import ConfigError, OdbdError
from odbd.flag_files import ensure_private_dir

log = logging.getLogger(__name__)

VERSION = 2
MAGIC = b"ODBDJRNL"
_LEN = struct.Struct("<I")
_FRAME = struct.Struct("<II")  # body length, crc32
FILE_HEADER = MAGIC + _LEN.pack(VERSION)


class JournalError(OdbdError):
    """The --state-dir journal could not be written: the job stops rather than run unrecorded."""


@dataclass(frozen=True, slots=True)
class JournalStep:
    epoch: int
    step: int
    global_samples: int
    keys_by_rank: tuple[np.ndarray, ...]  # (W,) view keys of each global rank
    # every node's identities of the step (planner/identities.py): (single views, repeated
    # identities); None in a journal written before they were recorded
    identities: tuple[int, tuple[int, ...]] | None = None


@dataclass(slots=True)
class ResumeState:
    """Bookkeeping of the trained prefix, rebuilt from the journal (pure result of replay)."""

    epoch: int
    step: int
    trained_steps: list[JournalStep] = field(default_factory=list)
    rejected_keys: list[int] = field(default_factory=list)  # this node's
    rejected: Counter[str] = field(default_factory=Counter)  # every node's, all rounds
    incarnation: int = 0  # restarts so far, this one included
    # views this node moved to others, every run (--migrate auto): a restart holds its own
    # ones it did not train until the others say whether they did (NodeState.release_held)
    moved_keys: list[int] = field(default_factory=list)


Record = tuple[dict, list[np.ndarray]]


@dataclass(frozen=True, slots=True)
class Scan:
    """What a journal's bytes hold (pure result of `scan`)."""

    records: list[Record]  # every intact record, in file order
    valid_bytes: int  # the intact prefix: file header and whole frames with a good checksum
    problem: str  # why reading stopped before the end ("" when every byte was read)


def encode_frame(header: dict, arrays: list[np.ndarray]) -> bytes:
    header = dict(header, shapes=[int(a.shape[0]) for a in arrays])
    head = json.dumps(header, separators=(",", ":")).encode()
    body = _LEN.pack(len(head)) + head + b"".join(a.astype("<i8").tobytes() for a in arrays)
    length = _LEN.pack(len(body))
    return length + _LEN.pack(zlib.crc32(length + body)) + body


def scan(data: bytes, path: Path | str = "the journal") -> Scan:
    """Intact records of a journal file's bytes; raises ConfigError for another layout."""
    if len(data) < len(FILE_HEADER) and FILE_HEADER.startswith(data):
        problem = "the file header is torn" if data else ""
        return Scan([], 0, problem)
    _check_layout(data, path)
    out: list[Record] = []
    pos = len(FILE_HEADER)
    while pos < len(data):
        record, problem = _decode_frame(data, pos)
        if record is None:
            return Scan(out, pos, problem)
        out.append(record)
        pos += _FRAME.size + _LEN.unpack_from(data, pos)[0]
    return Scan(out, pos, "")


def _check_layout(data: bytes, path: Path | str) -> None:
    if data.startswith(MAGIC):
        (version,) = _LEN.unpack_from(data, len(MAGIC))
        if version == VERSION:
            return
        found = f"journal layout {version}"
    elif _looks_like_layout_1(data):
        found = "journal layout 1 (frames without checksums, which a torn write can corrupt)"
    else:
        found = "bytes that are not an odbd journal"
    raise ConfigError(
        f"--state-dir journal {path} holds {found}; this odbd reads layout {VERSION}. Resume "
        "with the odbd release that wrote it, or start the job afresh with an empty --state-dir"
    )


def _looks_like_layout_1(data: bytes) -> bool:
    """Layout 1 began with a bare frame: u32 length, u32 JSON length, the header record."""
    return data[2 * _LEN.size : 2 * _LEN.size + 17] == b'{"kind":"header",'


def _decode_frame(data: bytes, pos: int) -> tuple[Record | None, str]:
    """The record of the frame at `pos`, or None and why it is not intact."""
    if pos + _FRAME.size > len(data):
        return None, f"a frame header is torn ({len(data) - pos} of {_FRAME.size} bytes)"
    length, crc = _FRAME.unpack_from(data, pos)
    end = pos + _FRAME.size + length
    if end > len(data):
        return None, f"a frame is torn ({len(data) - pos - _FRAME.size} of {length} bytes)"
    body = data[pos + _FRAME.size : end]
    if zlib.crc32(data[pos : pos + _LEN.size] + body) != crc:
        return None, "a frame fails its checksum"
    try:
        return _decode_body(body), ""
    except (ValueError, KeyError, TypeError, struct.error) as error:
        # A good checksum over a bad body is a bug, not a torn write; still never use it.
        return None, f"a frame does not decode ({type(error).__name__}: {error})"


def _decode_body(body: bytes) -> Record:
    (head_len,) = _LEN.unpack_from(body, 0)
    header = json.loads(body[_LEN.size : _LEN.size + head_len])
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise ValueError("the record has no kind")
    arrays, at = [], _LEN.size + head_len
    for n in header.get("shapes", []):
        arrays.append(np.frombuffer(body, dtype="<i8", count=n, offset=at).astype(np.int64))
        at += 8 * n
    if at != len(body):
        raise ValueError(f"the arrays end at byte {at} of {len(body)}")
    return header, arrays


class Journal:
    """One node's journal file in --state-dir, reached only through the directory's fd.

    Another local user must not be able to steer the daemon's writes (issue 29): the directory
    must be this user's (or root's) and not writable by others (created 0700 when absent), and
    the file is opened relative to the directory's fd with O_NOFOLLOW, so a symbolic link
    planted under the journal's name is refused, and nothing is created or changed through it.
    """

    def __init__(self, directory: Path, node_rank: int) -> None:
        self.path = directory / f"node{node_rank}.journal"
        self._name = self.path.name
        self._fd: int | None = None
        self._dir_fd: int | None = None
        directory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fix = "or pass a --state-dir only you can write"
        ensure_private_dir(directory, flag="--state-dir", fix=fix)
        try:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as error:
            raise self._error("open the directory of", error) from None
        # Checked again on what was opened: the path could have been swapped since.
        problem = private_dir_problem(os.fstat(dir_fd), os.getuid())
        if problem:
            os.close(dir_fd)
            raise ConfigError(
                f"--state-dir {directory} {problem}; pass a --state-dir only you can write"
            )
        self._dir_fd = dir_fd

    def exists(self) -> bool:
        """True if the journal holds a job's header: a restart, not a fresh start."""
        return bool(self.records())

    def open(self, fingerprint: dict[str, str], views_per_iteration: int) -> None:
        """Opens for appending: cuts a torn or corrupt tail first, starts a fresh file if empty."""
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self._name, flags, 0o600, dir_fd=self._dir_fd)
        except OSError as error:
            raise self._error("open", error) from None
        try:
            self._check_file(fd)
            os.fchmod(fd, 0o600)  # an older file may have other modes
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        valid = self._cut_torn_tail()
        if valid == 0:
            header = {"kind": "header", "version": VERSION, "fingerprint": fingerprint}
            header["views_per_iteration"] = views_per_iteration
            self._write(FILE_HEADER + encode_frame(header, []), "write")

    def _check_file(self, fd: int) -> None:
        """The opened journal is a regular file of this user (or root) with one name: not a
        device or a hard link to a file elsewhere that another user placed here."""
        info = os.fstat(fd)
        own = os.getuid()
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in (own, 0) or info.st_nlink != 1:
            raise JournalError(
                f"the --state-dir journal {self.path} is not a regular file of this user with "
                f"one name (owner uid {info.st_uid}, {info.st_nlink} links, mode "
                f"{stat.S_IMODE(info.st_mode):04o}); someone else placed it there. The daemon "
                "does not start: remove it (the job then starts afresh) or restore the "
                "journal this daemon wrote"
            )

    def _cut_torn_tail(self) -> int:
        """Truncates the file to its intact records; returns the bytes kept (0: start afresh)."""
        data = self._read()
        found = scan(data, self.path)
        keep = found.valid_bytes if found.records else 0  # no header record: nothing to keep
        if keep < len(data):
            log.warning(
                "--state-dir journal %s: %s at byte offset %d; dropping the last %d bytes. The "
                "daemon stopped while appending a record, so the last round's record is "
                "incomplete; that round was never handed to trainers and is planned and "
                "produced again",
                self.path,
                found.problem or "no complete header record",
                found.valid_bytes,
                len(data) - keep,
            )
            assert self._fd is not None
            try:
                os.ftruncate(self._fd, keep)
            except OSError as error:
                raise self._error("truncate", error) from None
        return keep

    def close(self) -> None:
        """Closes the file; never raises (a failed close only means nothing more is recorded)."""
        fds = [fd for fd in (self._fd, self._dir_fd) if fd is not None]
        self._fd = self._dir_fd = None
        for fd in fds:
            try:
                os.close(fd)
            except OSError as error:
                log.warning("%s", self._error("close", error))

    def append_round(
        self,
        round_index: int,
        steps: list[list[int]],  # [epoch, step, global samples] per kept step
        keys: np.ndarray,
        counts: np.ndarray,
        rejected_keys: list[int],
        rejected: dict[str, int],
        identities: list[list] | None = None,  # [singles, [repeated ids]] per kept step
    ) -> None:
        header = {"kind": "round", "round": round_index, "steps": steps, "rejected": rejected}
        if identities is not None:
            header["identities"] = identities
        rejected_arr = np.asarray(rejected_keys, dtype=np.int64)
        self._write(encode_frame(header, [keys, counts.reshape(-1), rejected_arr]), "write")

    def append_moved(self, round_index: int, keys: np.ndarray, target: int) -> None:
        """Views about to be sent to node `target`: fsynced before any byte goes, so a view a
        target may train is always in its home node's journal as moved."""
        header = {"kind": "moved", "round": round_index, "target": target}
        self._write(encode_frame(header, [keys.astype(np.int64)]), "write")

    def append_resume(self, epoch: int, step: int) -> None:
        self._write(encode_frame({"kind": "resume", "epoch": epoch, "step": step}, []), "write")

    def _write(self, data: bytes, what: str) -> None:
        if self._fd is None:
            raise JournalError(f"--state-dir journal {self.path} was written after close()")
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]  # a short write continues
            os.fsync(self._fd)
        except OSError as error:
            raise self._error("fsync" if not view else what, error) from None

    def _error(self, what: str, error: OSError) -> JournalError:
        if error.errno == errno.ELOOP:
            return JournalError(
                f"the --state-dir journal {self.path} is a symbolic link; odbd never follows "
                "one there (another user could point it at a file for the daemon to create or "
                "overwrite), so nothing was opened or created. The daemon does not start: "
                f"remove the link (`rm {self.path}`) and check who made it"
            )
        cause = os.strerror(error.errno) if error.errno else str(error)
        fix = (
            "free space on that file system or point --state-dir at one with room"
            if error.errno in (errno.ENOSPC, errno.EDQUOT)
            else "check that file system and its permissions, or point --state-dir elsewhere"
        )
        return JournalError(
            f"cannot {what} the --state-dir journal {self.path}: {cause} (errno "
            f"{errno.errorcode.get(error.errno or 0, error.errno)}). The job stops: without the "
            f"journal a restart could repeat or skip trained steps. To fix, {fix}, then "
            "restart the job (it resumes from the journal's last complete round)"
        )

    def records(self) -> list[Record]:
        """Every intact record; a torn or corrupt tail (crash mid-write) is left out."""
        return scan(self._read(), self.path).records

    def _read(self) -> bytes:
        """The file's bytes; b"" if it does not exist or is not a regular file (a device).
        Read through the open journal, else opened without following a symbolic link."""
        fd = self._fd
        try:
            if fd is None:
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                if self._dir_fd is None:  # closed: by path, still never through a link
                    fd = os.open(self.path, flags)
                else:
                    fd = os.open(self._name, flags, dir_fd=self._dir_fd)
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    return b""
                chunks, at = [], 0
                while at < info.st_size:  # one pread returns at most ~2 GiB
                    chunk = os.pread(fd, info.st_size - at, at)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    at += len(chunk)
                return b"".join(chunks)
            finally:
                if fd != self._fd:
                    os.close(fd)
        except FileNotFoundError:
            return b""
        except OSError as error:
            raise self._error("read", error) from None


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
        elif kind == "moved":
            state.moved_keys.extend(arrays[0].tolist())
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
    emitted = header.get("identities")
    for i, (epoch, step, global_samples) in enumerate(header["steps"]):
        per_rank = tuple(
            keys[bounds[i * world_size + r] : bounds[i * world_size + r + 1]]
            for r in range(world_size)
        )
        ids = None
        if emitted is not None:
            ids = (int(emitted[i][0]), tuple(int(x) for x in emitted[i][1]))
        out.append(JournalStep(epoch, step, global_samples, per_rank, ids))
    return out
