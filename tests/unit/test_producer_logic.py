"""Producer decisions without a daemon: sample facts, rejections, lane bookkeeping, commit
batching and credits; plus runs against a scripted fake daemon over a real unix socket of
frames (the ingest socket, protocol 7)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import socket as socketlib
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from odbclient import Producer, RejectReason
from odbclient.connect import PROTOCOL_VERSION
from odbclient.errors import DaemonUnavailableError, ODBClientError, ProtocolError
from odbclient.framing import FrameBuffer, frame, ingest_socket_path
from odbclient.producer import producer_main
from odbclient.producer.lane import (
    IDLE,
    LANE_HEADER_BYTES,
    CommitBuffer,
    LaneAllocator,
    LeaseCredits,
)
from odbclient.producer.producer import ProducerCore
from odbclient.samples import (
    SampleFacts,
    SampleRejected,
    count_loss_tokens,
    fetch_sample,
    inspect_sample,
    schema_hash,
)
from odbclient.shm import ArenaView, decode, encoded_size
from odbclient.wire.odbd.v1 import ingest_pb2, trainer_pb2
from odbd.ingest.arena import Arena
from odbd.ingest.ingest_socket import IngestServer
from odbd.ingest.service import IngestService
from tests.unit.fake_listener import FakeListener


def make_sample(n: int, *, ignored: int = 0, seed: int = 0) -> dict[str, np.ndarray]:
    labels = np.arange(n, dtype=np.int64) + seed
    labels[:ignored] = -100
    return {"input_ids": np.arange(n, dtype=np.int64) + seed, "labels": labels}


# --- sample facts and rejections ---------------------------------------------------------------


def test_schema_hash_is_stable_across_runs_and_libraries() -> None:
    numpy_sample = make_sample(3)
    torch_sample = {k: torch.from_numpy(v.copy()) for k, v in reversed(numpy_sample.items())}
    assert schema_hash(numpy_sample) == 12697642536378583829  # pinned: same in every process
    assert schema_hash(torch_sample) == schema_hash(numpy_sample)  # key order, library ignored
    assert schema_hash(make_sample(50)) == schema_hash(numpy_sample)  # first dim is padded


@pytest.mark.parametrize(
    "other",
    [
        {"input_ids": np.zeros(3, np.int32), "labels": np.zeros(3, np.int64)},  # dtype
        {"input_ids": np.zeros((3, 2), np.int64), "labels": np.zeros(3, np.int64)},  # ndim
        {"input_ids": np.zeros(3, np.int64), "target": np.zeros(3, np.int64)},  # key
        {"input_ids": np.zeros(3, np.int64)},  # missing key
    ],
)
def test_schema_hash_differs_when_structure_differs(other: dict[str, np.ndarray]) -> None:
    assert schema_hash(other) != schema_hash(make_sample(3))


def test_schema_hash_includes_trailing_dimensions() -> None:
    assert schema_hash({"x": np.zeros((2, 3))}) != schema_hash({"x": np.zeros((2, 4))})
    assert schema_hash({"x": np.zeros((2, 3))}) == schema_hash({"x": np.zeros((7, 3))})


def test_loss_tokens_count_labels_other_than_minus_100() -> None:
    assert count_loss_tokens(np.array([-100, -100, 5, 0, -1])) == 3
    assert count_loss_tokens(torch.tensor([[-100, 1], [2, -100]])) == 2
    facts = inspect_sample(make_sample(6, ignored=4), length_key="input_ids", labels_key="labels")
    assert (facts.length, facts.loss_tokens) == (6, 2)
    assert facts.nbytes == encoded_size(make_sample(6))


@pytest.mark.parametrize("labels_key", ["", "target"])
def test_loss_tokens_are_the_length_without_a_labels_key(labels_key: str) -> None:
    facts = inspect_sample(make_sample(6, ignored=4), length_key="input_ids", labels_key=labels_key)
    assert facts.loss_tokens == 6


@pytest.mark.parametrize(
    ("sample", "reason", "detail"),
    [
        ([1, 2, 3], RejectReason.NOT_A_DICT, "returned a list"),
        ({"input_ids": [1, 2]}, RejectReason.NOT_A_DICT, "'input_ids' holds a list"),
        ({"labels": np.zeros(2, np.int64)}, RejectReason.MISSING_LENGTH_KEY, "'input_ids'"),
        ({"input_ids": np.int64(3)}, RejectReason.MISSING_LENGTH_KEY, "scalar"),
        ({"input_ids": np.zeros(2, np.uint16)}, RejectReason.UNSUPPORTED_DTYPE, "uint16"),
        ({"input_ids": np.zeros(2, np.complex64)}, RejectReason.UNSUPPORTED_DTYPE, "complex64"),
    ],
)
def test_bad_samples_are_rejected_with_a_reason(sample: Any, reason: str, detail: str) -> None:
    with pytest.raises(SampleRejected) as info:
        inspect_sample(sample, length_key="input_ids", labels_key="labels")
    assert info.value.reason == reason and detail in info.value.detail
    assert "\n" not in info.value.detail


def test_dataset_errors_become_preprocess_error_rejections() -> None:
    class Broken:
        def __getitem__(self, i: int) -> None:
            raise ValueError(f"bad\nrow {i}")

    with pytest.raises(SampleRejected) as info:
        fetch_sample(Broken(), 4)
    assert info.value.reason == RejectReason.PREPROCESS_ERROR
    assert info.value.detail == "dataset[4] raised ValueError: bad row 4"


# --- lane, commits, credits --------------------------------------------------------------------


def test_lane_offsets_are_aligned_in_the_segment_even_for_a_misaligned_lane() -> None:
    lane = LaneAllocator(lane_offset=4100, lane_size=1000)
    assert lane.capacity_bytes == (1000 - 60) & -64
    first, second = lane.allocate(10), lane.allocate(100)
    assert first is not None and second is not None
    assert (4100 + first) % 64 == 0 and (4100 + second) % 64 == 0 and second - first == 64


def test_lane_fills_up_frees_and_reuses() -> None:
    lane = LaneAllocator(lane_offset=0, lane_size=256)
    offsets = [lane.allocate(64) for _ in range(4)]
    assert offsets == [0, 64, 128, 192] and lane.allocate(1) is None and not lane.fits_now(1)
    assert lane.fits_ever(256) and not lane.fits_ever(257)
    lane.free(64)
    assert lane.fits_now(64) and not lane.fits_now(65)
    assert lane.allocate(60) == 64 and lane.used_bytes == 256 and lane.num_live == 4


def test_lane_refuses_to_free_what_it_did_not_allocate() -> None:
    lane = LaneAllocator(lane_offset=0, lane_size=256)
    offset = lane.allocate(64)
    assert offset is not None
    lane.free(offset)
    with pytest.raises(ProtocolError, match="lane offset 0"):
        lane.free(offset)


@pytest.mark.parametrize("seed", range(20))
def test_lane_frees_a_batch_as_one_at_a_time_would(seed: int) -> None:
    """free_many joins adjacent samples into runs first; the free list ends up the same."""
    rng = np.random.default_rng(seed)
    batched, single = (LaneAllocator(lane_offset=0, lane_size=256 * 40) for _ in range(2))
    sizes = rng.integers(1, 200, size=30).tolist()
    offsets = [batched.allocate(n) for n in sizes]
    assert offsets == [single.allocate(n) for n in sizes] and None not in offsets
    freed = rng.permutation([o for o in offsets if o is not None])[: rng.integers(1, 30)]
    batched.free_many(freed.tolist())
    for offset in freed.tolist():
        single.free(offset)
    assert batched.used_bytes == single.used_bytes and batched.num_live == single.num_live
    assert [batched.allocate(n) for n in sizes] == [single.allocate(n) for n in sizes]


def test_lane_batch_with_a_bad_offset_frees_those_before_it_and_refuses() -> None:
    lane = LaneAllocator(lane_offset=0, lane_size=256)
    offsets = [lane.allocate(64) for _ in range(4)]
    assert offsets == [0, 64, 128, 192]
    with pytest.raises(ProtocolError, match="lane offset 100"):
        lane.free_many([0, 64, 100])
    assert lane.num_live == 2 and lane.used_bytes == 128 and lane.allocate(128) == 0


def test_commits_flush_by_count_and_by_age() -> None:
    facts = SampleFacts(nbytes=100, length=7, loss_tokens=5, schema_hash=2**64 - 1)
    commits = CommitBuffer(max_rows=3, interval_s=0.01)
    assert not commits.due(0.0)
    commits.add(10, 0, facts, now_s=1.0)
    commits.reject(11, RejectReason.TOO_LARGE, "big", now_s=1.001)
    assert not commits.due(1.005) and commits.due(1.01)
    commits.add(12, 128, facts, now_s=1.002)
    assert commits.due(1.002)  # three rows
    commit, reject = commits.take()
    assert np.frombuffer(commit.commit.view_keys, "<i8").tolist() == [10, 12]
    assert np.frombuffer(commit.commit.offsets, "<u8").tolist() == [0, 128]
    assert np.frombuffer(commit.commit.nbytes, "<u8").tolist() == [100, 100]
    assert np.frombuffer(commit.commit.lengths, "<u4").tolist() == [7, 7]
    assert np.frombuffer(commit.commit.loss_tokens, "<u4").tolist() == [5, 5]
    assert np.frombuffer(commit.commit.schema_hashes, "<u8").tolist() == [2**64 - 1] * 2
    assert [(r.view_key, r.reason) for r in reject.reject.rejections] == [(11, "too_large")]
    assert len(commits) == 0 and commits.take() == [] and not commits.due(9.0)


def test_credits_keep_about_the_target_in_hand() -> None:
    credits = LeaseCredits(max_ids=8)
    assert credits.request(in_hand=0) == 8
    assert credits.request(in_hand=0) == 0  # all 8 outstanding
    credits.granted(8)
    assert credits.request(in_hand=5) == 0  # more than half in hand
    assert credits.request(in_hand=4) == 4
    credits.granted(2)
    assert credits.outstanding == 2


def test_credits_hold_about_hold_s_of_work_within_the_bounds() -> None:
    credits = LeaseCredits(max_ids=512, hold_s=0.02, min_ids=4)
    assert credits.target == 32  # nothing measured yet: a modest first request
    credits.observe(0.0001)  # 100 us per sample: 200 ids cover 20 ms
    assert credits.target == 200
    credits.observe(0.0001)
    assert credits.target == 200
    for _ in range(400):  # the samples became expensive: 10 ms each
        credits.observe(0.01)
    assert credits.target == 4  # min_ids: a producer does not hoard ids it cannot make soon
    for _ in range(400):
        credits.observe(1e-6)
    assert credits.target == 512  # max_ids caps the cheapest samples
    assert LeaseCredits(max_ids=2).target == 2  # a max below min_ids wins


# --- the producer core over a plain buffer -----------------------------------------------------


class ListDataset:
    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        sample = self.samples[i]
        if isinstance(sample, Exception):
            raise sample
        return sample


def make_core(samples: list[Any], lane_size: int = 1 << 16, **kwargs: Any) -> ProducerCore:
    options: dict[str, Any] = dict(lease_batch=8, commit_batch=4, commit_interval_s=10.0)
    options.update(kwargs)
    return ProducerCore(
        ListDataset(samples),
        lane_buffer=memoryview(bytearray(lane_size)),
        lane_offset=4096,
        length_key="input_ids",
        labels_key="labels",
        **options,
    )


def run_until_idle(core: ProducerCore) -> list[ingest_pb2.ProducerMessage]:
    sent = core.messages(0.0)
    while core.can_work():
        core.work_one(0.0)
        sent += core.messages(0.0)
    return sent


def commits_of(sent: list[ingest_pb2.ProducerMessage]) -> dict[str, list[int]]:
    rows: dict[str, list[int]] = {"view_keys": [], "offsets": [], "lengths": [], "loss": []}
    for message in sent:
        if message.HasField("commit"):
            rows["view_keys"] += np.frombuffer(message.commit.view_keys, "<i8").tolist()
            rows["offsets"] += np.frombuffer(message.commit.offsets, "<u8").tolist()
            rows["lengths"] += np.frombuffer(message.commit.lengths, "<u4").tolist()
            rows["loss"] += np.frombuffer(message.commit.loss_tokens, "<u4").tolist()
    return rows


def test_core_writes_granted_samples_into_its_lane_and_commits_them() -> None:
    samples = [make_sample(n, ignored=1, seed=n) for n in (3, 9, 1, 4, 6)]
    core = make_core(samples)
    assert [m.lease.count for m in core.messages(0.0)] == [8]
    core.on_grant([100, 101, 102, 103, 104], [0, 1, 2, 3, 4])
    sent = run_until_idle(core)
    rows = commits_of(sent)
    assert rows["view_keys"] == [100, 101, 102, 103, 104]
    assert rows["lengths"] == [3, 9, 1, 4, 6] and rows["loss"] == [2, 8, 0, 3, 5]
    assert sum(m.HasField("commit") for m in sent) == 2  # 4 by count, then the rest when idle
    lane = core._lane_buffer  # the bytes the daemon and trainers read
    for offset, sample in zip(rows["offsets"], samples, strict=True):
        decoded = decode(lane[offset : offset + encoded_size(sample)])
        np.testing.assert_array_equal(decoded["input_ids"], sample["input_ids"])
        np.testing.assert_array_equal(decoded["labels"], sample["labels"])


def test_core_rejects_bad_samples_and_keeps_going() -> None:
    samples = [RuntimeError("tokenizer crashed"), "text", make_sample(2), make_sample(5000)]
    core = make_core(samples, lane_size=8192)
    core.messages(0.0)
    core.on_grant([1, 2, 3, 4], [0, 1, 2, 3])
    sent = run_until_idle(core)
    rejections = [r for m in sent if m.HasField("reject") for r in m.reject.rejections]
    assert [(r.view_key, r.reason) for r in rejections] == [
        (1, "preprocess_error"),
        (2, "not_a_dict"),
        (4, "too_large"),
    ]
    assert "tokenizer crashed" in rejections[0].detail
    assert commits_of(sent)["view_keys"] == [3]


def test_full_lane_is_backpressure_until_the_daemon_frees() -> None:
    sample = make_sample(8)
    size = encoded_size(sample)
    assert size <= 256
    # room for two samples of <= 256 bytes after the lane header
    core = make_core([sample] * 4, lane_size=LANE_HEADER_BYTES + 512)
    core.messages(0.0)
    core.on_grant([0, 1, 2, 3], [0, 1, 2, 3])
    sent = run_until_idle(core)
    assert commits_of(sent)["view_keys"] == [0, 1]  # flushed because no work can proceed
    assert not core.can_work() and core.in_hand == 2
    assert lane_full_sizes(sent) == [size]  # after the commits, so the daemon has them first
    kinds = [m.WhichOneof("kind") for m in sent]
    assert kinds.index("lane_full") > max(i for i, k in enumerate(kinds) if k == "commit")
    assert lane_full_sizes(core.messages(0.0)) == []  # once per wait
    offsets = commits_of(sent)["offsets"]
    core.on_free([offsets[0]])
    sent = run_until_idle(core)
    assert commits_of(sent)["view_keys"] == [2]
    assert commits_of(sent)["offsets"] == [LANE_HEADER_BYTES]
    assert lane_full_sizes(sent) == [size]  # a FreeBatch that made too little room: again
    core.on_free([offsets[1]])
    sent = run_until_idle(core)
    assert commits_of(sent)["view_keys"] == [3] and lane_full_sizes(sent) == []


def lane_full_sizes(sent: list[ingest_pb2.ProducerMessage]) -> list[int]:
    return [m.lane_full.nbytes for m in sent if m.HasField("lane_full")]


def test_credits_are_requested_again_once_half_are_used() -> None:
    core = make_core([make_sample(2)] * 8, lease_batch=8)
    assert [m.lease.count for m in core.messages(0.0)] == [8]
    core.on_grant(range(8), range(8))
    counts = []
    while core.can_work():
        core.work_one(0.0)
        counts += [m.lease.count for m in core.messages(0.0) if m.HasField("lease")]
    assert counts == [4, 4]


# --- one Producer.run against a scripted daemon ------------------------------------------------


class FramedPeer:
    """The fake daemon's end of one producer connection: frames out, frames in (a drain thread
    queues what the producer sends, so the script reads with deadlines)."""

    def __init__(self, connection: socketlib.socket) -> None:
        self.connection = connection
        self.frames = FrameBuffer()
        self.requests: queue.Queue[ingest_pb2.ProducerMessage | None] = queue.Queue()
        self._drain: threading.Thread | None = None

    def first(self) -> ingest_pb2.ProducerMessage:
        """The first frame (the hello); then the drain thread takes the rest."""
        while True:
            data = self.connection.recv(1 << 16)
            assert data, "the producer closed before its hello"
            payloads = self.frames.feed(data)
            if payloads:
                assert len(payloads) == 1, "the producer sent more than its hello before a welcome"
                self._drain = threading.Thread(target=self._read, name="fake-ingest-drain")
                self._drain.start()
                return ingest_pb2.ProducerMessage.FromString(payloads[0])

    def send(self, message: ingest_pb2.IngestMessage) -> None:
        self.connection.sendall(frame(message.SerializeToString()))

    def finish(self) -> None:
        """Half-closes (the stream ends), then waits for the producer to close its side."""
        with contextlib.suppress(OSError):
            self.connection.shutdown(socketlib.SHUT_WR)
        if self._drain is not None:
            self._drain.join(timeout=30)
            assert not self._drain.is_alive(), "the producer never closed its side"
        self.connection.close()

    def _read(self) -> None:
        try:
            while data := self.connection.recv(1 << 16):
                for payload in self.frames.feed(data):
                    self.requests.put(ingest_pb2.ProducerMessage.FromString(payload))
        except OSError:
            pass  # the producer went away
        finally:
            self.requests.put(None)


class FakeIngestServer:
    """A fake daemon's ingest socket beside `socket`: each connection runs `script(peer)` on
    its own thread; close() joins every thread it started."""

    def __init__(self, socket: str, script: Any) -> None:
        self.script = script
        self._listener = FakeListener(
            ingest_socket_path(socket), "fake-ingest", self._serve_connection, join_s=30
        )

    def close(self) -> None:
        self._listener.close()

    def _serve_connection(self, connection: socketlib.socket) -> None:
        self._serve(FramedPeer(connection))

    def _serve(self, peer: FramedPeer) -> None:
        try:
            self.script(peer)
        finally:
            peer.finish()


class FakeIngest:
    """Welcome, one grant of `identities`, frees what was committed, then Shutdown."""

    def __init__(self, arena: Arena, identities: list[int]) -> None:
        self.arena = arena
        self.lane = arena.allocate(1 << 16)
        self.identities = identities
        self.hello: ingest_pb2.ProducerHello | None = None
        self.commits: list[ingest_pb2.CommitBatch] = []
        self.producer_threads: list[str] = []  # comm of each thread of the producer process

    def __call__(self, peer: FramedPeer) -> None:
        self.hello = peer.first().hello
        assert self.lane is not None
        lane = ingest_pb2.Lane(segment=0, offset=self.lane.offset, size=self.lane.length)
        welcome = ingest_pb2.IngestWelcome(
            segments=self.arena.segment_names, length_key="input_ids", labels_key="labels",
            lane=lane, dataset_size=len(self.identities),
        )  # fmt: skip
        peer.send(ingest_pb2.IngestMessage(welcome=welcome))
        credit = peer.requests.get(timeout=30)  # grants only against credit, like odbd
        assert credit is not None and credit.lease.count >= len(self.identities), credit
        identities = np.array(self.identities, "<i8")
        grant = ingest_pb2.LeaseGrant(
            view_keys=(identities + 1000).tobytes(), identities=identities.tobytes()
        )
        peer.send(ingest_pb2.IngestMessage(lease=grant))
        offsets: list[int] = []
        while len(offsets) < len(self.identities):
            message = peer.requests.get(timeout=30)
            assert message is not None, "the producer closed before committing everything"
            if message.HasField("commit"):
                self.commits.append(message.commit)
                offsets += np.frombuffer(message.commit.offsets, "<u8").tolist()
        # The producer is producing (it has committed, and waits for frees): its threads now.
        tasks = Path(f"/proc/{self.hello.pid}/task")
        self.producer_threads = [(t / "comm").read_text().strip() for t in tasks.iterdir()]
        packed = np.array(offsets, "<u8").tobytes()
        peer.send(ingest_pb2.IngestMessage(free=ingest_pb2.FreeBatch(offsets=packed)))
        peer.send(ingest_pb2.IngestMessage(shutdown=ingest_pb2.Shutdown(reason="all epochs done")))


@pytest.fixture
def ingest_daemon(tmp_path: Path) -> Iterator[tuple[FakeIngest, str]]:
    with Arena.create(f"test-prod-{uuid.uuid4().hex[:8]}", 0, 1 << 20) as arena:
        fake = FakeIngest(arena, [0, 1, 2])
        socket = str(tmp_path / "odbd.sock")
        server = FakeIngestServer(socket, fake)
        try:
            yield fake, socket
        finally:
            server.close()


def committed_input_ids(servicer: FakeIngest) -> dict[int, list[int]]:
    """view key -> input_ids read back from shared memory, as a trainer would."""
    view = ArenaView.attach(servicer.arena.segment_names)
    assert servicer.lane is not None
    out = {}
    for commit in servicer.commits:
        rows = zip(
            np.frombuffer(commit.view_keys, "<i8").tolist(),
            np.frombuffer(commit.offsets, "<u8").tolist(),
            np.frombuffer(commit.nbytes, "<u8").tolist(),
            strict=True,
        )
        for key, offset, nbytes in rows:
            segment = servicer.arena.segment_names[0]
            buf = view.buffer(segment, servicer.lane.offset + offset, nbytes)
            out[key] = decode(buf)["input_ids"].tolist()
    return out


@pytest.mark.timeout(60)
def test_producer_run_commits_into_shared_memory_until_shutdown(
    ingest_daemon: tuple[FakeIngest, str],
) -> None:
    servicer, socket = ingest_daemon
    samples = [make_sample(n, seed=n) for n in (5, 2, 7)]
    producer = Producer(ListDataset(samples), socket, name="worker-3", job_id="j")
    producer.run()
    assert producer.shutdown_reason == "all epochs done"
    assert servicer.hello is not None and servicer.hello.name == "worker-3"
    assert servicer.hello.job_id == "j" and servicer.hello.protocol_version == PROTOCOL_VERSION
    assert committed_input_ids(servicer) == {
        1000 + i: sample["input_ids"].tolist() for i, sample in enumerate(samples)
    }


@pytest.mark.timeout(60)
def test_producer_main_exits_0_on_shutdown(
    ingest_daemon: tuple[FakeIngest, str], tmp_path: Path
) -> None:
    servicer, socket = ingest_daemon
    module = tmp_path / "tiny_dataset.py"
    module.write_text(
        "import numpy as np\n"
        "def build(n, offset):\n"
        "    return [{'input_ids': np.arange(i + 1) + offset} for i in range(n)]\n"
    )
    argv = ["--socket", socket, "--dataset", f"{module}:build", "--dataset-arg", "n=3"]
    argv += ["--dataset-arg", "offset=10", "--name", "worker-0"]
    assert producer_main.main(argv) == 0
    assert committed_input_ids(servicer) == {1000: [10], 1001: [10, 11], 1002: [10, 11, 12]}


@pytest.mark.timeout(60)
def test_producer_run_has_no_grpc_thread_while_producing(
    ingest_daemon: tuple[FakeIngest, str], tmp_path: Path
) -> None:
    """Protocol 7: a producer process runs its own thread, the frame reader and numpy's, none
    of gRPC's (event_engine, grpc_global_timer, lifeguard, ...), which every thread but gRPC's
    shows by keeping the process's name."""
    fake, socket = ingest_daemon
    module = tmp_path / "tiny_dataset.py"
    module.write_text(
        "import numpy as np\n"
        "def build(n):\n"
        "    return [{'input_ids': np.arange(i + 1)} for i in range(n)]\n"
    )
    argv = [sys.executable, "-m", "odbclient.producer.producer_main", "--socket", socket]
    argv += ["--dataset", f"{module}:build", "--dataset-arg", "n=3", "--name", "worker-0"]
    done = subprocess.run(argv, timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert fake.hello is not None and fake.producer_threads, "the fake daemon saw no producer"
    main = Path(f"/proc/{os.getpid()}/comm").read_text().strip()  # the same interpreter
    assert set(fake.producer_threads) == {main}, fake.producer_threads


def refuse(peer: FramedPeer) -> None:
    peer.first()
    refusal = trainer_pb2.Refusal(code="RESOURCE_EXHAUSTED", message="no room for another lane")
    peer.send(ingest_pb2.IngestMessage(refusal=refusal))


@pytest.mark.timeout(60)
def test_producer_refusal_carries_the_daemon_message_and_fix(tmp_path: Path) -> None:
    socket = str(tmp_path / "odbd.sock")
    server = FakeIngestServer(socket, refuse)
    try:
        with pytest.raises(ODBClientError, match="no room for another lane; run fewer producers"):
            Producer(ListDataset([]), socket, name="worker-1").run()
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_a_producer_that_attaches_while_the_daemon_shuts_down_is_told_so_and_ends_cleanly(
    tmp_path: Path,
) -> None:
    """A worker slow to build its dataset may say hello after the job ended: the daemon's own
    IngestService answers with the same Shutdown the attached producers got, so it exits 0
    (before: UNAVAILABLE, printed as `error: odbd ... not reachable; start odbd on this node`)."""
    socket = str(tmp_path / "odbd.sock")
    service = IngestService(
        state=None,  # type: ignore[arg-type]  # a refused-by-shutdown hello touches no state
        lanes=None,  # type: ignore[arg-type]
        welcome=ingest_pb2.IngestWelcome(),
        lease_timeout_s=10.0,
        on_progress=lambda: None,
        on_rejected=lambda rejected: None,
        stats=None,  # type: ignore[arg-type]
    )

    async def serve_one_late_producer() -> Producer:
        server = IngestServer(service, ingest_socket_path(socket))
        await server.start()
        service.shutdown("every epoch was trained")
        producer = Producer(ListDataset([]), socket, name="worker-1")
        try:
            await asyncio.to_thread(producer.run)
        finally:
            await server.close()
        return producer

    producer = asyncio.run(serve_one_late_producer())
    assert producer.shutdown_reason == "every epoch was trained"


@pytest.mark.timeout(30)
def test_a_daemon_older_than_protocol_7_is_named_at_once(tmp_path: Path) -> None:
    """Its gRPC socket answers but it has no ingest socket beside it: no 60 s wait."""
    socket = str(tmp_path / "odbd.sock")
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    listener.bind(socket)  # stands for the old daemon's gRPC socket
    listener.listen()
    try:
        with pytest.raises(
            ProtocolError, match=r"no producer socket .*\.ingest: the daemon is older"
        ):
            Producer(ListDataset([]), socket, connect_timeout_s=60.0).run()
    finally:
        listener.close()


@pytest.mark.timeout(30)
def test_producer_without_a_daemon_is_unavailable(tmp_path: Path) -> None:
    producer = Producer(ListDataset([]), str(tmp_path / "absent.sock"), connect_timeout_s=0.2)
    with pytest.raises(DaemonUnavailableError, match="absent.sock within 0.2 s"):
        producer.run()


def test_the_lane_header_names_the_view_in_flight_while_dataset_getitem_runs() -> None:
    """Issue 11: the daemon learns which id killed a producer from the lane header."""
    seen: list[int] = []

    class Watching:
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> Any:
            seen.append(int(np.frombuffer(lane, "<i8", count=1)[0]))
            if i == 1:
                raise ValueError("bad row")  # a rejection: the producer lives on
            if i == 2:
                raise SystemExit(3)  # the process dies inside dataset[i]
            return make_sample(8)

    lane = memoryview(bytearray(1 << 16))
    lane[:8] = np.int64(12345).tobytes()  # a reused lane's old bytes
    core = ProducerCore(
        Watching(),
        lane_buffer=lane,
        lane_offset=4096,
        length_key="input_ids",
        labels_key="labels",
        lease_batch=8,
        commit_batch=4,
        commit_interval_s=10.0,
    )
    header = np.frombuffer(lane, "<i8", count=1)
    assert header[0] == IDLE
    core.on_grant([70, 71, 72], [0, 1, 2])
    core.work_one(0.0)
    assert header[0] == IDLE
    core.work_one(0.0)
    assert header[0] == IDLE
    with pytest.raises(SystemExit):
        core.work_one(0.0)
    assert seen == [70, 71, 72] and header[0] == 72
    offsets = commits_of(core.commits.take())["offsets"]
    assert offsets and min(offsets) >= LANE_HEADER_BYTES  # samples never overwrite the header
