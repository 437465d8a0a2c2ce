"""The peer gRPC listener of a daemon: the Peer service (hub) or a refusal (others) plus Health."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.errors import ConfigError
from odbd.grpc_guard import DecodeGuard
from odbd.round.config import SERVER_OPTIONS, PeerTls, parse_address

PEER_SERVICE = "odbd.v1.Peer"
JOIN_METHOD = f"/{PEER_SERVICE}/Join"

JoinBehavior = Callable[[object, grpc.aio.ServicerContext], Awaitable[None]]


def _passthrough(data: bytes) -> bytes:
    # The hub serializes each RoundResult once and writes the same bytes to every stream, instead
    # of letting gRPC serialize a message of all nodes' payloads once per spoke.
    return data


def join_handler(behavior: JoinBehavior) -> grpc.GenericRpcHandler:
    """Peer/Join with PeerMessage requests and pre-serialized HubMessage bytes as responses."""
    method = grpc.stream_stream_rpc_method_handler(
        behavior,
        request_deserializer=peer_pb2.PeerMessage.FromString,
        response_serializer=_passthrough,
    )
    return grpc.method_handlers_generic_handler(PEER_SERVICE, {"Join": method})


def not_the_hub_handler(node_rank: int, fanout: int = 0) -> grpc.GenericRpcHandler:
    """A Join that reaches a daemon without children (a leaf of the relay tree) means --peers
    is out of order, or --round-fanout differs, on the caller."""

    async def refuse(_requests: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this daemon is node {node_rank}, not the hub, and relays for no node of the round "
            f"tree (--round-fanout {fanout}); --peers must list node 0's daemon first, every "
            "node in node-rank order, and --round-fanout must be the same on every daemon",
        )

    return join_handler(refuse)


class PeerHealth:
    """grpc.health.v1 statuses of the listener: SERVING once every node joined, until a failure."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self._pending: set[asyncio.Task[None]] = set()

    def set_serving(self, serving: bool) -> None:
        """Callable from synchronous protocol code; the servicer's update is a task."""
        status = health_pb2.HealthCheckResponse.SERVING
        if not serving:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", PEER_SERVICE):
            task = asyncio.get_running_loop().create_task(self.servicer.set(service, status))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def drain(self) -> None:
        await self.servicer.enter_graceful_shutdown()


async def serve(
    listen: str,
    handler: grpc.GenericRpcHandler,
    peer_health: PeerHealth,
    tls: PeerTls | None = None,
    num_nodes: int = 1,
) -> tuple[grpc.aio.Server, str]:
    """Binds and starts the listener; returns it and the bound "host:port" (port 0 resolved)."""
    host, _ = parse_address(listen, "--listen")
    # Connections beyond the job's own are strangers' (and probes): bounded, so they cannot
    # hold unbounded memory. A spoke turned away here reconnects (wait_for_ready) until its
    # join deadline, as it does while the hub is still starting.
    options = (*SERVER_OPTIONS, ("grpc.max_allowed_incoming_connections", num_nodes + 256))
    server = grpc.aio.server(options=options, interceptors=[DecodeGuard()])
    server.add_generic_rpc_handlers((handler,))
    health_pb2_grpc.add_HealthServicer_to_server(peer_health.servicer, server)
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:  # mTLS: a peer without a certificate of the job's CA cannot even say Hello
            port = server.add_secure_port(listen, tls.server_credentials())
    except RuntimeError as exc:
        raise ConfigError(
            f"cannot bind the peer listener to {listen} ({exc}); another process may hold the "
            "port or the host is not an address of this machine: pick another --listen"
        ) from None
    await server.start()
    peer_health.set_serving(False)
    return server, f"{host}:{port}"
