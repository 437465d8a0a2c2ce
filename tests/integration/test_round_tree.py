"""The relay tree of the round exchanges (round/tree.py) on real gRPC over 127.0.0.1: relays
collect their subtree's payloads, the hub writes to at most --round-fanout children, and every
node gets the same result; a relay that dies fails the job naming it and the nodes it cut off."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import grpc
import pytest

from odbd.demo.cluster import free_ports
from odbd.round import HandshakeError, PeerLostError, RoundBarrier, RoundTimeoutError
from odbd.round.errors import PeerFailedError
from tests.aio_wait import until
from tests.integration.test_round_barrier import (
    close_all,
    make_config,
    open_raw_stream,
    payload,
    raw_hello,
    raw_join,
    run,
)
from tests.integration.test_round_reduced import digest

pytestmark = pytest.mark.timeout(60)


async def start_tree(num_nodes: int, fanout: int, **overrides: Any) -> list[RoundBarrier]:
    """Every daemon on a fixed port: a relay's children must know where it listens."""
    peers = tuple(f"127.0.0.1:{p}" for p in free_ports(num_nodes))
    barriers = [
        RoundBarrier(
            make_config(
                n, num_nodes, peers[0], peers=peers, listen=peers[n], fanout=fanout, **overrides
            )
        )
        for n in range(num_nodes)
    ]
    await asyncio.gather(*(b.start() for b in barriers))
    return barriers


def test_a_tree_of_seven_gives_every_node_the_same_results_and_the_hub_writes_to_two() -> None:
    async def scenario() -> None:
        barriers = await start_tree(7, fanout=2)
        try:
            for k in range(0, 6, 2):
                relayed = await asyncio.gather(
                    *(b.exchange(k, payload(n, k)) for n, b in enumerate(barriers))
                )
                assert relayed == [[payload(n, k) for n in range(7)]] * 7
                reduced = await asyncio.gather(
                    *(
                        b.exchange_reduced(k + 1, payload(n, k + 1), digest)
                        for n, b in reversed(list(enumerate(barriers)))
                    )
                )
                assert reduced == [digest([payload(n, k + 1) for n in range(7)])] * 7
            traffic = [b.traffic for b in barriers]
            # the hub wrote each result to its 2 children only, and they passed it on unchanged:
            # every leaf received exactly what the hub sent one child
            leaves = traffic[3:]
            assert all(t.received == leaves[0].received > 0 for t in leaves), traffic
            assert traffic[0].sent == 2 * leaves[0].received, traffic
            # a relay sent the results down to its 2 children, and its subtree's payloads up
            assert traffic[1].sent > 2 * leaves[0].received + traffic[3].sent + traffic[4].sent
        finally:
            await close_all(barriers)

    run(scenario())


def test_a_lost_relay_fails_the_job_naming_it_and_the_nodes_it_cut_off() -> None:
    """Node 1 relays for nodes 3 and 4 (fan-out 2); its streams break without a Leave (as when
    its process is killed): the hub names node 1 and the nodes it relays for, and they name it."""

    async def scenario() -> None:
        barriers = await start_tree(5, fanout=2, round_timeout_s=30.0)
        relay = barriers[1]
        try:
            await asyncio.gather(
                *(b.exchange_reduced(0, payload(n, 0), digest) for n, b in enumerate(barriers))
            )
            # a crash: the listener and the stream to the hub go away without a Leave
            assert relay._server is not None and relay._spoke is not None
            relay._spoke._call.cancel()
            await relay._server.stop(0)
            others = [n for n in range(5) if n != 1]
            started = asyncio.get_running_loop().time()
            results = await asyncio.gather(
                *(barriers[n].exchange_reduced(1, payload(n, 1), digest) for n in others),
                return_exceptions=True,
            )
            assert asyncio.get_running_loop().time() - started < 10.0  # not the 30 s deadline
            for n, error in zip(others, results, strict=True):
                assert isinstance(error, PeerLostError), (n, results)
                assert "node 1 (127.0.0.1:" in str(error), (n, error)
            hub_error = str(results[0])
            assert "the nodes it relays for (3, 4)" in hub_error, hub_error
        finally:
            await close_all(barriers)

    run(scenario())


def test_the_hubs_normal_end_after_the_last_round_is_no_loss_down_a_chain() -> None:
    """A chain 0 - 1 - 2: the hub's trainers finish first and it shuts down. The relay and the
    leaf below it must not read that as a lost peer (raise_loss), or a job would fail at its
    end whenever node 0 finishes first; later rounds still fail."""

    async def scenario() -> None:
        barriers = await start_tree(3, fanout=1)
        try:
            await asyncio.gather(*(b.exchange(0, payload(n, 0)) for n, b in enumerate(barriers)))
            await barriers[0].close()
            leaf = barriers[2]._spoke
            assert leaf is not None
            await until(lambda: leaf.failure is not None, "the leaf saw its stream end")
            for barrier in barriers[1:]:
                barrier.raise_loss()  # no loss: the parent ended normally
            with pytest.raises(PeerLostError):
                barriers[2].raise_failure()  # but no round can be exchanged any more
        finally:
            await close_all(barriers[1:])

    run(scenario())


@pytest.mark.parametrize("failing", [0, 1, 2], ids=["hub", "relay", "leaf"])
def test_a_daemon_that_fails_the_job_fails_every_node_with_its_reason(failing: int) -> None:
    """A chain 0 - 1 - 2: whichever daemon fails the job itself (say an end_job() deadline),
    its reason goes up to the hub and the hub's Abort brings it to every node."""

    async def scenario() -> None:
        barriers = await start_tree(3, fanout=1)
        reason = f"rank 5 did not call ODBClient.end_job() (node {failing} decided)"
        try:
            await asyncio.gather(*(b.exchange(0, payload(n, 0)) for n, b in enumerate(barriers)))
            await barriers[failing].fail_job(reason)

            def failed(barrier: RoundBarrier) -> bool:
                try:
                    barrier.raise_loss()
                except PeerFailedError:
                    return True
                return False

            await until(lambda: all(failed(b) for b in barriers), "every node failed")
            for barrier in barriers:
                with pytest.raises(PeerFailedError, match=re.escape(reason)):
                    barrier.raise_loss()
        finally:
            await close_all(barriers)

    run(scenario())


@pytest.mark.parametrize("says_why", [True, False])
def test_a_stalled_leaf_below_a_relay_is_named_within_the_round_deadline(says_why: bool) -> None:
    """Node 3 at the end of a chain 0 - 1 - 2 - 3 never contributes, with a Waiting reason (its
    rank did not take its steps) or without a word (a stopped process): every node fails with
    the same message, and it names node 3 (the relays' halfway reports say who holds them)."""

    async def scenario() -> None:
        barriers = await start_tree(4, fanout=1, round_timeout_s=1.0)
        try:
            if says_why:
                await barriers[3].report_waiting(0, "rank 3 has not taken its steps")
            started = asyncio.get_running_loop().time()
            results = await asyncio.gather(
                *(barriers[n].exchange_reduced(0, payload(n, 0), digest) for n in range(3)),
                return_exceptions=True,
            )
            assert asyncio.get_running_loop().time() - started < 1.0 + 5.0
            assert all(isinstance(e, RoundTimeoutError) for e in results), results
            assert len({str(e) for e in results}) == 1, results  # one verdict for the job
            assert "node 3 (127.0.0.1:" in str(results[0]), results[0]
            if says_why:
                assert "rank 3 has not taken its steps" in str(results[0]), results[0]
        finally:
            await close_all(barriers)

    run(scenario())


def test_a_daemon_restarted_before_the_job_formed_rejoins_its_relay() -> None:
    """A chain 0 - 1 - 2 (fan-out 1): node 2 joins relay 1 while the hub is not up yet, dies,
    and its restart (as from --state-dir) is admitted in its place; then the job forms."""

    async def scenario() -> None:
        peers = tuple(f"127.0.0.1:{p}" for p in free_ports(3))

        def barrier(node: int) -> RoundBarrier:
            config = make_config(node, 3, peers[0], peers=peers, listen=peers[node], fanout=1)
            return RoundBarrier(config)

        relay, first = barrier(1), barrier(2)
        relay_start, first_start = (
            asyncio.create_task(relay.start()),
            asyncio.create_task(first.start()),
        )
        while relay._hub is None or 2 not in relay._hub._spokes:
            await asyncio.sleep(0.01)
        first_start.cancel()  # node 2 dies before the job formed
        with pytest.raises(asyncio.CancelledError):
            await first_start
        while 2 in relay._hub._spokes:
            await asyncio.sleep(0.01)
        second, hub = barrier(2), barrier(0)
        barriers = [hub, relay, second]
        try:
            await asyncio.gather(hub.start(), second.start(), relay_start)
            got = await asyncio.gather(
                *(b.exchange_reduced(0, payload(n, 0), digest) for n, b in enumerate(barriers))
            )
            assert got == [digest([payload(n, 0) for n in range(3)])] * 3
        finally:
            await close_all(barriers)

    run(scenario())


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        # a daemon of the star protocol (3) that joins a relay of protocol 4
        ({"protocol_version": 3}, "node 2 speaks odbd peer protocol 3, node 1 speaks 4"),
        # --round-fanout differs: node 2 at fan-out 1 joins node 1, which has fan-out 2
        (
            {"fingerprint": {"round_fanout": "1"}},
            "setting round_fanout differs: node 1 (a relay of the round tree) has 2, node 3 has 1",
        ),
    ],
)
def test_a_relay_refuses_a_mixed_protocol_or_fanout_naming_itself(
    overrides: dict[str, Any], needle: str
) -> None:
    async def scenario() -> None:
        peers = tuple(f"127.0.0.1:{p}" for p in free_ports(5))
        config = make_config(
            1, 5, peers[0], peers=peers, listen=peers[1], fanout=2, join_timeout_s=2.0
        )
        relay = RoundBarrier(config)  # children 3 and 4 at fan-out 2
        starting = asyncio.create_task(relay.start())
        while not relay.listen_address:
            await asyncio.sleep(0.01)
        channel, call = await open_raw_stream(relay.listen_address)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            hello = raw_hello(3, 5, **overrides)
            if "fingerprint" in overrides:
                fingerprint = {**dict(config.settings), **overrides["fingerprint"]}
                hello = raw_hello(3, 5, fingerprint=fingerprint)
            await raw_join(call, hello)
            await call.read()
        details = refused.value.details() or ""
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION, details
        assert needle.replace("node 2", "node 3") in details, details
        assert "node 1" in details, details
        await channel.close()
        # a mixed release is a stranger, the job waits for the real node 3 and names it; a mixed
        # fan-out is a member of the job that can never join: the job fails to form at once
        with pytest.raises(HandshakeError, match="never joined node 1|cannot form"):
            await starting
        await relay.close()

    run(scenario())
