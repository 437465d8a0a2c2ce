"""Suite-wide rules: a test leaves nothing running or mapped behind, and its timeout follows
the machine (tests/integration/harness.py: slowdown).

`no_leaks` (autouse) snapshots the process's threads, its child processes and odbd's
/dev/shm segments before each test, and after it fails the test that left any of them behind
(named in the error, with what leaked). Things that are shutting down get a short grace. What
leaked is then cleaned up (children killed, segments unlinked) so the next test starts clean
and is not blamed; a thread cannot be stopped, so it only fails the test that started it.
A passed test's LocalCluster directories (logs, sockets, reports in the temp dir) are removed;
a failed test's stay for its logs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.harness import scaled, slowdown

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "odbd-"  # odbd.ingest.arena.segment_name: odbd-<job id>-<node>-<index>
LEAK_GRACE_S = 3.0  # idle machine; scaled. Spent only while something is still there.
_POLL_S = 0.02


# -- timeouts follow the machine ---------------------------------------------------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Scales every test's pytest-timeout (its marker, else the ini `timeout`) by slowdown()."""
    factor = slowdown()
    if factor <= 1.0:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker and marker.args else default
        if seconds > 0:
            item.add_marker(pytest.mark.timeout(seconds * factor), append=False)


# -- nothing left behind -----------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    threads: frozenset[threading.Thread]
    children: frozenset[int]
    segments: frozenset[str]


@dataclass
class Leaks:
    threads: list[threading.Thread] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.threads or self.children or self.segments)


def child_pids() -> set[int]:
    """Live (non-zombie) child processes of this process, whichever thread started them."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue  # the thread ended while we looked
    return {pid for pid in pids if _state(pid) not in (None, "Z")}


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def odbd_segments() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith(SEGMENT_PREFIX)}


def snapshot() -> Snapshot:
    return Snapshot(
        frozenset(threading.enumerate()), frozenset(child_pids()), frozenset(odbd_segments())
    )


# Helpers a library starts once and keeps for the process's life: not a test's leak (and
# killing multiprocessing's resource tracker breaks every later spawn with a warning).
PROCESS_LIFETIME_THREADS = ("tqdm_monitor",)  # tqdm's monitor (HF datasets' progress bars)
PROCESS_LIFETIME_TARGETS = ("PollerCompletionQueue._poll_wrapper",)  # grpc.aio's poller


def _process_lifetime_thread(thread: threading.Thread) -> bool:
    target = getattr(getattr(thread, "_target", None), "__qualname__", "")
    return thread.name in PROCESS_LIFETIME_THREADS or target in PROCESS_LIFETIME_TARGETS


def _process_lifetime_children() -> set[int]:
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid else set()


def leaks_since(before: Snapshot) -> Leaks:
    threads = [
        t
        for t in threading.enumerate()
        if t not in before.threads and t.is_alive() and not _process_lifetime_thread(t)
    ]
    children = sorted(child_pids() - before.children - _process_lifetime_children())
    segments = sorted(s for s in odbd_segments() - before.segments if _ours(s))
    return Leaks(threads, children, segments)


def _ours(segment: str) -> bool:
    """Whether a new segment is this run's. Other runs may share the machine (and /dev/shm), so
    a segment owned by a live process counts only if that process is this one or its child;
    one whose owner died, only if its job id carries this process's pid (ClusterSpec's default
    job ids do: t<pid>x...), since a dead owner's parent cannot be known any more."""
    from odbd.ingest.arena import _live_owner

    owner = _live_owner(str(SHM_DIR / segment))
    if owner is not None:
        return owner == os.getpid() or _is_descendant(owner)
    return re.search(rf"(?<!\d){os.getpid()}(?!\d)", segment) is not None


def _is_descendant(pid: int) -> bool:
    me = os.getpid()
    for _ in range(64):  # a process tree is never that deep; guards against a pid cycle
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid == me:
            return True
        if pid <= 1:
            return False
    return False


def wait_for_leaks(before: Snapshot, grace_s: float) -> Leaks:
    """What is still left after `grace_s` for threads, processes and daemons to finish."""
    deadline = time.monotonic() + grace_s
    while True:
        leaks = leaks_since(before)
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(_POLL_S)


def describe_leaks(test: str, leaks: Leaks) -> str:
    parts = [f"{test} left behind:"]
    for t in leaks.threads:
        target = getattr(t, "_target", None)
        what = getattr(target, "__qualname__", "") if target is not None else ""
        parts.append(
            f"  thread {t.name!r}{' (daemon)' if t.daemon else ''}"
            + (f" running {what}" if what else "")
        )
    for pid in leaks.children:
        parts.append(f"  child process {pid}: {_cmdline(pid)}")
    for name in leaks.segments:
        parts.append(f"  shm segment {SHM_DIR / name}")
    parts.append(
        "Stop what the test started before it returns (close clients, stop clusters, join "
        "threads, wait for processes); the children were killed and the segments unlinked."
    )
    return "\n".join(parts)


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "(gone)"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:300]


def clean_up(leaks: Leaks) -> None:
    for pid in leaks.children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    for name in leaks.segments:
        try:
            (SHM_DIR / name).unlink()
        except FileNotFoundError:
            pass


# -- cluster directories ------------------------------------------------------------------------

_CALL_REPORT = pytest.StashKey[pytest.TestReport]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    if report.when == "call":
        item.stash[_CALL_REPORT] = report
    return report


def cluster_dirs() -> set[str]:
    """This run's LocalCluster directories (odbd.demo.cluster: odbd-<job id>-XXXX in the temp
    dir, job ids t<pid>x...): daemon and trainer logs, unix sockets, reports."""
    mine = re.compile(rf"odbd-t{os.getpid()}x\d+-")
    return {name for name in os.listdir(tempfile.gettempdir()) if mine.match(name)}


def remove_cluster_dirs(names: set[str]) -> None:
    """A passed test's cluster directories go (a failed one's stay, for its logs)."""
    for name in names:
        shutil.rmtree(os.path.join(tempfile.gettempdir(), name), ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    before, dirs_before = snapshot(), cluster_dirs()
    yield
    leaks = wait_for_leaks(before, scaled(LEAK_GRACE_S))
    if leaks:
        clean_up(leaks)
        pytest.fail(describe_leaks(request.node.nodeid, leaks), pytrace=False)
    report = request.node.stash.get(_CALL_REPORT, None)
    if report is not None and report.passed:
        remove_cluster_dirs(cluster_dirs() - dirs_before)
