"""The daemon's shm arena: allocation, ownership of segments, and reclaim after a crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odbclient.shm import (
    SEGMENT_HEADER_BYTES,
    SHM_DIR,
    Allocation,
    ArenaView,
    ShmAttachError,
    ShmLayoutError,
    align_up,
    decode,
    encode_into,
    encoded_size,
    read_meta,
)
from odbd.errors import ConfigError, InvariantError
from odbd.ingest.arena import (
    Arena,
    ArenaInUseError,
    SampleTooLargeError,
    describe_shm_holders,
    odbd_segments,
    reclaim_stale,
)

ArenaFactory = Callable[..., Arena]

HOLD_ARENA = """
import sys, time
from odbd.ingest.arena import Arena
arena = Arena.create(sys.argv[1], int(sys.argv[2]), 1 << 16)
print(",".join(arena.segment_names), flush=True)
time.sleep(120)
"""


def unique_job_id() -> str:
    return f"t{os.getpid()}-{uuid.uuid4().hex[:10]}"


def shm_files(job_id: str) -> list[str]:
    return sorted(p.name for p in Path(SHM_DIR).glob(f"odbd-{job_id}-*"))


@pytest.fixture
def job_id() -> Iterator[str]:
    job = unique_job_id()
    yield job
    for name in shm_files(job):  # never leak segments into /dev/shm, even when a test fails
        os.unlink(os.path.join(SHM_DIR, name))


@pytest.fixture
def make_arena(job_id: str) -> Iterator[ArenaFactory]:
    arenas: list[Arena] = []

    def make(capacity_bytes: int, node_rank: int = 0, **kwargs: object) -> Arena:
        arenas.append(Arena.create(job_id, node_rank, capacity_bytes, **kwargs))  # type: ignore[arg-type]
        return arenas[-1]

    yield make
    for arena in arenas:
        arena.close()


def hold_arena_in_subprocess(job_id: str, node_rank: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_ARENA, job_id, str(node_rank)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def allocate(arena: Arena, nbytes: int) -> Allocation:
    allocation = arena.allocate(nbytes)
    assert allocation is not None
    return allocation


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert proc.stdout is not None
    proc.stdout.close()


def test_fill_to_capacity_then_backpressure_then_coalesced_reuse(make_arena: ArenaFactory) -> None:
    arena = make_arena(64 * 16)
    allocations = [allocate(arena, 64) for _ in range(16)]
    assert arena.used_bytes == arena.capacity_bytes == 64 * 16
    assert arena.allocate(1) is None  # full: the caller waits and retries, nothing is dropped
    for allocation in [allocations[5], allocations[7], allocations[4], allocations[6]]:
        arena.free(allocation)
    assert arena.largest_free_bytes == 4 * 64  # four neighbours coalesced into one extent
    assert arena.allocate(4 * 64) is not None
    assert arena.allocate(1) is None


def test_freeing_everything_coalesces_the_whole_region(make_arena: ArenaFactory) -> None:
    arena = make_arena(1 << 16)
    allocations = [allocate(arena, n) for n in (1, 63, 64, 65, 1000, 4096)]
    assert all(a.offset % 64 == 0 for a in allocations)
    assert arena.used_bytes == sum(align_up(a.length) for a in allocations)
    for allocation in allocations[::2][::-1] + allocations[1::2]:
        arena.free(allocation)
    assert arena.used_bytes == 0 and arena.largest_free_bytes == arena.capacity_bytes
    assert arena.allocate(arena.capacity_bytes) is not None


def test_a_sample_larger_than_any_segment_is_an_error_not_backpressure(
    make_arena: ArenaFactory,
) -> None:
    arena = make_arena(4096, max_segment_bytes=2048)
    assert len(arena.segment_names) == 2 and arena.capacity_bytes == 4096
    with pytest.raises(SampleTooLargeError, match="--shm-size"):
        arena.allocate(2049)
    assert arena.allocate(2048) is not None and arena.allocate(2048) is not None


def test_double_free_and_foreign_free_are_invariant_errors(make_arena: ArenaFactory) -> None:
    arena = make_arena(4096)
    allocation = allocate(arena, 100)
    arena.free(allocation)
    with pytest.raises(InvariantError):
        arena.free(allocation)
    with pytest.raises(InvariantError):
        arena.free(Allocation("odbd-elsewhere-0-0", SEGMENT_HEADER_BYTES, 64))


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(st.integers(1, 3000), st.tuples(st.just("free"), st.integers(0, 1000))),
        max_size=80,
    )
)
def test_random_alloc_free_never_overlaps_and_counts_used_bytes(ops: list[object]) -> None:
    job = unique_job_id()
    with Arena.create(job, 0, 16384, max_segment_bytes=6000) as arena:
        live: list[Allocation] = []
        for op in ops:
            if isinstance(op, tuple):
                if live:
                    arena.free(live.pop(op[1] % len(live)))
            else:
                fits = align_up(op) <= arena.largest_free_bytes
                allocation = arena.allocate(op)
                assert (allocation is not None) == fits
                if allocation is not None:
                    live.append(allocation)
            spans = sorted((a.segment, a.offset, a.offset + align_up(a.length)) for a in live)
            for (seg_a, _, end_a), (seg_b, start_b, _) in zip(spans, spans[1:], strict=False):
                assert seg_a != seg_b or end_a <= start_b
            assert all(start % 64 == 0 and start >= SEGMENT_HEADER_BYTES for _, start, _ in spans)
            assert arena.used_bytes == sum(end - start for _, start, end in spans)
        for allocation in live:
            arena.free(allocation)
        assert arena.used_bytes == 0 and arena.largest_free_bytes == 5952  # 6000 & -64
    assert shm_files(job) == []


def test_segments_are_private_and_close_unlinks_them(job_id: str) -> None:
    arena = Arena.create(job_id, 3, 1 << 16, max_segment_bytes=1 << 14)
    assert shm_files(job_id) == [f"odbd-{job_id}-3-{i}" for i in range(4)]
    for name in arena.segment_names:
        assert os.stat(os.path.join(SHM_DIR, name)).st_mode & 0o777 == 0o600
    arena.close()
    arena.close()  # idempotent
    assert shm_files(job_id) == []


def test_close_with_a_live_view_keeps_the_view_readable(job_id: str) -> None:
    arena = Arena.create(job_id, 0, 4096)
    allocation = allocate(arena, 64)
    array = np.frombuffer(arena.view(allocation), np.uint8)
    array[:] = 7
    arena.close()  # unlinks; the mapping stays while `array` lives instead of segfaulting it
    assert shm_files(job_id) == [] and int(array.sum()) == 7 * 64


def test_producer_writes_through_attached_view_and_daemon_decodes(
    make_arena: ArenaFactory,
) -> None:
    arena = make_arena(1 << 16, max_segment_bytes=1 << 15)
    view = ArenaView.attach(arena.segment_names)
    sample = {"input_ids": np.arange(100, dtype=np.int32), "label": np.float32(1.5)}
    allocation = allocate(arena, encoded_size(sample))
    encode_into(view.view(allocation), sample)
    out = decode(arena.view(allocation))
    np.testing.assert_array_equal(out["input_ids"], sample["input_ids"])
    assert view.header(allocation.segment).owner_pid == os.getpid()
    with pytest.raises(ShmLayoutError, match="outside"):
        view.buffer(allocation.segment, 0, 64)


def test_half_written_allocation_of_a_killed_producer_is_freed(make_arena: ArenaFactory) -> None:
    arena = make_arena(4096)
    allocation = allocate(arena, 512)
    arena.view(allocation)[:] = os.urandom(512)
    with pytest.raises(ShmLayoutError):
        read_meta(arena.view(allocation))
    arena.free(allocation)
    assert arena.used_bytes == 0


def test_attaching_a_missing_segment_says_the_daemon_is_gone(job_id: str) -> None:
    with pytest.raises(ShmAttachError, match="reconnect"):
        ArenaView.attach([f"odbd-{job_id}-0-0"])


@pytest.mark.timeout(30)
def test_an_attaching_process_never_unlinks(make_arena: ArenaFactory, job_id: str) -> None:
    arena = make_arena(4096)
    code = "import sys; from odbclient.shm import ArenaView; ArenaView.attach(sys.argv[1:])"
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code, *arena.segment_names],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 0 and result.stderr == ""
    assert shm_files(job_id) == list(arena.segment_names)


@pytest.mark.timeout(30)
def test_segments_of_a_killed_daemon_are_reclaimed_on_start(
    make_arena: ArenaFactory, job_id: str
) -> None:
    proc, names = hold_arena_in_subprocess(job_id)
    kill(proc)
    assert shm_files(job_id) == [names]  # SIGKILL left the segment behind
    arena = make_arena(4096)
    assert arena.reclaimed == [names]
    assert shm_files(job_id) == list(arena.segment_names)


@pytest.mark.timeout(30)
def test_a_second_live_daemon_for_the_same_node_is_refused(
    make_arena: ArenaFactory, job_id: str
) -> None:
    proc, names = hold_arena_in_subprocess(job_id)
    try:
        with pytest.raises(ArenaInUseError, match=rf"{names}.*pid {proc.pid}"):
            make_arena(4096)
        other_node = make_arena(4096, node_rank=1)  # a local multi-node demo shares /dev/shm
        assert reclaim_stale(job_id) == []  # live segments are never reclaimed
        assert shm_files(job_id) == sorted([names, *other_node.segment_names])
    finally:
        kill(proc)
    assert reclaim_stale(job_id) == [names]


def test_the_same_process_cannot_create_a_node_arena_twice(make_arena: ArenaFactory) -> None:
    make_arena(4096)
    with pytest.raises(ArenaInUseError, match=f"pid {os.getpid()}"):
        make_arena(4096)


def test_half_created_segments_are_reclaimed_and_other_jobs_untouched(job_id: str) -> None:
    half = Path(SHM_DIR, f"odbd-{job_id}-0-0")
    longer_job = Path(SHM_DIR, f"odbd-{job_id}-1-0-0")  # job "<job_id>-1", node 0
    half.write_bytes(b"\x00" * 100)
    longer_job.write_bytes(b"\x00" * 100)
    an_hour_ago = time.time() - 3600  # left half-made by a daemon that died creating it
    os.utime(half, (an_hour_ago, an_hour_ago))
    assert reclaim_stale(job_id) == [half.name]
    assert longer_job.exists()


def test_a_segment_being_created_by_a_daemon_of_the_same_node_rank_is_refused_not_unlinked(
    job_id: str,
) -> None:
    """Two daemons started at once with one job and node rank (a NODE_RANK typo): each once
    unlinked the other's header-less segment as stale, and both died with a traceback."""
    creating = Path(SHM_DIR, f"odbd-{job_id}-0-0")
    creating.write_bytes(b"\x00" * 100)  # reserved, header not written yet
    try:
        with pytest.raises(ArenaInUseError, match="is being created right now.*own --node-rank"):
            Arena.create(job_id, 0, 1 << 16)
        assert reclaim_stale(job_id) == []  # another node rank's start-up leaves it alone
        assert creating.exists()
    finally:
        creating.unlink()


LEAVE_ARENA = """
import os, sys
from odbd.ingest.arena import Arena
Arena.create(sys.argv[1], 0, 1 << 16, shm_dir=sys.argv[2])
os._exit(0)  # as SIGKILL or the OOM killer would: no close, the segment stays
"""


@pytest.mark.timeout(60)
def test_the_out_of_space_error_names_odbd_s_own_segments_and_how_to_remove_the_stale(
    tmp_path: Path,
) -> None:
    """A daemon killed by the OOM killer leaves its arena in /dev/shm; the next job's daemon,
    short of space, must say so (only a daemon of the same job and node rank reclaims it)."""
    subprocess.run([sys.executable, "-c", LEAVE_ARENA, "dead-job", str(tmp_path)], check=True)
    mine = Arena.create("this-job", 0, 1 << 16, shm_dir=str(tmp_path))
    (tmp_path / "odbd-garbage-0-0").write_bytes(b"\x00" * 100)  # half-created, or not ours
    try:
        holders = {h.name: h for h in odbd_segments(str(tmp_path), exclude="odbd-this-job-0-1")}
        assert sorted(holders) == ["odbd-dead-job-0-0", "odbd-garbage-0-0", "odbd-this-job-0-0"]
        dead, garbage, own = (holders[n] for n in sorted(holders))
        assert dead.owner_pid not in (None, os.getpid()) and not dead.alive
        assert dead.nbytes >= 1 << 16  # what the segment takes from the filesystem
        assert garbage.owner_pid is None
        assert own.owner_pid == os.getpid() and own.alive
        text = describe_shm_holders(list(holders.values()), str(tmp_path))
        assert f"odbd-dead-job-0-0 (0.1 MiB, stale: its daemon, pid {dead.owner_pid}" in text
        assert "odbd-garbage-0-0 (0.0 MiB, header unreadable" in text
        assert "odbd-this-job-0-0 (0.1 MiB, this daemon's own)" in text
        assert text.endswith(f"remove them: rm {tmp_path}/odbd-dead-job-0-0")  # only the stale
    finally:
        mine.close()
    assert describe_shm_holders([], str(tmp_path)) == ""


@pytest.mark.parametrize(
    ("job", "node_rank", "capacity"),
    [("", 0, 4096), ("a/b", 0, 4096), ("-x", 0, 4096), ("x" * 65, 0, 4096), ("ok", -1, 4096)]
    + [("ok", 0, 63)],
)
def test_invalid_arena_config_is_a_config_error(job: str, node_rank: int, capacity: int) -> None:
    with pytest.raises(ConfigError):
        Arena.create(job, node_rank, capacity)
