"""Errors raised to trainers and producers: each says what happened, what follows, and the fix."""

from __future__ import annotations


class ODBClientError(Exception):
    """Base class of every odbclient error."""


class DaemonUnavailableError(ODBClientError, ConnectionError):
    """No odbd daemon answers on the socket (not started, crashed, or another path)."""


class UntrustedDaemonError(ODBClientError, PermissionError):
    """The daemon's socket or shm segment belongs to another user: nothing was sent to it."""


class RankRefusedError(ODBClientError, ValueError):
    """The daemon refused the hello: the rank is not on this node or the resume point is bad."""


class RankInUseError(ODBClientError):
    """Another ODBClient already holds this rank on the daemon."""


class JobMismatchError(ODBClientError):
    """The daemon serves another job id or speaks another protocol version."""


class DaemonConnectionError(ODBClientError, ConnectionError):
    """The stream to the daemon broke after it was established."""


class ReaderProcessError(ODBClientError, ConnectionError):
    """The reader process of ODBClient(reader="process") exited while the trainer used it."""


class DaemonTimeoutError(ODBClientError, TimeoutError):
    """No event arrived from the daemon within the deadline."""


class IteratorInUseError(ODBClientError, RuntimeError):
    """A second iter(client) while the first epoch iterator is live: they would split the epoch."""


class ClientClosedError(ODBClientError):
    """close() ended the client while (or before) an iteration waited for a batch."""


class JobFailedError(ODBClientError):
    """The daemon ended the job on an error (its reason is the message)."""


class ProtocolError(ODBClientError):
    """The daemon sent something the protocol does not allow: a version skew or a bug."""


class CollateError(ODBClientError, ValueError):
    """The samples of a batch cannot be collated into tensors (ragged fixed-shape keys...)."""


class StateDictError(ODBClientError, ValueError):
    """A state dict passed to load_state_dict is malformed or comes too late."""


class DatasetLoadError(ODBClientError, ValueError):
    """`--dataset MODULE:FACTORY` or a `--dataset-arg` cannot produce a map-style dataset."""
