"""The trainer's step channel, transport-agnostic: hello checks, attach and detach of a rank's
queue, Delivered reports, and which event to send next. `odbd.serve.step_socket` is its edge (a
unix stream socket of length-prefixed frames, protocol 6); `LegacyTrainRefusal` answers the
gRPC `Train` of older trainers with what to do."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from odbclient.connect import DEFAULT_PREFETCH, PROTOCOL_VERSION
from odbclient.wire.odbd.v1 import trainer_pb2, trainer_pb2_grpc
from odbd.daemon.locations import Locations
from odbd.daemon.remake import Rewinder
from odbd.daemon.rewind import ResumeDecision, Verdict, decide_resume
from odbd.serve.hello import Refusal, hello_refusal
from odbd.serve.rank_queue import QueuedItem, RankQueue

log = logging.getLogger("odbd.serve")

MAX_PREFETCH = 64
# Consecutive ready steps go as one StepBatches message of at most this many steps and about
# this many bytes (a step of many tiny samples is large).
MAX_STEPS_PER_EVENT = 32
MAX_EVENT_BYTES = 1 << 20


@dataclass(slots=True)
class Attachment:
    """One attached trainer: its rank's queue and how far ahead it may be pushed."""

    rank: int
    queue: RankQueue
    prefetch: int


class TrainerService:
    def __init__(
        self,
        *,
        job_id: str,
        queues: dict[int, RankQueue],
        welcome: trainer_pb2.TrainerWelcome,
        on_free: Callable[[list[Locations]], None],
        on_delivered: Callable[[int, trainer_pb2.Delivered], None],
        on_hello: Callable[[trainer_pb2.TrainerHello], str | None] = lambda hello: None,
        rewinder: Rewinder | None = None,
        node: int = 0,
        from_journal: bool = False,
        on_end_job: Callable[[int, trainer_pb2.EndJob], None] = lambda rank, end: None,
    ) -> None:
        self._job_id = job_id
        self._queues = queues
        self.welcome = welcome
        self._on_free = on_free
        self._on_delivered = on_delivered
        self._on_hello = on_hello
        self.rewinder = rewinder  # None: resume points before the last delivered are refused
        self._node = node
        self.from_journal = from_journal  # restarted from --state-dir (app._resume checks)
        self._on_end_job = on_end_job

    def admit(self, hello: trainer_pb2.TrainerHello) -> Refusal | None:
        """Why this hello must not attach (protocol, job, world, rank, resume point), else None.
        The resume check (on_hello) runs last: it records the rank's resume point."""
        refusal = hello_refusal(hello, who="trainer", job_id=self._job_id)
        if refusal is not None:
            return refusal
        world = world_refusal(hello, self.welcome.world_size)
        if world is not None:
            return Refusal("INVALID_ARGUMENT", world)
        if hello.rank not in self._queues:
            ranks = sorted(self._queues)
            return Refusal(
                "INVALID_ARGUMENT",
                f"rank {hello.rank} is not served by this daemon (it serves ranks "
                f"{ranks[0]}..{ranks[-1]}); connect to the socket of the node that runs it",
            )
        queue = self._queues[hello.rank]
        if queue.attached:
            return Refusal(
                "ALREADY_EXISTS",
                f"another client is already attached for rank {hello.rank}; each rank has "
                "exactly one ODBClient (close the other, or check RANK)",
            )
        if hello.resume:
            decision = self._decide(hello, queue)
            if decision.verdict is Verdict.REFUSE:  # RankRefusedError: "the resume point is bad"
                return Refusal("INVALID_ARGUMENT", decision.reason)
        resume = self._on_hello(hello)
        return None if resume is None else Refusal("FAILED_PRECONDITION", resume)

    def attach(self, hello: trainer_pb2.TrainerHello) -> Attachment:
        """Marks an admitted hello's rank attached; sending starts at its first undelivered
        step (or its resume point)."""
        queue = self._queues[hello.rank]
        if queue.ever_attached and not hello.resume and self.welcome.world_size > 1:
            log.warning(_reattach_warning(hello.rank, queue.first_undelivered()))
        queue.attached = True
        if hello.resume:
            resume = (hello.resume_epoch, hello.resume_step)
            if self._decide(hello, queue).verdict is Verdict.REWIND:
                assert self.rewinder is not None
                self.rewinder.start(queue, resume)
            else:
                self._on_free(queue.skip_before(*resume))
        queue.rewind()
        prefetch = min(hello.prefetch or DEFAULT_PREFETCH, MAX_PREFETCH)
        log.info("trainer rank %d attached (prefetch %d)", hello.rank, prefetch)
        return Attachment(hello.rank, queue, prefetch)

    def _decide(self, hello: trainer_pb2.TrainerHello, queue: RankQueue) -> ResumeDecision:
        resume = (hello.resume_epoch, hello.resume_step)
        if self.rewinder is None:  # the earlier rule: the history is never served
            refusal = resume_refusal(hello.rank, resume, queue.last_delivered)
            if refusal is not None:
                return ResumeDecision(Verdict.REFUSE, refusal)
        return decide_resume(
            rank=hello.rank,
            node=self._node,
            resume=resume,
            last_delivered=queue.last_delivered,
            floor=queue.history.floor,
            ever_sent=queue.ever_sent,
            from_journal=self.from_journal,
            history_steps=queue.history.limit,
        )

    def detach(self, attachment: Attachment) -> None:
        """The stream ended: undelivered steps go to the rank's next trainer (job_end.py
        reads the detach from the queue); a rewind not served yet is dropped."""
        if self.rewinder is not None:
            self.rewinder.cancel(attachment.rank)
        attachment.queue.attached = False
        attachment.queue.rewind()
        log.info("trainer rank %d detached", attachment.rank)

    def on_message(self, attachment: Attachment, message: trainer_pb2.TrainerMessage) -> None:
        """A message after the hello: a Delivered frees its steps' shared memory."""
        if message.HasField("delivered"):
            delivered = message.delivered
            self._on_free(attachment.queue.deliver(delivered.epoch, delivered.step))
            self._on_delivered(attachment.rank, delivered)
        elif message.HasField("end_job"):  # after the Delivered of every step it trained
            self._on_end_job(attachment.rank, message.end_job)

    def take_event(self, attachment: Attachment) -> bytes | None:
        """The next serialized TrainerEvent if one may be sent now, else None (no task, no
        wait)."""
        item = attachment.queue.take_ready(attachment.prefetch)
        return None if item is None else _event_from(item, attachment)

    async def next_event(self, attachment: Attachment) -> bytes | None:
        """The next serialized TrainerEvent, once one may be sent; None once the stream is
        finished (a failed job's end went out: the daemon ends the stream itself)."""
        item = await attachment.queue.next_to_send(attachment.prefetch)
        return None if item is None else _event_from(item, attachment)


def _event_from(item: QueuedItem, attachment: Attachment) -> bytes:
    if not item.is_step:
        return bytes(item.event.SerializeToString())  # a marker: always alone
    return _steps_event(_ready_steps(attachment.queue, attachment.prefetch, first=item))


class LegacyTrainRefusal(trainer_pb2_grpc.TrainerServicer):
    """gRPC `Train` (protocol <= 5): refused by name, so an old odbclient says what to do."""

    async def Train(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[trainer_pb2.TrainerMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[trainer_pb2.TrainerEvent]:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, legacy_train_refusal())
        yield trainer_pb2.TrainerEvent()  # pragma: no cover - abort raises


def legacy_train_refusal() -> str:
    return (
        f"this odbd speaks trainer protocol {PROTOCOL_VERSION}, whose step channel is a unix "
        "socket beside the gRPC socket (path + '.steps'), not the gRPC Train stream of "
        "protocol 5 and older: upgrade odbclient in the trainer's environment to the daemon's "
        "odbd release"
    )


def world_refusal(hello: trainer_pb2.TrainerHello, world_size: int) -> str | None:
    """Why a trainer whose own world disagrees with the daemon's must not train, else None.

    A hello without a world (no process group, no launcher variables) is accepted: a single
    process trainer for debugging has nothing to compare. Every loss_scale assumes the
    daemon's --world, so a mismatch would train with silently wrong gradient weights.
    """
    source = hello.world_source or "the trainer process"
    if hello.HasField("world_size") and hello.world_size != world_size:
        return (
            f"trainer rank {hello.rank} runs in a world of {hello.world_size} processes (from "
            f"{source}) but this job's --world is {world_size}: every loss_scale assumes "
            f"{world_size} ranks; launch {world_size} trainer processes (torchrun "
            f"--nproc-per-node, accelerate launch --num_processes {world_size}) or restart the "
            f"daemons with --world {hello.world_size}"
        )
    if hello.HasField("launcher_rank") and hello.launcher_rank != hello.rank:
        return (
            f"the trainer asked for rank {hello.rank} but its launcher made it rank "
            f"{hello.launcher_rank} (from {source}): two processes would train the same "
            "batches; build ODBClient(rank=...) from that rank (torch.distributed.get_rank(), "
            "$RANK or accelerator.process_index)"
        )
    return None


def resume_refusal(
    rank: int, resume: tuple[int, int], last_delivered: tuple[int, int] | None
) -> str | None:
    """Why a running daemon cannot resume `rank` at `resume` (epoch, step), else None: steps
    it already handed to the rank's previous trainer (Delivered came back) were freed, so the
    restored model would never train the steps from the resume point to the last of them."""
    if last_delivered is None or resume > last_delivered:
        return None
    (epoch, step), (last_epoch, last_step) = resume, last_delivered
    return (
        f"rank {rank} resumes at epoch {epoch} step {step}, but this daemon already handed "
        f"its previous trainer every step up to epoch {last_epoch} step {last_step} and freed "
        "them: a running daemon cannot send a step again, so the restored model would never "
        "train those steps. Nothing was trained. To resume exactly, stop every daemon of the "
        "job and start them again with the same flags and --state-dir (they rebuild the job "
        "from its journal at the checkpoint's step), then start the trainers from the "
        "checkpoint; without --state-dir, resume from a checkpoint after that step or start "
        "the job afresh"
    )


def _ready_steps(queue: RankQueue, prefetch: int, *, first: QueuedItem) -> list[QueuedItem]:
    """`first` and the steps that may follow it now, within the per-message limits."""
    if len(first.event) >= MAX_EVENT_BYTES:
        return [first]
    more = queue.take_ready_steps(
        prefetch, MAX_STEPS_PER_EVENT - 1, MAX_EVENT_BYTES - len(first.event)
    )
    return [first, *more]


def _steps_event(items: list[QueuedItem]) -> bytes:
    """The serialized TrainerEvent of these steps: `step` for one, else `steps` (one message
    for several: per message, both sides pay far more than the bytes). Each step's StepBatch
    was serialized once when planned (QueuedItem.event); the protobuf wire format of a
    message field is its tag, its length as a varint and its bytes, so the event is those
    bytes joined, with no StepBatch parsed, copied or serialized again per send."""
    if len(items) == 1:
        return _field(_EVENT_STEP, items[0].event)
    inner = b"".join(_field(_STEPS_STEP, item.event) for item in items)
    return _field(_EVENT_STEPS, inner)


# Tags (field number << 3 | wire type 2, length-delimited) of trainer.proto's fields.
_EVENT_STEP = bytes([2 << 3 | 2])  # TrainerEvent.step
_EVENT_STEPS = bytes([5 << 3 | 2])  # TrainerEvent.steps
_STEPS_STEP = bytes([1 << 3 | 2])  # StepBatches.steps


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    if value < 0x80:  # a StepBatch of a few samples
        return bytes((value,))
    if value < 0x4000:  # most steps and StepBatches
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _reattach_warning(rank: int, first: tuple[int, int] | None) -> str:
    """Why a rank that comes back without a resume point may train out of step with the
    others: it continues at its first step this daemon has no Delivered for, and Delivered
    reports are batched (up to half the prefetch window), so after every rank of a DDP job
    restarted (torchrun --max-restarts) their first undelivered steps can differ. ODBClient
    aligns them itself when torch.distributed is initialised (odbclient/trainer/align.py); a rank
    it moves reconnects with a resume point and is not warned about."""
    where = "the job's end" if first is None else f"epoch {first[0]} step {first[1]}"
    return (
        f"trainer rank {rank} attached again without a resume point; it continues at its "
        f"first undelivered step ({where}). If every rank restarted, ODBClient moves the ranks "
        "behind to the furthest rank's step once torch.distributed is initialised before the "
        "first iteration; without a process group (or with align_ranks=False) they may "
        "continue at different steps: save client.state_dict() with each checkpoint and call "
        "client.load_state_dict() before iterating, so every rank resumes at the same step"
    )
