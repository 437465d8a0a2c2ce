"""RoundBarrier.exchange_reduced on real gRPC over 127.0.0.1 (issue 25): the hub sends every node
its one reduced result instead of every node's payload, and counts the bytes it sent."""

from __future__ import annotations

import asyncio

import pytest

from odbd.round import PeerLostError, RoundTimeoutError
from tests.integration.test_round_barrier import close_all, payload, run, start_cluster

pytestmark = pytest.mark.timeout(60)


def digest(payloads: list[bytes]) -> bytes:
    """A reduction that depends on every payload and its place."""
    return b"|".join(p[:4] + len(p).to_bytes(4, "little") for p in payloads)


@pytest.mark.parametrize("last", [0, 2])
def test_every_node_gets_the_hubs_reduction_whoever_contributes_last(last: int) -> None:
    async def scenario() -> None:
        barriers = await start_cluster(3)
        try:
            for k in range(4):
                first = [
                    asyncio.create_task(b.exchange_reduced(k, payload(n, k), digest))
                    for n, b in enumerate(barriers)
                    if n != last
                ]
                await asyncio.sleep(0.05)  # the others are in: the late one is the straggler
                got = await barriers[last].exchange_reduced(k, payload(last, k), digest)
                assert got == digest([payload(n, k) for n in range(3)])
                assert all(r == got for r in await asyncio.gather(*first))
            hub, spokes = barriers[0].traffic, [b.traffic for b in barriers[1:]]
            assert hub.sent == sum(s.received for s in spokes) > 0
            assert hub.received == sum(s.sent for s in spokes) > 0
            # each result is the reduction (~26 bytes) in a RoundResult, not the payloads
            assert all(s.received < 4 * 64 for s in spokes), spokes
        finally:
            await close_all(barriers)

    run(scenario())


def test_relayed_and_reduced_rounds_mix_in_order() -> None:
    """Round k relays (exchange), round k + 1 reduces: each gets what it asked for."""

    async def scenario() -> None:
        barriers = await start_cluster(2)
        try:
            for k in range(0, 6, 2):
                relayed = await asyncio.gather(
                    *(b.exchange(k, payload(n, k)) for n, b in enumerate(barriers))
                )
                assert relayed == [[payload(0, k), payload(1, k)]] * 2
                reduced = await asyncio.gather(
                    *(
                        b.exchange_reduced(k + 1, payload(n, k + 1), digest)
                        for n, b in enumerate(barriers)
                    )
                )
                assert reduced == [digest([payload(0, k + 1), payload(1, k + 1)])] * 2
        finally:
            await close_all(barriers)

    run(scenario())


def test_a_reduction_that_refuses_a_payload_fails_the_job_on_every_node() -> None:
    def picky(payloads: list[bytes]) -> bytes:
        raise ValueError(f"node 1 sent {len(payloads[1])} bytes that are not a summary")

    async def scenario() -> None:
        barriers = await start_cluster(2)
        try:
            results = await asyncio.gather(
                *(b.exchange_reduced(0, payload(n, 0), picky) for n, b in enumerate(barriers)),
                return_exceptions=True,
            )
            for error in results:
                assert isinstance(error, PeerLostError), results
                assert "round 0 cannot be planned" in str(error)
                assert "node 1 sent" in str(error) and "not a summary" in str(error)
        finally:
            await close_all(barriers)

    run(scenario())


def test_a_single_node_reduces_its_own_payload() -> None:
    async def scenario() -> None:
        barriers = await start_cluster(1)
        try:
            got = await barriers[0].exchange_reduced(0, b"abcdefgh", digest)
            assert got == digest([b"abcdefgh"])
            assert barriers[0].traffic.sent == barriers[0].traffic.received == 0
        finally:
            await close_all(barriers)

    run(scenario())


def test_a_round_timeout_names_the_planners_round_and_exchange() -> None:
    """The live daemons run two barrier rounds per planner round: barrier round 3 is the
    second exchange of round 1, and that is what the deadline's message says."""

    async def scenario() -> None:
        barriers = await start_cluster(2, exchanges_per_round=2, round_timeout_s=1.0)
        try:
            for k in range(3):
                await asyncio.gather(
                    *(b.exchange_reduced(k, payload(n, k), digest) for n, b in enumerate(barriers))
                )
            with pytest.raises(RoundTimeoutError, match=r"round 1 \(exchange 2 of 2\) did not"):
                await barriers[0].exchange_reduced(3, payload(0, 3), digest)
        finally:
            await close_all(barriers)

    run(scenario())
