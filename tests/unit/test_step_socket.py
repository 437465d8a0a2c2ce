"""The daemon's step socket (odbd.serve.step_socket) with the real TrainerService and RankQueue
on a real unix socket: hello and welcome, steps pushed ahead, Delivered frees, EOF detaches,
refusals by name, the socket file's mode and its removal, and no connection outliving close()."""

from __future__ import annotations

import asyncio
import os
import socket as socketlib
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from odbclient.connect import PROTOCOL_VERSION
from odbclient.framing import FrameBuffer, frame
from odbclient.wire.odbd.v1 import trainer_pb2
from odbd.daemon.locations import Locations
from odbd.serve.rank_queue import QueuedItem, RankQueue
from odbd.serve.step_socket import StepServer
from odbd.serve.trainer_service import TrainerService
from tests.aio_wait import until

_WAIT_S = 10.0  # every read and state change has this deadline


class Trainer:
    """The trainer's end of one connection, driven from the event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.frames = reader, writer, FrameBuffer()
        self.pending: list[bytes] = []

    @classmethod
    async def connect(cls, path: str) -> Trainer:
        return cls(*await asyncio.open_unix_connection(path))

    def send(self, message: trainer_pb2.TrainerMessage) -> None:
        self.writer.write(frame(message.SerializeToString()))

    async def event(self) -> trainer_pb2.TrainerEvent | None:
        """The next event, or None at EOF."""
        while not self.pending:
            data = await asyncio.wait_for(self.reader.read(1 << 16), _WAIT_S)
            if not data:
                return None
            self.pending.extend(self.frames.feed(data))
        return trainer_pb2.TrainerEvent.FromString(self.pending.pop(0))


def hello(rank: int = 0, **fields: object) -> trainer_pb2.TrainerMessage:
    return trainer_pb2.TrainerMessage(
        hello=trainer_pb2.TrainerHello(
            protocol_version=PROTOCOL_VERSION, rank=rank, prefetch=2, **fields
        )
    )


def step(epoch: int, index: int) -> QueuedItem:
    event = trainer_pb2.StepBatch(epoch=epoch, step=index).SerializeToString()
    return QueuedItem(epoch, index, event, locations=[f"loc{index}"])  # type: ignore[list-item]


def one_rank_service(
    queue: RankQueue,
    on_free: Callable[[list[Locations]], None] = lambda locations: None,
    on_delivered: Callable[[int, trainer_pb2.Delivered], None] = lambda rank, d: None,
    world_size: int = 1,
) -> TrainerService:
    """The service of job "job" serving rank 0 from `queue` (of `world_size` ranks)."""
    return TrainerService(
        job_id="job",
        queues={0: queue},
        welcome=trainer_pb2.TrainerWelcome(job_id="job", world_size=world_size),
        on_free=on_free,
        on_delivered=on_delivered,
    )


@pytest.mark.timeout(60)
def test_a_trainer_attaches_gets_steps_within_prefetch_and_detaches_at_eof(tmp_path: Path) -> None:
    freed: list[object] = []
    delivered: list[tuple[int, int]] = []

    async def scenario() -> None:
        queue = RankQueue(0)
        queue.push([step(0, i) for i in range(5)])
        service = one_rank_service(
            queue,
            on_free=freed.extend,
            on_delivered=lambda rank, d: delivered.append((rank, d.step)),
        )
        server = StepServer(service, str(tmp_path / "odbd.sock.steps"))
        await server.start()
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
        trainer = await Trainer.connect(server.path)
        trainer.send(hello())
        assert (await trainer.event()).HasField("welcome")  # type: ignore[union-attr]
        got = []
        while len(got) < 2:  # prefetch 2: steps 0 and 1, in one or two messages
            event = await trainer.event()
            assert event is not None
            got += (
                [s.step for s in event.steps.steps]
                if event.HasField("steps")
                else [event.step.step]
            )
        assert got == [0, 1] and queue.attached
        trainer.send(trainer_pb2.TrainerMessage(delivered=trainer_pb2.Delivered(epoch=0, step=1)))
        event = await trainer.event()  # room for two more
        assert event is not None
        await until(
            lambda: freed == ["loc0", "loc1"], "the Delivered to free steps 0 and 1", _WAIT_S
        )
        assert delivered == [(0, 1)]
        trainer.writer.write_eof()  # detach
        await until(lambda: not queue.attached, "the detach", _WAIT_S)
        while await trainer.event() is not None:  # steps sent before the detach, then EOF
            pass
        trainer.writer.close()
        await server.close()
        assert not os.path.exists(server.path)

    asyncio.run(scenario())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("message", "code", "words"),
    [
        (hello(rank=3), "INVALID_ARGUMENT", "rank 3 is not served by this daemon"),
        (hello(job_id="other"), "FAILED_PRECONDITION", "the trainer asked for 'other'"),
        (
            trainer_pb2.TrainerMessage(hello=trainer_pb2.TrainerHello(protocol_version=5)),
            "FAILED_PRECONDITION",
            "trainer protocol version 5",
        ),
        (
            trainer_pb2.TrainerMessage(delivered=trainer_pb2.Delivered()),
            "INVALID_ARGUMENT",
            "first message must be a TrainerHello",
        ),
        (b"\xff\xff", "INVALID_ARGUMENT", "unreadable message"),
    ],
)
def test_refusals_name_the_reason_then_end_the_stream(
    tmp_path: Path, message: object, code: str, words: str
) -> None:
    async def scenario() -> None:
        queue = RankQueue(0)
        server = StepServer(one_rank_service(queue), str(tmp_path / "s.steps"))
        await server.start()
        trainer = await Trainer.connect(server.path)
        if isinstance(message, bytes):
            trainer.writer.write(frame(message))
        else:
            trainer.send(message)  # type: ignore[arg-type]
        event = await trainer.event()
        assert event is not None and event.HasField("refusal"), event
        assert event.refusal.code == code and words in event.refusal.message
        assert await trainer.event() is None  # the daemon closed the stream
        assert not queue.attached and not queue.ever_attached
        trainer.writer.close()
        await server.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_close_ends_open_connections(tmp_path: Path) -> None:
    async def scenario() -> None:
        queue = RankQueue(0)
        server = StepServer(one_rank_service(queue), str(tmp_path / "s.steps"))
        await server.start()
        trainer = await Trainer.connect(server.path)
        trainer.send(hello())
        assert (await trainer.event()).HasField("welcome")  # type: ignore[union-attr]
        await server.close()
        assert await trainer.event() is None  # EOF: the trainer sees the stream end
        await until(lambda: not queue.attached, "the detach at close", _WAIT_S)
        trainer.writer.close()
        probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        with pytest.raises(OSError):
            probe.connect(server.path)
        probe.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("world_size", "resume", "warned"),
    [(2, False, True), (2, True, False), (1, False, False)],
)
def test_a_rank_back_without_a_resume_point_is_warned_about_ddp_alignment(
    caplog: pytest.LogCaptureFixture, world_size: int, resume: bool, warned: bool
) -> None:
    queue = RankQueue(0)
    queue.push([step(0, 0), step(0, 1), step(0, 2)])
    service = one_rank_service(queue, world_size=world_size)
    service.detach(service.attach(hello().hello))
    assert not caplog.records  # a first attach is never warned about
    service.attach(hello(resume=resume, resume_epoch=0, resume_step=1).hello)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if warned:
        assert len(warnings) == 1, warnings
        assert "rank 0 attached again without a resume point" in warnings[0]
        assert "(epoch 0 step 0)" in warnings[0] and "load_state_dict" in warnings[0]
    else:
        assert warnings == []


@pytest.mark.parametrize(
    ("resume_step", "refused"),
    [(0, True), (2, True), (3, False), (4, False)],
)
def test_a_resume_point_at_or_before_a_delivered_step_is_refused_by_a_running_daemon(
    resume_step: int, refused: bool
) -> None:
    """A trainer restored from an older checkpoint while the daemon kept running (HF Trainer
    resume_from_checkpoint): steps 0-2 were delivered and freed, so resuming at step <= 2
    would never train them again; before, the daemon silently continued at step 3."""
    queue = RankQueue(0)
    queue.push([step(0, i) for i in range(6)])
    service = one_rank_service(queue)
    attachment = service.attach(hello().hello)
    assert [queue.take_ready(prefetch=3).step for _ in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
    service.on_message(
        attachment, trainer_pb2.TrainerMessage(delivered=trainer_pb2.Delivered(epoch=0, step=2))
    )
    service.detach(attachment)
    assert queue.last_delivered == (0, 2)
    refusal = service.admit(hello(resume=True, resume_epoch=0, resume_step=resume_step).hello)
    if not refused:
        assert refusal is None
        return
    assert refusal is not None and refusal.code == "INVALID_ARGUMENT"
    assert f"rank 0 resumes at epoch 0 step {resume_step}" in refusal.message
    assert "up to epoch 0 step 2" in refusal.message and "--state-dir" in refusal.message
