"""Step 1 of the daemon's life, start-up: claim the socket path, open the journal, create the
arena, serve the unix socket, form the job with the peer daemons (naming another job with the
same --job-id when it holds the peers), build the round loop and spawn the producers."""

from __future__ import annotations

import asyncio
import logging
import os

from odbclient.shm import SAMPLE_LAYOUT_VERSION, read_meta
from odbclient.wire.odbd.v1 import (
    ingest_pb2,
    trainer_pb2,
)
from odbd.daemon.daemon_callbacks import DaemonCallbacks
from odbd.daemon.job_clash import find_clash
from odbd.daemon.migration_live import LiveMigration
from odbd.daemon.remake import Rewinder
from odbd.daemon.resume import DaemonResume
from odbd.daemon.round_loop import RoundLoop
from odbd.daemon.serving import DaemonServing
from odbd.daemon.socket_claim import claim_socket_path
from odbd.daemon.split_exchange import exchanges_per_round
from odbd.daemon.split_round import check_summary_fits
from odbd.errors import OdbdError
from odbd.ingest.arena import Arena, ArenaInUseError
from odbd.ingest.lanes import Lanes
from odbd.ingest.rejections import samples_made
from odbd.ingest.service import IngestService
from odbd.ingest.supervisor import ProducerSupervisor, SupervisorConfig
from odbd.planner.config import Collate
from odbd.planner.migration import LinkModel
from odbd.round import RoundBarrier, RoundConfig
from odbd.round.errors import HandshakeError
from odbd.serve.trainer_service import TrainerService

log = logging.getLogger("odbd")


# Another job with our --job-id on this host: looked for this often while the job forms, and
# for this long after our arena was found taken (the other daemon may still be creating it).
_CLASH_POLL_S = 0.5
_CLASH_WAIT_S = 2.0


class DaemonStartup(DaemonServing, DaemonResume, DaemonCallbacks):
    """Step 1 of the daemon's life: everything the job needs, created in order."""

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
