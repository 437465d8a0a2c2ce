"""The producers' ingest stream, transport-agnostic: hello checks, lane assignment, leases,
commits, rejections, frees, LaneFull, Shutdown, and the release of a producer's leases when its
stream ends. `odbd.ingest.ingest_socket` is its edge (a unix stream socket of length-prefixed
frames beside the gRPC socket, protocol 7); `LegacyProduceRefusal` answers the gRPC `Produce`
of older producers with what to do."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import numpy as np

from odbclient.connect import PROTOCOL_VERSION
from odbclient.wire.odbd.v1 import ingest_pb2, ingest_pb2_grpc
from odbd.daemon.locations import Locations
from odbd.daemon.node_commits import Rejected
from odbd.daemon.node_state import NodeState
from odbd.daemon.remake import Rewinder
from odbd.ingest.hung import InFlight, hung, track
from odbd.ingest.lanes import Lane, Lanes
from odbd.ingest.schema_vote import SCHEMA_VOTE_WAIT_S
from odbd.ingest.validate import CommitRows, check_rejections, decode_commit
from odbd.metrics.stats import DaemonStats
from odbd.serve.hello import Refusal, hello_refusal

log = logging.getLogger("odbd.ingest")

SLOW_SAMPLE_S = 10.0  # a producer this long inside one dataset[i] is named in the wait line


@dataclass(slots=True)
class ProducerSession:
    producer: int
    name: str
    lane: Lane
    outbox: asyncio.Queue[ingest_pb2.IngestMessage | None]
    credit: int = 0
    lane_full: bool = False  # said LaneFull and got no FreeBatch since


class IngestService:
    """Translates producer streams into NodeState calls; every decision is NodeState's."""

    def __init__(
        self,
        *,
        state: NodeState,
        lanes: Lanes,
        welcome: ingest_pb2.IngestWelcome,
        lease_timeout_s: float,
        on_progress: Callable[[], None],
        on_rejected: Callable[[Rejected], None],
        stats: DaemonStats,
        on_error: Callable[[str], None] = lambda message: None,
        kill_worker: Callable[[str], int | None] = lambda name: None,
        is_worker: Callable[[str], bool] = lambda name: False,
    ) -> None:
        self._state = state
        self._lanes = lanes
        self._welcome = welcome
        self._lease_timeout_s = lease_timeout_s
        self._on_progress = on_progress
        self._on_rejected = on_rejected
        self._stats = stats
        self._on_error = on_error  # the daemon's last_error, shown by `odbd status`
        # The daemon's own --workers, by name: a hung one is killed (its pid), others named.
        self._kill_worker = kill_worker
        self._is_worker = is_worker
        self._in_flight: dict[int, InFlight] = {}  # producer -> the key in its lane header
        self._warned_hung: set[tuple[int, int]] = set()  # (producer, key) said once
        self._killed: set[int] = set()  # hung workers killed (ids are never reused)
        self.sessions: dict[int, ProducerSession] = {}
        self._next_producer = 0
        self.closing = False
        self._closed_for = ""  # the reason every producer's Shutdown gave
        # Samples made again for rewinds (negative view keys); set by the daemon.
        self.rewinder: Rewinder | None = None
        self._vote_seen_s: float | None = None  # the sweep first saw the schema vote open

    def open(self, hello: ingest_pb2.ProducerHello) -> ProducerSession | Refusal | None:
        """The new producer's session; a Refusal (protocol, job, dataset size, no lane left);
        None once the daemon is shutting down (the late producer is told so, as the others
        were: `late_shutdown`)."""
        refusal = hello_refusal(hello, who="producer", job_id=self._welcome.job_id)
        if refusal is not None:
            return refusal
        if self.closing:
            return None
        size = size_refusal(hello, self._welcome.dataset_size)
        if size is not None:
            log.error("refused a producer: %s", size)
            self._on_error(size)
            return Refusal("FAILED_PRECONDITION", size)
        producer = self._next_producer
        lane = self._lanes.open(producer)
        if lane is None:
            return Refusal(
                "RESOURCE_EXHAUSTED",
                f"no room for another {self._lanes.lane_bytes}-byte producer lane in the "
                "shared-memory arena; raise --shm-size or run fewer producers",
            )
        self._next_producer += 1
        session = ProducerSession(
            producer, hello.name or f"producer-{producer}", lane, asyncio.Queue()
        )
        self.sessions[producer] = session
        log.info("producer %s attached (lane %d)", session.name, lane.lane_id)
        return session

    def welcome_for(self, session: ProducerSession) -> ingest_pb2.IngestMessage:
        welcome = ingest_pb2.IngestWelcome()
        welcome.CopyFrom(self._welcome)
        welcome.lane.CopyFrom(_lane_message(session.lane))
        return ingest_pb2.IngestMessage(welcome=welcome)

    def late_shutdown(self) -> ingest_pb2.IngestMessage:
        """What a producer arriving after shutdown began is told."""
        return ingest_pb2.IngestMessage(shutdown=ingest_pb2.Shutdown(reason=self._closed_for))

    def on_message(self, session: ProducerSession, message: ingest_pb2.ProducerMessage) -> None:
        """A message after the hello; raises MalformedMessage (the edge refuses the producer
        with INVALID_ARGUMENT, and the stream's end releases its leases)."""
        kind = message.WhichOneof("kind")
        if kind == "lease":
            session.credit += message.lease.count
            self.pump_leases()
        elif kind == "commit":
            self._commit(session, message.commit)
        elif kind == "lane_full":
            session.lane_full = True
            self._on_progress()  # the round loop may plan with a partial buffer now
        elif kind == "reject":
            check_rejections(message.reject)
            for rejection in message.reject.rejections:
                if rejection.view_key < -1 and self.rewinder is not None:
                    self.rewinder.reject(session.producer, rejection.view_key, rejection.detail)
                    continue
                rejected = self._state.reject(
                    session.producer, rejection.view_key, rejection.reason, rejection.detail
                )
                if rejected is not None:
                    self._on_rejected(rejected)
            # A rejected id leaves its unit's lease budget: without new grants a job whose
            # samples are all rejected would wait forever with no lease outstanding.
            self.pump_leases()
            self._on_progress()

    def _commit(self, session: ProducerSession, batch: ingest_pb2.CommitBatch) -> None:
        rows = decode_commit(batch, session.lane.allocation.length, session.lane.live)
        lane = session.lane.lane_id
        locations = Locations.in_lane(lane, rows.offsets, rows.nbytes)
        keys = rows.view_keys.astype(np.int64, copy=False)
        if self.rewinder is not None and keys.size and int(keys.min()) < -1:
            self._commit_remade(session, rows, keys, locations)
            return
        outcome = self._state.commit(
            session.producer,
            keys,
            locations,
            rows.lengths.astype(np.int64),
            rows.loss_tokens.astype(np.int64),
            rows.schema_hashes.astype(np.uint64, copy=False).view(np.int64),
            rows.patches.astype(np.int64),
        )
        pump = bool(outcome.rejections)  # rejected ids left the lease budget (see on_message)
        accepted, rejections = outcome.accepted, outcome.rejections
        self._settle_commit(session, locations, accepted, rejections, outcome.voted_out, pump)

    def _commit_remade(
        self, session: ProducerSession, rows: CommitRows, keys: np.ndarray, where: Locations
    ) -> None:
        """A commit holding samples made again for a rewind (keys < -1): those rows go to
        the rewinder, the others to NodeState as usual."""
        assert self.rewinder is not None
        remade = keys < -1
        accepted = np.zeros(len(keys), dtype=bool)
        accepted[remade] = self.rewinder.commit(
            session.producer, keys[remade], where.take(np.flatnonzero(remade))
        )
        rest = np.flatnonzero(~remade)
        rejections: list[Rejected] = []
        voted_out: list[Rejected] = []
        if rest.size:
            outcome = self._state.commit(
                session.producer,
                keys[rest],
                where.take(rest),
                rows.lengths[rest].astype(np.int64),
                rows.loss_tokens[rest].astype(np.int64),
                rows.schema_hashes[rest].astype(np.uint64).view(np.int64),
                rows.patches[rest].astype(np.int64),
            )
            accepted[rest] = outcome.accepted
            rejections = outcome.rejections
            voted_out = outcome.voted_out
        self._settle_commit(session, where, accepted, rejections, voted_out, pump=True)

    def _settle_commit(
        self,
        session: ProducerSession,
        where: Locations,
        accepted: np.ndarray,
        rejections: list[Rejected],
        voted_out: list[Rejected],
        pump: bool,
    ) -> None:
        """A commit's end: the accepted rows' bytes held and counted, the others given back
        to the producer, the schema vote's losers dropped. `pump` grants new ids when the
        lease budget changed (rejected ids leave it; see on_message)."""
        every = bool(accepted.all())  # the usual commit: no row to select or give back
        kept = where.offsets if every else where.offsets[accepted]
        nbytes = where.nbytes if every else where.nbytes[accepted]
        self._lanes.hold(session.lane.lane_id, kept)
        self._stats.ingest_bytes += int(nbytes.sum())
        self._stats.ingest_samples += len(kept)
        for rejected in rejections:
            self._on_rejected(rejected)
        if not every:
            self._send_free(session, where.offsets[~accepted])  # rejected, stale
        if voted_out:
            self._drop_voted_out(voted_out)
        if pump:
            self.pump_leases()
        self._on_progress()

    def _grant_remakes(self, session: ProducerSession, deadline: float) -> None:
        """Samples a rewind waits for go first: a trainer is blocked on them."""
        if self.rewinder is None or not self.rewinder.wanted():
            return
        keys, identities = self.rewinder.lease(session.producer, session.credit, deadline)
        if keys.size:
            session.credit -= int(keys.size)
            grant = ingest_pb2.LeaseGrant(
                view_keys=keys.astype("<i8").tobytes(),
                identities=identities.astype("<i8").tobytes(),
            )
            session.outbox.put_nowait(ingest_pb2.IngestMessage(lease=grant))

    def _drop_voted_out(self, voted_out: list[Rejected]) -> None:
        """Samples held for the schema vote whose schema lost: counted as rejected, their
        bytes freed in whichever lane holds them."""
        for rejected in voted_out:
            self._on_rejected(rejected)
        where = [Locations.in_lane(r.location.lane, np.asarray([r.location.offset]),
                                   np.asarray([r.location.nbytes]))
                 for r in voted_out if r.location is not None]  # fmt: skip
        self.give_back(self._lanes.free(where))
        self.pump_leases()

    def close_schema_vote(self, now: float) -> None:
        """The sweep's part of the schema vote: one open SCHEMA_VOTE_WAIT_S since this sweep
        first saw it closes with the samples it holds (a dataset with few valid samples, or slow
        producers, would otherwise never start the job)."""
        if not self._state.schema_voting:
            self._vote_seen_s = None
            return
        if self._vote_seen_s is None:
            self._vote_seen_s = now
            return
        if now - self._vote_seen_s < SCHEMA_VOTE_WAIT_S:
            return
        self._vote_seen_s = None
        voted_out = self._state.close_schema_vote()
        if voted_out:
            self._drop_voted_out(voted_out)
        self._on_progress()

    def pump_leases(self) -> None:
        """Grants pending sample ids to producers with credit."""
        deadline = asyncio.get_running_loop().time() + self._lease_timeout_s
        for session in self.sessions.values():
            self._grant_remakes(session, deadline)
            if session.credit <= 0:
                continue
            keys = self._state.lease(session.producer, session.credit, deadline)
            if keys.size == 0:
                continue
            session.credit -= int(keys.size)
            identities = self._state.identities_of(keys)
            grant = ingest_pb2.LeaseGrant(
                view_keys=keys.astype("<i8").tobytes(),
                identities=identities.astype("<i8").tobytes(),
            )
            session.outbox.put_nowait(ingest_pb2.IngestMessage(lease=grant))

    def give_back(self, offsets_by_producer: dict[int, np.ndarray]) -> None:
        for producer, offsets in offsets_by_producer.items():
            session = self.sessions.get(producer)
            if session is not None and offsets.size:
                self._send_free(session, offsets)

    def _send_free(self, session: ProducerSession, offsets: np.ndarray) -> None:
        session.lane_full = False  # it says LaneFull again if this made too little room
        session.outbox.put_nowait(_free_message(offsets))

    def num_lane_full(self) -> int:
        """Producers waiting for lane space (backpressure, or a buffer too big for the lanes)."""
        return sum(s.lane_full for s in self.sessions.values())

    def lanes_full(self) -> bool:
        """Every producer holding leases waits for lane space: no commit can come before
        shared memory is freed, so the node's buffer cannot fill any further."""
        waiting = {s.producer for s in self.sessions.values() if s.lane_full}
        if not waiting:
            return False
        holders = self._state.lease_holders()
        return bool(holders) and holders <= waiting

    def expire_leases(self) -> int:
        """The periodic sweep: producers hung in one sample for --lease-timeout are dealt with
        (`_end_hung`), then expired leases go back to the pool, except a sample its supervised
        worker is still making (its death, should it hang, must count against that sample)."""
        now = asyncio.get_running_loop().time()
        self.close_schema_vote(now)
        self._end_hung(now)
        kept = {
            f.key
            for producer, f in self._in_flight.items()
            if self._holds(producer, f.key) and self._is_worker(self.sessions[producer].name)
        }
        if self.rewinder is not None:
            full = bool(self.sessions) and all(s.lane_full for s in self.sessions.values())
            self.rewinder.check_room(now, lanes_full=full, timeout_s=self._lease_timeout_s)
        if self.rewinder is not None and (remakes := self.rewinder.expired(now)):
            log.warning("%d leases of samples made again expired; re-leasing them", len(remakes))
            self.rewinder.release(remakes)
        expired = [key for key in self._state.expired(now) if key not in kept]
        if expired:
            log.warning("%d leases expired without a commit; re-leasing them", len(expired))
            self._stats.expired_leases += len(expired)
            self._state.release(expired)
            self.pump_leases()
        return len(expired)

    def slowest_sample(self) -> tuple[str, int, float] | None:
        """(producer name, identity, seconds) of the sample a producer has been inside
        dataset[i] for longest, once past SLOW_SAMPLE_S (as of the last sweep), for the wait
        line; None if every producer is quicker."""
        if not self._in_flight:
            return None
        now = asyncio.get_running_loop().time()
        producer, flight = min(self._in_flight.items(), key=lambda item: item[1].since_s)
        if now - flight.since_s < SLOW_SAMPLE_S or producer not in self.sessions:
            return None
        identity = int(self._state.identities_of(np.asarray([flight.key]))[0])
        return self.sessions[producer].name, identity, now - flight.since_s

    def _holds(self, producer: int, key: int) -> bool:
        return producer in self.sessions and self._state.leases.holder(key) == producer

    def _end_hung(self, now: float) -> None:
        """Reads every lane header; a producer in one sample for --lease-timeout is hung:
        a supervised worker is killed (its stream's end re-leases the sample, a second death on
        it quarantines it), an external producer is named once."""
        headers = {p: self._lanes.in_flight(s.lane.lane_id) for p, s in self.sessions.items()}
        self._in_flight = track(self._in_flight, headers, now)
        for producer, stuck in hung(self._in_flight, now, self._lease_timeout_s).items():
            if producer in self._killed or stuck.key < -1:  # a re-make: its lease expires
                continue  # its lease stays until its stream's end counts the death
            name = self.sessions[producer].name
            identity = int(self._state.identities_of(np.asarray([stuck.key]))[0])
            where = (
                f"producer {name} has been inside dataset[i] for sample {identity} (view "
                f"{stuck.key}) for {now - stuck.since_s:.0f} s, past --lease-timeout "
                f"{self._lease_timeout_s:g} s"
            )
            pid = self._kill_worker(name) if self._holds(producer, stuck.key) else None
            if pid is not None:
                self._killed.add(producer)
                log.warning(
                    "%s: it is hung there, so it was killed (pid %d) and is restarted; the "
                    "sample is re-leased once and quarantined (rejected as producer_crash) if a "
                    "producer dies or hangs on it again. If dataset[%d] legitimately takes this "
                    "long, raise --lease-timeout",
                    where,
                    pid,
                    identity,
                )
            elif (producer, stuck.key) not in self._warned_hung:
                self._warned_hung.add((producer, stuck.key))
                log.warning(
                    "%s: it looks hung there; its leases are re-leased to other producers, but "
                    "odbd does not kill a producer it did not start: stop it (a sample in flight "
                    "at a producer's second death is quarantined) and run dataset[%d] by hand",
                    where,
                    identity,
                )

    def shutdown(self, reason: str) -> None:
        self.closing, self._closed_for = True, reason
        for session in self.sessions.values():
            message = ingest_pb2.IngestMessage(shutdown=ingest_pb2.Shutdown(reason=reason))
            session.outbox.put_nowait(message)

    def detach(self, session: ProducerSession) -> None:
        """The stream ended (EOF, a refusal, a broken connection, Shutdown sent): the
        producer's leases go back to the pool and its lane is orphaned."""
        if self.sessions.pop(session.producer, None) is None:
            return
        self._account_death(session)
        held = self._state.leases_of(session.producer)
        self._state.release(held)
        if self.rewinder is not None:
            self.rewinder.release(self.rewinder.leases_of(session.producer))
        self._lanes.orphan(session.lane.lane_id)
        log.info("producer %s detached; %d leases go back to the pool", session.name, len(held))
        self.pump_leases()
        self._on_progress()

    def _account_death(self, session: ProducerSession) -> None:
        """A stream that ends with a view key in the lane header ended inside dataset[i]: the
        producer died making it. The id is re-leased the first time, quarantined (rejected as
        producer_crash) once it was in flight at DEATHS_TO_QUARANTINE deaths."""
        key = self._lanes.in_flight(session.lane.lane_id)
        if key is None or self.closing:  # between samples, or told to stop mid-sample
            return
        deaths, quarantined = self._state.producer_died(session.producer, key, session.name)
        if quarantined is not None:
            log.error(
                "quarantined sample %d (view %d): producers died %d times while making it "
                "(the last: %s); it is rejected as %s and the epoch goes on without it",
                quarantined.identity,
                key,
                deaths,
                session.name,
                quarantined.reason,
            )
            self._on_rejected(quarantined)
        elif deaths:
            identity = int(self._state.identities_of(np.asarray([key]))[0])
            log.warning(
                "producer %s ended while making sample %d (view %d); it is re-leased, and "
                "quarantined if a producer dies on it again",
                session.name,
                identity,
                key,
            )


def size_refusal(hello: ingest_pb2.ProducerHello, served: int) -> str | None:
    """Why a producer whose dataset has another size than the daemon serves is refused."""
    if not hello.dataset_size or hello.dataset_size == served:
        return None
    name = hello.name or f"pid {hello.pid}"
    return (
        f"producer {name}'s dataset has {hello.dataset_size} samples but this daemon serves "
        f"{served} identities; start the producer with the job's dataset (check its "
        "--dataset-arg) or the daemon with --dataset-size matching it"
    )


class LegacyProduceRefusal(ingest_pb2_grpc.IngestServicer):
    """gRPC `Produce` (protocol <= 6): refused by name, so an old odbclient says what to do."""

    async def Produce(  # noqa: N802 (gRPC method name)
        self,
        request_iterator: AsyncIterator[ingest_pb2.ProducerMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ingest_pb2.IngestMessage]:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, legacy_produce_refusal())
        yield ingest_pb2.IngestMessage()  # pragma: no cover - abort raises


def legacy_produce_refusal() -> str:
    return (
        f"this odbd speaks producer protocol {PROTOCOL_VERSION}, whose ingest stream is a unix "
        "socket beside the gRPC socket (path + '.ingest'), not the gRPC Produce stream of "
        "protocol 6 and older: upgrade odbclient in the producer's environment to the "
        "daemon's odbd release"
    )


def _lane_message(lane: Lane) -> ingest_pb2.Lane:
    return ingest_pb2.Lane(
        segment=lane.segment_index, offset=lane.allocation.offset, size=lane.allocation.length
    )


def _free_message(offsets: np.ndarray) -> ingest_pb2.IngestMessage:
    packed = offsets.astype("<u8").tobytes()
    return ingest_pb2.IngestMessage(free=ingest_pb2.FreeBatch(offsets=packed))
