"""The trainer side of ODBClient(reader="process"): a reader process (odbclient.reader_process)
holds the step stream and collates; this process only copies a staged batch into fresh memory
and wraps it (odbclient.staging has the shared layouts and why).

No thread in this process: next() takes the staged batches the reader process announced
(one non-blocking recv takes every packet waiting) and blocks in poll only when none is
ready. Delivered reports are written into the control page (no syscall, no wake-up) and sent
by the reader process; a flush request is one packet. If the reader process dies, the socket
pair's EOF ends any wait and next() raises ReaderProcessError with its exit status.
"""

from __future__ import annotations

import array
import contextlib
import mmap
import os
import pickle
import queue
import select
import signal
import socket as socketlib
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from odbclient.connect import Failure
from odbclient.errors import (
    ClientClosedError,
    DaemonTimeoutError,
    ProtocolError,
    ReaderProcessError,
)
from odbclient.trainer.batch import Batch
from odbclient.trainer.staging import END_JOB, FLUSH, MEASURED, ControlPage, Report, staged_batch
from odbclient.trainer.stream import TrainerWorld, Welcome, daemon_says

_START_ALLOWANCE_S = 60.0  # the reader process imports numpy and torch before it connects
_EXIT_GRACE_S = 5.0  # close(): the reader process sends our last reports and detaches
_RECV_BYTES = 1 << 18
_WAKE = b"W"
_MAX_FDS = 16  # memfds in one packet: at most one per staging slot it announces
_ANCILLARY_BYTES = socketlib.CMSG_SPACE(_MAX_FDS * 4)


class StagedReports:
    """DeliveryReports' interface over the control page: add() writes the running sums there,
    flush() asks the reader process to send them now."""

    def __init__(self, page: ControlPage, send: Callable[[bytes], bool]) -> None:
        self._page, self._send = page, send
        self._reported = self._requested = 0
        self._wait_s = self._compute_s = 0.0
        self._measured: list[tuple[int, int, float]] = []

    def add(self, epoch: int, step: int, *, wait_s: float, compute_s: float) -> int:
        """Records one step handed out; returns how many are not yet asked to be sent."""
        self._reported += 1
        self._wait_s += wait_s
        self._compute_s += compute_s
        self._page.write_report(Report(self._reported, epoch, step, self._wait_s, self._compute_s))
        if self._page.take_parked():  # rare: the first report after a pause
            self._send(_WAKE)
        # 0: the reader process flushes every report_every steps itself, when it wakes for the
        # daemon's next message or its poll_s timer; a request per report_every steps (a
        # syscall and a wake-up) cost more than it saved.
        return 0

    def add_measured(self, epoch: int, step: int, compute_s: float) -> None:
        self._measured.append((epoch, step, compute_s))

    def flush(self) -> None:
        if self._measured:
            if self._send(MEASURED + pickle.dumps(self._measured)):
                self._measured = []
        elif self._reported != self._requested:
            self._send(FLUSH)
        self._requested = self._reported

    def close(self) -> None:
        self.flush()


class StagedStream:
    """One rank's stream through its reader process; take() returns Batch, Welcome, EpochEnd,
    JobEnd, Failure or StreamEnd, like TrainerStream's inbox."""

    def __init__(
        self, *, rank: int, socket: str, peer: socketlib.socket, page: ControlPage,
        process: subprocess.Popen[bytes],
    ) -> None:  # fmt: skip
        self.rank, self.socket = rank, socket
        self._peer, self._page, self._process = peer, page, process
        self.reports = StagedReports(page, self._send)
        self.welcome: Welcome | None = None
        self._ready: deque[tuple[object, ...]] = deque()
        self._slots: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
        self._buffer = bytearray(_RECV_BYTES)
        self._poller = select.poll()
        self._poller.register(peer, select.POLLIN)
        self._consumed = 0
        self._closed = False
        self._gone: Exception | None = None

    @classmethod
    def open(
        cls,
        *,
        rank: int,
        socket: str,
        job_id: str,
        prefetch: int,
        resume: tuple[int, int] | None,
        resume_update: int = 0,
        connect_timeout_s: float,
        world: TrainerWorld,
        report_every: int,
    ) -> StagedStream:
        """Starts the reader process and waits for the daemon's welcome (or its refusal)."""
        mine, theirs = socketlib.socketpair(socketlib.AF_UNIX, socketlib.SOCK_SEQPACKET)
        control_fd = os.memfd_create(f"odbclient-control-{rank}", os.MFD_CLOEXEC)
        try:
            page = ControlPage.create(control_fd)
            args = [
                f"--socket={socket}", f"--job-id={job_id}", f"--rank={rank}",
                f"--prefetch={prefetch}", f"--peer-fd={theirs.fileno()}",
                f"--control-fd={control_fd}", f"--parent-pid={os.getpid()}",
                f"--num-slots={prefetch + 4}", f"--report-every={report_every}",
                f"--resume-update={resume_update}", f"--connect-timeout-s={connect_timeout_s}",
                f"--world={_blank(world.world_size)},{_blank(world.rank)}",
                f"--world-source={world.source}",
            ]  # fmt: skip
            if resume is not None:
                args.append(f"--resume={resume[0]},{resume[1]}")
            process = subprocess.Popen(
                [sys.executable, "-m", "odbclient.trainer.reader_process", *args],
                pass_fds=(theirs.fileno(), control_fd),
                stdin=subprocess.DEVNULL,
                env=_env_importing_odbclient(),
            )
        finally:
            theirs.close()
            os.close(control_fd)
        stream = cls(rank=rank, socket=socket, peer=mine, page=page, process=process)
        try:
            stream._await_welcome(connect_timeout_s + _START_ALLOWANCE_S)
        except BaseException:
            stream.close()
            raise
        return stream

    def _await_welcome(self, timeout_s: float) -> None:
        try:
            item = self.take(timeout_s)
        except queue.Empty:
            raise DaemonTimeoutError(
                f"the reader process of trainer rank {self.rank} (pid {self._process.pid}) "
                f"got no welcome from odbd on unix:{self.socket} within {timeout_s:g} s; the "
                f"daemon is stuck starting; check its log{daemon_says(self.socket)}"
            ) from None
        if isinstance(item, Failure):
            raise item.error
        if not isinstance(item, Welcome):
            raise ProtocolError(f"odbd sent {item!r} before its welcome; versions differ")
        self.welcome = item

    # --- taking batches ------------------------------------------------------------------------

    def take(self, timeout_s: float) -> object:
        """The next item; raises queue.Empty after `timeout_s`."""
        deadline_s: float | None = None
        while True:
            if self._closed:
                return Failure(self._closed_error())
            if self._ready:
                return self._item(self._ready.popleft())
            if self._gone is not None:
                return Failure(self._gone)
            if self._receive():
                continue
            now_s = time.monotonic()
            if deadline_s is None:
                deadline_s = now_s + timeout_s
            if now_s >= deadline_s:
                raise queue.Empty
            self._poller.poll((deadline_s - now_s) * 1e3)

    def _receive(self) -> bool:
        """Takes one waiting packet (never blocks); False if there was none."""
        while True:
            try:
                size, ancillary, flags, _ = self._peer.recvmsg_into(
                    [self._buffer], _ANCILLARY_BYTES, socketlib.MSG_DONTWAIT
                )
            except BlockingIOError:
                return False
            except OSError as error:
                self._gone = self._process_error(f"{type(error).__name__}: {error}")
                return True
            if not size:
                self._gone = self._process_error("it closed its socket")
                return True
            if flags & socketlib.MSG_TRUNC:
                raise ProtocolError(f"a reader process packet exceeded {_RECV_BYTES} bytes")
            fds_left = deque(_fds_of(ancillary))
            for item in pickle.loads(memoryview(self._buffer)[:size]):
                if item[0] == "slot":
                    self._map_slot(item[1], item[2], fds_left.popleft())
                else:
                    self._ready.append(item)
            return True  # one packet: a second recv would mostly find none (a syscall)

    def _map_slot(self, index: int, size: int, fd: int) -> None:
        # The old mapping, if any, is unmapped once nothing views it: batches are copies.
        try:
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._slots[index] = (mapping, np.frombuffer(mapping, np.uint8))

    def _item(self, item: tuple[object, ...]) -> object:
        kind = item[0]
        if kind == "batch":
            return self._batch(item[1], item[2], item[3])  # type: ignore[arg-type]
        if kind == "failure":
            return Failure(item[1])  # type: ignore[arg-type]
        return item[1]  # "event": Welcome, EpochEnd, JobEnd, StreamEnd

    def _batch(self, slot: int, facts_at: int, facts_nbytes: int) -> Batch:
        mapping, data = self._slots[slot]
        facts = pickle.loads(mapping[facts_at : facts_at + facts_nbytes])
        owned = data[:facts_at].copy()  # fresh memory: the slot is reused after this
        self._consumed += 1
        self._page.set_consumed(self._consumed)
        return staged_batch(owned, facts)

    # --- the reader process --------------------------------------------------------------------

    def send_end_job(self, epoch: int, step: int) -> None:
        """ODBClient.end_job: the reader process sends every report, then the EndJob."""
        self.reports.flush()
        self._peer.send(END_JOB + pickle.dumps((epoch, step)))  # blocking: it must arrive

    def _send(self, packet: bytes) -> bool:
        """One packet to the reader process, never blocking: False if it could not go now (a
        flush request is then pending anyway) or the process is gone (take() says so)."""
        try:
            self._peer.send(packet, socketlib.MSG_DONTWAIT)
        except OSError:
            return False
        return True

    def _process_error(self, how: str) -> Exception:
        if self._closed:
            return self._closed_error()
        try:
            code = self._process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            status = "is still running"
        else:
            status = (
                f"was killed by {signal.Signals(-code).name}"
                if code < 0
                else f"exited with status {code}"
            )
        return ReaderProcessError(
            f"the reader process of trainer rank {self.rank} (pid {self._process.pid}) "
            f"{status} ({how}), so its stream to odbd on unix:{self.socket} is gone; see "
            "this process's stderr for its traceback, then restart the trainer (the daemon "
            'resends undelivered steps); ODBClient(reader="thread") reads in this process'
        )

    def _closed_error(self) -> ClientClosedError:
        return ClientClosedError(
            f"the ODBClient of rank {self.rank} on unix:{self.socket} was closed; iterate a "
            "new ODBClient to go on (the daemon re-sends the steps this one did not deliver)"
        )

    def close(self) -> None:
        """Sends the last reports and ends the reader process (idempotent); the daemon then
        sees the detach."""
        if self._closed:
            return
        self.reports.close()
        self._closed = True
        with contextlib.suppress(OSError):
            self._peer.shutdown(socketlib.SHUT_WR)  # its EOF: flush, detach, exit
        deadline_s = time.monotonic() + _EXIT_GRACE_S
        # Drain what it still sends until its end closes: a full receive queue (~200 KiB of
        # packets, hundreds of unread batches) would block it in send before its last reports
        # and the detach.
        while self._poller.poll(max(0.0, deadline_s - time.monotonic()) * 1e3):
            if not self._discard_packet():
                break
        try:
            self._process.wait(timeout=max(0.0, deadline_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._peer.close()

    def _discard_packet(self) -> bool:
        """Drops one waiting packet (closing the memfds it carries); False at its end."""
        try:
            size, ancillary, _, _ = self._peer.recvmsg_into(
                [self._buffer], _ANCILLARY_BYTES, socketlib.MSG_DONTWAIT
            )
        except BlockingIOError:
            return True
        except OSError:
            return False
        for fd in _fds_of(ancillary):
            os.close(fd)
        return size > 0


def _fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socketlib.SOL_SOCKET and kind == socketlib.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _blank(value: int | None) -> str:
    return "" if value is None else str(value)


def _env_importing_odbclient() -> dict[str, str]:
    """This environment, with the directory odbclient was imported from first on PYTHONPATH
    (a source checkout on sys.path only, as in tests, must reach the child too)."""
    env = dict(os.environ)
    # This file is odbclient/trainer/staged_stream.py: its great-grandparent holds the
    # odbclient package (not `import odbclient`, whose package re-exports ODBClient, an import
    # cycle).
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env
