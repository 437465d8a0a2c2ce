"""round/bulk.py: moved samples daemon to daemon over real loopback TCP into a real shm arena
(issue 26 item 1 b): authenticated by the job token, length and checksum checked, refused
transfers leave nothing allocated."""

from __future__ import annotations

import asyncio
import uuid
import zlib

import numpy as np
import pytest

from odbclient.shm import Allocation
from odbd.daemon.locations import Locations
from odbd.ingest.arena import Arena
from odbd.ingest.lanes import Lanes
from odbd.round.bulk import BulkError, BulkReceiver, SampleRecord, Transfer, record_of, send_samples

TOKEN = b"job token of this test"


def payloads_of(n: int) -> list[bytes]:
    return [bytes((i * 7 + j) % 251 for j in range(100 + 37 * i)) for i in range(n)]


def records_of(payloads: list[bytes]) -> list[SampleRecord]:
    return [
        record_of(100 + i, 1000 + i, len(p) // 2, len(p) // 3, 0, 1, p)
        for i, p in enumerate(payloads)
    ]


class Node:
    """One receiving daemon's side: its arena and what landed."""

    def __init__(self, arena: Arena, token: bytes = TOKEN) -> None:
        self.arena = arena
        self.landed: list[tuple[Transfer, Allocation, list[int]]] = []
        self.receiver: BulkReceiver[Allocation] = BulkReceiver(
            token=token,
            job_id="job-a",
            node=1,
            allocate=self.allocate,
            release=self.release,
            landed=lambda t, h, at: self.landed.append((t, h, at)),
        )

    def allocate(self, nbytes: int) -> tuple[Allocation, memoryview] | None:
        a = self.arena.allocate(nbytes)
        return None if a is None else (a, self.arena.view(a))

    def release(self, handle: Allocation) -> None:
        self.arena.free(handle)


def run(scenario) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.fixture
def arena():  # type: ignore[no-untyped-def]
    with Arena.create(f"bulk{uuid.uuid4().hex[:8]}", 1, 1 << 20) as a:
        yield a


def test_samples_land_in_the_receivers_arena_byte_for_byte(arena: Arena) -> None:
    payloads = payloads_of(5)

    async def scenario() -> None:
        node = Node(arena)
        port = await node.receiver.start()
        try:
            await send_samples(
                "127.0.0.1", port, token=TOKEN, job_id="job-a", source=0, target=1,
                round_index=7, records=records_of(payloads), payloads=payloads,
            )  # fmt: skip
        finally:
            await node.receiver.close()
        ((transfer, region, offsets),) = node.landed
        assert (transfer.source, transfer.target, transfer.round_index) == (0, 1, 7)
        assert [r.view for r in transfer.records] == [100, 101, 102, 103, 104]
        whole = arena.view(region)
        for at, p in zip(offsets, payloads, strict=True):
            assert at % 64 == 0  # aligned as a producer lane lays samples out
            assert bytes(whole[at : at + len(p)]) == p
        assert node.receiver.received_bytes == sum(map(len, payloads))
        assert arena.num_allocations == 1  # one region per transfer
        # The region becomes a daemon-owned lane: trainers read the samples where they landed,
        # and the last delivery returns the region to the arena, handing nothing to a producer.
        lanes = Lanes(arena, 4096)
        lane = lanes.adopt(region, np.asarray(offsets))
        where = Locations.in_lane(
            lane.lane_id, np.asarray(offsets), np.asarray(list(map(len, payloads)))
        )
        segments, starts = lanes.resolve_many(where)
        assert starts.tolist() == [region.offset + at for at in offsets]
        assert lanes.free([where.take(np.arange(2))]) == {} and arena.num_allocations == 1
        assert lanes.free([where.take(np.arange(2, 5))]) == {} and arena.num_allocations == 0

    run(scenario)


@pytest.mark.parametrize(
    "case",
    ["wrong token", "wrong job", "wrong node", "bad checksum", "lengths disagree"],
)
def test_a_bad_transfer_is_refused_with_the_reason_and_leaves_the_arena_empty(
    arena: Arena, case: str
) -> None:
    payloads = payloads_of(3)
    records = records_of(payloads)
    token, job, target = TOKEN, "job-a", 1
    if case == "wrong token":
        token = b"someone else"
    elif case == "wrong job":
        job = "job-b"
    elif case == "wrong node":
        target = 2
    elif case == "bad checksum":
        r = records[1]
        records[1] = SampleRecord(
            r.view, r.identity, r.length, r.tokens, r.patches, r.age, r.nbytes, r.crc32 ^ 1
        )
    else:
        r = records[2]
        records[2] = SampleRecord(
            r.view, r.identity, r.length, r.tokens, r.patches, r.age, r.nbytes + 1, r.crc32
        )
    expected = {
        "wrong token": "token",
        "wrong job": "meant for job 'job-b'",
        "wrong node": "node 2",
        "bad checksum": "view 101 .* crc32",
        # the receiver reads the length the record claims: the bytes then fail the checksum
        "lengths disagree": "view 102 .* crc32",
    }[case]

    async def scenario() -> None:
        node = Node(arena)
        port = await node.receiver.start()
        try:
            with pytest.raises(
                BulkError, match=f"refused node 0's 3 moved samples of round 2: .*{expected}"
            ):
                await send_samples(
                    "127.0.0.1", port, token=token, job_id=job, source=0, target=target,
                    round_index=2, records=records, payloads=payloads, timeout_s=20,
                )  # fmt: skip
        finally:
            await node.receiver.close()
        assert node.landed == [] and node.receiver.refused == 1
        assert arena.num_allocations == 0  # what arrived before the refusal was freed

    run(scenario)


@pytest.mark.parametrize("taken", [0, 4096])  # too large for the arena / no room left now
def test_a_full_arena_refuses_the_move_and_names_the_fix(taken: int) -> None:
    with Arena.create(f"bulk{uuid.uuid4().hex[:8]}", 1, 8192) as small:
        if taken:
            small.allocate(taken)
        payloads = [b"x" * 3000, b"y" * (6000 if not taken else 1200)]

        async def scenario() -> None:
            node = Node(small)
            port = await node.receiver.start()
            try:
                with pytest.raises(BulkError, match="refused .* --shm-size"):
                    await send_samples(
                        "127.0.0.1", port, token=TOKEN, job_id="job-a", source=0, target=1,
                        round_index=0, records=records_of(payloads), payloads=payloads,
                    )  # fmt: skip
            finally:
                await node.receiver.close()
            assert small.num_allocations == (1 if taken else 0)

        run(scenario)


def test_a_receiver_that_is_gone_fails_the_move_naming_the_node() -> None:
    async def scenario() -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        payloads = payloads_of(1)
        with pytest.raises(
            BulkError, match="could not move 1 samples of round 3 to node 1 .*--state-dir"
        ):
            await send_samples(
                "127.0.0.1", port, token=TOKEN, job_id="job-a", source=0, target=1,
                round_index=3, records=records_of(payloads), payloads=payloads, timeout_s=20,
            )  # fmt: skip

    run(scenario)


def test_crc_is_of_the_payload() -> None:
    assert record_of(1, 2, 3, 3, 0, 0, b"abc").crc32 == zlib.crc32(b"abc")
