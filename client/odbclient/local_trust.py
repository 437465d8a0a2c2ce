"""Who may be on the other end of the daemon's unix sockets and shared memory (issue 29).

On a shared node another user can bind a predictable socket path first or plant files where
the daemon writes. Trust is by uid, both ways: a trainer or producer talks only to a daemon
running as its own user or root, and the daemon serves only peers of its user or root. Each
side checks the kernel's word for it (the socket file's owner and the peer's SO_PEERCRED
credentials) before sending a byte. Why no allow-list of other uids: the socket files and shm
segments are 0600, so another uid could not connect or map them anyway; serving one would mean
opening both to a group, and every member of that group could read every sample.

The default socket lives in a directory only its user can write: $XDG_RUNTIME_DIR/odbd when
that directory is ours and private (systemd's per-user runtime directory), else /tmp/odbd-$UID.
The daemon creates it 0700 and refuses one that someone else owns or others can write; the
trainer, producer and `odbd status` compute the same path. Shared by odbclient and the daemon;
imports neither grpc nor odbd.
"""

from __future__ import annotations

import os
import socket as socketlib
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from odbclient.errors import UntrustedDaemonError

SOCKET_NAME = "odbd.sock"
RUNTIME_ENV = "XDG_RUNTIME_DIR"
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def trusted_uid(uid: int, own_uid: int) -> bool:
    """A peer (or a file's owner) is trusted when it is this process's user or root."""
    return uid in (own_uid, 0)


def private_dir_problem(info: os.stat_result, own_uid: int) -> str:
    """Why a directory may not hold the daemon's socket or journal ("" when it may): it must
    be a directory of this user (or root) that nobody else can write."""
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if not trusted_uid(info.st_uid, own_uid):
        return f"is owned by another user, not by this user (uid {own_uid}) or root"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "is writable by group or others"
    return ""


def default_socket_dir(environ: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """$XDG_RUNTIME_DIR/odbd when $XDG_RUNTIME_DIR is an absolute, private directory of this
    user (a stale value from another host or user falls back), else /tmp/odbd-$UID."""
    env = os.environ if environ is None else environ
    uid = os.getuid() if uid is None else uid
    runtime = env.get(RUNTIME_ENV, "").strip()
    if runtime.startswith("/"):
        try:
            info = os.stat(runtime)
        except OSError:
            info = None
        if info is not None and info.st_uid == uid and not private_dir_problem(info, uid):
            return os.path.join(runtime, "odbd")
    return f"/tmp/odbd-{uid}"


def default_socket(environ: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """Where trainers and producers find the daemon unless told otherwise."""
    return os.path.join(default_socket_dir(environ, uid), SOCKET_NAME)


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socketlib.socket) -> PeerCredentials:
    """The kernel's SO_PEERCRED of a connected unix socket: who is on the other end (the
    process that connected, or the one that called listen())."""
    raw = sock.getsockopt(socketlib.SOL_SOCKET, socketlib.SO_PEERCRED, _PEERCRED.size)
    return PeerCredentials(*_PEERCRED.unpack(raw))


def check_socket_owner(path: str, *, who: str) -> None:
    """Refuses a socket file another user owns (UntrustedDaemonError), before connecting."""
    try:
        owner = os.stat(path).st_uid
    except OSError:
        return  # absent: the connect that follows says so (or waits for the daemon)
    own = os.getuid()
    if not trusted_uid(owner, own):
        raise UntrustedDaemonError(
            f"the socket {path} belongs to uid {owner}, not to this user (uid {own}) or root: "
            f"another user's process may be posing as odbd, so the {who} sent nothing. Start "
            f"odbd as uid {own} and point socket= / $ODBD_SOCKET at its --socket in a "
            "directory only you can write"
        )


def check_daemon_peer(sock: socketlib.socket, path: str, *, who: str) -> None:
    """Refuses a connected socket whose listener runs as another user (SO_PEERCRED), before
    the caller sends anything on it."""
    peer = peer_credentials(sock)
    own = os.getuid()
    if not trusted_uid(peer.uid, own):
        raise UntrustedDaemonError(
            f"the process listening on {path} (pid {peer.pid}) runs as uid {peer.uid}, not as "
            f"this user (uid {own}) or root: it is not a daemon this {who} may trust, so it "
            f"sent nothing. Start odbd as uid {own} and point socket= / $ODBD_SOCKET at its "
            "--socket in a directory only you can write"
        )


def probe_daemon(path: str, *, who: str) -> None:
    """Checks the socket file's owner and its listener's uid without sending a byte (for
    gRPC channels, which expose no peer credentials). Does nothing when nobody listens."""
    check_socket_owner(path, who=who)
    probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        try:
            probe.connect(path)
        except OSError:
            return
        check_daemon_peer(probe, path, who=who)
    finally:
        probe.close()


def check_segment(fd: int, name: str) -> None:
    """Refuses a shm segment that is not a regular file of this user (or root) with no access
    for group or others (UntrustedDaemonError): another user's segment could feed forged
    samples."""
    info = os.fstat(fd)
    own = os.getuid()
    if not stat.S_ISREG(info.st_mode) or not trusted_uid(info.st_uid, own):
        raise UntrustedDaemonError(
            f"shm segment {name} belongs to uid {info.st_uid}, not to this user (uid {own}) or "
            "root: it was not made by a daemon this process trusts; run odbd and its trainers "
            "and producers as the same user"
        )
    if info.st_mode & 0o077:
        raise UntrustedDaemonError(
            f"shm segment {name} has mode {stat.S_IMODE(info.st_mode):04o}; odbd makes its "
            "segments 0600, so others could read or change its samples: not mapped. Restart "
            "the daemon (it recreates its segments) and look for who changed the mode"
        )
