"""The node daemon's life: startup -> round loop -> drain -> shutdown (uvicorn-style).

startup: reclaim stale shm and create the arena, serve the unix socket (ingest, trainer,
health), form the job with the peer daemons, spawn producers.
main: the round loop until every epoch is planned (or the job fails).
drain: wait until the local trainers received everything queued (bounded by a grace period).
shutdown: stop producers, servers and the barrier; unlink the arena and the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket as socketlib
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from odbclient.shm import SAMPLE_LAYOUT_VERSION, Allocation
from odbclient.wire.odbd.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    ingest_pb2,
    ingest_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from odbd.config import DaemonConfig
from odbd.daemon.journal import Journal, check_header, replay
from odbd.daemon.node_state import NodeState, Rejected
from odbd.daemon.round_loop import RoundLoop
from odbd.errors import ConfigError, OdbdError
from odbd.grpc_guard import DecodeGuard
from odbd.ingest.arena import Arena
from odbd.ingest.lanes import Lanes
from odbd.ingest.service import IngestService
from odbd.ingest.supervisor import ProducerSupervisor, SupervisorConfig
from odbd.metrics.collector import DaemonCollector
from odbd.metrics.stats import DaemonStats
from odbd.round import RoundBarrier, RoundConfig
from odbd.serve.admin_service import AdminService
from odbd.serve.rank_queue import RankQueue
from odbd.serve.trainer_service import TrainerService

log = logging.getLogger("odbd")

_MESSAGE_BYTES = 16 * 1024 * 1024  # local messages carry metadata only; bulk bytes are in shm
_DRAIN_GRACE_S = 60.0
_EXPIRY_PERIOD_S = 1.0
_HEALTH_PERIOD_S = 0.2  # producers attach and leave without a callback: health is polled


class Daemon:
    def __init__(self, config: DaemonConfig, dataset_size: int) -> None:
        self.config = config
        self.state = NodeState(config, dataset_size)
        self.queues = {rank: RankQueue(rank) for rank in config.local_ranks}
        self.arena: Arena | None = None
        self.server: grpc.aio.Server | None = None
        self.barrier: RoundBarrier | None = None
        self.supervisor: ProducerSupervisor | None = None
        self.health = health.aio.HealthServicer()
        self.loop: RoundLoop | None = None
        self.ingest: IngestService | None = None
        self.exit_code = 0
        self.rejections: list[Rejected] = []
        self.stats = DaemonStats.for_config(config, dataset_size)
        self.metrics_address = ""
        self.phase = "starting"
        self.journal: Journal | None = None
        self.journal_records: list | None = None  # set when resuming from --state-dir
        self.resume_points: dict[int, tuple[int, int]] = {}
        self.resume_known = asyncio.Event()
        self.resumed = False
        self.last_error = ""
        self.started_s = time.monotonic()
        self._metrics_server: Any = None
        self._health_server: grpc.aio.Server | None = None
        self._stop = asyncio.Event()
        self._stop_deadline = float("inf")  # loop time by which a SIGTERM's drain must end
        self._peers_joined = False

    # -- startup -----------------------------------------------------------------------------

    async def startup(self) -> None:
        config = self.config
        self.arena = Arena.create(config.job_id, config.node_rank, config.shm_size)
        lanes = Lanes(self.arena, self._lane_bytes())
        self.ingest = IngestService(
            state=self.state,
            lanes=lanes,
            welcome=self._ingest_welcome(),
            lease_timeout_s=config.lease_timeout_s,
            on_progress=self._on_progress,
            on_rejected=self._on_rejected,
            stats=self.stats,
        )
        trainer = TrainerService(
            job_id=config.job_id,
            queues=self.queues,
            welcome=self._trainer_welcome(),
            on_free=lambda locations: self._free(lanes, locations),
            on_delivered=self._on_delivered,
            on_hello=self._on_trainer_hello,
        )
        self._open_journal()
        await self._serve_socket(trainer)
        self.barrier = RoundBarrier(self._round_config())
        await self.barrier.start()
        self.loop = RoundLoop(
            config=config,
            state=self.state,
            barrier=self.barrier,
            queues=self.queues,
            lanes=lanes,
            read_sample=self._read_sample,
            on_planned=lambda plan: self.ingest.pump_leases() if self.ingest else None,
            stats=self.stats,
            journal=self.journal,
            lanes_full=lambda: self.ingest is not None and self.ingest.lanes_full(),
        )
        self._serve_metrics(lanes)
        if config.dataset is not None and config.workers > 0:
            self.supervisor = ProducerSupervisor(
                SupervisorConfig(
                    socket=config.socket,
                    dataset=config.dataset,
                    dataset_args=config.dataset_args,
                    workers=config.workers,
                    job_id=config.job_id,
                ),
                on_restart=self._on_producer_restart,
            )
            await self.supervisor.start()
        self._peers_joined = True  # SERVING follows from the health watcher once running
        log.info(
            "node %d of job %r serving ranks %d..%d on %s (peers: %s)",
            config.node_rank,
            config.job_id,
            config.local_ranks[0],
            config.local_ranks[-1],
            config.socket,
            self.barrier.listen_address or "single node",
        )

    def _lane_bytes(self) -> int:
        # Room for every producer's lane plus slack, 64-byte aligned.
        lanes = max(self.config.workers, 1) + 2
        return (self.config.shm_size // lanes) // 64 * 64

    def _ingest_welcome(self) -> ingest_pb2.IngestWelcome:
        assert self.arena is not None
        return ingest_pb2.IngestWelcome(
            job_id=self.config.job_id,
            segments=list(self.arena.segment_names),
            layout_version=SAMPLE_LAYOUT_VERSION,
            length_key=self.config.length_key,
            labels_key=self.config.labels_key,
            lease_timeout_s=self.config.lease_timeout_s,
            dataset_size=self.state.dataset_size,
        )

    def _trainer_welcome(self) -> trainer_pb2.TrainerWelcome:
        assert self.arena is not None
        return trainer_pb2.TrainerWelcome(
            job_id=self.config.job_id,
            segments=list(self.arena.segment_names),
            layout_version=SAMPLE_LAYOUT_VERSION,
            world_size=self.config.world.world_size,
            length_key=self.config.length_key,
            pads=[trainer_pb2.PadValue(key=k, value=v) for k, v in self.config.pads],
            loss_scaling=self.config.loss_scaling.value,
        )

    def _round_config(self) -> RoundConfig:
        config = self.config
        nodes = config.world.num_nodes
        return RoundConfig(
            job_id=config.job_id,
            node_rank=config.node_rank,
            num_nodes=nodes,
            peers=config.peers if nodes > 1 else (),
            listen=config.listen if nodes > 1 else "",
            fingerprint=config.fingerprint(self.state.dataset_size),
            job_token=config.job_token,
            tls=config.peer_tls,
            join_timeout_s=config.join_timeout_s,
            round_timeout_s=config.round_timeout_s,
        )

    async def _serve_socket(self, trainer: TrainerService) -> None:
        path = self.config.socket
        _claim_socket_path(path)
        options = [
            ("grpc.max_receive_message_length", _MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MESSAGE_BYTES),
        ]
        server = grpc.aio.server(options=options, interceptors=[DecodeGuard()])
        assert self.ingest is not None
        ingest_pb2_grpc.add_IngestServicer_to_server(self.ingest, server)
        trainer_pb2_grpc.add_TrainerServicer_to_server(trainer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(self.snapshot), server)
        old_umask = os.umask(0o177)  # the socket file is created 0600: only this user connects
        try:
            server.add_insecure_port(f"unix:{path}")
            await server.start()
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self.server = server

    # -- restart from --state-dir -------------------------------------------------------------

    def _open_journal(self) -> None:
        if self.config.state_dir is None:
            return
        journal = Journal(self.config.state_dir, self.config.node_rank)
        fingerprint = self.config.fingerprint(self.state.dataset_size)
        if journal.exists():
            self.journal_records = journal.records()
            check_header(self.journal_records, fingerprint)
            self.state.paused = True  # producers wait until the trainers say where to resume
            log.info(
                "resuming from %s: waiting for every local trainer's resume point",
                journal.path,
            )
        journal.open(fingerprint, self.state.views_per_iteration)
        self.journal = journal

    def _on_trainer_hello(self, hello: trainer_pb2.TrainerHello) -> str | None:
        if self.journal_records is None or self.resumed:
            return None
        if not hello.resume:
            return (
                f"this daemon restarted from --state-dir {self.config.state_dir}; rank "
                f"{hello.rank} must call ODBClient.load_state_dict() with its checkpoint before "
                "iterating (or start the job afresh with an empty --state-dir)"
            )
        self.resume_points[hello.rank] = (hello.resume_epoch, hello.resume_step)
        if len(self.resume_points) == len(self.queues):
            self.resume_known.set()
        return None

    async def _resume(self) -> None:
        """Waits for every local trainer's resume point, then rebuilds state from the journal."""
        assert self.journal is not None and self.journal_records is not None and self.loop
        try:
            await asyncio.wait_for(self.resume_known.wait(), self.config.join_timeout_s)
        except TimeoutError:
            missing = sorted(set(self.queues) - set(self.resume_points))
            raise ConfigError(
                f"resuming from --state-dir: ranks {missing} sent no resume point within "
                f"{self.config.join_timeout_s:g} s; start their trainers with load_state_dict()"
            ) from None
        points = set(self.resume_points.values())
        if len(points) != 1:
            raise ConfigError(
                f"local trainers resume at different steps {self.resume_points}; every rank "
                "must load the state_dict saved at the same checkpoint step"
            )
        epoch, step = points.pop()
        resume = replay(self.journal_records, self.config.world.world_size, epoch, step)
        self.journal.append_resume(epoch, step)
        self.loop.restore(resume)
        self.resumed = True
        self.state.paused = False
        if self.ingest is not None:
            self.ingest.pump_leases()
        log.info(
            "resumed at epoch %d step %d: %d trained steps kept, the rest is produced again",
            epoch,
            step,
            len(resume.trained_steps),
        )

    def _serve_metrics(self, lanes: Lanes) -> None:
        if self.config.metrics_port is None:
            return
        registry = CollectorRegistry(auto_describe=False)
        registry.register(DaemonCollector(self.stats, lambda: self._live_gauges(lanes)))
        host, port = self.config.metrics_host, self.config.metrics_port
        try:
            server, _ = start_http_server(port, host, registry)
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
        )

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

    # -- callbacks ---------------------------------------------------------------------------

    def _on_producer_restart(self) -> None:
        self.stats.producers_restarted += 1

    def _on_delivered(self, rank: int, delivered: trainer_pb2.Delivered) -> None:
        rank_stats = self.stats.rank(rank)
        rank_stats.wait_s += delivered.wait_s
        rank_stats.compute_s += delivered.compute_s
        rank_stats.delivered_steps += max(delivered.steps, 1)
        self._on_progress()

    def _on_progress(self) -> None:
        if self.loop is not None:
            self.loop.progress.set()

    def _on_rejected(self, rejected: Rejected) -> None:
        log.warning(
            "rejected sample %d (view %d): %s: %s",
            rejected.identity,
            rejected.view_key,
            rejected.reason,
            rejected.detail,
        )
        self.rejections.append(rejected)
        self.stats.rejected[rejected.reason] += 1

    def _free(self, lanes: Lanes, locations: list) -> None:
        if locations and self.ingest is not None:
            self.ingest.give_back(lanes.free(locations))
            self.ingest.pump_leases()
            self._on_progress()

    def _read_sample(self, segment: int, offset: int, nbytes: int) -> memoryview:
        assert self.arena is not None
        name = self.arena.segment_names[segment]
        return self.arena.view(Allocation(name, offset, nbytes))

    # -- main --------------------------------------------------------------------------------

    async def run(self) -> int:
        stop = asyncio.ensure_future(self._stop.wait())
        watch: asyncio.Future[None] | None = None
        try:
            await self._serve_health_tcp()
            # A SIGTERM while the job forms (peers may take minutes) stops at once.
            starting = asyncio.ensure_future(self.startup())
            await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
                log.info("stopped before the job formed")
                return self.exit_code
            starting.result()
            assert self.loop is not None
            expiry = asyncio.ensure_future(self._expire_leases())
            if self.journal_records is not None:
                await self._resume()
            self.phase = "running"
            watch = asyncio.ensure_future(self._watch_health())
            main = asyncio.ensure_future(self.loop.run())
            done, _ = await asyncio.wait({main, stop}, return_when=asyncio.FIRST_COMPLETED)
            expiry.cancel()
            if main in done:
                main.result()  # raises the round error, if any
                self.phase = "draining"
                await self._update_health()
                await self._drain()
                self.phase = "done"
            else:
                main.cancel()
                self.loop.fail("the daemon was stopped (SIGTERM)")
                # In-flight steps were planned on every node: let the trainers take them.
                await self._drain(grace_s=self.config.drain_timeout_s)
        except OdbdError as error:
            log.error("%s", error)
            self.phase, self.last_error = "failed", str(error)
            if self.loop is not None:
                self.loop.abort(str(error))
                await self._drain(grace_s=5.0)
            self.exit_code = 1
        finally:
            stop.cancel()
            if watch is not None:
                watch.cancel()
            await self.shutdown()
        return self.exit_code

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(_EXPIRY_PERIOD_S)
            if self.ingest is not None:
                self.ingest.expire_leases()

    async def _drain(self, grace_s: float = _DRAIN_GRACE_S) -> None:
        """Waits until local trainers took everything queued (JobEnd included), or the grace."""
        deadline = asyncio.get_running_loop().time() + grace_s
        while any(q.queued_steps() or q.attached for q in self.queues.values()):
            # A SIGTERM during the end-of-job drain shortens it to --drain-timeout.
            if asyncio.get_running_loop().time() > min(deadline, self._stop_deadline):
                waiting = {
                    r: f"{q.queued_steps()} steps from {q.first_undelivered()} undelivered"
                    + (", client attached" if q.attached else "")
                    for r, q in self.queues.items()
                    if q.queued_steps() or q.attached
                }
                log.warning("stopping before trainers took everything: %s", waiting)
                return
            await asyncio.sleep(0.05)

    def request_stop(self) -> None:
        """SIGTERM: NOT_SERVING at once, then drain within --drain-timeout and release shm."""
        self.phase = "draining"
        self.stats.serving = False
        loop = asyncio.get_running_loop()
        self._stop_deadline = loop.time() + self.config.drain_timeout_s
        loop.create_task(self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
        self._stop.set()

    async def shutdown(self) -> None:
        await self.health.enter_graceful_shutdown()
        if self.ingest is not None:
            self.ingest.shutdown("the job is over")
        if self.supervisor is not None:
            await self.supervisor.stop()
        if self.server is not None:
            await self.server.stop(1.0)
        if self._health_server is not None:
            await self._health_server.stop(0.5)
        if self.barrier is not None:
            await self.barrier.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self.journal is not None:
            self.journal.close()
        if self.arena is not None:
            self.arena.close()
        with contextlib.suppress(FileNotFoundError):
            Path(self.config.socket).unlink()


def is_serving(*, phase: str, peers_joined: bool, producers: int, external_producers: bool) -> bool:
    """grpc.health.v1 SERVING: the job formed and samples can flow, and not draining.

    With --dataset the daemon's own producers must be connected; with --dataset-size the
    producers are external and may attach later, so joined peers are enough.
    """
    if phase != "running" or not peers_joined:
        return False
    return external_producers or producers > 0


def _claim_socket_path(path: str) -> None:
    """Removes a stale socket file of a dead daemon; refuses one a live daemon answers on."""
    if not os.path.exists(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return
    probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a dead daemon's leftover
        return
    finally:
        probe.close()
    raise ConfigError(f"another daemon is serving on {path}; stop it or pass a different --socket")


def run_daemon(config: DaemonConfig, dataset_size: int) -> int:
    """Runs one daemon to completion in its own event loop (uvloop when available)."""
    runner: Callable[[Coroutine[Any, Any, int]], int]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        runner = asyncio.run

    async def main() -> int:
        daemon = Daemon(config, dataset_size)
        loop = asyncio.get_running_loop()
        stops = {"count": 0}

        def on_signal() -> None:
            stops["count"] += 1
            if stops["count"] > 1:
                log.error("second signal: exiting now")
                os._exit(130)
            log.info("signal received: draining (send it again to force exit)")
            daemon.request_stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        return await daemon.run()

    return runner(main())
