"""Serving: the node's unix socket (the step and ingest sockets beside the gRPC one, with the
admin and health servicers), Prometheus /metrics, `odbd status`'s snapshot, and grpc.health.v1
(SERVING once the job formed and samples can flow)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from odbclient.framing import ingest_socket_path, steps_socket_path
from odbclient.wire.odbd.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    ingest_pb2_grpc,
    trainer_pb2_grpc,
)
from odbd.daemon.daemon_state import DaemonState
from odbd.daemon.socket_claim import claim_socket_path
from odbd.errors import ConfigError
from odbd.grpc_guard import DecodeGuard
from odbd.ingest.ingest_socket import IngestServer
from odbd.ingest.lanes import Lanes
from odbd.ingest.service import LegacyProduceRefusal
from odbd.metrics.collector import DaemonCollector
from odbd.metrics.http_server import start_metrics_server
from odbd.serve.admin_service import AdminService
from odbd.serve.progress_status import progress_fields, trained_fields
from odbd.serve.step_socket import StepServer
from odbd.serve.trainer_service import LegacyTrainRefusal, TrainerService

log = logging.getLogger("odbd")

_MESSAGE_BYTES = 16 * 1024 * 1024  # local messages carry metadata only; bulk bytes are in shm
_HEALTH_PERIOD_S = 0.2  # producers attach and leave without a callback: health is polled


def is_serving(*, phase: str, peers_joined: bool, producers: int, external_producers: bool) -> bool:
    """grpc.health.v1 SERVING: the job formed and samples can flow, and not draining.

    With --dataset the daemon's own producers must be connected; with --dataset-size the
    producers are external and may attach later, so joined peers are enough.
    """
    if phase != "running" or not peers_joined:
        return False
    return external_producers or producers > 0


class DaemonServing(DaemonState):
    """The daemon's servers: the unix socket (ingest, trainer, admin, health), /metrics and
    the health probes."""

    async def _serve_socket(self, trainer: TrainerService) -> None:
        path = self.config.socket
        claim_socket_path(path)  # again: a stale file may have appeared since startup began
        # The framed sockets first: a client that finds the gRPC socket answering but no step
        # (ingest) socket beside it may then conclude the daemon is older than protocol 6 (7).
        steps_path = steps_socket_path(path)
        claim_socket_path(steps_path)
        self.step_server = StepServer(trainer, steps_path)
        await self.step_server.start()
        assert self.ingest is not None
        ingest_path = ingest_socket_path(path)
        claim_socket_path(ingest_path)
        self.ingest_server = IngestServer(self.ingest, ingest_path)
        await self.ingest_server.start()
        options = [
            ("grpc.max_receive_message_length", _MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MESSAGE_BYTES),
        ]
        server = grpc.aio.server(options=options, interceptors=[DecodeGuard()])
        ingest_pb2_grpc.add_IngestServicer_to_server(LegacyProduceRefusal(), server)
        trainer_pb2_grpc.add_TrainerServicer_to_server(LegacyTrainRefusal(), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(self.snapshot), server)
        old_umask = os.umask(0o177)  # the socket file is created 0600: only this user connects
        try:
            server.add_insecure_port(f"unix:{path}")
            await server.start()
        finally:
            os.umask(old_umask)
        self.server = server
        info = os.stat(path)
        self._socket_id = (info.st_dev, info.st_ino)  # shutdown unlinks only this file
        os.chmod(path, 0o600)

    def _serve_metrics(self, lanes: Lanes) -> None:
        if self.config.metrics_port is None:
            return
        registry = CollectorRegistry(auto_describe=False)
        registry.register(DaemonCollector(self.stats, lambda: self._live_gauges(lanes)))
        host, port = self.config.metrics_host, self.config.metrics_port
        try:
            server = start_metrics_server(host, port, registry)
        except OSError as error:
            raise ConfigError(
                f"cannot serve /metrics on {host}:{port}: {error}; "
                "pick a free --metrics-port (or a local --metrics-host)"
            ) from None
        self._metrics_server = server
        self.metrics_address = f"{host}:{server.server_port}"
        log.info("serving Prometheus metrics on http://%s/metrics", self.metrics_address)

    def _live_gauges(self, lanes: Lanes) -> dict[str, float]:
        # Runs on the metrics thread: reads only plain attributes (a torn read is harmless).
        assert self.arena is not None
        return {
            "buffered_samples": self.state.buffered_now(),
            "leased_samples": len(self.state.leases),
            "queued_steps": sum(q.queued_steps() for q in self.queues.values()),
            "shm_used_bytes": self.arena.used_bytes,
            "shm_capacity_bytes": self.arena.capacity_bytes,
            "producers": len(self.ingest.sessions) if self.ingest else 0,
            "producers_lane_full": self.ingest.num_lane_full() if self.ingest else 0,
            "trainers": sum(q.attached for q in self.queues.values()),
        }

    def snapshot(self) -> admin_pb2.StatusReply:
        """What `odbd status` shows: read-only facts of this daemon."""
        loop, arena = self.loop, self.arena
        ranks = [
            admin_pb2.RankStatus(
                rank=rank,
                attached=q.attached,
                queued_steps=q.queued_steps(),
                delivered_steps=self.stats.rank(rank).delivered_steps,
                wait_s=self.stats.rank(rank).wait_s,
                compute_s=self.stats.rank(rank).compute_s,
                **trained_fields(q.trained),
            )
            for rank, q in sorted(self.queues.items())
        ]
        return admin_pb2.StatusReply(
            job_id=self.config.job_id,
            node_rank=self.config.node_rank,
            num_nodes=self.config.world.num_nodes,
            epoch=self.state.epoch,
            round=loop.round_index if loop else 0,
            dataset_size=self.state.dataset_size,
            epoch_emitted_samples=self.stats.epoch_samples,
            buffered_samples=self.state.buffered_now(),
            leased_samples=len(self.state.leases),
            producers=len(self.ingest.sessions) if self.ingest else 0,
            producers_lane_full=self.ingest.num_lane_full() if self.ingest else 0,
            shm_used_bytes=arena.used_bytes if arena else 0,
            shm_capacity_bytes=arena.capacity_bytes if arena else 0,
            ranks=ranks,
            rejected_by_reason=dict(self.stats.rejected),
            uptime_s=time.monotonic() - self.started_s,
            phase=self.phase,
            last_error=self.last_error,
            waiting_for=loop.waiting_for if loop else "",
            ending=loop.ending_status(time.monotonic()) if loop else "",
            cost_model=self._cost_model_status(),
            migrate=self.config.migrate,
            migrated_out_samples=self.stats.migrated_out_samples,
            migrated_out_bytes=self.stats.migrated_out_bytes,
            migrated_in_samples=self.stats.migrated_in_samples,
            migrated_in_bytes=self.stats.migrated_in_bytes,
            migration_rounds_none=self.stats.migration_rounds["none"],
            migration_rounds_balanced=self.stats.migration_rounds["balanced"],
            migration_rounds_dealt=self.stats.migration_rounds["dealt"],
            **progress_fields(self.stats, time.monotonic()),
        )

    def _cost_model_status(self) -> admin_pb2.CostModelStatus:
        fit, mode = self.stats.cost_fit, self.config.cost_model.value
        fixed = self.stats.fixed_cost
        if fit is None:  # before the first round
            return admin_pb2.CostModelStatus(
                mode=mode, state="warmup", a=fixed.a, b=fixed.b, c=fixed.c,
                fit_error=math.nan, fixed_error=math.nan,
            )  # fmt: skip
        used = fit.model if self.stats.cost_learned else fixed
        return admin_pb2.CostModelStatus(
            mode=mode, state=fit.state.value, learned=self.stats.cost_learned,
            a=used.a, b=used.b, c=used.c,
            a_seconds=fit.seconds[0], b_seconds=fit.seconds[1], c_seconds=fit.seconds[2],
            fit_error=fit.error, fixed_error=fit.fixed_error, observations=fit.num_observations,
        )  # fmt: skip

    # -- health ------------------------------------------------------------------------------

    async def _serve_health_tcp(self) -> None:
        """grpc.health.v1 on TCP for Kubernetes gRPC probes (the unix socket serves it too)."""
        if not self.config.health_listen:
            return
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            server.add_insecure_port(self.config.health_listen)
        except RuntimeError as error:
            raise ConfigError(
                f"cannot serve health checks on {self.config.health_listen} ({error}); "
                "pick a free --health-listen"
            ) from None
        await server.start()
        self._health_server = server

    async def _update_health(self) -> None:
        serving = is_serving(
            phase=self.phase,
            peers_joined=self._peers_joined,
            producers=len(self.ingest.sessions) if self.ingest else 0,
            external_producers=self.config.dataset is None,
        )
        if serving != self.stats.serving:
            self.stats.serving = serving
            status = health_pb2.HealthCheckResponse.NOT_SERVING
            if serving:
                status = health_pb2.HealthCheckResponse.SERVING
            await self.health.set("", status)

    async def _watch_health(self) -> None:
        while True:
            await self._update_health()
            await asyncio.sleep(_HEALTH_PERIOD_S)
