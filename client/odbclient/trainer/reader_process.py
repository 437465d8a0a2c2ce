"""The reader process of one trainer rank (ODBClient(reader="process")): it holds the step
stream to the daemon, collates each step into a staging slot and tells the trainer over a
socket pair; it sends the Delivered reports the trainer writes into the control page
(odbclient.staging has the layouts and the packets).

    python -m odbclient.trainer.reader_process --peer-fd N --control-fd N --parent-pid P ...

One thread: a poll over the daemon's socket and the trainer's. Its life is tied to the
trainer's: it exits when the trainer's end of the socket pair closes (close(), or the trainer
died) and, checked at least once a second, when its parent is no longer the trainer (a forked
child of the trainer holding the socket's other end would hide the EOF). SIGINT is ignored:
a Ctrl-C interrupts the trainer, which then closes this process.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import pickle
import select
import signal
import socket as socketlib
import sys
import time
from typing import Any

import numpy as np
import torch

from odbclient.connect import Failure, StreamEnd, connect_steps
from odbclient.errors import ProtocolError
from odbclient.framing import FrameBuffer
from odbclient.trainer.batch import Batch
from odbclient.trainer.reports import DEFAULT_PARK_AFTER_S, DEFAULT_POLL_S
from odbclient.trainer.staging import (
    CLOSE,
    END_JOB,
    FACTS,
    FLUSH,
    MEASURED,
    PROGRESS,
    ControlPage,
    Report,
    align,
)
from odbclient.trainer.stream import TrainerStream, TrainerWorld, hello_message
from odbclient.wire.odbd.v1 import trainer_pb2

_RECV_BYTES = 1 << 20
_PARKED_POLL_S = 1.0  # parked: still look at the parent this often
_CLOSE_GRACE_S = 2.0  # like TrainerStream.close: the daemon reads our last messages
_MIN_SLOT_BYTES = 1 << 20
_MAX_ITEMS_PER_PACKET = 16  # and so at most 16 memfds (staged_stream._MAX_FDS)


class _Exit(Exception):
    """The trainer closed its end or is gone: flush, detach and exit."""


class StagingReader:
    """The loop of the reader process (see the module)."""

    def __init__(
        self,
        stream: TrainerStream,
        peer: socketlib.socket,
        page: ControlPage,
        *,
        num_slots: int,
        report_every: int,
        parent_pid: int,
    ) -> None:
        self.stream, self.peer, self.page = stream, peer, page
        self.num_slots, self.report_every, self.parent_pid = num_slots, report_every, parent_pid
        self._slots: list[tuple[mmap.mmap, np.ndarray] | None] = [None] * num_slots
        self._num_batches = 0  # batches staged so far; batch n goes to slot n % num_slots
        self._items: list[tuple[Any, ...]] = []
        self._fds: list[int] = []  # memfds attached to the next packet
        self._sent = Report(0, 0, 0, 0.0, 0.0)  # the report record as last sent to the daemon
        self._unsent_since_s: float | None = None
        self._last_progress_s = time.monotonic()
        self._measured: list[tuple[int, int, float]] = []
        self._parked = False

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        connection = self.stream._connection
        frames, buffer = FrameBuffer(), bytearray(_RECV_BYTES)
        view = memoryview(buffer)
        poller = select.poll()
        poller.register(connection, select.POLLIN)
        poller.register(self.peer, select.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(self._timeout_s() * 1e3))
                if not ready and os.getppid() != self.parent_pid:
                    raise _Exit
                if self.peer.fileno() in ready:
                    self._on_peer()
                if connection.fileno() in ready:
                    received = connection.recv_into(buffer)
                    if not received:
                        cut = frames.pending_bytes > 0
                        self._stage(Failure(self.stream._broken("the stream ended inside a "
                                    "message")) if cut else StreamEnd())  # fmt: skip
                        self._send_items()
                        return
                    for payload in frames.feed(view[:received]):
                        event = trainer_pb2.TrainerEvent.FromString(payload)
                        if event.HasField("refusal"):
                            self._stage(Failure(self.stream._refusal(event.refusal)))
                            self._send_items()
                            return
                        for item in self.stream._handle(event):
                            self._stage(item)
                    self._send_items()
                self._flush_reports(force=False)
        except _Exit:
            self._detach()
        except OSError as error:
            self._fail(self.stream._broken(f"{type(error).__name__}: {error}"))
        except Exception as exc:  # bad data or a bug: the trainer must see it, not hang
            self._fail(exc)

    def _fail(self, error: Exception) -> None:
        with contextlib.suppress(OSError):
            self._stage(Failure(error))
            self._send_items()

    def _timeout_s(self) -> float:
        """Until reports are due; poll_s while they flow; parked (1 s) once they stopped."""
        now_s = time.monotonic()
        if self._unsent_since_s is not None:
            return self._unpark(max(0.0, self._unsent_since_s + DEFAULT_POLL_S - now_s))
        if now_s - self._last_progress_s < DEFAULT_PARK_AFTER_S:
            return self._unpark(DEFAULT_POLL_S)
        if not self._parked:
            self._parked = True
            self.page.set_parked(True)
        if self.page.read_report().reported != self._sent.reported:
            return self._unpark(0.0)  # a report came before it could see the flag
        return _PARKED_POLL_S

    def _unpark(self, timeout_s: float) -> float:
        if self._parked:  # polling again: the trainer need not wake us
            self._parked = False
            self.page.set_parked(False)
        return timeout_s

    def _on_peer(self) -> None:
        """What the trainer sent: flush requests, step times, or its end (EOF)."""
        while True:
            try:
                packet = self.peer.recv(1 << 16, socketlib.MSG_DONTWAIT)
            except BlockingIOError:
                return
            if not packet or packet[:1] == CLOSE:
                raise _Exit
            if packet[:1] == MEASURED:
                self._measured.extend(pickle.loads(packet[1:]))
                self._flush_reports(force=True)
            elif packet[:1] == FLUSH:
                self._flush_reports(force=True)
            elif packet[:1] == END_JOB:
                self._flush_reports(force=True)
                self.stream.send_end_job(*pickle.loads(packet[1:]))

    def _detach(self) -> None:
        """The trainer closed: its last reports, then the daemon's detach (TrainerStream.close)."""
        connection = self.stream._connection
        with contextlib.suppress(OSError):
            self._flush_reports(force=True)
            connection.shutdown(socketlib.SHUT_WR)
            connection.settimeout(_CLOSE_GRACE_S)
            while connection.recv(_RECV_BYTES):
                pass

    # --- reports -------------------------------------------------------------------------------

    def _flush_reports(self, *, force: bool) -> None:
        report = self.page.read_report()
        unsent = report.reported - self._sent.reported
        now_s = time.monotonic()
        if not unsent:
            return
        self._last_progress_s = now_s
        if self._unsent_since_s is None:
            self._unsent_since_s = now_s
        if not (
            force or unsent >= self.report_every or now_s - self._unsent_since_s >= DEFAULT_POLL_S
        ):
            return
        delivered = trainer_pb2.Delivered(
            epoch=report.epoch,
            step=report.step,
            wait_s=report.wait_s - self._sent.wait_s,
            compute_s=report.compute_s - self._sent.compute_s,
            steps=unsent,
        )
        for epoch, step, compute_s in self._measured:
            delivered.measured.add(epoch=epoch, step=step, compute_s=compute_s)
        self._measured.clear()
        self._sent, self._unsent_since_s = report, None
        self.stream._send(trainer_pb2.TrainerMessage(delivered=delivered))

    # --- staging -------------------------------------------------------------------------------

    def _stage(self, item: object) -> None:
        if isinstance(item, Failure):
            self._items.append(("failure", _picklable(item.error)))
        elif isinstance(item, Batch):
            self._stage_batch(item)
        else:
            self._items.append(("event", item))
        if len(self._items) >= _MAX_ITEMS_PER_PACKET:
            self._send_items()

    def _stage_batch(self, batch: Batch) -> None:
        slot = self._num_batches % self.num_slots
        self._await_slot()
        arrays, at = [], 0
        layout: list[tuple[object, ...]] = []
        for key, value in batch.tensors.items():
            if not isinstance(value, torch.Tensor):
                layout.append((key, value))
                continue
            bf16 = value.dtype == torch.bfloat16
            array = (value.view(torch.int16) if bf16 else value).contiguous().numpy()
            dtype = "bfloat16" if bf16 else array.dtype.name
            layout.append((key, dtype, tuple(array.shape), at, array.nbytes))
            arrays.append((at, array))
            at = align(at + array.nbytes)
        facts = pickle.dumps(
            (
                tuple(layout),
                tuple(getattr(batch, name) for name in FACTS),
                tuple(getattr(batch.progress, name) for name in PROGRESS),
            ),
            pickle.HIGHEST_PROTOCOL,
        )
        data = self._slot(slot, at + len(facts))
        for offset, array in arrays:
            data[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
        data[at : at + len(facts)] = np.frombuffer(facts, np.uint8)
        self._items.append(("batch", slot, at, len(facts)))
        self._num_batches += 1

    def _await_slot(self) -> None:
        """Waits until the trainer has copied out the batch that used this slot before (rare:
        the daemon pushes at most prefetch batches ahead of the Delivered reports)."""
        while self._num_batches - self.page.consumed() >= self.num_slots:
            self._send_items()  # the trainer may be waiting for exactly these
            if select.select([self.peer], [], [], DEFAULT_POLL_S)[0]:
                self._on_peer()
            self._flush_reports(force=False)

    def _slot(self, index: int, nbytes: int) -> np.ndarray:
        """Slot `index` with room for `nbytes`; a new, bigger memfd if it had less."""
        current = self._slots[index]
        if current is not None and len(current[0]) >= nbytes:
            return current[1]
        size = max(_MIN_SLOT_BYTES, nbytes, 2 * len(current[0]) if current else 0)
        fd = os.memfd_create(f"odbclient-staging-{index}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
        self._slots[index] = (mapping, np.frombuffer(mapping, np.uint8))
        self._items.append(("slot", index, size))
        self._fds.append(fd)
        return self._slots[index][1]  # type: ignore[index]

    def _send_items(self) -> None:
        if not self._items:
            return
        packet = pickle.dumps(self._items, pickle.HIGHEST_PROTOCOL)
        if self._fds:
            socketlib.send_fds(self.peer, [packet], self._fds)
            for fd in self._fds:
                os.close(fd)
        else:
            self.peer.send(packet)
        self._items, self._fds = [], []


def _picklable(error: Exception) -> Exception:
    """The error itself if it survives pickling, else a ProtocolError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return ProtocolError(f"{type(error).__name__}: {error}")
    return error


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="odbclient.trainer.reader_process")
    for name in ("--socket", "--job-id", "--world-source"):
        p.add_argument(name, default="")
    for name in ("--rank", "--prefetch", "--peer-fd", "--control-fd", "--parent-pid"):
        p.add_argument(name, type=int, required=True)
    for name in ("--num-slots", "--report-every", "--resume-update"):
        p.add_argument(name, type=int, default=0)
    p.add_argument("--resume", default="", help="EPOCH,STEP")
    p.add_argument("--world", default="", help="SIZE,RANK (either may be empty)")
    p.add_argument("--connect-timeout-s", type=float, default=60.0)
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    peer = socketlib.socket(fileno=args.peer_fd)
    if os.getppid() != args.parent_pid:
        return 0  # the trainer died while this process started
    try:
        page = ControlPage.attach(args.control_fd)
        stream = TrainerStream(
            rank=args.rank,
            socket=args.socket,
            connection=connect_steps(args.socket, timeout_s=args.connect_timeout_s),
            prefetch=args.prefetch,
        )
    except Exception as exc:
        peer.send(pickle.dumps([("failure", _picklable(exc))]))
        return 1
    size, _, rank = args.world.partition(",")
    resume = tuple(int(x) for x in args.resume.split(",")) if args.resume else None
    stream._send(
        hello_message(
            rank=args.rank,
            job_id=args.job_id,
            prefetch=args.prefetch,
            resume=resume,  # type: ignore[arg-type]
            resume_update=args.resume_update,
            world=TrainerWorld(
                int(size) if size else None, int(rank) if rank else None, args.world_source
            ),  # fmt: skip
        )
    )
    reader = StagingReader(
        stream,
        peer,
        page,
        num_slots=args.num_slots,
        report_every=args.report_every,
        parent_pid=args.parent_pid,
    )
    reader.run()
    with contextlib.suppress(OSError):
        stream._connection.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
