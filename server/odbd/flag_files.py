"""Files and directories the daemon's flags name: checked and read before anything starts.

Each problem is a ConfigError saying what is wrong with which flag and how to fix it; the CLI
prints it as one line and exits 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from odbd.errors import ConfigError

if TYPE_CHECKING:
    from odbd.round.config import PeerTls


def check_socket_directory(socket: str) -> None:
    """The socket's directory must exist and be writable: odbd does not create it, so a typo
    in the path is an error here rather than a directory made somewhere unexpected."""
    directory = Path(socket).parent
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


def check_state_dir(state_dir: Path) -> None:
    """--state-dir is a writable directory, or can be created under one (the journal does)."""
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
