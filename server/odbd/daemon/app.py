"""The node daemon's life: startup -> round loop -> end of job -> shutdown (uvicorn-style).

1. startup: claim the socket path, create the arena, serve the unix socket (ingest, trainer,
   health), form the job with the peer daemons, spawn producers.
2. main: the round loop until every epoch is planned, while every local rank must attach
   within --attach-timeout (or the job fails naming it).
3. end of job: wait until every local rank took the job's end (job_end.py: no fixed grace);
   a signal waits only for attached ranks, within --drain-timeout.
4. shutdown: stop producers, servers and the barrier; close the journal; unlink the arena and
   the socket this daemon created. Each step runs even when an earlier one failed.
Any failure in 1-3 ends the job the same way (`_fail`): one ERROR line, trainers get
JobFailedError with the reason, exit 1 (2 for an operator error found at start-up).
A second signal exits at once (`_force_exit`), still releasing shm, the socket and producers.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from odbclient.framing import ingest_socket_path, steps_socket_path
from odbclient.shm import SAMPLE_LAYOUT_VERSION, Allocation, read_meta
from odbclient.wire.odbd.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    ingest_pb2,
    ingest_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from odbd.config import DaemonConfig
from odbd.daemon.job_clash import find_clash
from odbd.daemon.job_end import (
    Outcome,
    attach_failure,
    dropped_summary,
    end_verdict,
    overdue_ranks,
    presences,
)
from odbd.daemon.journal import Journal, check_header, replay
from odbd.daemon.migration_live import LiveMigration
from odbd.daemon.node_state import NodeState, Rejected
from odbd.daemon.remake import Rewinder
from odbd.daemon.round_loop import RoundLoop
from odbd.daemon.socket_claim import claim_socket_path
from odbd.daemon.split_exchange import exchanges_per_round
from odbd.daemon.split_round import check_summary_fits
from odbd.errors import ConfigError, OdbdError
from odbd.grpc_guard import DecodeGuard
from odbd.ingest.arena import Arena, ArenaInUseError
from odbd.ingest.ingest_socket import IngestServer
from odbd.ingest.lanes import Lanes
from odbd.ingest.rejections import RejectionLog, samples_made
from odbd.ingest.service import IngestService, LegacyProduceRefusal
from odbd.ingest.supervisor import ProducerSupervisor, SupervisorConfig
from odbd.metrics.collector import DaemonCollector
from odbd.metrics.http_server import start_metrics_server
from odbd.metrics.stats import DaemonStats
from odbd.planner.config import Collate
from odbd.planner.migration import LinkModel
from odbd.round import RoundBarrier, RoundConfig
from odbd.round.errors import HandshakeError
from odbd.round.traffic import round_work_line
from odbd.serve.admin_service import AdminService
from odbd.serve.progress_status import progress_fields, trained_fields
from odbd.serve.rank_queue import QueuedItem, RankQueue
from odbd.serve.step_socket import StepServer
from odbd.serve.trainer_service import LegacyTrainRefusal, TrainerService

log = logging.getLogger("odbd")

_MESSAGE_BYTES = 16 * 1024 * 1024  # local messages carry metadata only; bulk bytes are in shm
_EXPIRY_PERIOD_S = 1.0
_HEALTH_PERIOD_S = 0.2  # producers attach and leave without a callback: health is polled
_ATTENDANCE_PERIOD_S = 0.5  # how often the attach deadline is checked
_LOOP_STOP_S = 1.0  # how long a stop waits for the cancelled round loop to wind down
_END_POLL_S = 0.05  # the end-of-job wait re-reads the rank queues this often
_END_WAIT_LOG_S = 30.0  # the end-of-job wait says what it waits for this often
# A failing job tells attached trainers why (JobFailedError) before its streams close: their
# failed JobEnd goes out at once (RankQueue.finished), so this only bounds a stuck stream.
_FAILURE_NOTICE_S = 5.0
EXIT_USAGE = 2  # an operator error found at start-up (as for bad flags, cli.py)
# What a forced exit (second signal) still does, synchronously, before os._exit.
_FORCED_EXIT_STEPS = ("unlink shared memory", "remove the socket")


# Another job with our --job-id on this host: looked for this often while the job forms, and
# for this long after our arena was found taken (the other daemon may still be creating it).
_CLASH_POLL_S = 0.5
_CLASH_WAIT_S = 2.0


class AttachTimeoutError(OdbdError):
    """A local rank stayed away past --attach-timeout: the job cannot end with every step."""


class EndJobError(OdbdError):
    """ODBClient.end_job() calls that cannot end the job (different steps, or a rank missing
    past --end-timeout): daemon/end_requests.py says which ranks."""


class Daemon:
    def __init__(self, config: DaemonConfig, dataset_size: int) -> None:
        self.config = config
        self.state = NodeState(config, dataset_size)
        self.queues = {
            rank: RankQueue(rank, history_steps=config.rewind_steps) for rank in config.local_ranks
        }
        self.arena: Arena | None = None
        self.server: grpc.aio.Server | None = None
        self.step_server: StepServer | None = None  # the trainers' step socket (protocol 6)
        self.ingest_server: IngestServer | None = None  # the producers' socket (protocol 7)
        self.barrier: RoundBarrier | None = None
        self.migration: LiveMigration | None = None  # --migrate auto
        self.supervisor: ProducerSupervisor | None = None
        self.health = health.aio.HealthServicer()
        self.loop: RoundLoop | None = None
        self.ingest: IngestService | None = None
        self.exit_code = 0
        self.rewinder: Rewinder | None = None
        self.rejections: list[Rejected] = []
        self._rejection_log = RejectionLog()
        self.stats = DaemonStats.for_config(config, dataset_size)
        self.stats.trained.ranks = {rank: q.trained for rank, q in self.queues.items()}
        self.metrics_address = ""
        self.phase = "starting"
        self.journal: Journal | None = None
        self.journal_records: list | None = None  # set when resuming from --state-dir
        self.resume_points: dict[int, tuple[int, int]] = {}
        self.resume_updates: dict[int, int] = {}  # rank -> first update not trained
        self.resume_known = asyncio.Event()
        self.resumed = False
        self.last_error = ""
        self.started_s = time.monotonic()
        self._metrics_server: Any = None
        self._health_server: grpc.aio.Server | None = None
        self._stop = asyncio.Event()
        self._stop_signal = ""  # "SIGTERM" or "SIGINT" once a signal asked to stop
        self._stop_deadline_s = float("inf")  # monotonic time by which a signal's drain ends
        self._signals = 0
        self._peers_joined = False
        self._job_formed = False  # startup completed: failures are no longer start-up errors
        self._ready_s = time.monotonic()  # attach deadlines of never-attached ranks count from here
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound
        self._clash_seen = ""  # another job with our --job-id seen on this host while forming

    # -- startup -----------------------------------------------------------------------------

    async def startup(self) -> None:
        config = self.config
        world = config.world
        check_summary_fits(config.planner(0))  # follows the units, not --buffer
        # First, before anything is created: a live daemon on this socket refuses the start.
        claim_socket_path(config.socket)
        # Then the journal: one that is refused (a planted symlink) leaves nothing created.
        self._open_journal()
        try:
            self.arena = Arena.create(config.job_id, config.node_rank, config.shm_size)
        except ArenaInUseError as error:
            # A segment being created has no owner yet: give its daemon a moment to stamp it.
            for _ in range(int(_CLASH_WAIT_S / _CLASH_POLL_S)):
                named = self._named_clash(error, [config.node_rank])
                if named is not error:
                    raise named from None
                await asyncio.sleep(_CLASH_POLL_S)
            raise
        lanes = Lanes(self.arena, self._lane_bytes())
        # Read only for the first sample and mismatches: a schema_mismatch then names the key.
        self.state.sample_meta = lambda at: read_meta(
            self._read_sample(*lanes.resolve(at), at.nbytes)
        )
        self.ingest = IngestService(
            state=self.state,
            lanes=lanes,
            welcome=self._ingest_welcome(),
            lease_timeout_s=config.lease_timeout_s,
            on_progress=self._on_progress,
            on_rejected=self._on_rejected,
            stats=self.stats,
            on_error=self._on_ingest_error,
            kill_worker=lambda name: self.supervisor.kill_hung(name) if self.supervisor else None,
            is_worker=lambda name: self.supervisor is not None and self.supervisor.supervises(name),
        )
        self.rewinder = Rewinder(
            node=config.node_rank,
            resolve=lanes.resolve_many,
            free=lambda locations: self._free(lanes, locations),
            fail=lambda reason: self.loop.give_up(reason) if self.loop else None,
            wake=lambda: self.ingest.pump_leases() if self.ingest else None,
        )
        self.ingest.rewinder = self.rewinder
        trainer = TrainerService(
            job_id=config.job_id,
            queues=self.queues,
            welcome=self._trainer_welcome(),
            on_free=lambda locations: self._free(lanes, locations),
            on_delivered=self._on_delivered,
            on_hello=self._on_trainer_hello,
            rewinder=self.rewinder,
            node=config.node_rank,
            on_end_job=self._on_end_job,
        )
        trainer.from_journal = self.journal_records is not None
        await self._serve_socket(trainer)
        self.barrier = RoundBarrier(self._round_config())
        self.stats.round_traffic = self.barrier.traffic  # odbd_round_payload_bytes_total
        others = [n for n in range(world.num_nodes) if n != config.node_rank]
        watch = asyncio.ensure_future(self._watch_for_clash(others))
        try:
            await self.barrier.start()
        except HandshakeError as error:  # a node never joined, or the hub never answered
            raise self._named_clash(error, others) from None
        finally:
            watch.cancel()
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
            producers=lambda: len(self.ingest.sessions) if self.ingest else 0,
            starting=lambda: self.supervisor.running() if self.supervisor else (0, 0.0),
            slow_sample=lambda: self.ingest.slowest_sample() if self.ingest else None,
            free=lambda locations: self._free(lanes, locations),
        )
        if config.migrate:
            await self._start_migration(lanes)
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
                progress=lambda: samples_made(self.stats.ingest_samples, self.stats.rejected),
                on_give_up=self.loop.give_up,
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
            patch_key=self.config.patch_source[0] if self.config.max_patches else "",
            patch_count_key=self.config.patch_source[1] if self.config.max_patches else "",
            concat_keys=list(self.config.concat),
            packed=self.config.collate is Collate.PACKED,
            check_finite=self.config.check_finite,
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
            collate=self.config.collate.value,
            concat_keys=list(self.config.concat),
            labels_key=self.config.labels_key,
        )

    def _named_clash(self, error: OdbdError, node_ranks: list[int]) -> OdbdError:
        """`error`, led by the clash when another job with our --job-id holds `node_ranks`
        (now, or while the job was forming: the other job may have failed first)."""
        config = self.config
        clash = find_clash(config.job_id, node_ranks, config.peers, own_pid=os.getpid())
        clash = clash or self._clash_seen
        return type(error)(f"{clash}. What this daemon saw: {error}") if clash else error

    async def _watch_for_clash(self, node_ranks: list[int]) -> None:
        """While the job forms: remembers another job with our --job-id on this host."""
        config = self.config
        while node_ranks:
            clash = find_clash(config.job_id, node_ranks, config.peers, own_pid=os.getpid())
            self._clash_seen = clash or self._clash_seen
            await asyncio.sleep(_CLASH_POLL_S)

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
            fanout=config.round_fanout,
            from_journal=self.journal_records is not None,
            # split_exchange.py: (the moves, --migrate auto) summaries, step totals (and the
            # deals, --align updates)
            exchanges_per_round=exchanges_per_round(self.state.planner),
        )

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
        self.resume_updates[hello.rank] = hello.resume_update
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
        self.loop.restore(resume, update=max(self.resume_updates.values(), default=0))
        for queue in self.queues.values():  # the steps before it are not this daemon's to send
            queue.history.floor = (epoch, step)
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

    # -- callbacks ---------------------------------------------------------------------------

    def _on_end_job(self, rank: int, end: trainer_pb2.EndJob) -> None:
        if self.loop is not None:
            self.loop.request_end(rank, end.epoch, end.step)

    def _on_producer_restart(self) -> None:
        self.stats.producers_restarted += 1

    def _on_delivered(self, rank: int, delivered: trainer_pb2.Delivered) -> None:
        rank_stats = self.stats.rank(rank)
        rank_stats.wait_s += delivered.wait_s
        rank_stats.compute_s += delivered.compute_s
        rank_stats.delivered_steps += max(delivered.steps, 1)
        took_s = delivered.wait_s + delivered.compute_s
        for line in self.stats.trained.on_report(time.monotonic(), took_s):
            log.info("%s", line)
        if self.loop is not None:
            for timed in delivered.measured:
                self.loop.cost.measured(rank, timed.epoch, timed.step, timed.compute_s)
            self.loop.trainer_progress()

    def _on_progress(self) -> None:
        if self.loop is not None:
            self.loop.ingest_progress()

    def _on_ingest_error(self, message: str) -> None:
        self.last_error = message  # e.g. a producer refused for its dataset size

    def _on_rejected(self, rejected: Rejected) -> None:
        in_full, summary = self._rejection_log.record(rejected.reason, time.monotonic())
        if in_full:
            log.warning(
                "rejected sample %d (view %d): %s: %s (further %s rejections are counted, "
                "summarised every %.0f s and at epoch end)",
                rejected.identity,
                rejected.view_key,
                rejected.reason,
                rejected.detail,
                rejected.reason,
                self._rejection_log.interval_s,
            )
        if summary:
            log.warning("rejected since the last summary: %s", summary)
        self.rejections.append(rejected)
        self.stats.rejected[rejected.reason] += 1

    def _free(self, lanes: Lanes, locations: list) -> None:
        if locations and self.ingest is not None:
            self.ingest.give_back(lanes.free(locations))
            self.ingest.pump_leases()
        if locations and self.loop is not None:
            self.loop.trainer_progress()

    async def _start_migration(self, lanes: Lanes) -> None:
        """--migrate auto: the bulk port beside the peer listener (migration_live.py)."""
        config, loop = self.config, self.loop
        assert self.arena is not None and self.barrier is not None and loop is not None
        host = config.listen.rsplit(":", 1)[0] if config.world.num_nodes > 1 else "127.0.0.1"
        self.migration = LiveMigration(
            barrier=self.barrier,
            node=config.node_rank,
            state=self.state,
            lanes=lanes,
            arena=self.arena,
            stats=self.stats,
            link=LinkModel(bytes_per_s=config.link_gbps * 1e9 / 8),
            token=config.job_token,
            job_id=config.job_id,
            host=host or "127.0.0.1",
            free=lambda locations: self._free(lanes, locations),
            read=self._read_sample,
            journal=self.journal.append_moved if self.journal is not None else None,
            released=self._release_held,
        )
        await self.migration.start()
        loop.migration = self.migration

    def _release_held(self, trained_elsewhere: np.ndarray) -> None:
        """Round 0's moves exchange named every view the other nodes trained before the
        resume point: the views this node held back since its restart are settled."""
        held = self.state.num_held()
        final, again = self.state.release_held(trained_elsewhere)
        if held:
            log.info(
                "restart with moves: of %d views this node had moved out and not trained, "
                "%d were trained by other nodes (final) and %d are produced again",
                held, final, again,
            )  # fmt: skip
        if again and self.ingest is not None:
            self.ingest.pump_leases()

    def _read_sample(self, segment: int, offset: int, nbytes: int) -> memoryview:
        assert self.arena is not None
        name = self.arena.segment_names[segment]
        return self.arena.view(Allocation(name, offset, nbytes))

    # -- main --------------------------------------------------------------------------------

    async def run(self) -> int:
        """The daemon's whole life; returns its exit status (0 only if nothing was dropped)."""
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            if await self._form_job(stop):
                await self._run_job(stop)
        except Exception as error:  # noqa: BLE001 - every failure ends the job the same way
            await self._fail(error)
        finally:
            stop.cancel()
            await self.shutdown()
        return self.exit_code

    async def _form_job(self, stop: asyncio.Future[Any]) -> bool:
        """1. startup; False if a signal came first (peers may take minutes to join)."""
        await self._serve_health_tcp()
        starting = asyncio.ensure_future(self.startup())
        await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            log.info("stopped (%s) before the job formed", self._stop_signal)
            return False
        starting.result()  # raises the start-up error, if any
        self._job_formed = True
        self._ready_s = time.monotonic()
        return True

    async def _run_job(self, stop: asyncio.Future[Any]) -> None:
        """2. the round loop, then 3. the end of the job."""
        assert self.loop is not None
        background = [asyncio.ensure_future(self._expire_leases())]
        try:
            if self.journal_records is not None:
                await self._resume()
            self.phase = "running"
            background.append(asyncio.ensure_future(self._watch_health()))
            main = asyncio.ensure_future(self.loop.run())
            attendance = asyncio.ensure_future(self._watch_attendance())
            await asyncio.wait({main, stop, attendance}, return_when=asyncio.FIRST_COMPLETED)
            attendance.cancel()
            if main.done():
                main.result()  # raises the round's error, if any
                s = self.stats
                log.info("%s", round_work_line(s.round_traffic, s.rounds, s.round_planning.total))
            elif attendance.done():
                attendance.result()  # raises AttachTimeoutError
            else:
                main.cancel()
                # Steps already queued were planned on every node: the trainers may take them.
                # fail() also ends the loop at its next check, should a wait inside it swallow
                # the cancellation (it did: rounds went on being planned after the signal).
                self.loop.fail(f"the daemon was stopped ({self._stop_signal})")
                await asyncio.wait({main}, timeout=_LOOP_STOP_S)
            if self.phase == "running":
                self.phase = "draining"
            await self._update_health()
            await self._end_job()
        finally:
            for task in background:
                task.cancel()

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(_EXPIRY_PERIOD_S)
            if self.ingest is not None:
                self.ingest.expire_leases()

    async def _watch_attendance(self) -> None:
        """While rounds run: a rank away past --attach-timeout fails the job, naming it."""
        timeout_s = self.config.attach_timeout_s
        while True:
            await asyncio.sleep(_ATTENDANCE_PERIOD_S)
            ranks = presences(self.queues.values(), ready_s=self._ready_s, now_s=time.monotonic())
            overdue = overdue_ranks(ranks, timeout_s)
            if overdue:
                raise AttachTimeoutError(attach_failure(overdue, timeout_s))
            self._check_end_requests()

    def _check_end_requests(self) -> None:
        """end_job() calls that failed the job (different steps, a rank past --end-timeout)."""
        loop = self.loop
        if loop is not None and loop.ending:
            reason = loop.failure or loop.end_overdue(time.monotonic())
            if reason:
                raise EndJobError(reason)

    async def _end_job(self) -> None:
        """3. Waits until every local rank took the job's end (job_end.end_verdict)."""
        last_log_s = time.monotonic()
        while True:
            now_s = time.monotonic()
            verdict = end_verdict(
                presences(self.queues.values(), ready_s=self._ready_s, now_s=now_s),
                attach_timeout_s=self.config.attach_timeout_s,
                stopping=self._stop.is_set(),
                stop_overdue=now_s > self._stop_deadline_s,
            )
            self._check_end_requests()  # every step was planned: this node decides alone
            if verdict.outcome is Outcome.DONE:
                if not self._stop.is_set():
                    self.phase = "done"
                log.info("every local rank took the job's end")
                return
            if verdict.outcome is Outcome.FAIL:
                raise AttachTimeoutError(verdict.reason)
            if verdict.outcome is Outcome.STOP:
                self._report_dropped(dropped_summary(verdict.dropped))
                return
            if now_s - last_log_s >= _END_WAIT_LOG_S:
                last_log_s = now_s
                log.info("the job's end is queued; waiting for %s", verdict.reason)
            await asyncio.sleep(_END_POLL_S)

    def _report_dropped(self, summary: str) -> None:
        """A stop's drain is over: say what it dropped; dropping anything is a failed exit."""
        if not summary:
            log.info("stopped (%s): every queued step was delivered", self._stop_signal)
            return
        log.error(
            "stopped (%s) before trainers took everything, %s; these steps are lost "
            "(restart with --state-dir to produce them again)",
            self._stop_signal,
            summary,
        )
        self.last_error = f"stopped before trainers took everything: {summary}"
        self.exit_code = 1

    # -- failure -----------------------------------------------------------------------------

    async def _fail(self, error: Exception) -> None:
        """Ends the job on any error: one ERROR line, trainers told why, exit 1 (2 for an
        operator error at start-up)."""
        reason = _describe_failure(error)
        if isinstance(error, OdbdError | OSError):
            log.error("%s", reason)
        else:  # a bug in odbd: the traceback is what a report needs
            log.error("%s", reason, exc_info=error)
        self.phase, self.last_error = "failed", reason
        start_up = isinstance(error, ConfigError) and not self._job_formed
        self.exit_code = EXIT_USAGE if start_up else 1
        try:
            if self.rewinder is not None:  # a gated queue would hold back the failed JobEnd
                self.rewinder.cancel_all()
            self._tell_trainers(reason)
            await self._announce_failure()
        except Exception as notice_error:  # noqa: BLE001 - shutdown must still run
            log.error("could not tell the trainers why the job failed: %s", notice_error)

    def _tell_trainers(self, reason: str) -> None:
        """Unsent steps are dropped and a failed JobEnd follows what was already sent."""
        if self.loop is not None and not self.loop.done:
            self.loop.abort(reason)
            return
        end = trainer_pb2.JobEnd(reason=reason, failed=True)
        for queue in self.queues.values():
            queue.fail_job(QueuedItem(self.state.epoch, -1, trainer_pb2.TrainerEvent(job_end=end)))

    async def _announce_failure(self) -> None:
        """Lets attached trainers read their failed JobEnd before the streams close."""
        deadline_s = time.monotonic() + _FAILURE_NOTICE_S
        while time.monotonic() < deadline_s:
            verdict = end_verdict(
                presences(self.queues.values(), ready_s=self._ready_s, now_s=time.monotonic()),
                attach_timeout_s=self.config.attach_timeout_s,
                stopping=True,
            )
            if verdict.outcome is not Outcome.WAIT:
                return
            await asyncio.sleep(_END_POLL_S)

    # -- signals -----------------------------------------------------------------------------

    def on_signal(self, signum: int) -> None:
        """The first SIGTERM/SIGINT drains (request_stop); a second one exits at once."""
        name = signal.Signals(signum).name
        self._signals += 1
        if self._signals > 1:
            self._force_exit(name, 128 + signum)
        log.info(
            "%s received: draining within --drain-timeout %g s (send it again to force exit)",
            name,
            self.config.drain_timeout_s,
        )
        self.request_stop(name)

    def request_stop(self, signal_name: str = "SIGTERM") -> None:
        """NOT_SERVING at once, no producer restarts, then drain within --drain-timeout."""
        self._stop_signal = signal_name
        self.phase = "draining"
        self.stats.serving = False
        self._stop_deadline_s = time.monotonic() + self.config.drain_timeout_s
        if self.supervisor is not None:
            self.supervisor.stop_restarting()
        loop = asyncio.get_running_loop()
        loop.create_task(self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
        self._stop.set()

    def _force_exit(self, signal_name: str, code: int) -> None:
        """Second signal: no drain, but producers, shm and the socket are still released."""
        log.error(
            "second signal (%s): exiting now with status %d; steps not yet delivered are lost",
            signal_name,
            code,
        )
        steps = [(w, s) for w, s in self._shutdown_steps() if w in _FORCED_EXIT_STEPS]
        if self.supervisor is not None:
            steps.insert(0, ("kill the producers", self.supervisor.kill_now))
        for what, step in steps:
            try:
                step()
            except Exception as error:  # noqa: BLE001 - the exit must happen regardless
                log.error("forced exit: could not %s: %s", what, error)
        logging.shutdown()
        os._exit(code)

    # -- shutdown ----------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """4. Releases everything; a failing step is logged once and the next still runs."""
        for what, step in self._shutdown_steps():
            try:
                result = step()
                if inspect.isawaitable(result):
                    await result
            except Exception as error:  # noqa: BLE001 - the remaining resources must be released
                log.error(
                    "shutdown: could not %s (%s: %s); releasing the rest",
                    what,
                    type(error).__name__,
                    error,
                )

    def _shutdown_steps(self) -> list[tuple[str, Callable[[], object]]]:
        """What shutdown releases, in order: what exists of it (start-up may have failed)."""
        steps: list[tuple[str, Callable[[], object]]] = [
            ("mark health NOT_SERVING", self.health.enter_graceful_shutdown)
        ]
        if self.ingest is not None:
            steps.append(("tell producers to stop", partial(self.ingest.shutdown, "job over")))
        if self.supervisor is not None:
            steps.append(("stop the producers", self.supervisor.stop))
        if self.ingest_server is not None:
            steps.append(("stop the ingest socket server", self.ingest_server.close))
        if self.step_server is not None:
            steps.append(("stop the step socket server", self.step_server.close))
        if self.server is not None:
            steps.append(("stop the socket server", partial(self.server.stop, 1.0)))
        if self._health_server is not None:
            steps.append(("stop the health server", partial(self._health_server.stop, 0.5)))
        if self.migration is not None:
            steps.append(("close the bulk port", self.migration.close))
        if self.barrier is not None:
            steps.append(("close the round barrier", self.barrier.close))
        if self._metrics_server is not None:
            steps.append(("stop the metrics server", self._stop_metrics))
        if self.journal is not None:
            steps.append(("close the journal", self.journal.close))
        if self.arena is not None:
            steps.append(("unlink shared memory", self.arena.close))
        steps.append(("remove the socket", self._unlink_socket))
        return steps

    def _stop_metrics(self) -> None:
        self._metrics_server.shutdown()
        self._metrics_server.server_close()

    def _unlink_socket(self) -> None:
        """Removes the socket file only if it is still the one this daemon bound."""
        if self.step_server is not None:
            self.step_server.unlink()
        if self.ingest_server is not None:
            self.ingest_server.unlink()
        if self._socket_id is None:
            return  # never bound: the file (if any) belongs to someone else
        with contextlib.suppress(FileNotFoundError):
            info = os.stat(self.config.socket)
            if (info.st_dev, info.st_ino) == self._socket_id:
                os.unlink(self.config.socket)


def _describe_failure(error: Exception) -> str:
    """One line for the log, `odbd status` and the trainers' JobFailedError."""
    if isinstance(error, OdbdError):
        return str(error)
    if isinstance(error, OSError):
        return (
            f"the job stopped on an operating-system error: {error}; free the disk space or "
            "fix the file or limit behind it, then restart the job (with --state-dir it resumes)"
        )
    return (
        f"the job stopped on an internal error (a bug in odbd; please report it with this "
        f"log): {type(error).__name__}: {error}"
    )


def is_serving(*, phase: str, peers_joined: bool, producers: int, external_producers: bool) -> bool:
    """grpc.health.v1 SERVING: the job formed and samples can flow, and not draining.

    With --dataset the daemon's own producers must be connected; with --dataset-size the
    producers are external and may attach later, so joined peers are enough.
    """
    if phase != "running" or not peers_joined:
        return False
    return external_producers or producers > 0


def run_daemon(config: DaemonConfig, dataset_size: int) -> int:
    """Runs one daemon to completion in its own event loop (uvloop when available), then ends
    the process with its exit status."""
    runner: Callable[[Coroutine[Any, Any, int]], int]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        runner = asyncio.run

    async def main() -> int:
        daemon = Daemon(config, dataset_size)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.on_signal, sig)
        return await daemon.run()

    code = runner(main())
    # Everything is released by now. The interpreter's own teardown (torch is imported by
    # odbclient) took 1-2.5 s on a loaded 2-core machine: skip it, so Ctrl-C ends the daemon
    # in well under 2 s.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
