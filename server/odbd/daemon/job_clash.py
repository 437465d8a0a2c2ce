"""Two jobs started with the same --job-id on one host: named, not blamed on --peers (issue 24).

A host's daemons share /dev/shm, where a job's segments are named by job id and node rank
(odbd-JOB-NODE-i). Two 2-node jobs started at once with the same id take each other's node
ranks: for each node rank one daemon gets the arena and the other exits, so each job may lose
a node. The survivors saw only a node that never joined (the hub) or a hub that never answered
(a spoke) and told the operator to check --peers. A daemon that holds the missing node rank's
arena on this host but was given other --peers than ours is the other job, and is named.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from odbd.ingest.arena import live_owners

_PEERS_FLAG = "--peers"
_PEERS_ENV = "ODBD_PEERS"


@dataclass(frozen=True, slots=True)
class OtherDaemon:
    pid: int
    node_rank: int
    peers: tuple[str, ...] | None  # its --peers (None: unreadable)


def peers_of(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """A daemon's --peers from its command line, else its $ODBD_PEERS; None if neither."""
    raw: str | None = None
    for i, arg in enumerate(argv):
        if arg == _PEERS_FLAG and i + 1 < len(argv):
            raw = argv[i + 1]  # the last one wins, as in argparse
        elif arg.startswith(_PEERS_FLAG + "="):
            raw = arg.split("=", 1)[1]
    if raw is None:
        raw = environ.get(_PEERS_ENV)
    if raw is None:
        return None
    return tuple(entry.strip() for entry in raw.split(",") if entry.strip())


def clash_message(job_id: str, ours: tuple[str, ...], others: Iterable[OtherDaemon]) -> str:
    """The clash, or "" when every other daemon was given our --peers (it is of this job)."""
    foreign = [o for o in others if o.peers is not None and o.peers != ours]
    if not foreign:
        return ""
    named = "; ".join(
        f"node rank {o.node_rank} is held by pid {o.pid} with --peers {','.join(o.peers or ())}"
        for o in foreign
    )
    return (
        f"another job runs on this host with the same --job-id {job_id!r} ({named}; this "
        f"daemon's --peers are {','.join(ours)}): the two jobs' daemons take each other's "
        "node ranks (their shared memory is named by job id and node rank), so this job "
        "cannot form. Give each job its own --job-id (ODBD_JOB_ID), then start this job again "
        "on every node (if that daemon is of this job, give every node the same --peers)"
    )


def find_clash(
    job_id: str, node_ranks: Iterable[int], ours: tuple[str, ...], *, own_pid: int
) -> str:
    """clash_message for the live daemons of `job_id` holding `node_ranks` on this host."""
    others = []
    for node_rank in node_ranks:
        for pid in live_owners(job_id, node_rank):
            if pid != own_pid:
                others.append(OtherDaemon(pid, node_rank, _peers_of_pid(pid)))
    return clash_message(job_id, ours, others)


def _peers_of_pid(pid: int) -> tuple[str, ...] | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        environ: dict[str, str] = {}
        if _PEERS_FLAG not in " ".join(argv):
            raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            environ = dict(e.split("=", 1) for e in raw.split("\0") if "=" in e)
    except OSError:  # gone since, or another user's
        return None
    return peers_of(argv, environ)
