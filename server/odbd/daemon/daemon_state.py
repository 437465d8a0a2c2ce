"""What one node daemon holds: its parts (arena, servers, barrier, round loop, producers),
its phase and exit status; shared by the modules of its life (app.py says the order)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
from grpc_health.v1 import health

from odbd.config import DaemonConfig
from odbd.daemon.journal import Journal
from odbd.daemon.migration_live import LiveMigration
from odbd.daemon.node_commits import Rejected
from odbd.daemon.node_state import NodeState
from odbd.daemon.remake import Rewinder
from odbd.daemon.round_loop import RoundLoop
from odbd.ingest.arena import Arena
from odbd.ingest.ingest_socket import IngestServer
from odbd.ingest.rejections import RejectionLog
from odbd.ingest.service import IngestService
from odbd.ingest.supervisor import ProducerSupervisor
from odbd.metrics.stats import DaemonStats
from odbd.round import RoundBarrier
from odbd.serve.rank_queue import RankQueue
from odbd.serve.step_socket import StepServer

log = logging.getLogger("odbd")

END_POLL_S = 0.05  # the end-of-job and failure-notice waits re-read the rank queues this often


class DaemonState:
    """The daemon's parts and facts, created empty and filled by start-up; its concerns
    (startup, serving, resume, callbacks, shutdown) are subclasses, app.Daemon all of them."""

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
