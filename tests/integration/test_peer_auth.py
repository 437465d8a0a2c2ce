"""Issue 29 on the peer port, with real gRPC in one event loop: the token challenge (no replay,
both directions), strangers that never stop or learn a job, the handshake deadline and cap."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpc
import pytest

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.round import HandshakeError, RoundBarrier, auth
from odbd.round.admission import MAX_HANDSHAKES
from tests.integration.test_round_barrier import (
    SETTINGS,
    TOKEN,
    close_all,
    make_config,
    open_raw_stream,
    raw_hello,
    raw_join,
    run,
    start_hub,
)

pytestmark = pytest.mark.timeout(60)


async def _refusal(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call.read()
    return refused.value


def test_a_replayed_hello_and_proof_are_refused_and_the_real_node_joins() -> None:
    """An eavesdropper captured node 1's Hello and Proof of an earlier attempt (the spoke
    restarted before the job formed); replayed on a new stream they fail the new challenge."""

    async def scenario() -> None:
        hub, starting = await start_hub(3)
        channel, call = await open_raw_stream(hub.listen_address)
        hello = raw_hello(1, 3)
        await call.write(hello)
        challenge = (await call.read()).challenge
        proof = peer_pb2.PeerMessage(
            proof=peer_pb2.Proof(spoke_proof=auth.spoke_proof(TOKEN, hello.hello, challenge.nonce))
        )
        await call.write(proof)  # admitted as node 1; the job waits for node 2
        while 1 not in hub._hub._spokes:  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
        call.cancel()  # the restart: before the job formed, node 1's slot is free again
        while 1 in hub._hub._spokes:  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
        replay_channel, replay = await open_raw_stream(hub.listen_address)
        await replay.write(hello)
        fresh = (await replay.read()).challenge
        assert fresh.nonce != challenge.nonce
        await replay.write(proof)
        refused = await _refusal(replay)
        assert refused.code() is grpc.StatusCode.UNAUTHENTICATED, refused
        assert "job-token challenge" in (refused.details() or "")
        spokes = [RoundBarrier(make_config(n, 3, hub.listen_address)) for n in (1, 2)]
        await asyncio.gather(starting, *(s.start() for s in spokes))
        assert await asyncio.gather(
            *(b.exchange(0, b"%d" % i) for i, b in enumerate([hub, *spokes]))
        )
        await channel.close()
        await replay_channel.close()
        await close_all([hub, *spokes])

    run(scenario())


def test_a_spoke_sends_nothing_to_a_hub_without_the_token() -> None:
    """A process that holds the hub's address but not the token (here: a hub of another
    token) gets a Hello, never a Proof or a contribution; the real hub's log would name it."""

    async def scenario() -> None:
        impostor, starting = await start_hub(2, job_token=b"not-the-job-token", join_timeout_s=3)
        spoke = RoundBarrier(make_config(1, 2, impostor.listen_address))
        with pytest.raises(HandshakeError, match="could not prove it holds this job's token"):
            await spoke.start()
        with pytest.raises(HandshakeError, match="node 1 failed the job-token challenge"):
            await starting  # the empty proof told it why node 1 gave up

    run(scenario())


def test_without_a_token_strangers_never_stop_the_job_nor_learn_its_settings() -> None:
    """A loopback hub without --job-token-file: a Hello of another protocol, of other
    settings, of another job or an out-of-range rank is refused on its own stream only, told
    no setting, and the real node 1 then forms the job."""

    async def scenario() -> None:
        hub, starting = await start_hub(2, job_token=b"")
        strangers = [
            ({"protocol_version": 99}, grpc.StatusCode.FAILED_PRECONDITION, "protocol 99"),
            ({"fingerprint": {}}, grpc.StatusCode.FAILED_PRECONDITION, "settings of node 1"),
            ({"job_id": "other"}, grpc.StatusCode.FAILED_PRECONDITION, "does not belong"),
            ({"node_rank": 7}, grpc.StatusCode.INVALID_ARGUMENT, "not a spoke"),
        ]
        for overrides, code, needle in strangers:
            channel, call = await open_raw_stream(hub.listen_address)
            try:
                await raw_join(call, raw_hello(1, 2, **overrides), b"")
            except grpc.aio.AioRpcError:
                pass  # refused right after the Hello (another protocol)
            refused = await _refusal(call)
            details = refused.details() or ""
            assert refused.code() is code and needle in details, (overrides, details)
            for secret in ("12288", "token_budget", "test-job", "1..1", "16"):
                assert secret not in details, (overrides, details)
            await channel.close()
        assert not starting.done()  # nothing a stranger said stopped the hub
        spoke = RoundBarrier(make_config(1, 2, hub.listen_address, job_token=b""))
        await asyncio.gather(starting, spoke.start())
        assert await asyncio.gather(hub.exchange(0, b"a"), spoke.exchange(0, b"b"))
        await close_all([hub, spoke])

    run(scenario())


def test_an_authenticated_member_with_other_settings_still_fails_fast_with_the_detail() -> None:
    async def scenario() -> None:
        hub, starting = await start_hub(2)
        settings = {**SETTINGS, "seed": "8"}
        spoke = RoundBarrier(make_config(1, 2, hub.listen_address, fingerprint=settings))
        with pytest.raises(HandshakeError, match="setting seed differs"):
            await spoke.start()
        with pytest.raises(HandshakeError, match="setting seed differs"):
            await starting

    run(scenario())


def test_a_stream_without_a_hello_is_closed_at_the_deadline() -> None:
    async def scenario() -> None:
        hub, starting = await start_hub(2, hello_timeout_s=0.5)
        channel, call = await open_raw_stream(hub.listen_address)
        refused = await _refusal(call)  # sent nothing at all
        assert refused.code() is grpc.StatusCode.DEADLINE_EXCEEDED, refused
        assert "no Hello" in (refused.details() or "")
        half_channel, half = await open_raw_stream(hub.listen_address)
        await half.write(raw_hello(1, 2))  # a Hello, but never the Proof
        assert (await half.read()).WhichOneof("kind") == "challenge"
        assert (await _refusal(half)).code() is grpc.StatusCode.DEADLINE_EXCEEDED
        spoke = RoundBarrier(make_config(1, 2, hub.listen_address))
        await asyncio.gather(starting, spoke.start())
        await channel.close()
        await half_channel.close()
        await close_all([hub, spoke])

    run(scenario())


def test_handshakes_are_capped_and_a_real_spoke_retries_past_the_strangers() -> None:
    async def scenario() -> None:
        hub, starting = await start_hub(2, hello_timeout_s=2.0)
        channels, silent = [], []
        for _ in range(MAX_HANDSHAKES):  # over several connections (16 streams each at most)
            if len(silent) % 8 == 0:
                # A channel of its own subchannel pool: its own TCP connection.
                own = [("grpc.use_local_subchannel_pool", 1)]
                channels.append(grpc.aio.insecure_channel(hub.listen_address, options=own))
            join = channels[-1].stream_stream(
                "/odbd.v1.Peer/Join",
                request_serializer=peer_pb2.PeerMessage.SerializeToString,
                response_deserializer=peer_pb2.HubMessage.FromString,
            )
            call = join()
            await call.wait_for_connection()
            silent.append(call)
        while hub._hub._handshaking < MAX_HANDSHAKES:  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
        extra_channel, extra = await open_raw_stream(hub.listen_address)
        refused = await _refusal(extra)
        assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        # The real spoke is refused too while the strangers hold every slot, retries, and
        # joins once the deadline closed them.
        spoke = RoundBarrier(make_config(1, 2, hub.listen_address))
        await asyncio.gather(starting, spoke.start())
        assert hub._hub._handshaking == 0  # type: ignore[union-attr]
        for channel in (*channels, extra_channel):
            await channel.close()
        await close_all([hub, spoke])

    run(scenario(), timeout_s=40.0)


def test_a_huge_hello_is_refused_before_its_strings_reach_the_log() -> None:
    async def scenario() -> None:
        hub, starting = await start_hub(2)
        channel, call = await open_raw_stream(hub.listen_address)
        await call.write(raw_hello(1, 2, job_id="x" * 100_000))
        refused = await _refusal(call)
        assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT, refused
        assert "over the 65536 allowed" in (refused.details() or "")
        await channel.close()
        spoke = RoundBarrier(make_config(1, 2, hub.listen_address))
        await asyncio.gather(starting, spoke.start())
        await close_all([hub, spoke])

    run(scenario())


def test_connections_are_capped_and_the_real_spoke_joins_after_them() -> None:
    """300 raw TCP connections that never speak HTTP/2: the hub keeps num_nodes + 256 and
    closes the rest at once (each would otherwise hold its buffers until the 10 s HTTP/2
    handshake deadline); the real spoke reconnects and joins once they are gone."""

    async def scenario() -> None:
        hub, starting = await start_hub(2)
        host, port = hub.listen_address.rsplit(":", 1)
        strangers = [socket.create_connection((host, int(port))) for _ in range(300)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while (closed := sum(map(_closed_by_peer, strangers))) < 300 - 258:
            assert loop.time() < deadline, closed
            await asyncio.sleep(0.05)
        assert closed == 300 - 258, closed
        for stranger in strangers:
            stranger.close()
        spoke = RoundBarrier(make_config(1, 2, hub.listen_address))
        await asyncio.gather(starting, spoke.start())
        await close_all([hub, spoke])

    run(scenario())


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
