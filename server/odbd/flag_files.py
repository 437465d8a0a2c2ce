"""Files and directories the daemon's flags name: checked and read before anything starts.

Each problem is a ConfigError saying what is wrong with which flag and how to fix it; the CLI
prints it as one line and exits 2.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from odbclient import local_trust
from odbd.errors import ConfigError

if TYPE_CHECKING:
    from odbd.round.config import PeerTls


def check_socket_directory(socket: str) -> None:
    """The socket's directory must exist and be writable: odbd does not create it, so a typo
    in the path is an error here rather than a directory made somewhere unexpected. The
    default socket's directory is the exception: created mode 0700, and refused when another
    user owns it or others can write it (another user could take the path first)."""
    directory = Path(socket).parent
    if str(directory) == local_trust.default_socket_dir():
        fix = "or pass --socket in a directory only you can write"
        ensure_private_dir(directory, flag="--socket", fix=fix)
    if not directory.is_dir():
        raise ConfigError(
            f"--socket {socket}: directory {directory} does not exist; create it (mode 0700) "
            "or pass a --socket in an existing directory"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--socket {socket}: directory {directory} is not writable by this user; "
            "pass a --socket in a directory you own"
        )
    if Path(socket).is_dir():
        raise ConfigError(
            f"--socket {socket} is a directory; pass a file path such as {socket}/odbd.sock"
        )


def ensure_private_dir(directory: Path, *, flag: str, fix: str) -> None:
    """Creates `directory` mode 0700 if absent (its parent must exist); refuses one another
    user owns or others can write (ConfigError with the fix): another user could plant files
    there for odbd to follow, or replace what odbd keeps."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    check_private_dir(directory, flag=flag, fix=fix)


def check_private_dir(directory: Path, *, flag: str, fix: str) -> None:
    """`directory` (or, through a symbolic link this user or root owns, its target) is a
    directory of this user or root that group and others cannot write; else ConfigError."""
    problem = private_dir_problem(directory)
    if problem:
        uid = os.getuid()
        raise ConfigError(
            f"{flag}: directory {directory} {problem}, so another user could plant or replace "
            f"files odbd uses there. Fix: `chown {uid} {directory} && chmod 700 {directory}` "
            f"(as root), or remove it so odbd creates it mode 0700, {fix}"
        )


def private_dir_problem(directory: Path) -> str:
    """Why `directory` may not hold odbd's sockets or journal ("" when it may)."""
    uid = os.getuid()
    try:
        link = os.lstat(directory)
        if stat.S_ISLNK(link.st_mode) and not local_trust.trusted_uid(link.st_uid, uid):
            return f"is a symbolic link owned by uid {link.st_uid}, not by this user (uid {uid})"
        info = os.stat(directory)
    except OSError as error:
        return f"cannot be inspected ({error.strerror})"
    problem = local_trust.private_dir_problem(info, uid)
    if not problem:
        return ""
    return f"{problem} (owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"


def check_state_dir(state_dir: Path) -> None:
    """--state-dir is a writable directory, or can be created under one (the journal does,
    mode 0700: odbd.daemon.journal checks its owner and mode when it opens it)."""
    existing = state_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"--state-dir {state_dir}: {existing} is not a directory; pass a directory path "
            "for the restart journal"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--state-dir {state_dir}: {existing} is not writable by this user, so the restart "
            "journal cannot be written; pass a directory you can write"
        )
    if existing == state_dir:
        check_private_dir(
            state_dir, flag="--state-dir", fix="or pass a --state-dir only you can write"
        )


def read_peer_tls(cert: Path | None, key: Path | None, ca: Path | None) -> PeerTls | None:
    """The three --tls-* files (all or none), read once: the daemon never rereads them."""
    files = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
    given = {flag: path for flag, path in files.items() if path is not None}
    if not given:
        return None
    if len(given) != len(files):
        missing = sorted(set(files) - set(given))
        raise ConfigError(
            f"peer mTLS needs --tls-cert, --tls-key and --tls-ca together; missing {missing}"
        )
    from odbd.round.config import PeerTls  # imports grpc: only when TLS is asked for

    data = {}
    for flag, path in given.items():
        try:
            data[flag] = path.read_bytes()
        except OSError as error:
            raise ConfigError(
                f"cannot read {flag} {path}: {error.strerror}; pass a readable PEM file"
            ) from None
    return PeerTls(
        cert_chain=data["--tls-cert"],
        private_key=data["--tls-key"],
        root_certificates=data["--tls-ca"],
    )


def read_job_token(path: Path | None) -> bytes:
    """The shared secret, or b"" without --job-token-file. An empty file is refused: it would
    silently turn peer authentication off."""
    if path is None:
        return b""
    try:
        token = path.read_bytes().strip()
    except OSError as error:
        raise ConfigError(
            f"cannot read --job-token-file {path}: {error.strerror}; pass a readable file "
            "holding the job's shared secret"
        ) from None
    if not token:
        raise ConfigError(
            f"--job-token-file {path} is empty, which would turn peer authentication off; "
            "write a secret into it (e.g. openssl rand -hex 32) or omit the flag"
        )
    return token
