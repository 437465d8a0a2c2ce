"""Round barrier between the daemons of a job: peer channels, handshake, deadlines.

Stage: offers (opaque bytes per node) -> all nodes' offers in node-rank order, identical on
every daemon, so the pure planner computes the same RoundPlan everywhere.

    config.py       RoundConfig, wire limits and gRPC options
    fingerprint.py  canonical settings and the first mismatch (pure)
    handshake.py    the hub's admit/refuse decision on a Hello (pure)
    table.py        per-round contributions at the hub, or at a relay of its subtree (pure)
    tree.py         the relay tree: parent, children and subtree of a node (pure)
    admission.py    the hub's handshake of a Join stream: challenge, refusals, join deadline
    missing.py      why a round is incomplete, node by node, for its timeout's Abort (pure)
    hub.py          node 0 and relays: their children's Join streams, results, deadlines, aborts
    spoke.py        other nodes: one Join stream to the parent (the hub or a relay)
    server.py       the peer listener: Peer service and grpc.health.v1
    barrier.py      RoundBarrier, the one entry point
"""

from odbd.round.barrier import RoundBarrier, RoundRecord
from odbd.round.config import PROTOCOL_VERSION, RoundConfig, max_payload_bytes
from odbd.round.errors import (
    HandshakeError,
    PayloadTooLargeError,
    PeerLostError,
    RoundTimeoutError,
)
from odbd.round.fingerprint import canonical_value, fingerprint_mismatch, fingerprint_of

__all__ = [
    "PROTOCOL_VERSION",
    "HandshakeError",
    "PayloadTooLargeError",
    "PeerLostError",
    "RoundBarrier",
    "RoundConfig",
    "RoundRecord",
    "RoundTimeoutError",
    "canonical_value",
    "fingerprint_mismatch",
    "fingerprint_of",
    "max_payload_bytes",
]
