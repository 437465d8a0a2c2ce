"""ODBClient against a scripted fake daemon (a real step socket of frames beside a real gRPC
socket for Admin status, real shm arena): iteration per epoch, Delivered, EpochEnd/JobEnd, idle
fillers, resume, timeouts, refusals."""

from __future__ import annotations

import contextlib
import os
import queue
import socket as socketlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from odbclient import ODBClient
from odbclient.client import DEFAULT_SOCKET
from odbclient.errors import (
    ClientClosedError,
    DaemonConnectionError,
    DaemonTimeoutError,
    DaemonUnavailableError,
    IteratorInUseError,
    JobFailedError,
    JobMismatchError,
    ProtocolError,
    RankInUseError,
    RankRefusedError,
    StateDictError,
)
from odbclient.framing import FrameBuffer, frame, steps_socket_path
from odbclient.shm import ShmLayoutError, encode_into, encoded_size
from odbclient.wire.odbd.v1 import admin_pb2, admin_pb2_grpc, trainer_pb2
from odbd.ingest.arena import Arena
from tests.unit.fake_listener import FakeListener

Event = trainer_pb2.TrainerEvent
Script = Callable[[trainer_pb2.TrainerHello, Any], Iterator[Event]]  # (hello, StepContext)


@dataclass
class FakeDaemon:
    socket: str
    arena: Arena
    script: Script | None = None
    hellos: list[trainer_pb2.TrainerHello] = field(default_factory=list)
    delivered: queue.Queue[trainer_pb2.Delivered] = field(default_factory=queue.Queue)
    status: admin_pb2.StatusReply | None = None  # None: no Admin service (UNIMPLEMENTED)

    def place(self, sample: dict[str, np.ndarray]) -> tuple[int, int, int]:
        """Writes a sample into the arena like a producer: (segment index, offset, nbytes)."""
        allocation = self.arena.allocate(encoded_size(sample))
        assert allocation is not None
        encode_into(self.arena.view(allocation), sample)
        return 0, allocation.offset, allocation.length

    def welcome(self, **pads: float) -> Event:
        return Event(
            welcome=trainer_pb2.TrainerWelcome(
                job_id="test",
                segments=self.arena.segment_names,
                world_size=2,
                length_key="input_ids",
                pads=[trainer_pb2.PadValue(key=k, value=v) for k, v in pads.items()],
            )
        )

    def step(self, epoch: int, step: int, lengths: list[int], *, ids_from: int = 0) -> Event:
        ids = list(range(ids_from, ids_from + len(lengths)))
        placed = [self.place(make_sample(n, seed=i)) for i, n in zip(ids, lengths, strict=True)]
        return Event(
            step=trainer_pb2.StepBatch(
                epoch=epoch,
                step=step,
                loss_scale=0.5,
                num_samples=len(lengths),
                num_tokens=sum(lengths),
                global_num_samples=2 * len(lengths),
                global_num_tokens=2 * sum(lengths),
                sample_ids=np.array(ids, "<i8").tobytes(),
                segments=np.array([p[0] for p in placed], "<u4").tobytes(),
                offsets=np.array([p[1] for p in placed], "<u8").tobytes(),
                nbytes=np.array([p[2] for p in placed], "<u8").tobytes(),
            )
        )


def make_sample(n: int, *, seed: int = 0) -> dict[str, np.ndarray]:
    return {"input_ids": np.arange(n, dtype=np.int64) + seed, "labels": np.full(n, 1, np.int64)}


def idle(epoch: int, step: int, schema: str = "") -> Event:
    return Event(
        step=trainer_pb2.StepBatch(epoch=epoch, step=step, is_idle=True, filler_schema=schema)
    )


def epoch_end(epoch: int, num_steps: int) -> Event:
    end = trainer_pb2.EpochEnd(
        epoch=epoch, num_steps=num_steps, global_num_samples=8, num_identities=8,
        rejected_by_reason={"preprocess_error": 2},
    )  # fmt: skip
    return Event(epoch_end=end)


def job_end(reason: str = "all epochs done", failed: bool = False) -> Event:
    return Event(job_end=trainer_pb2.JobEnd(reason=reason, failed=failed))


def wait_until_cancelled(context: StepContext) -> None:
    context.closed.wait(timeout=30.0)  # the client detaches (EOF) well before this


class _Aborted(Exception):
    """A script refused the trainer (StepContext.abort): the connection ends."""


class StepContext:
    """One trainer connection as a script sees it (the shape of a gRPC servicer context)."""

    def __init__(self, connection: socketlib.socket) -> None:
        self.connection = connection
        self.closed = threading.Event()  # the client's side ended (EOF)

    def is_active(self) -> bool:
        return not self.closed.is_set()

    def send(self, event: Event) -> None:
        self.connection.sendall(frame(event.SerializeToString()))

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.send(Event(refusal=trainer_pb2.Refusal(code=code.name, message=message)))
        raise _Aborted


class FakeStepServer:
    """The fake daemon's step socket: each connection runs the script on its own thread."""

    def __init__(self, daemon: FakeDaemon) -> None:
        self.daemon = daemon
        self._listener = FakeListener(
            steps_socket_path(daemon.socket), "fake-steps", self._serve, join_s=10
        )
        self.threads = self._listener.threads  # _serve adds its drain threads

    def close(self) -> None:
        self._listener.close()

    def _serve(self, connection: socketlib.socket) -> None:
        context = StepContext(connection)
        frames = FrameBuffer()
        try:
            hello = trainer_pb2.TrainerMessage.FromString(self._first_frame(connection, frames))
            self.daemon.hellos.append(hello.hello)
            drain = threading.Thread(
                target=self._drain, args=(connection, frames, context), name="fake-steps-drain"
            )
            self.threads.append(drain)
            drain.start()
            assert self.daemon.script is not None
            with contextlib.suppress(_Aborted, OSError):
                for event in self.daemon.script(hello.hello, context):
                    context.send(event)
            with contextlib.suppress(OSError):
                connection.shutdown(socketlib.SHUT_WR)  # the script ended: so does the stream
            context.closed.wait(timeout=30.0)
        finally:
            connection.close()

    @staticmethod
    def _first_frame(connection: socketlib.socket, frames: FrameBuffer) -> bytes:
        while True:
            data = connection.recv(1 << 16)
            assert data, "the client closed before its hello"
            payloads = frames.feed(data)
            if payloads:
                assert len(payloads) == 1, "the client sent more than its hello before a welcome"
                return payloads[0]

    def _drain(self, connection: socketlib.socket, frames: FrameBuffer, ctx: StepContext) -> None:
        try:
            while data := connection.recv(1 << 16):
                for payload in frames.feed(data):
                    message = trainer_pb2.TrainerMessage.FromString(payload)
                    self.daemon.delivered.put(message.delivered)
        except OSError:
            pass  # the client went away
        finally:
            ctx.closed.set()


class FakeAdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, daemon: FakeDaemon) -> None:
        self.daemon = daemon

    def Status(self, request: Any, context: Any) -> admin_pb2.StatusReply:  # noqa: N802
        if self.daemon.status is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no admin")
        return self.daemon.status


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[FakeDaemon]:
    with Arena.create(f"test-client-{uuid.uuid4().hex[:8]}", 0, 1 << 20) as arena:
        fake = FakeDaemon(str(tmp_path / "odbd.sock"), arena)
        steps = FakeStepServer(fake)  # first, like odbd: see odbclient.connect.connect_steps
        executor = futures.ThreadPoolExecutor(max_workers=4)
        server = grpc.server(executor)
        admin_pb2_grpc.add_AdminServicer_to_server(FakeAdminService(fake), server)
        server.add_insecure_port(f"unix:{fake.socket}")
        server.start()
        try:
            yield fake
        finally:
            server.stop(grace=None).wait()
            executor.shutdown(wait=True)  # grpc leaves its pool's threads idle
            steps.close()


def client_for(daemon: FakeDaemon, **kwargs: Any) -> ODBClient:
    options: dict[str, Any] = dict(connect_timeout_s=10.0, deadline_s=10.0)
    options.update(kwargs)
    return ODBClient(rank=0, socket=daemon.socket, **options)


def delivered(daemon: FakeDaemon, count: int) -> list[tuple[int, int, int]]:
    """The Delivered reports covering the first `count` steps: (epoch, last step, steps)."""
    reports: list[tuple[int, int, int]] = []
    while sum(steps for _, _, steps in reports) < count:
        m = daemon.delivered.get(timeout=10)
        assert m.wait_s >= 0 and m.compute_s >= 0 and m.steps >= 1
        reports.append((m.epoch, m.step, m.steps))
    return reports


@pytest.mark.timeout(60)
def test_the_job_has_ended_when_the_loop_of_its_last_epoch_ends(daemon: FakeDaemon) -> None:
    # Found by hand: `while not client.job_ended: for batch in client:` (docs/training.md) ran
    # a third, empty epoch after --epochs 2, repeating its per-epoch code and summary.
    def last(event: Event) -> Event:
        event.step.progress.job_fraction = 1.0  # the job's last step, as every daemon plans it
        return event

    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome(input_ids=-1)
        yield daemon.step(0, 0, [3, 1])
        yield epoch_end(0, num_steps=1)
        yield last(daemon.step(1, 0, [2]))
        yield epoch_end(1, num_steps=1)
        yield job_end()
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon, prefetch=3) as client:
        epochs = []
        while not client.job_ended:
            epochs.append([(b.epoch, b.step) for b in client])
        assert epochs == [[(0, 0)], [(1, 0)]]
        assert client.summary["epoch"] == 1 and list(client) == []


def test_each_iteration_is_one_epoch_and_every_batch_is_delivered(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome(input_ids=-1)
        yield daemon.step(0, 0, [3, 1])
        yield daemon.step(0, 1, [2], ids_from=2)
        yield epoch_end(0, num_steps=2)
        yield daemon.step(1, 0, [4])
        yield epoch_end(1, num_steps=1)
        yield job_end()
        wait_until_cancelled(context)  # keep reading Delivered until the client closes

    daemon.script = script
    with client_for(daemon, prefetch=3) as client:
        first = list(client)
        assert [(b.epoch, b.step) for b in first] == [(0, 0), (0, 1)]
        assert first[0]["input_ids"].tolist() == [[0, 1, 2], [1, -1, -1]]
        assert first[0]["labels"].tolist() == [[1, 1, 1], [1, -100, -100]]
        assert first[0].sample_ids == (0, 1) and first[0].loss_scale == 0.5
        assert (first[0].num_samples, first[0].num_tokens, first[0].global_num_tokens) == (2, 4, 8)
        assert client.summary == {
            "epoch": 0, "num_steps": 2, "global_num_samples": 8, "num_identities": 8,
            "rejected_by_reason": {"preprocess_error": 2}, "num_batches": 2,
            "num_idle_batches": 0,
        }  # fmt: skip
        assert client.state_dict() == {"version": 1, "epoch": 1, "step": 0}
        assert [(b.epoch, b.step) for b in client] == [(1, 0)]
        assert list(client) == [] and client.job_ended
    reports = delivered(daemon, 3)  # one report per flush: how many depends on timing
    assert (0, 1) in [r[:2] for r in reports]  # flushed when epoch 0 ended
    assert reports[-1][:2] == (1, 0)
    assert daemon.hellos[0].rank == 0 and daemon.hellos[0].prefetch == 3
    assert not daemon.hellos[0].resume


def with_update(event: Event, index: int, step_in_update: int, num_steps: int) -> Event:
    event.step.update.CopyFrom(
        trainer_pb2.Update(
            index=index, end=step_in_update == num_steps - 1, num_steps=num_steps,
            step_in_update=step_in_update, num_tokens=40, num_samples=6,
        )
    )  # fmt: skip
    return event


@pytest.mark.timeout(60)
def test_batches_without_update_facts_are_one_step_updates(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        yield daemon.step(0, 4, [2, 3])
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon) as client:
        batch = next(iter(client))
        assert batch.update_end and not batch.windowed and batch.update_num_steps == 1
        assert (batch.update_index, batch.update_tokens, batch.update_samples) == (4, 10, 4)
        assert client.state_dict() == {"version": 1, "epoch": 0, "step": 5}


@pytest.mark.timeout(60)
def test_state_dict_is_refused_inside_an_update_and_names_the_next_one(
    daemon: FakeDaemon,
) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        for step in range(4):
            yield with_update(daemon.step(0, step, [2]), step // 2, step % 2, 2)
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon) as client:
        batches = iter(client)
        first = next(batches)
        assert first.windowed and not first.update_end and first.update_tokens == 40
        with pytest.raises(StateDictError, match="middle of optimizer update 0"):
            client.state_dict()
        assert next(batches).update_end
        assert client.state_dict() == {"version": 1, "epoch": 0, "step": 2, "update": 1}
        next(batches)
        with pytest.raises(StateDictError, match="update 1 of epoch 0"):
            client.state_dict()


@pytest.mark.timeout(60)
def test_a_resume_sends_the_update_to_continue_from(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        yield with_update(daemon.step(0, 6, [2]), 3, 0, 2)
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon) as client:
        client.load_state_dict({"version": 1, "epoch": 0, "step": 6, "update": 3})
        assert next(iter(client)).update_index == 3
    hello = daemon.hellos[0]
    assert hello.resume and (hello.resume_step, hello.resume_update) == (6, 3)


@pytest.mark.timeout(60)
def test_align_updates_skipped_slots_are_dropped_and_resume_past_them(
    daemon: FakeDaemon,
) -> None:
    """odbd --align updates (issue 26): this rank runs 2 micro-steps of a 4-step update and
    skips its slots 2 and 3; they are reported, never yielded, and the resume point after its
    update_end is step 4, where every rank resumes."""

    def per_rank(event: Event, step_in_update: int, skip: bool = False) -> Event:
        event.step.update.CopyFrom(
            trainer_pb2.Update(
                index=0, end=step_in_update == 1 and not skip, num_steps=2,
                step_in_update=step_in_update, num_tokens=40, num_samples=6, per_rank=True,
                skip=skip, skipped_after=2 if step_in_update == 1 and not skip else 0,
            )
        )  # fmt: skip
        return event

    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        yield per_rank(daemon.step(0, 0, [2]), 0)
        yield per_rank(daemon.step(0, 1, [3]), 1)
        yield per_rank(idle(0, 2), 2, skip=True)
        yield per_rank(idle(0, 3), 2, skip=True)
        yield with_update(daemon.step(0, 4, [2]), 1, 0, 1)
        yield epoch_end(0, num_steps=5)
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon, prefetch=4) as client:
        batches = iter(client)
        first, last = next(batches), next(batches)
        assert first.update_per_rank and not first.update_end
        assert (last.step, last.update_end, last.update_skipped_after) == (1, True, 2)
        assert client.state_dict() == {"version": 1, "epoch": 0, "step": 4, "update": 1}
        assert [(b.step, b.update_index) for b in batches] == [(4, 1)]
        assert client.summary["num_batches"] == 3  # the skipped slots are not the rank's
    assert sum(steps for _, _, steps in delivered(daemon, 5)) == 5  # every slot reported


def three_steps_then_wait(daemon: FakeDaemon) -> Any:
    """A daemon script: the welcome, steps 0..2 of epoch 0 (2 samples each), then nothing."""

    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        for step in range(3):
            yield daemon.step(0, step, [2])
        wait_until_cancelled(context)

    return script


@pytest.mark.timeout(60)
def test_state_dict_tracks_the_next_undelivered_step(daemon: FakeDaemon) -> None:
    daemon.script = three_steps_then_wait(daemon)
    with client_for(daemon) as client:
        assert client.state_dict() == {"version": 1, "epoch": 0, "step": 0}
        batches = iter(client)
        next(batches)
        assert client.state_dict() == {"version": 1, "epoch": 0, "step": 1}
        next(batches)
        assert client.state_dict() == {"version": 1, "epoch": 0, "step": 2}
        with pytest.raises(StateDictError, match="after iteration started"):
            client.load_state_dict(client.state_dict())


@pytest.mark.timeout(60)
def test_deliveries_reach_the_daemon_while_the_trainer_holds_its_batch(
    daemon: FakeDaemon,
) -> None:
    """next() only queues the Delivered report (odbclient.reports); the reader thread must
    still send it without another next() or close(), or the daemon would stall a slow
    trainer's window."""

    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        for step in range(2):  # nothing after: the reader thread gets no data to wake it
            yield daemon.step(0, step, [2])
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon, prefetch=8) as client:
        batches = iter(client)
        next(batches)
        next(batches)
        assert delivered(daemon, 2)[-1][:2] == (0, 1)  # before any further next()


@pytest.mark.timeout(60)
def test_fast_steps_report_every_half_prefetch(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("odbclient.reports.DEFAULT_POLL_S", 3600.0)  # the reader never sends

    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        for step in range(6):
            yield daemon.step(0, step, [2])
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon, prefetch=8) as client:
        batches = iter(client)
        for _ in range(4):
            next(batches)
        assert delivered(daemon, 4) == [(0, 3, 4)]  # one report for 4 steps
        assert daemon.delivered.empty()


@pytest.mark.timeout(60)
def test_a_blocked_next_reports_what_it_consumed_to_a_daemon_waiting_for_room(
    daemon: FakeDaemon,
) -> None:
    """next() flushes its reports only once it has blocked a moment (issue 15: not on every
    empty inbox), so a daemon that pushes nothing until it hears of the consumed step must
    still get that report, well before the first of 4 unreported steps would send it."""

    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        yield daemon.step(0, 0, [2])
        assert delivered(daemon, 1)[-1][:2] == (0, 0)  # room only once step 0 is reported
        yield daemon.step(0, 1, [3])
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon, prefetch=8) as client:
        batches = iter(client)
        assert next(batches).step == 0
        assert next(batches).step == 1


@pytest.mark.timeout(60)
def test_load_state_dict_resumes_with_the_hello(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        yield daemon.step(hello.resume_epoch, hello.resume_step, [2])
        yield epoch_end(hello.resume_epoch, num_steps=hello.resume_step + 1)
        yield job_end()

    daemon.script = script
    with client_for(daemon) as client:
        client.load_state_dict({"version": 1, "epoch": 2, "step": 5})
        assert client.state_dict() == {"version": 1, "epoch": 2, "step": 5}
        assert [(b.epoch, b.step) for b in client] == [(2, 5)]
    hello = daemon.hellos[0]
    assert (hello.resume, hello.resume_epoch, hello.resume_step) == (True, 2, 5)


@pytest.mark.timeout(60)
def test_expect_job_asks_the_daemon_for_the_job_and_the_welcome_names_it(
    daemon: FakeDaemon,
) -> None:
    """ODBTrainer resumes a checkpoint with the daemon's job id it saved (daemon_job_id), so a
    daemon of another job refuses the hello."""

    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        yield epoch_end(0, num_steps=0)
        yield job_end()

    daemon.script = script
    with client_for(daemon) as client:
        assert client.daemon_job_id is None  # not connected yet
        client.expect_job("test")
        list(client)
        assert client.daemon_job_id == "test"
        with pytest.raises(RuntimeError, match="after iteration started"):
            client.expect_job("test")
    assert daemon.hellos[0].job_id == "test"
    with pytest.raises(ValueError, match="built for job 'a', not 'b'"):
        ODBClient(rank=0, socket="/nonexistent", job_id="a").expect_job("b")


@pytest.mark.parametrize("state", [{}, {"version": 2, "epoch": 0, "step": 0}, {"version": 1}])
def test_malformed_state_dict_is_refused(state: dict[str, Any]) -> None:
    with pytest.raises(StateDictError, match="state dict"):
        ODBClient(rank=0, socket="/nonexistent").load_state_dict(state)


@pytest.mark.timeout(60)
def test_idle_fillers_follow_the_last_batch_or_the_daemon_schema(daemon: FakeDaemon) -> None:
    schema = '[["input_ids", "int64", []], ["pixels", "float32", [3, 2]]]'

    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        yield idle(0, 0, schema)
        yield daemon.step(0, 1, [3])
        yield idle(0, 2)
        yield epoch_end(0, num_steps=3)
        yield job_end()

    daemon.script = script
    with client_for(daemon) as client:
        from_schema, real, from_last = list(client)
    assert from_schema.is_idle and from_schema.loss_scale == 0 and from_schema.sample_ids == ()
    assert from_schema["pixels"].shape == (1, 3, 2) and from_schema["input_ids"].shape == (1, 1)
    assert not real.is_idle
    assert from_last.is_idle and set(from_last.tensors) == {"input_ids", "labels"}
    assert from_last["labels"].shape == (1, 1) and from_last["labels"].dtype == torch.int64
    assert client.summary["num_idle_batches"] == 2


@pytest.mark.timeout(60)
def test_failed_job_end_raises_job_failed_error_every_time(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        yield daemon.step(0, 0, [2])
        yield job_end("peer node 1 missed round 7", failed=True)

    daemon.script = script
    with client_for(daemon) as client:
        batches = iter(client)
        next(batches)
        with pytest.raises(JobFailedError, match="peer node 1 missed round 7"):
            next(batches)
        with pytest.raises(JobFailedError):
            iter(client)


@pytest.mark.timeout(60)
def test_no_event_within_the_deadline_raises_naming_socket_and_rank(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon, deadline_s=0.2) as client:
        with pytest.raises(DaemonTimeoutError, match=f"unix:{daemon.socket} for rank 0 in 0.2 s"):
            list(client)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("code", "error", "fix"),
    [
        (grpc.StatusCode.ALREADY_EXISTS, RankInUseError, "one ODBClient per rank"),
        (grpc.StatusCode.INVALID_ARGUMENT, RankRefusedError, "check RANK"),
        (grpc.StatusCode.FAILED_PRECONDITION, JobMismatchError, "--job-id"),
    ],
)
def test_refusals_become_client_errors_with_the_daemon_message_and_fix(
    daemon: FakeDaemon, code: grpc.StatusCode, error: type[Exception], fix: str
) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        context.abort(code, "the daemon's own words")
        yield daemon.welcome()  # never reached

    daemon.script = script
    with client_for(daemon) as client:
        with pytest.raises(error, match=f"the daemon's own words; .*{fix}"):
            list(client)


@pytest.mark.timeout(60)
def test_a_stream_cut_inside_a_message_is_a_connection_error(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: StepContext) -> Iterator[Event]:
        yield daemon.welcome()
        context.connection.sendall(frame(daemon.step(0, 0, [2]).SerializeToString())[:-3])
        context.connection.shutdown(socketlib.SHUT_RDWR)  # the daemon died mid-write

    daemon.script = script
    with client_for(daemon) as client:
        with pytest.raises(DaemonConnectionError, match="ended inside a message.*restarted"):
            list(client)


@pytest.mark.timeout(60)
def test_stream_closed_without_job_end_is_a_connection_error(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()

    daemon.script = script
    with client_for(daemon) as client:
        with pytest.raises(DaemonConnectionError, match="without ending the job"):
            list(client)


@pytest.mark.timeout(60)
def test_close_wakes_a_next_blocked_in_another_thread(daemon: FakeDaemon) -> None:
    """Issue 11: a thread left in next() after close() waited out its whole deadline, then
    raised into whichever test ran at that moment."""

    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        wait_until_cancelled(context)  # no batch ever: next() can only end by close()

    daemon.script = script
    client = client_for(daemon, deadline_s=600.0)
    batches = iter(client)  # connects: the welcome has arrived
    raised: list[BaseException] = []
    waiter = threading.Thread(target=_next_into, args=(batches, raised), name="blocked-next")
    waiter.start()
    client.close()
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "next() still waits after close()"
    assert len(raised) == 1 and isinstance(raised[0], ClientClosedError), raised
    assert "rank 0" in str(raised[0]) and "was closed" in str(raised[0])
    with pytest.raises(ClientClosedError):  # and every later iteration says so at once
        next(iter(client))


@pytest.mark.timeout(60)
def test_close_drops_queued_batches_instead_of_handing_them_out(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        for step in range(12):  # more than the inbox holds (prefetch 2 + 4)
            yield daemon.step(0, step, [2], ids_from=step)
        wait_until_cancelled(context)

    daemon.script = script
    client = client_for(daemon, prefetch=2)
    batches = iter(client)
    assert next(batches).step == 0
    client.close()
    with pytest.raises(ClientClosedError):
        next(batches)


@pytest.mark.timeout(60)
def test_a_daemon_pushing_past_prefetch_fills_the_inbox_to_its_bound_and_loses_nothing(
    daemon: FakeDaemon,
) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        for step in range(12):  # more than the inbox holds (prefetch 2 + 4)
            yield daemon.step(0, step, [2], ids_from=100 + step)
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon, prefetch=2) as client:
        batches = iter(client)  # connects: the reader starts filling the inbox
        stream = client._stream
        assert stream is not None
        deadline_s = time.monotonic() + 30.0
        seen = 0
        while seen < 6 and time.monotonic() < deadline_s:  # the reader fills it to the bound
            seen = stream.inbox.qsize()
            assert seen <= 6, f"the inbox holds {seen} items, more than prefetch 2 + 4"
        assert seen == 6
        for step in range(12):  # each next() lets the reader queue one more, in order
            batch = next(batches)
            assert (batch.step, batch.sample_ids) == (step, (100 + step,))
            assert stream.inbox.qsize() <= 6


def _next_into(batches: Iterator[Any], raised: list[BaseException]) -> None:
    try:
        next(batches)
    except BaseException as error:  # noqa: BLE001 (handed to the test thread)
        raised.append(error)


@pytest.mark.timeout(60)
def test_corrupt_sample_reference_raises_instead_of_hanging(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        bad = daemon.step(0, 0, [2])
        bad.step.offsets = np.array([1 << 40], "<u8").tobytes()
        yield bad
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon) as client:
        with pytest.raises(ShmLayoutError, match="outside the allocatable region"):
            list(client)


@pytest.mark.timeout(30)
def test_no_daemon_is_unavailable_naming_the_socket(tmp_path: Path) -> None:
    socket = str(tmp_path / "absent.sock")
    with ODBClient(rank=0, socket=socket, connect_timeout_s=0.2) as client:
        with pytest.raises(DaemonUnavailableError, match=f"unix:{socket} within 0.2 s") as raised:
            list(client)
    # A daemon building a slow --dataset has no socket yet: the fix for that case is named too.
    assert "still starting" in str(raised.value) and "raise connect_timeout_s" in str(raised.value)


def test_socket_comes_from_argument_then_environment_then_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ODBD_SOCKET", "/run/odbd/env.sock")
    assert ODBClient(rank=0, socket="/arg.sock").socket == "/arg.sock"
    assert ODBClient(rank=0).socket == "/run/odbd/env.sock"
    monkeypatch.delenv("ODBD_SOCKET")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    # In a directory only this user can write (issue 29), not bare /tmp.
    assert ODBClient(rank=0).socket == f"/tmp/odbd-{os.getuid()}/odbd.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/nonexistent-runtime-dir")  # stale: falls back
    assert ODBClient(rank=0).socket == f"/tmp/odbd-{os.getuid()}/odbd.sock"
    assert DEFAULT_SOCKET.endswith("/odbd.sock")


def test_invalid_constructor_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="rank must be >= 0"):
        ODBClient(rank=-1)


@pytest.mark.timeout(60)
def test_timeout_says_what_the_daemon_reports_as_wrong(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        wait_until_cancelled(context)

    daemon.script = script
    daemon.status = admin_pb2.StatusReply(
        phase="running",
        last_error="external producer p1 says --dataset-size 90, the daemon has 100",
        dataset_size=100,
        producers=1,
        ranks=[admin_pb2.RankStatus(rank=0, attached=True), admin_pb2.RankStatus(rank=1)],
    )
    with client_for(daemon, deadline_s=0.2) as client:
        with pytest.raises(DaemonTimeoutError) as raised:
            list(client)
    message = str(raised.value)
    assert "for rank 0 in 0.2 s" in message
    assert "phase running; last error: external producer p1 says --dataset-size 90" in message
    assert "0 of 100 samples emitted this epoch" in message
    assert "local ranks not attached: [1]" in message


@pytest.mark.timeout(60)
def test_a_second_iterator_is_refused_while_the_first_is_live(daemon: FakeDaemon) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        for epoch in range(3):
            yield daemon.step(epoch, 0, [3])
            yield daemon.step(epoch, 1, [4])
            yield epoch_end(epoch, 2)
        yield job_end()

    daemon.script = script
    with client_for(daemon) as client:
        first = iter(client)
        with pytest.raises(IteratorInUseError, match="would split the epoch's batches"):
            iter(client)
        assert next(first).step == 0  # started: still refused, and the first is unharmed
        with pytest.raises(IteratorInUseError, match="at epoch 0, step 1"):
            iter(client)
        assert [b.step for b in first] == [1]
        assert [b.step for b in client] == [0, 1]  # the first ended: the next epoch is fine
        broken = []
        for batch in client:  # a loop left with break drops its iterator
            broken.append(batch.step)
            break
        assert broken == [0]
        del batch
        assert [b.step for b in client] == [1]  # the rest of epoch 2
        assert list(client) == [] and client.job_ended


@pytest.mark.timeout(60)
def test_the_hello_carries_the_launcher_world(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        yield job_end()

    daemon.script = script
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with client_for(daemon) as client:
        list(client)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    with client_for(daemon) as client:
        list(client)
    with client_for(daemon) as client:
        client.set_world(1, 0, source="accelerate")
        list(client)
    env, unknown, declared = daemon.hellos
    assert (env.world_size, env.launcher_rank) == (2, 0)
    assert env.world_source == "$WORLD_SIZE=2, $RANK=0"
    assert not unknown.HasField("world_size") and not unknown.HasField("launcher_rank")
    assert (declared.world_size, declared.launcher_rank, declared.world_source) == (
        1,
        0,
        "accelerate",
    )


@pytest.mark.timeout(60)
def test_a_daemon_without_a_step_socket_is_refused_as_older_at_once(tmp_path: Path) -> None:
    """A daemon of protocol <= 5 serves only gRPC: the client must say so, not wait out its
    connect timeout."""
    socket = str(tmp_path / "old.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_insecure_port(f"unix:{socket}")
    server.start()
    try:
        started_s = time.monotonic()
        with ODBClient(rank=0, socket=socket, connect_timeout_s=30.0) as client:
            with pytest.raises(ProtocolError, match="older than this odbclient.*same odbd"):
                list(client)
        assert time.monotonic() - started_s < 15.0  # not the 30 s connect timeout
    finally:
        server.stop(grace=None).wait()


@pytest.mark.timeout(60)
def test_only_the_reader_thread_runs_beside_the_trainer(daemon: FakeDaemon) -> None:
    """Protocol 6: no gRPC channel and no sender thread in a process that only iterates."""

    daemon.script = three_steps_then_wait(daemon)
    before = {t.ident for t in threading.enumerate()}
    with client_for(daemon) as client:
        batches = iter(client)
        for _ in range(3):
            next(batches)
        started = [t.name for t in threading.enumerate() if t.ident not in before]
        # the fake daemon's own threads live in this process too
        assert sorted(started) == ["fake-steps", "fake-steps-drain", "odbclient-rank0"], started


@pytest.mark.timeout(60)
def test_the_job_id_defaults_to_odbd_job_id_as_the_daemons_do(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a probe: a trainer pointed at another job's socket (same world) trained that
    job's data, since ODBClient asked for no job. $ODBD_JOB_ID, which the daemons' --job-id
    reads too, now names the job in the hello; an explicit job_id wins."""

    def script(hello: Any, context: Any) -> Iterator[Event]:
        yield daemon.welcome()
        yield epoch_end(0, num_steps=0)
        yield job_end()

    daemon.script = script
    monkeypatch.setenv("ODBD_JOB_ID", "job-a")
    with client_for(daemon) as client:
        list(client)
    with client_for(daemon, job_id="") as client:
        list(client)
    monkeypatch.delenv("ODBD_JOB_ID")
    with client_for(daemon) as client:
        list(client)
    assert [h.job_id for h in daemon.hellos] == ["job-a", "", ""]
