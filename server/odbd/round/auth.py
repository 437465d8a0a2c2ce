"""Peer authentication: a challenge-response over the job token, both ways (pure).

The token never crosses the wire. The spoke's Hello carries a fresh nonce; the hub answers
with its own fresh nonce and a proof that it holds the token; the spoke checks that proof and
answers with its own. Each proof is an HMAC-SHA256 keyed by the token over both nonces and
everything the Hello claims (job id, node rank, listener, settings), with a different label per
direction, so:
  - a captured Hello and proof are worthless later: the hub's nonce is new on every stream;
  - a proof cannot be moved to another job, node rank or direction;
  - a spoke does not send its contributions (sample ids and lengths) to a process that merely
    bound the hub's address without the token.
Without TLS the stream itself is not bound to the proofs: an active man in the middle who can
rewrite traffic can still relay a handshake and read the rounds. --tls-* closes that.

With an empty token (a loopback job without --job-token-file) the same exchange runs with an
empty key: it authenticates nobody, and the hub treats such peers as unauthenticated.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from odbclient.wire.odbd.v1 import peer_pb2

NONCE_BYTES = 32
_HUB_LABEL = b"odbd peer v2: hub proof"
_SPOKE_LABEL = b"odbd peer v2: spoke proof"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _field(data: bytes) -> bytes:
    # Length-prefixed, so no two different transcripts encode to the same bytes.
    return len(data).to_bytes(4, "big") + data


def transcript(label: bytes, hello: peer_pb2.Hello, hub_nonce: bytes) -> bytes:
    """The bytes a proof covers: the direction, both nonces and every claim of the Hello."""
    parts = [
        label,
        bytes(hello.nonce),
        hub_nonce,
        str(hello.protocol_version).encode(),
        hello.job_id.encode(),
        str(hello.node_rank).encode(),
        hello.listen_address.encode(),
    ]
    for name in sorted(hello.fingerprint):
        parts += [name.encode(), hello.fingerprint[name].encode()]
    return b"".join(_field(p) for p in parts)


def hub_proof(token: bytes, hello: peer_pb2.Hello, hub_nonce: bytes) -> bytes:
    return hmac.new(token, transcript(_HUB_LABEL, hello, hub_nonce), hashlib.sha256).digest()


def spoke_proof(token: bytes, hello: peer_pb2.Hello, hub_nonce: bytes) -> bytes:
    return hmac.new(token, transcript(_SPOKE_LABEL, hello, hub_nonce), hashlib.sha256).digest()


def proof_matches(expected: bytes, got: bytes) -> bool:
    """Constant-time, so the time of a refusal says nothing about how much of a guess was right."""
    return hmac.compare_digest(expected, got)
