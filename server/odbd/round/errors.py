"""Errors of the round barrier. Each message names the round, the daemons involved and the fix."""

from __future__ import annotations

from odbclient.wire.odbd.v1 import peer_pb2
from odbd.errors import OdbdError


class RoundTimeoutError(OdbdError):
    """A round's contributions did not all arrive by the deadline; the job cannot go on."""


class PeerLostError(OdbdError):
    """A daemon's stream broke or closed while the job still needed it; the job cannot go on."""


class ParentClosedError(PeerLostError):
    """The parent (hub or relay) ended this node's stream normally: it shut down. Mid-job that
    fails every later round as a lost peer; once this daemon planned every round it is the
    parent's normal end (RoundBarrier.raise_loss ignores it)."""


class PeerFailedError(OdbdError):
    """Another daemon failed the job itself (ABORT_KIND_JOB_FAILED); the message is its reason."""


class HandshakeError(OdbdError):
    """The job could not form: a daemon was refused at the handshake or never joined in time."""


class PayloadTooLargeError(OdbdError, ValueError):
    """A node's round payload exceeds its share of the 64 MiB round message."""


# The error an Abort of each kind raises, on the hub (a relay's report) and on a spoke alike.
ERROR_OF_ABORT_KIND: dict[int, type[OdbdError]] = {
    peer_pb2.ABORT_KIND_ROUND_TIMEOUT: RoundTimeoutError,
    peer_pb2.ABORT_KIND_PEER_LOST: PeerLostError,
    peer_pb2.ABORT_KIND_JOIN_TIMEOUT: HandshakeError,
    peer_pb2.ABORT_KIND_REFUSED: HandshakeError,
    peer_pb2.ABORT_KIND_JOB_FAILED: PeerFailedError,
}
