"""The Trainer gRPC service: one stream per rank pushes its planned steps ahead of time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from odbclient.connect import DEFAULT_PREFETCH
from odbclient.wire.odbd.v1 import trainer_pb2, trainer_pb2_grpc
from odbd.daemon.node_state import Locations as Location  # one per step: its samples, as columns
from odbd.serve.hello import read_hello
from odbd.serve.rank_queue import QueuedItem, RankQueue

log = logging.getLogger("odbd.serve")

MAX_PREFETCH = 64
# Consecutive ready steps go as one StepBatches message of at most this many steps and about
# this many bytes (a step of many tiny samples is large; the client accepts up to 4 MiB).
MAX_STEPS_PER_EVENT = 32
MAX_EVENT_BYTES = 1 << 20


class TrainerService(trainer_pb2_grpc.TrainerServicer):
    def __init__(
        self,
        *,
        job_id: str,
        queues: dict[int, RankQueue],
        welcome: trainer_pb2.TrainerWelcome,
        on_free: Callable[[list[Location]], None],
        on_delivered: Callable[[int, trainer_pb2.Delivered], None],
        on_hello: Callable[[trainer_pb2.TrainerHello], str | None] = lambda hello: None,
    ) -> None:
        self._job_id = job_id
        self._queues = queues
        self._welcome = welcome
        self._on_free = on_free
        self._on_delivered = on_delivered
        self._on_hello = on_hello

    async def Train(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[trainer_pb2.TrainerMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[trainer_pb2.TrainerEvent]:
        hello = await self._hello(request_iterator, context)
        queue = self._queues[hello.rank]
        queue.attached = True
        if hello.resume:
            self._on_free(queue.skip_before(hello.resume_epoch, hello.resume_step))
        queue.rewind()
        prefetch = min(hello.prefetch or DEFAULT_PREFETCH, MAX_PREFETCH)
        reader = asyncio.ensure_future(self._read_deliveries(request_iterator, queue))
        log.info("trainer rank %d attached (prefetch %d)", hello.rank, prefetch)
        try:
            yield trainer_pb2.TrainerEvent(welcome=self._welcome)
            while True:
                # Fast path without a task per step: the queue usually has the next one ready.
                item = queue.take_ready(prefetch)
                if item is None:
                    item = await _first(queue.next_to_send(prefetch), reader)
                if item is None:
                    return
                if not item.is_step:
                    yield item.event  # a marker: always alone
                    continue
                steps = _ready_steps(queue, prefetch, first=item)
                yield item.event if len(steps) == 1 else _steps_event(steps)
        finally:
            reader.cancel()
            queue.attached = False
            queue.rewind()
            log.info("trainer rank %d detached", hello.rank)

    async def _hello(
        self,
        request_iterator: AsyncIterator[trainer_pb2.TrainerMessage],
        context: grpc.aio.ServicerContext,
    ) -> trainer_pb2.TrainerHello:
        hello = await read_hello(
            request_iterator, context, who="trainer", hello_type="TrainerHello", job_id=self._job_id
        )
        refusal = world_refusal(hello, self._welcome.world_size)
        if refusal is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        if hello.rank not in self._queues:
            ranks = sorted(self._queues)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank {hello.rank} is not served by this daemon (it serves ranks "
                f"{ranks[0]}..{ranks[-1]}); connect to the socket of the node that runs it",
            )
        if self._queues[hello.rank].attached:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"another client is already attached for rank {hello.rank}; each rank has "
                "exactly one ODBClient (close the other, or check RANK)",
            )
        refusal = self._on_hello(hello)
        if refusal is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        return hello

    async def _read_deliveries(
        self, request_iterator: AsyncIterator[trainer_pb2.TrainerMessage], queue: RankQueue
    ) -> None:
        async for message in request_iterator:
            if message.HasField("delivered"):
                delivered = message.delivered
                self._on_free(queue.deliver(delivered.epoch, delivered.step))
                self._on_delivered(queue.rank, delivered)


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


def _ready_steps(queue: RankQueue, prefetch: int, *, first: QueuedItem) -> list[QueuedItem]:
    """`first` and the steps that may follow it now, within the per-message limits."""
    steps, nbytes = [first], first.event.ByteSize()
    while len(steps) < MAX_STEPS_PER_EVENT and nbytes < MAX_EVENT_BYTES:
        item = queue.take_ready_step(prefetch)
        if item is None:
            break
        steps.append(item)
        nbytes += item.event.ByteSize()
    return steps


def _steps_event(items: list[QueuedItem]) -> trainer_pb2.TrainerEvent:
    """One message for several steps: per message, gRPC costs both sides far more than the
    bytes (a StepBatch is a few hundred bytes; the samples stay in shared memory)."""
    return trainer_pb2.TrainerEvent(
        steps=trainer_pb2.StepBatches(steps=[item.event.step for item in items])
    )


async def _first(
    send: Coroutine[Any, Any, QueuedItem | None], reader: asyncio.Future[None]
) -> QueuedItem | None:
    """The next queue item, or None once the client's side of the stream ended or a failed
    job's end went out (RankQueue.next_to_send)."""
    sender = asyncio.ensure_future(send)
    waiting: set[asyncio.Future[Any]] = {sender, reader}
    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if sender in done:
        return sender.result()
    sender.cancel()
    return None
