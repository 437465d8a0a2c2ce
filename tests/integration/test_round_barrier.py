"""RoundBarrier on real gRPC over 127.0.0.1: daemons in separate processes, and fast in-process
cases (several barriers in one event loop) for the protocol's edges."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any, cast

import grpc
import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.errors import ConfigError, InvariantError, OdbdError
from odbd.round import (
    PROTOCOL_VERSION,
    HandshakeError,
    PayloadTooLargeError,
    PeerLostError,
    RoundBarrier,
    RoundConfig,
    RoundTimeoutError,
    auth,
)

SETTINGS = {"world": "16", "ranks_per_node": "4", "token_budget": "12288", "seed": "7"}
TOKEN = b"job-token"
SPAWN = mp.get_context("spawn")


def payload(node: int, round_index: int) -> bytes:
    """Distinct, size-varying payloads so a misordered or mixed-up result cannot pass."""
    return hashlib.sha256(f"{node}:{round_index}".encode()).digest() * (
        1 + (7 * node + round_index) % 40
    )


def make_config(node: int, num_nodes: int, hub_address: str, **overrides: Any) -> RoundConfig:
    fields: dict[str, Any] = {
        "job_id": "test-job",
        "node_rank": node,
        "num_nodes": num_nodes,
        "peers": (hub_address or "127.0.0.1:0",) + ("127.0.0.1:0",) * (num_nodes - 1),
        "listen": "127.0.0.1:0",
        "fingerprint": SETTINGS,
        "job_token": TOKEN,
        "join_timeout_s": 20.0,
        "round_timeout_s": 30.0,
    }
    fields.update(overrides)
    return RoundConfig(**fields)


# -- one daemon per process --------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What one daemon process does."""

    num_nodes: int
    rounds: int = 50
    pipelined: bool = False  # send round k+1 before awaiting round k's result
    pause_after: int | None = None  # report "paused" after this round, then sleep (stall or kill)
    pause_s: float = 30.0
    uvloop: bool = False  # run the daemon's event loop on uvloop, as the daemon does when present
    config: dict[str, Any] = field(default_factory=dict)


async def _run_daemon(node: int, plan: Plan, hub_address: str, out: Any) -> str:
    barrier = RoundBarrier(make_config(node, plan.num_nodes, hub_address, **plan.config))
    starting = asyncio.create_task(barrier.start())
    while node == 0 and not barrier.listen_address and not starting.done():
        await asyncio.sleep(0.01)
    if node == 0 and barrier.listen_address:
        out.send((0, "address", barrier.listen_address))
    try:
        await starting
        digest = hashlib.sha256()
        pending = None
        for k in range(plan.rounds):
            exchange = asyncio.create_task(barrier.exchange(k, payload(node, k)))
            if plan.pipelined and pending is None:
                pending = exchange
                continue
            for done_round, task in (
                ((k - 1, pending), (k, exchange)) if pending else ((k, exchange),)
            ):
                got = await task
                assert got == [payload(n, done_round) for n in range(plan.num_nodes)], done_round
                digest.update(b"".join(got))
            pending = None
            if plan.pause_after == k:
                out.send((node, "paused", k))
                await asyncio.sleep(plan.pause_s)
                return "paused"
        return digest.hexdigest()
    finally:
        await barrier.close()


def _daemon_main(node: int, plan: Plan, hub_address: str, out: Any) -> None:
    try:
        daemon = _run_daemon(node, plan, hub_address, out)
        result = uvloop.run(daemon) if plan.uvloop else asyncio.run(daemon)
        out.send((node, "ok", result))
    except OdbdError as exc:
        out.send((node, type(exc).__name__, str(exc)))


def _spawn(node: int, plan: Plan, hub_address: str) -> tuple[Any, Connection]:
    # One pipe per daemon, not a shared Queue: killing a daemon while its Queue feeder thread
    # holds the queue's cross-process lock would wedge every other daemon's report.
    receiver, sender = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=_daemon_main, args=(node, plan, hub_address, sender), daemon=True)
    proc.start()
    sender.close()
    return proc, receiver


def run_job(
    plans: list[Plan],
    timeout_s: float = 60.0,
    on_pause: Callable[[int, list[Any]], tuple[str, Any] | None] | None = None,
) -> dict[int, tuple[str, Any]]:
    """Runs node 0 then the others in spawned processes; returns node -> (outcome, detail).

    `on_pause(node, procs)` runs when a daemon reports it paused; it may return its outcome.
    """
    hub, hub_pipe = _spawn(0, plans[0], "")
    procs: list[Any] = [hub]
    pipes: list[Connection] = [hub_pipe]
    paused: list[Any] = []
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < len(plans):
            ready = wait(pipes, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"daemons did not finish in {timeout_s} s: {outcomes}")
            for pipe in cast(list[Connection], ready):
                try:
                    message: tuple[int, str, Any] = pipe.recv()
                except EOFError:
                    pipes.remove(pipe)
                    continue
                node, kind, detail = message
                if kind == "address":
                    for n, plan in enumerate(plans[1:], start=1):
                        proc, spoke_pipe = _spawn(n, plan, detail)
                        procs.append(proc)
                        pipes.append(spoke_pipe)
                elif kind == "paused":
                    paused.append(procs[node])
                    if on_pause is not None and (outcome := on_pause(node, procs)) is not None:
                        outcomes[node] = outcome
                else:
                    outcomes[node] = (kind, detail)
    finally:
        for proc in procs:
            proc.join(timeout=0 if proc in paused else 5)  # a paused daemon sleeps on
            if proc.is_alive():
                proc.kill()
    return outcomes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_nodes", [2, 4])
def test_daemons_exchange_fifty_rounds_and_agree(num_nodes: int) -> None:
    # Half of the daemons pipeline (round k+1 in flight before round k's result is consumed);
    # with 4 nodes the hub and one spoke run on uvloop.
    plans = [
        Plan(num_nodes, pipelined=bool(n % 2), uvloop=num_nodes == 4 and n in (0, 3))
        for n in range(num_nodes)
    ]
    outcomes = run_job(plans)
    assert {kind for kind, _ in outcomes.values()} == {"ok"}, outcomes
    assert len({digest for _, digest in outcomes.values()}) == 1


@pytest.mark.timeout(60)
def test_fingerprint_mismatch_is_refused_naming_the_setting_and_both_values() -> None:
    theirs = {**SETTINGS, "token_budget": "8192"}
    plans = [Plan(2), Plan(2, config={"fingerprint": theirs})]
    outcomes = run_job(plans)
    for node in (0, 1):
        kind, message = outcomes[node]
        assert kind == "HandshakeError", outcomes
        assert "setting token_budget differs" in message
        assert "12288" in message and "8192" in message


@pytest.mark.timeout(60)
def test_wrong_token_is_refused() -> None:
    # The join deadline must outlast spawning the refused spoke (an interpreter start and imports,
    # seconds on a loaded machine), or the hub times out before it ever saw the wrong token.
    plans = [Plan(2, config={"join_timeout_s": 10.0}), Plan(2, config={"job_token": b"guess"})]
    outcomes = run_job(plans)
    assert outcomes[1][0] == "HandshakeError"
    assert "could not prove it holds this job's token" in outcomes[1][1], outcomes
    # A stranger cannot stop the hub; it times out naming the node and why it was refused.
    assert outcomes[0][0] == "HandshakeError"
    assert "node 1 failed the job-token challenge" in outcomes[0][1], outcomes


@pytest.mark.timeout(60)
def test_a_peer_that_never_contributes_makes_everyone_time_out_naming_it() -> None:
    config = {"round_timeout_s": 2.0}
    plans = [Plan(3, rounds=10, config=config) for _ in range(3)]
    plans[2] = replace(plans[2], pause_after=2, pause_s=60.0)  # stalls for good
    outcomes = run_job(plans, on_pause=lambda node, procs: ("stalled", None))
    for node in (0, 1):
        kind, message = outcomes[node]
        assert kind == "RoundTimeoutError", outcomes
        assert "round 3" in message and "node 2 (127.0.0.1:" in message and "2 s" in message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim", [2, 0])
def test_a_killed_daemon_fails_the_others_with_a_clear_error(victim: int) -> None:
    def kill(node: int, procs: list[Any]) -> tuple[str, Any]:
        procs[node].kill()
        return ("killed", None)

    plans = [Plan(3, rounds=10) for _ in range(3)]
    plans[victim] = replace(plans[victim], pause_after=2)
    outcomes = run_job(plans, on_pause=kill)
    survivors = [n for n in range(3) if n != victim]
    for node in survivors:
        kind, message = outcomes[node]
        assert kind == "PeerLostError", outcomes
        assert ("node 2 (127.0.0.1:" if victim == 2 else "the hub node 0") in message


# -- several barriers in one event loop --------------------------------------------------------


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 20.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def start_hub(num_nodes: int, **overrides: Any) -> tuple[RoundBarrier, asyncio.Task[None]]:
    """A hub listening (its address known), and its start() still waiting for the spokes."""
    hub = RoundBarrier(make_config(0, num_nodes, "", **overrides))
    starting = asyncio.create_task(hub.start())
    while not hub.listen_address:
        if starting.done():
            starting.result()
        await asyncio.sleep(0.01)
    return hub, starting


async def start_cluster(num_nodes: int, **overrides: Any) -> list[RoundBarrier]:
    hub, starting = await start_hub(num_nodes, **overrides)
    spokes = [
        RoundBarrier(make_config(n, num_nodes, hub.listen_address, **overrides))
        for n in range(1, num_nodes)
    ]
    await asyncio.gather(starting, *(s.start() for s in spokes))
    return [hub, *spokes]


async def close_all(barriers: list[RoundBarrier]) -> None:
    await asyncio.gather(*(b.close() for b in barriers))


async def open_raw_stream(hub_address: str) -> tuple[grpc.aio.Channel, Any]:
    channel = grpc.aio.insecure_channel(hub_address)
    join = channel.stream_stream(
        "/odbd.v1.Peer/Join",
        request_serializer=peer_pb2.PeerMessage.SerializeToString,
        response_deserializer=peer_pb2.HubMessage.FromString,
    )
    return channel, join()


def raw_hello(node: int, num_nodes: int, **overrides: Any) -> peer_pb2.PeerMessage:
    config = make_config(node, num_nodes, "127.0.0.1:1")
    fields: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "job_id": config.job_id,
        "node_rank": node,
        "fingerprint": config.settings,
        "nonce": auth.new_nonce(),
    }
    fields.update(overrides)
    return peer_pb2.PeerMessage(hello=peer_pb2.Hello(**fields))


async def raw_join(call: Any, hello: peer_pb2.PeerMessage, token: bytes = TOKEN) -> None:
    """Hello and the Proof answering the hub's Challenge, as a spoke would (auth.py)."""
    await call.write(hello)
    reply = await call.read()
    assert reply.WhichOneof("kind") == "challenge", reply
    proof = auth.spoke_proof(token, hello.hello, reply.challenge.nonce)
    await call.write(peer_pb2.PeerMessage(proof=peer_pb2.Proof(spoke_proof=proof)))


@pytest.mark.timeout(30)
def test_single_node_exchange_returns_the_payload_without_network() -> None:
    async def scenario() -> None:
        barrier = RoundBarrier(make_config(0, 1, "", peers=(), listen=""))
        await barrier.start()
        assert barrier.listen_address == ""
        assert await barrier.exchange(0, b"offer") == [b"offer"]
        assert await barrier.exchange(1, b"") == [b""]
        await barrier.close()

    run(scenario())


@pytest.mark.timeout(30)
def test_pipelined_rounds_in_one_loop_return_in_node_order() -> None:
    async def scenario() -> None:
        barriers = await start_cluster(3)
        try:
            await pipelined_rounds(barriers)
        finally:
            await close_all(barriers)

    async def pipelined_rounds(barriers: list[RoundBarrier]) -> None:
        tasks = [
            [asyncio.create_task(b.exchange(k, payload(n, k))) for n, b in enumerate(barriers)]
            for k in range(4)  # four rounds in flight at once
        ]
        for k, round_tasks in enumerate(tasks):
            for got in await asyncio.gather(*round_tasks):
                assert got == [payload(n, k) for n in range(3)]
        assert barriers[1].last_round is not None and barriers[1].last_round.round_index == 3

    run(scenario())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("last", [0, 1, 2])
def test_whoever_contributes_last_every_node_gets_the_same_result(last: int) -> None:
    # A spoke that contributes last got its result early, before it asked (peer.proto).
    async def scenario() -> None:
        barriers = await start_cluster(3)
        try:
            await rounds_with_a_late_node(barriers)
        finally:
            await close_all(barriers)

    async def rounds_with_a_late_node(barriers: list[RoundBarrier]) -> None:
        for k in range(3):
            first = [
                asyncio.create_task(b.exchange(k, payload(n, k)))
                for n, b in enumerate(barriers)
                if n != last
            ]
            await asyncio.sleep(0.05)
            got = await barriers[last].exchange(k, payload(last, k))
            assert got == [payload(n, k) for n in range(3)]
            assert all(r == got for r in await asyncio.gather(*first))
            assert barriers[last].last_round is not None
            assert barriers[last].last_round.last_node == last

    run(scenario())


@pytest.mark.timeout(30)
def test_health_is_serving_once_every_node_joined() -> None:
    async def check(address: str) -> int:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service="odbd.v1.Peer"))
            return int(reply.status)

    async def scenario() -> None:
        hub = RoundBarrier(make_config(0, 2, ""))
        starting = asyncio.create_task(hub.start())
        while not hub.listen_address:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert await check(hub.listen_address) == health_pb2.HealthCheckResponse.NOT_SERVING
        spoke = RoundBarrier(make_config(1, 2, hub.listen_address))
        await asyncio.gather(starting, spoke.start())
        await asyncio.sleep(0.05)
        for address in (hub.listen_address, spoke.listen_address):
            assert await check(address) == health_pb2.HealthCheckResponse.SERVING
        await close_all([hub, spoke])

    run(scenario())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad_round", [0, 5])
def test_replayed_or_skipped_round_is_invalid_argument_and_fails_the_job(bad_round: int) -> None:
    async def scenario() -> None:
        hub = RoundBarrier(make_config(0, 2, ""))
        starting = asyncio.create_task(hub.start())
        while not hub.listen_address:
            await asyncio.sleep(0.01)
        channel, call = await open_raw_stream(hub.listen_address)
        await raw_join(call, raw_hello(1, 2))
        await starting
        assert (await call.read()).WhichOneof("kind") == "welcome"
        contribution = peer_pb2.Contribution(round=0, node_rank=1, payload=b"x")
        await call.write(peer_pb2.PeerMessage(contribution=contribution))
        assert await hub.exchange(0, b"h") == [b"h", b"x"]
        assert (await call.read()).WhichOneof("kind") == "result"
        contribution.round = bad_round
        await call.write(peer_pb2.PeerMessage(contribution=contribution))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"round {bad_round}" in (refused.value.details() or "")
        with pytest.raises(PeerLostError, match="node 1"):
            await hub.exchange(1, b"h")
        await channel.close()
        await hub.close()

    run(scenario())


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("overrides", "token", "code", "needle"),
    [
        ({"node_rank": 3}, TOKEN, grpc.StatusCode.INVALID_ARGUMENT, "outside 1..2"),
        ({"protocol_version": 99}, TOKEN, grpc.StatusCode.FAILED_PRECONDITION, "protocol 99"),
        ({}, b"", grpc.StatusCode.UNAUTHENTICATED, "job-token challenge"),
    ],
)
def test_bad_hellos_are_refused_with_their_status(
    overrides: dict[str, Any], token: bytes, code: grpc.StatusCode, needle: str
) -> None:
    async def scenario() -> None:
        hub = RoundBarrier(make_config(0, 3, "", join_timeout_s=1.0))
        starting = asyncio.create_task(hub.start())
        while not hub.listen_address:
            await asyncio.sleep(0.01)
        channel, call = await open_raw_stream(hub.listen_address)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await raw_join(call, raw_hello(1, 3, **overrides), token)
            await call.read()
        assert refused.value.code() is code and needle in (refused.value.details() or "")
        await channel.close()
        with pytest.raises(HandshakeError):
            await starting

    run(scenario())


@pytest.mark.timeout(30)
def test_duplicate_node_rank_is_refused() -> None:
    async def scenario() -> None:
        hub = RoundBarrier(make_config(0, 3, "", join_timeout_s=2.0))
        starting = asyncio.create_task(hub.start())
        while not hub.listen_address:
            await asyncio.sleep(0.01)
        first = RoundBarrier(make_config(1, 3, hub.listen_address))
        joining = asyncio.create_task(first.start())
        while 1 not in hub._hub._spokes:  # type: ignore[union-attr]  # admitted, not yet formed
            await asyncio.sleep(0.01)
        duplicate = RoundBarrier(make_config(1, 3, hub.listen_address))
        with pytest.raises(HandshakeError, match="INVALID_ARGUMENT.*already joined"):
            await duplicate.start()
        for task in (starting, joining):  # node 2 never came: both give up naming it
            with pytest.raises(HandshakeError, match="node 2"):
                await task

    run(scenario())


@pytest.mark.timeout(30)
def test_joining_a_daemon_that_is_not_the_hub_names_the_misordered_peers() -> None:
    async def scenario() -> None:
        other = RoundBarrier(make_config(2, 3, "127.0.0.1:1", join_timeout_s=1.0))
        starting = asyncio.create_task(other.start())
        while not other.listen_address:
            await asyncio.sleep(0.01)
        lost = RoundBarrier(make_config(1, 3, other.listen_address, join_timeout_s=1.0))
        with pytest.raises(HandshakeError, match="not the hub"):
            await lost.start()
        with pytest.raises(HandshakeError, match="could not reach the hub"):
            await starting

    run(scenario())


@pytest.mark.timeout(30)
def test_out_of_order_local_exchange_and_oversized_payload_are_refused() -> None:
    async def scenario() -> None:
        barrier = RoundBarrier(make_config(0, 1, "", peers=(), listen=""))
        await barrier.start()
        with pytest.raises(InvariantError, match="round 0 is next"):
            await barrier.exchange(1, b"")
        with pytest.raises(PayloadTooLargeError, match="lower --buffer"):
            await barrier.exchange(0, bytes(65 * 1024 * 1024))

    run(scenario())


@pytest.mark.timeout(30)
def test_bind_failure_names_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        barrier = RoundBarrier(make_config(0, 2, "", listen=address))
        with pytest.raises(ConfigError, match=f"cannot bind the peer listener to {address}"):
            run(barrier.start())


@pytest.mark.timeout(30)
def test_round_timeout_in_one_loop_fails_every_waiting_daemon() -> None:
    async def scenario() -> None:
        barriers = await start_cluster(3, round_timeout_s=0.5)
        try:
            waiting = [asyncio.create_task(b.exchange(0, b"x")) for b in barriers[:2]]
            for task in waiting:
                with pytest.raises(RoundTimeoutError, match=r"round 0 .*node 2 \(127\.0\.0\.1:"):
                    await task
            try:
                await barriers[2].exchange(0, b"late")
            except RoundTimeoutError:
                return
            # Node 2 was round 0's straggler, so the hub sent it the result early (peer.proto);
            # if its stream had not delivered the Abort yet, round 0 completes locally and the
            # abort fails the very next round instead. Either way node 2 learns of it.
            with pytest.raises(RoundTimeoutError, match=r"round 0 .*node 2 \(127\.0\.0\.1:"):
                await barriers[2].exchange(1, b"later")
        finally:
            await close_all(barriers)

    run(scenario())


@pytest.mark.timeout(60)
def test_a_round_timeout_quotes_why_the_missing_spoke_waits() -> None:
    """The spoke's Waiting message reaches the hub and every daemon's error quotes it."""

    async def waiting_scenario() -> None:
        hub, spoke = await start_cluster(2, round_timeout_s=1.5)
        try:
            await spoke.report_waiting(0, "rank 3 has 9 steps undelivered")
            with pytest.raises(RoundTimeoutError) as at_hub:
                await hub.exchange(0, b"hub offer")
            message = str(at_hub.value)
            assert "node 1" in message and "rank 3 has 9 steps undelivered" in message
            # The spoke got round 0's result early (it was the straggler): it learns of the
            # abort on its stream, without another exchange.
            deadline = time.monotonic() + 10.0
            with pytest.raises(RoundTimeoutError, match="rank 3 has 9 steps undelivered"):
                while time.monotonic() < deadline:
                    spoke.raise_failure()
                    await asyncio.sleep(0.02)
        finally:
            await close_all([hub, spoke])

    run(waiting_scenario())


@pytest.mark.timeout(60)
def test_a_hub_whose_own_loop_was_blocked_past_the_deadline_blames_itself() -> None:
    """The event loop is blocked (as if SIGSTOPped) while the spoke's contribution is in flight."""

    async def scenario() -> None:
        hub, spoke = await start_cluster(2, round_timeout_s=1.0)
        try:
            round0 = asyncio.create_task(hub.exchange(0, b"hub offer"))
            await asyncio.sleep(0.3)  # let the hub's contribution arm the round deadline
            time.sleep(2.5)  # the fault: this process (the hub's loop) does not run
            with pytest.raises(OdbdError) as failed:
                await round0
            message = str(failed.value)
            assert "node 0, the hub) itself did not run for" in message, message
            assert "is not to blame" in message, message
        finally:
            await close_all([hub, spoke])

    run(scenario())


@pytest.mark.timeout(30)
def test_a_hub_restarted_from_its_journal_names_the_spoke_that_kept_running() -> None:
    """Only the hub restarted from --state-dir (found with a 2-node --max-updates job whose
    spoke had planned every step and kept serving them): the spoke never joins again, and the
    hub's join failure told the operator to 'start every daemon with the same --peers' while
    node 1 ran; now it says to restart node 1's daemon with its --state-dir too."""

    async def scenario() -> None:
        hub = RoundBarrier(make_config(0, 2, "", join_timeout_s=0.5, from_journal=True))
        with pytest.raises(HandshakeError) as failed:
            await hub.start()
        text = str(failed.value)
        assert "node 1" in text and "restarted from its --state-dir journal" in text, text
        assert "stop the daemon of node 1 too" in text and "same --peers" not in text, text
        await hub.close()

    run(scenario())
