"""Where the local daemon listens, how to reach it, and what its refusals mean to a user.

Shared by the trainer client and the producer; imports grpc but no generated stubs. Trainers
reach the daemon over the step socket beside its gRPC socket, producers over the ingest socket
beside it (odbclient.framing); gRPC is left for status queries.
"""

from __future__ import annotations

import os
import queue
import socket as socketlib
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from odbclient.errors import (
    DaemonConnectionError,
    DaemonTimeoutError,
    DaemonUnavailableError,
    JobMismatchError,
    ODBClientError,
    ProtocolError,
    RankInUseError,
    RankRefusedError,
    UntrustedDaemonError,
)
from odbclient.local_trust import check_daemon_peer, check_socket_owner, default_socket

# The odbd.v1 trainer and ingest services; the daemon refuses other versions. 2: steps may come
# as StepBatches and a Delivered may cover several steps (a version 1 client would drop them).
# 3: a TrainerHello carries the trainer's own world, which the daemon checks against --world,
# and StepBatch.progress; a version 2 client, which never says its world, is refused.
# 4: StepBatch.update (optimizer updates, --accumulate / --tokens-per-update); a version 3
# client would step its optimizer after every micro-step with update-wide loss scales.
# 5: batch forms (TrainerWelcome.collate / concat_keys, IngestWelcome patch and concat keys,
# CommitBatch.patches); a version 4 client would pad a packed job's batches, and a version 4
# producer would send no patch counts under --max-patches.
# 6: the trainer's step channel is a unix socket of length-prefixed frames beside the gRPC
# socket (odbclient.framing), no longer the gRPC Train stream, which refuses older trainers.
# 7: the producer's ingest stream is a unix socket of length-prefixed frames beside the gRPC
# socket (path + ".ingest"), no longer the gRPC Produce stream, which refuses older producers.
PROTOCOL_VERSION = 7
# Batches the daemon pushes ahead of the trainer (TrainerHello.prefetch; the daemon's default
# when a hello says 0): 8 lets the daemon send and the client report 4 steps per message
# (8 KiB samples: 19-21k -> 23k samples/s over 4). The cost: when a peer node dies, a rank may
# still train on up to this many batches before JobFailedError.
DEFAULT_PREFETCH = 8
SOCKET_ENV = "ODBD_SOCKET"
# The daemons' --job-id reads it too: one variable in the job's environment names the job for
# both, so a trainer pointed at another job's socket is refused instead of training its data.
JOB_ID_ENV = "ODBD_JOB_ID"
# $XDG_RUNTIME_DIR/odbd/odbd.sock or /tmp/odbd-$UID/odbd.sock (odbclient.local_trust): a
# directory only this user can write, as of import; resolve_socket computes it afresh.
DEFAULT_SOCKET = default_socket()

_Refusal = tuple[type[ODBClientError], str]  # error class, the fix to append

TRAINER_REFUSALS: Mapping[grpc.StatusCode, _Refusal] = {
    grpc.StatusCode.INVALID_ARGUMENT: (
        RankRefusedError,
        "check RANK against the daemon's --world, --nproc-per-node and --node-rank, and that "
        "a resumed state_dict was saved by this job",
    ),
    grpc.StatusCode.ALREADY_EXISTS: (
        RankInUseError,
        "run one ODBClient per rank: close the other client of this rank (client.close()) or "
        "fix a duplicated RANK",
    ),
    grpc.StatusCode.FAILED_PRECONDITION: (
        JobMismatchError,
        "pass the daemon's --job-id as job_id (or leave it empty) and install the same odbd "
        "release for the daemon and its clients",
    ),
}
PRODUCER_REFUSALS: Mapping[grpc.StatusCode, _Refusal] = {
    grpc.StatusCode.INVALID_ARGUMENT: (
        RankRefusedError,
        "the daemon does not accept this producer; check its --dataset-size and log",
    ),
    grpc.StatusCode.FAILED_PRECONDITION: TRAINER_REFUSALS[grpc.StatusCode.FAILED_PRECONDITION],
    grpc.StatusCode.RESOURCE_EXHAUSTED: (
        ODBClientError,
        "run fewer producers (--workers) or give the daemon a larger --shm-size",
    ),
}


def resolve_socket(socket: str | None) -> str:
    """The socket argument, else $ODBD_SOCKET, else the per-user default."""
    return socket or os.environ.get(SOCKET_ENV) or default_socket()


def open_channel(socket: str, *, timeout_s: float) -> grpc.Channel:
    """A channel to the daemon's unix socket, ready; waits up to `timeout_s` for it to start."""
    channel = grpc.insecure_channel(f"unix:{socket}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise DaemonUnavailableError(
            f"no odbd daemon answered on unix:{socket} within {timeout_s:g} s; start odbd on "
            f"this node, or point socket= / ${SOCKET_ENV} at the daemon's --socket"
        ) from None
    return channel


_CONNECT_POLL_S = 0.05  # between attempts while the daemon starts


def connect_steps(socket: str, *, timeout_s: float) -> socketlib.socket:
    """A connected, blocking socket to the step channel of the daemon whose gRPC socket is
    `socket`; waits up to `timeout_s` for the daemon to start."""
    from odbclient.framing import steps_socket_path

    return _connect_framed(socket, steps_socket_path(socket), who="trainer", timeout_s=timeout_s)


def connect_ingest(socket: str, *, timeout_s: float) -> socketlib.socket:
    """A connected, blocking socket to the ingest stream of the daemon whose gRPC socket is
    `socket`; waits up to `timeout_s` for the daemon to start."""
    from odbclient.framing import ingest_socket_path

    return _connect_framed(socket, ingest_socket_path(socket), who="producer", timeout_s=timeout_s)


def _connect_framed(socket: str, path: str, *, who: str, timeout_s: float) -> socketlib.socket:
    """A connected, blocking socket at `path` beside the daemon's gRPC socket `socket`.

    A daemon binds its framed sockets before its gRPC socket, so a gRPC socket that answers
    with none at `path` is a daemon older than this odbclient: that fails at once, by name.
    Before the caller sends a byte, the socket file's owner and the listener's SO_PEERCRED uid
    must be this user or root (odbclient.local_trust), else UntrustedDaemonError.
    """
    deadline_s = time.monotonic() + timeout_s
    refused_since_s: float | None = None  # the socket file exists but nothing listens
    while True:
        check_socket_owner(path, who=who)
        sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        try:
            sock.connect(path)
            check_daemon_peer(sock, path, who=who)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as error:
            sock.close()
            if isinstance(error, FileNotFoundError) and accepts_connections(socket):
                raise ProtocolError(
                    f"odbd on unix:{socket} has no {who} socket {path}: the daemon is older "
                    f"than this odbclient ({who} protocol {PROTOCOL_VERSION}), or it is "
                    f"shutting down; install the same odbd release for the daemon and its {who}s"
                ) from None
            if isinstance(error, FileNotFoundError):
                refused_since_s = None
            else:
                now_s = time.monotonic()
                refused_since_s = now_s if refused_since_s is None else refused_since_s
                if now_s - refused_since_s >= _DEAD_DAEMON_GRACE_S:
                    raise DaemonUnavailableError(dead_daemon_message(socket, path, who)) from None
        except UntrustedDaemonError:
            sock.close()
            raise
        except PermissionError:
            sock.close()
            raise DaemonUnavailableError(
                f"the {who} socket {path} belongs to another user (mode 0600); run the {who} "
                "as the user of the odbd daemon"
            ) from None
        if time.monotonic() >= deadline_s:
            # A daemon opens its sockets only after its own call of the --dataset factory
            # (for len()), which takes minutes on a real corpus: trainers started beside it
            # (a pod's sidecar) were told to start a daemon that was starting.
            raise DaemonUnavailableError(
                f"no odbd daemon answered on unix:{socket} within {timeout_s:g} s (its {who} "
                f"socket {path} does not accept); start odbd on this node, or point socket= / "
                f"${SOCKET_ENV} at the daemon's --socket. A daemon that is still starting "
                "opens it only after building its --dataset once: if that takes longer, raise "
                "connect_timeout_s"
            )
        time.sleep(_CONNECT_POLL_S)


# A daemon listens as soon as it binds, and one starting again removes a dead one's socket
# files before building its dataset, within seconds of its start: a socket file refused this
# long is a dead daemon's, with no new one starting (a trainer started beside a restarted
# daemon must not be told its daemon died while that one imports). 60 s before (issue 24).
_DEAD_DAEMON_GRACE_S = 5.0


def dead_daemon_message(socket: str, path: str, who: str) -> str:
    """A socket file with no listener: its daemon ran and ended without removing it."""
    try:
        bound = time.strftime("%H:%M:%S", time.localtime(os.stat(path).st_mtime))
    except OSError:
        bound = "?"
    return (
        f"the odbd daemon of unix:{socket} ran and is gone: its {who} socket {path} (bound at "
        f"{bound}) is still there but nothing listened on it for {_DEAD_DAEMON_GRACE_S:g} s, "
        "and no daemon started again there, so the daemon was killed (SIGKILL, "
        "the OOM killer) or crashed before it could remove it; read its log for why, then "
        "start the job again (its daemon on this node first: it removes the dead socket)"
    )


def accepts_connections(path: str) -> bool:
    """Something listens on the unix socket at `path` (the kernel accepts into the listen
    backlog for a stopped or hung process too, so this says nothing of whether it answers)."""
    probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def refusal_error(
    code: str,
    message: str,
    *,
    socket: str,
    who: str,
    refusals: Mapping[grpc.StatusCode, _Refusal],
) -> ODBClientError:
    """The ODBClientError for a refusal sent on a step or ingest socket (code: a status code
    name)."""
    status = grpc.StatusCode.__members__.get(code, grpc.StatusCode.UNKNOWN)
    cls, fix = refusals.get(status, (ODBClientError, "check the daemon log"))
    return cls(f"odbd on unix:{socket} refused {who}: {message}; {fix}")


def translate_rpc_error(
    error: grpc.RpcError,
    *,
    socket: str,
    who: str,
    established: bool,
    refusals: Mapping[grpc.StatusCode, _Refusal],
) -> ODBClientError:
    """The ODBClientError for a gRPC failure, with the daemon's message and the fix."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else "") or str(code)
    where = f"odbd on unix:{socket}"
    if code in refusals:
        cls, fix = refusals[code]
        return cls(f"{where} refused {who}: {details}; {fix}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DaemonTimeoutError(f"{where} did not answer {who} in time: {details}")
    if code == grpc.StatusCode.UNAVAILABLE and not established:
        return DaemonUnavailableError(
            f"{where} is not reachable for {who}: {details}; start odbd on this node, or point "
            f"socket= / ${SOCKET_ENV} at the daemon's --socket"
        )
    return DaemonConnectionError(
        f"the stream between {who} and {where} broke ({code.name}: {details}); the daemon "
        "exited or restarted; check its log, then restart this process"
    )


class Outbox:
    """The request side of a bidi stream: messages put here are sent in order until close()."""

    _END = object()

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def put(self, message: Any) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(self._END)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._queue.get, self._END)


def start_reader(target: Any, *, name: str) -> threading.Thread:
    """A daemon thread: it must never keep the trainer or producer process alive on exit."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


@dataclass(frozen=True, slots=True)
class Failure:
    """A reader thread's error, queued so the consuming thread raises it instead of hanging."""

    error: Exception


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """The daemon closed the stream cleanly (status OK)."""
