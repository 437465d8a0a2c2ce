"""The daemon's ingest socket (odbd.ingest.ingest_socket) with the real IngestService, NodeState
and Lanes on a real unix socket: hello and welcome with a lane, leases against credit, commits
booked, frees handed back, Shutdown, the producer's leases back in the pool when its stream
ends (EOF, a refusal, close()), refusals by name, the socket file's mode and its removal."""

from __future__ import annotations

import asyncio
import os
import socket as socketlib
import stat
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from odbclient.connect import PROTOCOL_VERSION
from odbclient.framing import MAX_FRAME_BYTES, FrameBuffer, frame
from odbclient.producer.lane import LANE_HEADER_BYTES
from odbclient.wire.odbd.v1 import ingest_pb2
from odbd.config import DaemonConfig
from odbd.daemon.node_state import NodeState
from odbd.ingest.arena import Arena
from odbd.ingest.ingest_socket import IngestServer
from odbd.ingest.lanes import Lanes
from odbd.ingest.service import IngestService
from odbd.metrics.stats import DaemonStats
from odbd.world import World
from tests.aio_wait import until

_WAIT_S = 10.0  # every read and state change has this deadline
_DATASET = 64


class Producer:
    """The producer's end of one connection, driven from the event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.frames = reader, writer, FrameBuffer()
        self.pending: list[bytes] = []

    @classmethod
    async def connect(cls, path: str) -> Producer:
        return cls(*await asyncio.open_unix_connection(path))

    def send(self, message: ingest_pb2.ProducerMessage) -> None:
        self.writer.write(frame(message.SerializeToString()))

    async def message(self) -> ingest_pb2.IngestMessage | None:
        """The next message, or None at EOF."""
        while not self.pending:
            data = await asyncio.wait_for(self.reader.read(1 << 16), _WAIT_S)
            if not data:
                return None
            self.pending.extend(self.frames.feed(data))
        return ingest_pb2.IngestMessage.FromString(self.pending.pop(0))


class Daemon:
    """What the daemon builds around its IngestService (app.py), minus the round loop."""

    def __init__(self, arena: Arena, lane_bytes: int = 4096) -> None:
        config = DaemonConfig(world=World(1, 1), buffer=8, token_budget=64, dataset_size=_DATASET)
        self.state = NodeState(config, _DATASET)
        self.lanes = Lanes(arena, lane_bytes)
        self.errors: list[str] = []
        self.service = IngestService(
            state=self.state,
            lanes=self.lanes,
            welcome=ingest_pb2.IngestWelcome(
                job_id="job", segments=arena.segment_names, dataset_size=_DATASET
            ),
            lease_timeout_s=60.0,
            on_progress=lambda: None,
            on_rejected=lambda rejected: None,
            stats=DaemonStats(node_rank=0, dataset_size=_DATASET),
            on_error=self.errors.append,
        )


@pytest.fixture
def arena() -> Iterator[Arena]:
    arena = Arena.create(f"t{uuid.uuid4().hex[:8]}", 0, 1 << 16)
    yield arena
    arena.close()


def hello(**fields: object) -> ingest_pb2.ProducerMessage:
    fields.setdefault("protocol_version", PROTOCOL_VERSION)
    return ingest_pb2.ProducerMessage(hello=ingest_pb2.ProducerHello(name="worker-0", **fields))


def lease(count: int) -> ingest_pb2.ProducerMessage:
    return ingest_pb2.ProducerMessage(lease=ingest_pb2.LeaseRequest(count=count))


def commit(key: int, offset: int, nbytes: int) -> ingest_pb2.ProducerMessage:
    batch = ingest_pb2.CommitBatch(
        view_keys=np.array([key], "<i8").tobytes(),
        offsets=np.array([offset], "<u8").tobytes(),
        nbytes=np.array([nbytes], "<u8").tobytes(),
        lengths=np.array([4], "<u4").tobytes(),
        loss_tokens=np.array([4], "<u4").tobytes(),
        schema_hashes=np.array([1], "<u8").tobytes(),
    )
    return ingest_pb2.ProducerMessage(commit=batch)


async def attached(daemon: Daemon, path: str) -> tuple[Producer, ingest_pb2.IngestWelcome]:
    producer = await Producer.connect(path)
    producer.send(hello())
    first = await producer.message()
    assert first is not None and first.HasField("welcome"), first
    return producer, first.welcome


@pytest.mark.timeout(60)
def test_a_producer_leases_commits_gets_frees_and_its_leases_return_at_eof(
    tmp_path: Path, arena: Arena
) -> None:
    async def scenario() -> None:
        daemon = Daemon(arena)
        server = IngestServer(daemon.service, str(tmp_path / "odbd.sock.ingest"))
        await server.start()
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
        producer, welcome = await attached(daemon, server.path)
        assert welcome.job_id == "job" and welcome.lane.size == 4096
        assert list(daemon.service.sessions) == [0]
        producer.send(lease(4))  # credit 4: the daemon grants at most 4
        grant = await producer.message()
        assert grant is not None and grant.HasField("lease"), grant
        keys = np.frombuffer(grant.lease.view_keys, "<i8")
        assert len(keys) == 4 and len(daemon.state.leases_of(0)) == 4
        producer.send(commit(int(keys[0]), LANE_HEADER_BYTES, 256))
        await until(lambda: len(daemon.state.leases_of(0)) == 3, "the commit to be booked", _WAIT_S)
        lane = daemon.service.sessions[0].lane
        assert lane.live == {LANE_HEADER_BYTES}
        daemon.service.give_back({0: np.array([LANE_HEADER_BYTES])})  # a trainer consumed it
        free = await producer.message()
        assert free is not None and free.HasField("free"), free
        assert np.frombuffer(free.free.offsets, "<u8").tolist() == [LANE_HEADER_BYTES]
        producer.writer.write_eof()  # the producer is gone
        assert await producer.message() is None  # the daemon closes its side too
        await until(lambda: not daemon.service.sessions, "the detach", _WAIT_S)
        assert daemon.state.leases_of(0) == []  # the 3 uncommitted ids are back in the pool
        producer.writer.close()
        await server.close()
        assert not os.path.exists(server.path)

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_shutdown_ends_the_stream_and_a_late_producer_is_told_the_same(
    tmp_path: Path, arena: Arena
) -> None:
    async def scenario() -> None:
        daemon = Daemon(arena)
        server = IngestServer(daemon.service, str(tmp_path / "s.ingest"))
        await server.start()
        producer, _ = await attached(daemon, server.path)
        daemon.service.shutdown("job over")
        message = await producer.message()
        assert message is not None and message.shutdown.reason == "job over", message
        assert await producer.message() is None  # the stream ends after Shutdown
        await until(lambda: not daemon.service.sessions, "the detach", _WAIT_S)
        late = await Producer.connect(server.path)
        late.send(hello())
        message = await late.message()
        assert message is not None and message.shutdown.reason == "job over", message
        assert await late.message() is None
        producer.writer.close()
        late.writer.close()
        await server.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("payload", "code", "words"),
    [
        (hello(protocol_version=6), "FAILED_PRECONDITION", "producer protocol version 6"),
        (hello(job_id="other"), "FAILED_PRECONDITION", "the producer asked for 'other'"),
        (hello(dataset_size=10), "FAILED_PRECONDITION", "dataset has 10 samples"),
        (lease(1), "INVALID_ARGUMENT", "first message must be a ProducerHello"),
        (frame(b"\xff\xff"), "INVALID_ARGUMENT", "unreadable message on the ingest socket"),
        (struct.pack("<I", MAX_FRAME_BYTES + 1), "INVALID_ARGUMENT", "(ProducerHello) announces"),
    ],
    ids=["protocol", "job", "dataset-size", "no-hello", "garbage", "huge-frame"],
)
def test_refusals_name_the_reason_then_end_the_stream(
    tmp_path: Path, arena: Arena, payload: object, code: str, words: str
) -> None:
    async def scenario() -> None:
        daemon = Daemon(arena)
        server = IngestServer(daemon.service, str(tmp_path / "s.ingest"))
        await server.start()
        producer = await Producer.connect(server.path)
        if isinstance(payload, bytes):
            producer.writer.write(payload)
        else:
            producer.send(payload)  # type: ignore[arg-type]
        message = await producer.message()
        assert message is not None and message.HasField("refusal"), message
        assert message.refusal.code == code and words in message.refusal.message
        assert await producer.message() is None  # the daemon closed the stream
        assert not daemon.service.sessions
        producer.writer.close()
        await server.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_no_room_for_a_lane_is_resource_exhausted(tmp_path: Path, arena: Arena) -> None:
    async def scenario() -> None:
        daemon = Daemon(arena, lane_bytes=1 << 15)  # the 64 KiB arena holds at most 2 lanes
        server = IngestServer(daemon.service, str(tmp_path / "s.ingest"))
        await server.start()
        producers = []
        for _ in range(3):
            producer = await Producer.connect(server.path)
            producers.append(producer)
            producer.send(hello())
            message = await producer.message()
            assert message is not None
            if message.HasField("refusal"):
                break
        assert message.refusal.code == "RESOURCE_EXHAUSTED", message
        assert "raise --shm-size or run fewer producers" in message.refusal.message
        assert len(daemon.service.sessions) == len(producers) - 1
        for producer in producers:
            producer.writer.close()
        await server.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_malformed_commit_is_refused_and_the_leases_return(tmp_path: Path, arena: Arena) -> None:
    async def scenario() -> None:
        daemon = Daemon(arena)
        server = IngestServer(daemon.service, str(tmp_path / "s.ingest"))
        await server.start()
        producer, welcome = await attached(daemon, server.path)
        producer.send(lease(2))
        grant = await producer.message()
        assert grant is not None and grant.HasField("lease"), grant
        key = int(np.frombuffer(grant.lease.view_keys, "<i8")[0])
        producer.send(commit(key, welcome.lane.size + 64, 256))  # outside its lane
        message = await producer.message()
        assert message is not None and message.refusal.code == "INVALID_ARGUMENT", message
        assert "does not lie inside the producer's" in message.refusal.message
        assert await producer.message() is None
        await until(lambda: not daemon.service.sessions, "the detach", _WAIT_S)
        assert daemon.state.leases_of(0) == []
        producer.writer.close()
        await server.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_close_ends_open_connections_and_releases_their_leases(
    tmp_path: Path, arena: Arena
) -> None:
    async def scenario() -> None:
        daemon = Daemon(arena)
        server = IngestServer(daemon.service, str(tmp_path / "s.ingest"))
        await server.start()
        producer, _ = await attached(daemon, server.path)
        producer.send(lease(2))
        assert (await producer.message()) is not None
        await server.close()
        assert await producer.message() is None  # EOF: the producer sees the stream end
        await until(lambda: not daemon.service.sessions, "the detach at close", _WAIT_S)
        assert daemon.state.leases_of(0) == []
        producer.writer.close()
        probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        with pytest.raises(OSError):
            probe.connect(server.path)
        probe.close()

    asyncio.run(scenario())
