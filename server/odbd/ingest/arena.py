"""The node's shared-memory arena, daemon side: create, allocate, free, reclaim, unlink.

The byte layouts and the attach side live in `odbclient.shm`. Only the daemon creates and
unlinks segments; it is a single-threaded asyncio process, so the allocator takes no locks.
Allocator state (free lists, live allocations) lives in daemon memory, never in shm, so a
producer killed mid-write can only leave garbage sample bytes, which `free` never reads.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from odbclient.alloc import FreeList
from odbclient.shm import (
    SEGMENT_HEADER_BYTES,
    SHM_DIR,
    Allocation,
    SegmentHeader,
    ShmLayoutError,
    align_up,
)
from odbd.errors import ConfigError, InvariantError, OdbdError

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# A segment without a header younger than this is being created by a daemon starting now (it
# reserves every page before it writes the header), not left half-made by a dead one.
_CREATING_S = 30.0
_ONE_DAEMON = (
    "two daemons cannot share a node's arena: give each daemon of a job its own --node-rank "
    "(NODE_RANK), or this one another --job-id"
)


class ArenaInUseError(OdbdError):
    """A live daemon already owns the shm segments of this job and node rank."""


class ShmSpaceError(OdbdError):
    """/dev/shm cannot hold the arena that --shm-size asks for."""


class SampleTooLargeError(OdbdError, ValueError):
    """A sample is larger than any segment of the arena, so waiting would never help."""


def segment_name(job_id: str, node_rank: int, index: int) -> str:
    return f"odbd-{job_id}-{node_rank}-{index}"


@dataclass(slots=True)
class _Segment:
    name: str
    path: str
    buf: memoryview  # the whole mapping, header included
    free: FreeList
    live: dict[int, int] = field(default_factory=dict)  # offset -> reserved bytes


class Arena:
    """One bounded arena per node daemon: `capacity_bytes` of allocatable shm in a few segments.

    `capacity_bytes` counts allocatable bytes; every segment file adds a 4 KiB header. A sample
    must fit in one segment, so the default is a single segment; `max_segment_bytes` splits the
    arena when /dev/shm or the operator wants smaller files.
    """

    def __init__(self, segments: list[_Segment], reclaimed: list[str]) -> None:
        self._segments = {s.name: s for s in segments}
        self._used_bytes = 0
        self._closed = False
        self.reclaimed = reclaimed  # stale segment names removed when this arena was created

    @classmethod
    def create(
        cls,
        job_id: str,
        node_rank: int,
        capacity_bytes: int,
        *,
        max_segment_bytes: int | None = None,
        shm_dir: str = SHM_DIR,
    ) -> Arena:
        """Reclaims stale segments of the job, then creates this node's segments (mode 0600)."""
        sizes = _segment_sizes(job_id, node_rank, capacity_bytes, max_segment_bytes)
        reclaimed = reclaim_stale(job_id, node_rank=node_rank, shm_dir=shm_dir)
        segments: list[_Segment] = []
        try:
            for index, size in enumerate(sizes):
                name = segment_name(job_id, node_rank, index)
                header = _new_header(job_id, node_rank, index, len(sizes), size)
                segments.append(_create_segment(shm_dir, name, header))
        except BaseException:
            for segment in segments:
                _unlink_quietly(segment.path)
            raise
        return cls(segments, reclaimed)

    @property
    def segment_names(self) -> tuple[str, ...]:
        return tuple(self._segments)

    @property
    def capacity_bytes(self) -> int:
        return sum(len(s.buf) - SEGMENT_HEADER_BYTES for s in self._segments.values())

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def num_allocations(self) -> int:
        return sum(len(s.live) for s in self._segments.values())

    @property
    def largest_free_bytes(self) -> int:
        """The largest allocation that would succeed now (fragmentation shows as a gap to free)."""
        return max(s.free.largest() for s in self._segments.values())

    def allocate(self, nbytes: int) -> Allocation | None:
        """Reserves align_up(nbytes) bytes; None when full (backpressure: wait for a free)."""
        if nbytes < 1:
            raise InvariantError(f"allocations need at least one byte, asked for {nbytes}")
        size = align_up(nbytes)
        for segment in self._segments.values():
            offset = segment.free.take(size)
            if offset is not None:
                segment.live[offset] = size
                self._used_bytes += size
                return Allocation(segment.name, offset, nbytes)
        if size > max(len(s.buf) - SEGMENT_HEADER_BYTES for s in self._segments.values()):
            raise SampleTooLargeError(
                f"a sample of {nbytes} bytes is larger than any shm segment of the arena "
                f"({self.capacity_bytes} bytes in {len(self._segments)} segments), so it can "
                "never be ingested; raise --shm-size"
            )
        return None

    def free(self, allocation: Allocation) -> None:
        """Returns an allocation; its bytes may be garbage (a producer died mid-write)."""
        segment = self._segments.get(allocation.segment)
        size = None if segment is None else segment.live.pop(allocation.offset, None)
        if segment is None or size != align_up(allocation.length):
            raise InvariantError(f"free of {allocation}, which this arena did not hand out")
        segment.free.give(allocation.offset, size)
        self._used_bytes -= size

    def view(self, allocation: Allocation) -> memoryview:
        segment = self._segments[allocation.segment]
        return segment.buf[allocation.offset : allocation.offset + allocation.length]

    def close(self) -> None:
        """Unlinks every segment, then unmaps those no view still uses (idempotent).

        A mapping with live views (BufferError on release) stays mapped until the process
        exits: unmapping under a view would turn its next read into a segfault.
        """
        if self._closed:
            return
        self._closed = True
        for segment in self._segments.values():
            _unlink_quietly(segment.path)
            mapping = segment.buf.obj
            segment.buf.release()  # slices handed out keep their own reference to the mapping
            try:
                mapping.close()  # type: ignore[attr-defined]  # an mmap.mmap
            except BufferError:
                pass

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reclaim_stale(
    job_id: str, *, node_rank: int | None = None, shm_dir: str = SHM_DIR
) -> list[str]:
    """Unlinks the job's segments whose owner daemon is dead; returns their names.

    With `node_rank`, only that node rank's segments are considered, and one owned by a live
    daemon raises ArenaInUseError. Other node ranks' segments are never touched: on a shared
    host (a local multi-node demo) another daemon may be creating its segment right now, and
    one whose header is not written yet would look stale. A dead daemon's segments are
    reclaimed when a daemon of its node rank starts again.
    """
    pattern = re.compile(rf"odbd-{re.escape(job_id)}-(\d+)-\d+")
    reclaimed = []
    for path in sorted(Path(shm_dir).glob(f"odbd-{job_id}-*")):
        match = pattern.fullmatch(path.name)
        if match is None:
            continue  # another job whose id extends ours, e.g. "a-1" for "a"
        if node_rank is not None and int(match.group(1)) != node_rank:
            continue
        try:
            owner = _live_owner(str(path))
        except PermissionError:
            owner = -1  # another user's segment: we can neither read nor unlink it
        if owner is None and _being_created(path):
            if node_rank is not None:
                raise ArenaInUseError(
                    f"shm segment {path.name} is being created right now by another odbd of "
                    f"job {job_id!r}, node rank {node_rank}; {_ONE_DAEMON}"
                )
            continue
        if owner is None:
            _unlink_quietly(str(path))
            reclaimed.append(path.name)
        elif node_rank is not None and int(match.group(1)) == node_rank:
            raise ArenaInUseError(
                f"shm segment {path.name} belongs to a running odbd "
                f"({'of another user' if owner < 0 else f'pid {owner}'}) of job "
                f"{job_id!r}, node rank {node_rank}; stop that daemon, or: {_ONE_DAEMON}"
            )
    return reclaimed


def _being_created(path: Path) -> bool:
    """No readable header yet, and younger than _CREATING_S: a daemon is creating it now.
    Before, such a segment was unlinked as stale, so two daemons started at once with the same
    job and node rank unlinked each other's segments and both failed with a traceback."""
    try:
        with open(path, "rb") as f:
            SegmentHeader.unpack(f.read(SEGMENT_HEADER_BYTES), name=path.name)
        return False
    except FileNotFoundError:
        return False
    except ShmLayoutError:
        return time.time() - path.stat().st_mtime < _CREATING_S


def live_owners(job_id: str, node_rank: int, *, shm_dir: str = SHM_DIR) -> list[int]:
    """Pids of the running daemons that own segments of `job_id`'s node `node_rank` here."""
    pattern = re.compile(rf"odbd-{re.escape(job_id)}-{node_rank}-\d+")
    owners = set()
    for path in Path(shm_dir).glob(f"odbd-{job_id}-{node_rank}-*"):
        if pattern.fullmatch(path.name) is None:
            continue
        try:
            owner = _live_owner(str(path))
        except PermissionError:
            continue  # another user's: not a daemon of ours
        if owner is not None:
            owners.add(owner)
    return sorted(owners)


def _live_owner(path: str) -> int | None:
    """The pid of the live daemon owning a segment, or None when it is stale or half-created.

    A half-created segment (no magic yet) is treated as stale: the only process that could be
    writing it is another daemon of the same job and node rank, which is itself the error.
    """
    try:
        with open(path, "rb") as f:
            header = SegmentHeader.unpack(f.read(SEGMENT_HEADER_BYTES), name=path)
    except (ShmLayoutError, FileNotFoundError):
        return None
    return header.owner_pid if _owner_runs(header) else None


def _owner_runs(header: SegmentHeader) -> bool:
    """The segment's daemon still runs: same boot, and its pid has the same start time."""
    if header.boot_id != _boot_id():
        return False
    return _process_start_ticks(header.owner_pid) == header.owner_start_ticks


def _process_start_ticks(pid: int) -> int | None:
    """Start time of a running, non-zombie process (clock ticks since boot), None otherwise."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    # fields[0] is field 3 (state) of proc(5); starttime is field 22. Zombies are dead daemons.
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))
    except (OSError, ValueError):
        return b"\x00" * 16


def _segment_sizes(
    job_id: str, node_rank: int, capacity_bytes: int, max_segment_bytes: int | None
) -> list[int]:
    """Allocatable bytes of each segment, each a multiple of the allocation alignment."""
    if not _JOB_ID.fullmatch(job_id):
        raise ConfigError(
            f"job id {job_id!r} cannot name shm segments; use 1-64 letters, digits, '_', '.' "
            "or '-', starting with a letter or digit (--job-id)"
        )
    if node_rank < 0:
        raise ConfigError(f"node rank must be >= 0, got {node_rank}; check --node-rank")
    # Round down: --shm-size is a bound on /dev/shm use (plus one 4 KiB header per segment).
    total, per_segment = capacity_bytes & -64, (max_segment_bytes or capacity_bytes) & -64
    if total < 64 or per_segment < 64:
        raise ConfigError(
            f"shm arena of {capacity_bytes} bytes (segments of {per_segment}) cannot hold a "
            "sample; pass --shm-size of at least the largest encoded sample"
        )
    full, rest = divmod(total, per_segment)
    return [per_segment] * full + ([rest] if rest else [])


def _new_header(
    job_id: str, node_rank: int, index: int, num_segments: int, size: int
) -> SegmentHeader:
    pid = os.getpid()
    start_ticks = _process_start_ticks(pid)
    assert start_ticks is not None, "a running process always has /proc/self/stat"
    return SegmentHeader(
        capacity_bytes=SEGMENT_HEADER_BYTES + size,
        owner_pid=pid,
        owner_start_ticks=start_ticks,
        boot_id=_boot_id(),
        created_unix_ns=time.time_ns(),
        node_rank=node_rank,
        segment_index=index,
        num_segments=num_segments,
        job_id=job_id,
    )


def _create_segment(shm_dir: str, name: str, header: SegmentHeader) -> _Segment:
    """Creates, reserves, maps and stamps one segment file; unlinks it again on failure."""
    path = os.path.join(shm_dir, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ArenaInUseError(
            f"shm segment {name} appeared while this daemon started: another odbd of the same "
            f"job and node rank is starting; {_ONE_DAEMON}"
        ) from None
    try:
        os.fchmod(fd, 0o600)  # the umask could only remove bits; make the mode exact anyway
        _reserve(fd, name, header.capacity_bytes, shm_dir)
        buf = memoryview(mmap.mmap(fd, header.capacity_bytes))  # the file we made, not the path
        header.pack_into(buf)
    except BaseException:
        _unlink_if_ours(path, fd)
        raise
    finally:
        os.close(fd)
    region = header.capacity_bytes - SEGMENT_HEADER_BYTES
    return _Segment(name, path, buf, FreeList([SEGMENT_HEADER_BYTES], [region]))


def _reserve(fd: int, name: str, nbytes: int, shm_dir: str) -> None:
    """Allocates every page now: a sparse tmpfs file would SIGBUS on first touch when full."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        stat = os.statvfs(shm_dir)
        holders = describe_shm_holders(odbd_segments(shm_dir, exclude=name), shm_dir)
        raise ShmSpaceError(
            f"{shm_dir} has {stat.f_bavail * stat.f_frsize} bytes free but shm segment {name} "
            f"needs {nbytes}; lower --shm-size or enlarge {shm_dir} (docker --shm-size, "
            f"Kubernetes emptyDir medium Memory sizeLimit){holders}"
        ) from None


@dataclass(frozen=True, slots=True)
class ShmHolder:
    """An odbd segment found in the shm directory, as seen from this process."""

    name: str
    nbytes: int
    owner_pid: int | None  # None: no header we can read (another user's, or half-written)
    alive: bool


def odbd_segments(shm_dir: str, *, exclude: str = "") -> list[ShmHolder]:
    """Every odbd segment in `shm_dir` but `exclude`, with its size and whether its owner runs.

    Said when the arena does not fit: a daemon killed by SIGKILL or the OOM killer leaves its
    segments behind, and only a daemon of the same job and node rank reclaims them by itself.
    """
    holders = []
    for path in sorted(Path(shm_dir).glob("odbd-*")):
        if path.name == exclude:
            continue
        try:
            nbytes = path.stat().st_blocks * 512  # what it takes from tmpfs, not its length
            with open(path, "rb") as f:
                header = SegmentHeader.unpack(f.read(SEGMENT_HEADER_BYTES), name=path.name)
        except FileNotFoundError:
            continue  # unlinked meanwhile
        except (PermissionError, ShmLayoutError):
            holders.append(ShmHolder(path.name, nbytes, None, False))
            continue
        holders.append(ShmHolder(path.name, nbytes, header.owner_pid, _owner_runs(header)))
    return holders


def describe_shm_holders(holders: list[ShmHolder], shm_dir: str) -> str:
    """The part of the out-of-space error that names what odbd itself already holds there."""
    if not holders:
        return ""
    stale = [h for h in holders if h.owner_pid is not None and not h.alive]
    parts = [f"{h.name} ({_mib(h.nbytes)}, {_owner_text(h)})" for h in holders]
    text = f"; odbd segments in {shm_dir} hold {_mib(sum(h.nbytes for h in holders))}: "
    text += ", ".join(parts)
    if stale:
        paths = " ".join(os.path.join(shm_dir, h.name) for h in stale)
        text += (
            f". The stale ones were left by daemons that died without cleaning up (SIGKILL, "
            f"the OOM killer); unless a daemon in another container shares {shm_dir}, "
            f"remove them: rm {paths}"
        )
    return text


def _owner_text(holder: ShmHolder) -> str:
    if holder.owner_pid is None:
        return "header unreadable: another user's, or being created"
    if holder.owner_pid == os.getpid():
        return "this daemon's own"
    if holder.alive:
        return f"in use by running odbd pid {holder.owner_pid}"
    return f"stale: its daemon, pid {holder.owner_pid}, is not running"


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _unlink_if_ours(path: str, fd: int) -> None:
    """Unlinks `path` only if it is still the file open as `fd` (another daemon's file may have
    taken the name)."""
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
