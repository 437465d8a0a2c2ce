"""Producer: leases sample ids from the node's daemon, runs the user's preprocessing
(`dataset[identity]`) and writes each sample straight into its lane of shared memory.

    Producer(MyDataset(...)).run()      # until the daemon sends Shutdown

`ProducerCore` makes every decision (validate, allocate, batch commits, ask for credits) and
is testable without a socket; `Producer` only moves messages. Loop, per iteration:
  1. send due commits and rejections (all of them when no work can proceed), and lease
     credits when half are used; this runs before blocking, so nothing waits unsent;
  2. take the daemon's messages (grants, frees, shutdown); block only when no work can proceed;
  3. make a turn of samples (or retry the one waiting for lane space): up to 16, for at most
     1 ms, ending early when a daemon message arrives.
A full lane is backpressure: the producer waits for FreeBatch and never drops a sample; it
says so with one LaneFull per wait, so the daemon can plan a round with what is buffered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket as socketlib
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from odbclient.connect import (
    PRODUCER_REFUSALS,
    PROTOCOL_VERSION,
    Failure,
    StreamEnd,
    connect_ingest,
    refusal_error,
    resolve_socket,
    start_reader,
)
from odbclient.errors import (
    DaemonConnectionError,
    DaemonTimeoutError,
    DatasetLoadError,
    ProtocolError,
)
from odbclient.framing import FrameBuffer, frame
from odbclient.producer.lane import (
    LANE_HEADER_BYTES,
    CommitBuffer,
    InFlightMark,
    LaneAllocator,
    LeaseCredits,
)
from odbclient.producer.sample_plan import SamplePlan, SamplePlanner
from odbclient.samples import (
    PLAIN_SAMPLES,
    RejectReason,
    SampleFacts,
    SampleForm,
    SampleRejected,
    fetch_sample,
    promote_token_ids,
)
from odbclient.shm import ArenaView
from odbclient.wire.odbd.v1 import ingest_pb2

__all__ = ["Producer", "ProducerCore", "RejectReason"]

log = logging.getLogger("odbclient.producer")
_MAX_LOGGED_TRACEBACKS = 5  # then rejections are only counted by the daemon
# A commit is one message each side handles, which costs far more than its rows: at 32 rows /
# 2 ms an 8 KiB producer sent one per ~28 samples. Issue 15 (docs/bench/datapath.md): 128 / 10
# ms gave +12 % samples/s and -17 % daemon CPU per sample; 256 with 512 ids in hand halved the
# ingest messages again (daemon -10-16 %); 512 with 1024 in hand, daemon 6.0 -> 4.9 us per 8
# KiB sample (10 alternated rounds, lower in 8). Only cheap samples reach these caps: ids in
# hand follow ~20 ms of measured work (LeaseCredits), and a commit leaves after
# DEFAULT_COMMIT_INTERVAL_S or when the producer idles, so slow samples are never held back
# longer.
DEFAULT_LEASE_BATCH = 1024
DEFAULT_COMMIT_BATCH = 512
DEFAULT_COMMIT_INTERVAL_S = 0.01


@dataclass(frozen=True, slots=True)
class _Made:
    """A sample made by dataset[i] and inspected, on its way into the lane."""

    view_key: int
    sample: Any
    facts: SampleFacts
    plan: SamplePlan | None  # None: encoded the generic way


class ProducerCore:
    """A producer's decisions over its lane buffer; no socket, no clock of its own."""

    def __init__(
        self,
        dataset: Any,
        *,
        lane_buffer: memoryview,
        lane_offset: int,
        length_key: str,
        labels_key: str,
        lease_batch: int,
        commit_batch: int,
        commit_interval_s: float,
        form: SampleForm = PLAIN_SAMPLES,
    ) -> None:
        self._dataset = dataset
        # Validation and layout per sample structure (the daemon's --concat / patch source
        # included): a sample of a known structure is not checked again, only copied.
        self._planner = SamplePlanner(length_key=length_key, labels_key=labels_key, form=form)
        self._token_keys = tuple(k for k in (length_key, labels_key) if k)
        self._lane_buffer = lane_buffer  # the lane's bytes: index 0 is lane offset 0
        self.lane = LaneAllocator(lane_offset, len(lane_buffer), LANE_HEADER_BYTES)
        self.in_flight = InFlightMark(lane_buffer)
        self.in_flight.clear()
        self.commits = CommitBuffer(max_rows=commit_batch, interval_s=commit_interval_s)
        self.credits = LeaseCredits(max_ids=lease_batch)
        self._work: deque[tuple[int, int]] = deque()  # (view_key, identity) granted, not made
        self._stalled: _Made | None = None  # waiting for lane space
        self._lane_full_sent = False  # LaneFull told for the current wait
        self._num_tracebacks = 0

    @property
    def in_hand(self) -> int:
        return len(self._work) + (self._stalled is not None)

    def on_grant(self, view_keys: Iterable[int], identities: Iterable[int]) -> None:
        granted = list(zip(view_keys, identities, strict=True))
        self._work.extend(granted)
        self.credits.granted(len(granted))

    def on_free(self, offsets: list[int]) -> None:
        self.lane.free_many(offsets)
        self._lane_full_sent = False  # the daemon forgets it on every FreeBatch: tell again

    def can_work(self) -> bool:
        if self._stalled is not None:
            return self.lane.fits_now(self._stalled.facts.nbytes)
        return bool(self._work)

    def work_one(self, now_s: float) -> None:
        """Makes one sample: the stalled one if it fits now, else the next granted id."""
        if self._stalled is not None:
            made, self._stalled = self._stalled, None
            self._place(made.view_key, made.sample, made.facts, made.plan, now_s)
            return
        view_key, identity = self._work.popleft()
        # If dataset[identity] kills this process (sys.exit, abort, a segfault in a C
        # extension), the mark stays: the daemon reads it when the stream breaks.
        self.in_flight.set(view_key)
        self._make(view_key, identity, now_s)
        self.in_flight.clear()

    def _make(self, view_key: int, identity: int, now_s: float) -> None:
        try:
            sample = promote_token_ids(fetch_sample(self._dataset, identity), self._token_keys)
            facts, plan = self._planner.facts(sample)
            if not self.lane.fits_ever(facts.nbytes):
                raise SampleRejected(
                    RejectReason.TOO_LARGE,
                    f"sample {identity} encodes to {facts.nbytes} bytes but the producer lane "
                    f"holds {self.lane.capacity_bytes}; raise the daemon's --shm-size",
                )
        except SampleRejected as rejected:
            self._reject(view_key, rejected, now_s)
            return
        self._place(view_key, sample, facts, plan, now_s)

    def messages(self, now_s: float) -> list[ingest_pb2.ProducerMessage]:
        """What to send now: due commits (all of them when no work can proceed), LaneFull once
        per wait for lane space, then credits."""
        out = []
        if self.commits.due(now_s) or (len(self.commits) and not self.can_work()):
            out.extend(self.commits.take())
        if self._stalled is not None and not self._lane_full_sent and not self.can_work():
            lane_full = ingest_pb2.LaneFull(nbytes=self._stalled.facts.nbytes)
            out.append(ingest_pb2.ProducerMessage(lane_full=lane_full))
            self._lane_full_sent = True
        count = self.credits.request(self.in_hand)
        if count:
            out.append(ingest_pb2.ProducerMessage(lease=ingest_pb2.LeaseRequest(count=count)))
        return out

    def _place(
        self,
        view_key: int,
        sample: Any,
        facts: SampleFacts,
        plan: SamplePlan | None,
        now_s: float,
    ) -> None:
        # The parts as arguments, not a _Made: that is built only for a sample that must wait.
        offset = self.lane.allocate(facts.nbytes)
        if offset is None:
            self._stalled = _Made(view_key, sample, facts, plan)  # backpressure: wait for a free
            return
        try:
            where = self._lane_buffer[offset : offset + facts.nbytes]
            self._planner.encode(where, sample, plan)
        except MemoryError:
            raise  # the process is out of memory, not the sample bad (see fetch_sample)
        except Exception as exc:  # e.g. a tensor whose copy fails; inspect_sample passed it
            self.lane.free(offset)
            rejected = SampleRejected(RejectReason.PREPROCESS_ERROR, f"encoding raised {exc!r}")
            self._reject(view_key, rejected, now_s)
            return
        self.commits.add(view_key, offset, facts, now_s)

    def _reject(self, view_key: int, rejected: SampleRejected, now_s: float) -> None:
        if rejected.__cause__ is not None and self._num_tracebacks < _MAX_LOGGED_TRACEBACKS:
            self._num_tracebacks += 1
            log.warning("rejected view %d: %s", view_key, rejected.detail, exc_info=rejected)
        self.commits.reject(view_key, rejected.reason, rejected.detail, now_s)


class Producer:
    """Serves one map-style dataset to the node's daemon until it sends Shutdown."""

    def __init__(
        self,
        dataset: Any,
        socket: str | None = None,
        *,
        name: str | None = None,
        job_id: str = "",
        lease_batch: int = DEFAULT_LEASE_BATCH,
        commit_batch: int = DEFAULT_COMMIT_BATCH,
        commit_interval_s: float = DEFAULT_COMMIT_INTERVAL_S,
        connect_timeout_s: float = 60.0,
    ) -> None:
        if lease_batch < 1 or commit_batch < 1 or commit_interval_s < 0:
            raise ValueError(
                f"Producer(lease_batch={lease_batch}, commit_batch={commit_batch}, "
                f"commit_interval_s={commit_interval_s}): batches must be >= 1, interval >= 0"
            )
        self.dataset = dataset
        self.socket = resolve_socket(socket)
        self.name = name or f"external-{os.getpid()}"
        self.job_id = job_id  # "" accepts the daemon's job
        self._lease_batch, self._commit_batch = lease_batch, commit_batch
        self._commit_interval_s = commit_interval_s
        self._connect_timeout_s = connect_timeout_s
        self.shutdown_reason: str | None = None  # set when the daemon sent Shutdown

    def run(self) -> None:
        """Produces until the daemon sends Shutdown or ends the stream; raises on failures.

        Transport (protocol 7): one blocking unix socket to the daemon's ingest socket,
        carrying length-prefixed ProducerMessage / IngestMessage frames (odbclient.framing).
        Two threads: this one makes samples and writes each loop's messages in one send; the
        reader thread receives whatever arrived (many frames per recv) into the inbox."""
        connection = connect_ingest(self.socket, timeout_s=self._connect_timeout_s)
        inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        closing = threading.Event()
        hello = ingest_pb2.ProducerHello(
            protocol_version=PROTOCOL_VERSION,
            job_id=self.job_id,
            name=self.name,
            pid=os.getpid(),
            dataset_size=self._dataset_size() or 0,  # the daemon refuses a different size
        )
        reader = start_reader(
            lambda: self._read(connection, inbox, closing), name=f"odbclient-{self.name}"
        )
        try:
            _send(connection, [ingest_pb2.ProducerMessage(hello=hello)])
            welcome = self._await_welcome(inbox)
            if welcome is not None:
                self._serve(self._core(welcome), inbox, connection)
        finally:
            closing.set()
            # Half-close first, so the daemon reads our last commits before the end of the
            # stream (which releases the leases we hold); its close ends our reader.
            with contextlib.suppress(OSError):
                connection.shutdown(socketlib.SHUT_WR)
            reader.join(timeout=_CLOSE_GRACE_S)
            with contextlib.suppress(OSError):
                connection.shutdown(socketlib.SHUT_RDWR)  # wakes a reader still in recv
            reader.join(timeout=5.0)
            connection.close()

    def _core(self, welcome: ingest_pb2.IngestWelcome) -> ProducerCore:
        self._check_size(welcome.dataset_size)
        # Mapped once for the process lifetime (shm.py): never unmapped under a view.
        arena = ArenaView.attach(list(welcome.segments))
        lane = welcome.lane
        if lane.segment >= len(welcome.segments):
            raise ProtocolError(f"odbd gave lane segment {lane.segment} of {len(welcome.segments)}")
        return ProducerCore(
            self.dataset,
            lane_buffer=arena.buffer(welcome.segments[lane.segment], lane.offset, lane.size),
            lane_offset=lane.offset,
            length_key=welcome.length_key,
            labels_key=welcome.labels_key,
            lease_batch=self._lease_batch,
            commit_batch=self._commit_batch,
            commit_interval_s=self._commit_interval_s,
            form=SampleForm(
                patch_key=welcome.patch_key,
                patch_count_key=welcome.patch_count_key,
                concat_keys=tuple(welcome.concat_keys),
                packed=welcome.packed,
                check_finite=welcome.check_finite,
            ),
        )

    def _dataset_size(self) -> int | None:
        return len(self.dataset) if hasattr(self.dataset, "__len__") else None

    def _check_size(self, dataset_size: int) -> None:
        size = self._dataset_size()
        if dataset_size and size is not None and size != dataset_size:
            raise DatasetLoadError(
                f"producer {self.name}'s dataset has {size} samples but the daemon serves "
                f"{dataset_size} identities; every producer must load the same dataset "
                "(check --dataset-arg / --dataset-size)"
            )

    def _serve(
        self, core: ProducerCore, inbox: queue.SimpleQueue[object], connection: socketlib.socket
    ) -> None:
        while True:
            _send(connection, core.messages(time.monotonic()))  # 1. commits, credits
            for item in _receive(inbox, block=not core.can_work()):  # 2. daemon messages
                if isinstance(item, StreamEnd):
                    return
                if isinstance(item, Failure):
                    raise item.error
                assert isinstance(item, ingest_pb2.IngestMessage), item
                if not self._apply(core, item):
                    _send(connection, core.commits.take())
                    return
            if core.can_work():  # 3. a turn of samples
                _work_turn(core, inbox)

    def _apply(self, core: ProducerCore, message: ingest_pb2.IngestMessage) -> bool:
        """Applies one daemon message; False on Shutdown."""
        kind = message.WhichOneof("kind")
        if kind == "lease":
            view_keys = np.frombuffer(message.lease.view_keys, "<i8").tolist()
            core.on_grant(view_keys, np.frombuffer(message.lease.identities, "<i8").tolist())
        elif kind == "free":
            core.on_free(np.frombuffer(message.free.offsets, "<u8").tolist())
        elif kind == "shutdown":
            self._take_shutdown(message.shutdown)
            return False
        return True

    def _take_shutdown(self, shutdown: ingest_pb2.Shutdown) -> None:
        self.shutdown_reason = shutdown.reason
        log.info("producer %s: daemon shutdown (%s)", self.name, shutdown.reason)

    def _await_welcome(self, inbox: queue.SimpleQueue[object]) -> ingest_pb2.IngestWelcome | None:
        """The daemon's welcome, or None when it answered with Shutdown (the job had ended)."""
        try:
            item = inbox.get(timeout=self._connect_timeout_s)
        except queue.Empty:
            raise DaemonTimeoutError(
                f"odbd on unix:{self.socket} sent producer {self.name} no welcome within "
                f"{self._connect_timeout_s:g} s; check the daemon log"
            ) from None
        if isinstance(item, Failure):
            raise item.error
        if isinstance(item, ingest_pb2.IngestMessage) and item.HasField("shutdown"):
            self._take_shutdown(item.shutdown)
            return None
        if not (isinstance(item, ingest_pb2.IngestMessage) and item.HasField("welcome")):
            raise ProtocolError(f"odbd sent {item!r} before its welcome; versions differ")
        return item.welcome

    def _read(
        self,
        connection: socketlib.socket,
        inbox: queue.SimpleQueue[object],
        closing: threading.Event,
    ) -> None:
        """The reader thread: every frame that arrives, decoded, into the inbox; then how the
        stream ended (StreamEnd, or a Failure the producer's thread raises)."""
        frames, buffer = FrameBuffer(), bytearray(_RECV_BYTES)
        view = memoryview(buffer)
        try:
            while received := connection.recv_into(buffer):
                for payload in frames.feed(view[:received]):
                    message = ingest_pb2.IngestMessage.FromString(payload)
                    if message.HasField("refusal"):
                        inbox.put(Failure(self._refusal(message.refusal)))
                        return
                    inbox.put(message)
            if frames.pending_bytes and not closing.is_set():
                inbox.put(Failure(self._broken("the stream ended inside a message")))
            else:
                inbox.put(StreamEnd())
        except OSError as error:
            if not closing.is_set():
                inbox.put(Failure(self._broken(f"{type(error).__name__}: {error}")))
        except Exception as exc:  # bad data or a bug: the producer must see it, not hang
            inbox.put(Failure(exc))

    def _refusal(self, refusal: Any) -> Exception:
        return refusal_error(
            refusal.code,
            refusal.message,
            socket=self.socket,
            who=f"producer {self.name}",
            refusals=PRODUCER_REFUSALS,
        )

    def _broken(self, why: str) -> DaemonConnectionError:
        return DaemonConnectionError(
            f"the stream between producer {self.name} and odbd on unix:{self.socket} broke "
            f"({why}); the daemon exited or restarted; check its log, then restart this process"
        )


_RECV_BYTES = 1 << 20  # one recv takes every frame that arrived, up to this many bytes
_CLOSE_GRACE_S = 5.0  # how long the daemon may take to read our last frames and close


def _send(connection: socketlib.socket, messages: list[ingest_pb2.ProducerMessage]) -> None:
    """Writes `messages` in one send. A broken socket is not raised here: the reader sees it
    too and queues the failure (with the daemon's refusal, when it sent one) that the loop
    raises."""
    if messages:
        data = b"".join(frame(m.SerializeToString()) for m in messages)
        with contextlib.suppress(OSError):
            connection.sendall(data)


_TURN_SAMPLES = 16  # most samples per turn of the loop's step 3
_TURN_S = 0.001  # a turn ends after this long (slow samples: commits and credits keep flowing)


def _work_turn(core: ProducerCore, inbox: queue.SimpleQueue[object]) -> None:
    """Makes samples until the turn is spent, no work can proceed or the daemon sent something.
    Why turns: steps 1 and 2 of the loop cost about a third of a cheap sample's work (8 KiB:
    ~7 of ~22 us), and with samples this cheap nothing they do is due after every sample."""
    started = now = time.monotonic()
    for _ in range(_TURN_SAMPLES):
        core.work_one(now)
        done = time.monotonic()
        core.credits.observe(done - now)
        now = done
        if now - started >= _TURN_S or not core.can_work() or not inbox.empty():
            return


def _receive(inbox: queue.SimpleQueue[object], *, block: bool) -> list[object]:
    """Every queued item; when `block`, waits for at least one. Called once per sample, so it
    checks empty() rather than catch queue.Empty (raising costs more than the check); this
    thread is the only consumer, so a non-empty inbox stays non-empty."""
    items = [inbox.get()] if block else []
    while not inbox.empty():
        items.append(inbox.get_nowait())
    return items
