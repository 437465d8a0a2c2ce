"""The trainer side of one step channel: hello, welcome, and a reader thread that turns
StepBatch events into ready Batch objects (collated out of shared memory) in an inbox.

Transport (protocol 6): one blocking unix socket to the daemon's step socket, carrying
length-prefixed TrainerMessage / TrainerEvent frames (odbclient.framing). Threads: `_read` runs
on the reader thread, receives whatever arrived (many frames per recv), is the only user of the
arena views and writes the Delivered reports next() queued once they are due
(odbclient.reports); the trainer thread takes from `inbox` and writes reports itself only when
it flushes (`_send`, under a lock). No other thread: gRPC is used only to ask a stalled daemon
why (`daemon_says`), lazily. Every failure on the reader thread reaches the trainer as a
`Failure` item, so a broken stream or bad data raises in next() instead of hanging it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import socket as socketlib
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import grpc
import numpy as np

from odbclient.connect import (
    PROTOCOL_VERSION,
    TRAINER_REFUSALS,
    Failure,
    StreamEnd,
    connect_steps,
    refusal_error,
    start_reader,
)
from odbclient.errors import (
    ClientClosedError,
    DaemonConnectionError,
    DaemonTimeoutError,
    ProtocolError,
)
from odbclient.framing import FrameBuffer, frame
from odbclient.shm import ArenaView, decode, read_meta
from odbclient.trainer.batch import BATCH_FACTS, Batch, Progress, assemble_batch, assemble_progress
from odbclient.trainer.collate import (
    BatchForm,
    Collated,
    KeySchema,
    collate,
    filler_tensors,
    parse_filler_schema,
)
from odbclient.trainer.inbox import Inbox
from odbclient.trainer.reports import DEFAULT_POLL_S, DeliveryReports
from odbclient.trainer.step_collate import SegmentTable, collate_uniform
from odbclient.wire.odbd.v1 import admin_pb2, admin_pb2_grpc, trainer_pb2

_CLOSE_GRACE_S = 2.0  # how long close() lets the daemon read our last messages
_RECV_BYTES = 1 << 20  # one recv takes every frame that arrived, up to this many bytes
_STATUS_TIMEOUT_S = 5.0  # asking a stalled daemon why must not become a second stall


def daemon_says(socket: str, *, timeout_s: float = _STATUS_TIMEOUT_S) -> str:
    """What the daemon's Admin status tells about a stall, as a clause to append to an error
    ("" when the daemon does not answer): its phase, last error and what the round waits on."""
    channel = grpc.insecure_channel(f"unix:{socket}")
    try:
        stub = admin_pb2_grpc.AdminStub(channel)
        reply = stub.Status(admin_pb2.StatusRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return ""
    finally:
        channel.close()
    return "; " + status_clause(reply)


def status_clause(reply: admin_pb2.StatusReply) -> str:
    """One line of the facts of a status reply that explain why no batch comes."""
    parts = [f"the daemon reports phase {reply.phase or 'unknown'}"]
    if reply.last_error:
        parts.append(f"last error: {reply.last_error}")
    if reply.waiting_for:
        parts.append(f"its next round waits because {reply.waiting_for}")
    detached = [r.rank for r in reply.ranks if not r.attached]
    parts.append(
        f"round {reply.round}, epoch {reply.epoch}, {reply.epoch_emitted_samples} of "
        f"{reply.dataset_size} samples emitted this epoch, {reply.buffered_samples} buffered, "
        f"{reply.leased_samples} leased, {reply.producers} producers"
        + (
            f" ({reply.producers_lane_full} waiting for lane space)"
            if reply.producers_lane_full
            else ""
        )
        + (f", local ranks not attached: {detached}" if detached else "")
    )
    return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class TrainerWorld:
    """The trainer process's own view of its world, sent in the hello for the daemon to check
    against its --world; None: unknown (no process group, no launcher variables)."""

    world_size: int | None
    rank: int | None
    source: str  # where the numbers came from, for the daemon's messages


@dataclass(frozen=True, slots=True)
class Welcome:
    job_id: str
    world_size: int
    length_key: str
    loss_scaling: str


@dataclass(frozen=True, slots=True)
class EpochEnd:
    epoch: int
    num_steps: int
    global_num_samples: int
    num_identities: int
    rejected_by_reason: dict[str, int]


@dataclass(frozen=True, slots=True)
class JobEnd:
    reason: str
    failed: bool


# A StepBatch's facts in odbclient.batch.BATCH_FACTS order: the step's own, then the update's.
_STEP_FACTS = ("epoch", "step", "num_samples", "num_tokens", "global_num_samples",
               "global_num_tokens", "sample_ids", "is_idle", "loss_scale")  # fmt: skip
_UPDATE_FACTS = ("update_end", "update_index", "update_num_steps", "update_step",
                 "update_tokens", "update_samples", "update_short", "windowed",
                 "update_per_rank", "update_skip", "update_skipped_after")  # fmt: skip
if BATCH_FACTS != (*_STEP_FACTS, *_UPDATE_FACTS):
    raise ImportError(f"odbclient.stream builds Batch facts as {_STEP_FACTS + _UPDATE_FACTS}, "
                      f"but Batch has {BATCH_FACTS}; update stream.py with batch.py")  # fmt: skip


def _update(step: trainer_pb2.StepBatch) -> tuple[object, ...]:
    """Batch's update fields (_UPDATE_FACTS); a daemon without windows sends none: each step
    is an update."""
    if not step.HasField("update"):
        return (True, step.step, 1, 0, step.global_num_tokens, step.global_num_samples, False,
                False, False, False, 0)  # fmt: skip
    u = step.update
    return (u.end, u.index, u.num_steps, u.step_in_update, u.num_tokens, u.num_samples, u.short,
            True, u.per_rank, u.skip, u.skipped_after)  # fmt: skip


def _progress(p: trainer_pb2.Progress) -> Progress:
    """Progress from its message, fields in PROGRESS_FIELDS order."""
    return assemble_progress(
        (
            p.epoch_steps_estimate,
            p.epoch_steps_exact,
            p.epoch_sample_fraction,
            p.epoch_token_fraction,
            p.epoch_tokens,
            p.job_fraction,
            p.job_steps_estimate,
        )
    )


# The step's per-sample references are little-endian arrays; on a little-endian host a
# memoryview cast reads them in one C call (np.frombuffer(...).tolist() is ~2x slower).
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


_INT_ARRAYS = {"I": ("<u4", 4), "Q": ("<u8", 8), "q": ("<i8", 8)}  # struct code: numpy, size


def int_list(data: bytes, code: Literal["I", "Q", "q"]) -> list[int]:
    """The little-endian integers of `data` (struct code "I" u32, "Q" u64, "q" i64) as a
    list; ProtocolError if its length is no multiple of their size."""
    dtype, size = _INT_ARRAYS[code]
    if len(data) % size:
        raise ProtocolError(
            f"odbd sent a step reference array of {len(data)} bytes, not a multiple of "
            f"{size}: the daemon and odbclient versions differ; install the same odbd release"
        )
    if _LITTLE_ENDIAN_HOST:
        return memoryview(data).cast(code).tolist()
    return np.frombuffer(data, dtype).tolist()


def hello_message(
    *,
    rank: int,
    job_id: str,
    prefetch: int,
    resume: tuple[int, int] | None,
    resume_update: int,
    world: TrainerWorld,
) -> trainer_pb2.TrainerMessage:
    """The first message of a step stream: who this rank is and where it resumes."""
    hello = trainer_pb2.TrainerHello(
        protocol_version=PROTOCOL_VERSION, job_id=job_id, rank=rank, prefetch=prefetch
    )
    if resume is not None:
        hello.resume, (hello.resume_epoch, hello.resume_step) = True, resume
        hello.resume_update = resume_update
    if world.world_size is not None:
        hello.world_size = world.world_size
    if world.rank is not None:
        hello.launcher_rank = world.rank
    hello.world_source = world.source
    return trainer_pb2.TrainerMessage(hello=hello)


class TrainerStream:
    """One rank's connection; `inbox` yields Batch, EpochEnd, JobEnd, Failure or StreamEnd."""

    def __init__(
        self, *, rank: int, socket: str, connection: socketlib.socket, prefetch: int
    ) -> None:
        self.rank, self.socket = rank, socket
        # Batches are visible at once; a waiting trainer is woken about twice per recv, not
        # once per step (odbclient.inbox; issue 15). _put bounds it.
        self.inbox = Inbox()
        self._inbox_bound = prefetch + 4  # the daemon pushes <= prefetch steps, plus markers
        self.welcome: Welcome | None = None
        self._connection = connection
        self._send_lock = threading.Lock()  # the trainer thread and close() both write
        # A pipe that ends the reader's wait when a report comes after a pause (reports.py).
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.reports = DeliveryReports(self._send, wake=self._wake_reader)
        self._closing = threading.Event()
        self._arena: ArenaView | None = None
        self._segment_names: list[str] = []
        self._segment_table = SegmentTable((), (), ())
        self._pads: dict[str, float] = {}
        self._form = BatchForm()  # from the welcome
        self._last_schema: tuple[KeySchema, ...] = ()  # of the last real batch: idle fillers
        self._reader: threading.Thread | None = None
        # Set by send_end_job before the EndJob leaves: steps from it on are never read.
        self._end_point: tuple[int, int] | None = None

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
    ) -> TrainerStream:
        """Connects, sends the hello and waits for the welcome (or raises the refusal)."""
        stream = cls(
            rank=rank,
            socket=socket,
            connection=connect_steps(socket, timeout_s=connect_timeout_s),
            prefetch=prefetch,
        )
        hello = hello_message(
            rank=rank,
            job_id=job_id,
            prefetch=prefetch,
            resume=resume,
            resume_update=resume_update,
            world=world,
        )
        try:
            stream._send(hello)
            stream._reader = start_reader(stream._read, name=f"odbclient-rank{rank}")
            stream._await_welcome(connect_timeout_s)
        except BaseException:
            stream.close()
            raise
        return stream

    def take(self, timeout_s: float) -> object:
        """The next inbox item; raises queue.Empty after `timeout_s`."""
        return self.inbox.take(timeout_s)

    def close(self) -> None:
        """Ends the stream and the reader thread (idempotent); arena mappings stay (shm.py)."""
        if self._closing.is_set():
            return
        self.reports.close()
        self._closing.set()
        # Half-close first: the daemon reads the last Delivered, then the end of the stream
        # (the detach), and closes its side, which ends our reader. Closing at once could
        # drop the last Delivered, leaving the daemon waiting for a step that was trained.
        with contextlib.suppress(OSError):
            self._connection.shutdown(socketlib.SHUT_WR)
        self._join_reader(_CLOSE_GRACE_S)
        with contextlib.suppress(OSError):
            self._connection.shutdown(socketlib.SHUT_RDWR)  # wakes a reader still in recv
        self._join_reader(5.0)
        self._connection.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self._wake_waiter()

    def _wake_reader(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a wake is pending already
            os.write(self._wake_write, b"\0")

    def _join_reader(self, timeout_s: float) -> None:
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=timeout_s)

    def send_end_job(self, epoch: int, step: int) -> None:
        """ODBClient.end_job: every Delivered report first, then the EndJob (trainer.proto).

        The end point is set before the EndJob leaves: once the daemon has it, it gives the
        shared memory of every step from there on back to its producers (sent or not), so the
        reader must not read those steps any more (`_steps`)."""
        self.reports.flush()
        self._end_point = (epoch, step)
        self._send(trainer_pb2.TrainerMessage(end_job=trainer_pb2.EndJob(epoch=epoch, step=step)))

    def _send(self, message: trainer_pb2.TrainerMessage) -> None:
        """Writes one message (any thread). A broken socket is not raised here: the reader
        sees it too and queues the failure that next() raises with the reason."""
        data = frame(message.SerializeToString())
        with self._send_lock, contextlib.suppress(OSError):
            self._connection.sendall(data)

    def _wake_waiter(self) -> None:
        """Ends a next() that another thread is blocked in: the reader puts nothing more, so
        without this it would wait out its whole deadline (600 s by default). Batches still
        queued are dropped: they were never reported Delivered, so the daemon re-sends them
        to the rank's next client."""
        closed = Failure(
            ClientClosedError(
                f"the ODBClient of rank {self.rank} on unix:{self.socket} was closed; iterate a "
                "new ODBClient to go on (the daemon re-sends the steps this one did not deliver)"
            )
        )
        self.inbox.clear()
        self.inbox.put(closed)

    def _await_welcome(self, timeout_s: float) -> None:
        try:
            item = self.inbox.take(timeout_s)
        except queue.Empty:
            raise DaemonTimeoutError(
                f"odbd on unix:{self.socket} accepted the connection of rank {self.rank} but "
                f"sent no welcome within {timeout_s:g} s; the daemon is stuck starting; check "
                f"its log{daemon_says(self.socket)}"
            ) from None
        if isinstance(item, Failure):
            raise item.error
        if not isinstance(item, Welcome):
            raise ProtocolError(f"odbd sent {item!r} before its welcome; versions differ")

    # --- reader thread -------------------------------------------------------------------------

    def _read(self) -> None:
        frames, buffer = FrameBuffer(), bytearray(_RECV_BYTES)
        view = memoryview(buffer)
        poller = select.poll()
        poller.register(self._connection, select.POLLIN)
        poller.register(self._wake_read, select.POLLIN)
        try:
            while True:
                # Wait for data, or until queued Delivered reports are due (odbclient.reports).
                timeout_s = self.reports.poll_timeout_s()
                ready = dict(poller.poll(None if timeout_s is None else timeout_s * 1e3))
                if self._wake_read in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_read, 64)
                self.reports.flush_due()
                if self._connection.fileno() not in ready:
                    continue
                received = self._connection.recv_into(buffer)
                if not received:
                    break
                # A waiting trainer is woken after the first item of this recv and after its
                # last (odbclient.inbox), not after each one.
                first = True
                try:
                    for payload in frames.feed(view[:received]):
                        event = trainer_pb2.TrainerEvent.FromString(payload)
                        if event.HasField("refusal"):
                            self._put(Failure(self._refusal(event.refusal)))
                            return
                        for item in self._handle(event):
                            self._put(item)
                            if first:
                                self.inbox.ring()
                                first = False
                finally:
                    self.inbox.ring()
            self._on_stream_end(cut=frames.pending_bytes > 0)
        except OSError as error:
            if not self._closing.is_set():
                self._put(Failure(self._broken(f"{type(error).__name__}: {error}")))
                self.inbox.ring()
        except Exception as exc:  # bad data or a bug: the trainer must see it, not hang
            self._put(Failure(exc))
            self.inbox.ring()
            with contextlib.suppress(OSError):
                self._connection.shutdown(socketlib.SHUT_RDWR)

    def _on_stream_end(self, *, cut: bool) -> None:
        """The daemon closed the stream: cleanly after a failed job's end or at its shutdown
        (StreamEnd: the client tells which), or it died (a frame cut short)."""
        if self._closing.is_set():
            return
        self._put(
            Failure(self._broken("the stream ended inside a message")) if cut else StreamEnd()
        )
        self.inbox.ring()

    def _refusal(self, refusal: trainer_pb2.Refusal) -> Exception:
        return refusal_error(
            refusal.code,
            refusal.message,
            socket=self.socket,
            who=f"trainer rank {self.rank}",
            refusals=TRAINER_REFUSALS,
        )

    def _broken(self, why: str) -> DaemonConnectionError:
        return DaemonConnectionError(
            f"the stream between trainer rank {self.rank} and odbd on unix:{self.socket} broke "
            f"({why}); the daemon exited or restarted; check its log, then restart this process"
        )

    def _put(self, item: object) -> None:
        """Queues `item`; waits while the inbox is full (the daemon pushed more than prefetch),
        until next() takes one or close() (then drops it); due reports still leave meanwhile."""
        while len(self.inbox) >= self._inbox_bound:
            self.inbox.ring()  # the trainer must see what is queued before we wait for it
            if self._closing.wait(DEFAULT_POLL_S):
                return
            self.reports.flush_due()
        if not self._closing.is_set():
            self.inbox.add(item)  # the caller rings

    def _handle(self, event: trainer_pb2.TrainerEvent) -> Iterator[object]:
        """The inbox items of one event."""
        kind = event.WhichOneof("kind")
        if kind == "step":
            yield from self._steps([event.step])
        elif kind == "steps":
            yield from self._steps(event.steps.steps)
        elif kind == "welcome":
            yield self._on_welcome(event.welcome)
        elif kind == "epoch_end":
            end = event.epoch_end
            yield EpochEnd(
                epoch=end.epoch,
                num_steps=end.num_steps,
                global_num_samples=end.global_num_samples,
                num_identities=end.num_identities,
                rejected_by_reason=dict(end.rejected_by_reason),
            )
        elif kind == "job_end":
            yield JobEnd(reason=event.job_end.reason, failed=event.job_end.failed)
        # else: an event kind from a newer daemon, nothing to do with it

    def _on_welcome(self, welcome: trainer_pb2.TrainerWelcome) -> Welcome:
        # Mapped once for the process lifetime (shm.py): batches are copied out, never viewed.
        self._arena = ArenaView.attach(list(welcome.segments))
        self._segment_names = list(welcome.segments)
        mappings = [self._arena.mapping(name) for name in welcome.segments]
        self._segment_table = SegmentTable(
            mappings,
            [self._arena.header(n).header_bytes for n in welcome.segments],
            [len(m) for m in mappings],
        )
        self._pads = {pad.key: pad.value for pad in welcome.pads}
        self._form = BatchForm(
            packed=welcome.collate == "packed",
            concat_keys=frozenset(welcome.concat_keys),
            length_key=welcome.length_key,
            labels_key=welcome.labels_key,
        )
        self.welcome = Welcome(
            job_id=welcome.job_id,
            world_size=welcome.world_size,
            length_key=welcome.length_key,
            loss_scaling=welcome.loss_scaling,
        )
        return self.welcome

    def _steps(self, steps: Iterable[trainer_pb2.StepBatch]) -> Iterator[Batch]:
        """The Batches of the steps this rank may still train: none from its end_job() point
        on. The trainer thread may set that point while a step is being read here, and the
        daemon may hand the step's memory to a producer as soon as it hears of it, so a step
        past the point after reading is dropped too, whatever reading it raised or returned."""
        for step in steps:
            if self._past_end(step):
                continue
            try:
                batch = self._batch(step)
            except Exception:
                if self._past_end(step):
                    continue
                raise
            if not self._past_end(step):
                yield batch

    def _past_end(self, step: trainer_pb2.StepBatch) -> bool:
        end = self._end_point
        return end is not None and (step.epoch, step.step) >= end

    def _batch(self, step: trainer_pb2.StepBatch) -> Batch:
        sample_ids: tuple[int, ...]
        if step.is_idle:
            tensors, sample_ids = filler_tensors(self._filler_schema(step), self._form), ()
        else:
            collated = self._collate(step)
            self._last_schema = collated.schema
            tensors = collated.tensors
            sample_ids = tuple(int_list(step.sample_ids, "q"))
        facts = (step.epoch, step.step, step.num_samples, step.num_tokens,
                 step.global_num_samples, step.global_num_tokens, sample_ids, step.is_idle,
                 step.loss_scale, *_update(step))  # fmt: skip
        return assemble_batch(tensors, _progress(step.progress), facts)

    def _collate(self, step: trainer_pb2.StepBatch) -> Collated:
        """A step whose samples share one header takes a few copies per key
        (odbclient.step_collate); any other step is decoded and collated sample by sample."""
        segments = int_list(step.segments, "I")
        offsets = int_list(step.offsets, "Q")
        nbytes = int_list(step.nbytes, "Q")
        count = len(step.sample_ids) // 8
        if not count or not len(segments) == len(offsets) == len(nbytes) == count:
            raise ProtocolError(
                f"odbd sent step {step.step} of epoch {step.epoch} with {count} sample ids, "
                f"{len(segments)} segments, {len(offsets)} offsets and {len(nbytes)} sizes"
            )
        collated = collate_uniform(self._segment_table, segments, offsets, nbytes, form=self._form)
        if collated is not None:
            return collated
        samples, bfloat16_keys = self._samples(step, segments, offsets, nbytes)
        return collate(samples, pads=self._pads, bfloat16_keys=bfloat16_keys, form=self._form)

    def _filler_schema(self, step: trainer_pb2.StepBatch) -> tuple[KeySchema, ...]:
        # This rank's own last batch gives exact shapes (fixed-shape keys included); the
        # daemon's schema covers a rank that has not seen a real batch yet.
        if self._last_schema:
            return self._last_schema
        if step.filler_schema:
            return parse_filler_schema(step.filler_schema)
        raise ProtocolError(
            f"odbd sent rank {self.rank} an idle filler for epoch {step.epoch} step {step.step} "
            "without filler_schema before any real batch, so its tensors are unknown; the "
            "daemon and odbclient versions differ"
        )

    def _samples(
        self,
        step: trainer_pb2.StepBatch,
        segments: list[int],
        offsets: list[int],
        nbytes: list[int],
    ) -> tuple[list[dict[str, np.ndarray]], frozenset[str]]:
        """Zero-copy views of the step's samples, and which keys hold bfloat16 bits."""
        if max(segments) >= len(self._segment_names) or self._arena is None:
            raise ProtocolError(f"step {step.step} names shm segment {max(segments)}, unknown")
        buffers = [
            self._arena.buffer(self._segment_names[s], o, n)
            for s, o, n in zip(segments, offsets, nbytes, strict=True)
        ]
        # The daemon checked schema hashes (dtypes included), so sample 0 speaks for all.
        bfloat16_keys = frozenset(
            f.name for f in read_meta(buffers[0]).fields if f.dtype == "bfloat16"
        )
        return [decode(buf) for buf in buffers], bfloat16_keys
