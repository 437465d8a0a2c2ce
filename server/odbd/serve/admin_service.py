"""The Admin gRPC service: a read-only snapshot of the daemon for `odbd status`."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from odbclient.wire.odbd.v1 import admin_pb2, admin_pb2_grpc


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, snapshot: Callable[[], admin_pb2.StatusReply]) -> None:
        self._snapshot = snapshot

    async def Status(  # noqa: N802 (gRPC method name)
        self, request: admin_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StatusReply:
        return self._snapshot()
