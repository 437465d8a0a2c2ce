"""Protected by default: a multi-node daemon on a network address must authenticate its peers.

Redis's protected mode is the model. A daemon whose peer traffic can leave the machine (its
--listen or any --peers entry is not a loopback address) refuses to start unless peers
authenticate with a job token or mTLS, or the operator says the network is isolated with
--insecure. Loopback-only jobs (`odbd demo`, tests, one machine) need nothing. Pure.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(address: str) -> bool:
    """True for "127.x.y.z:port", "[::1]:port" and "localhost:port"; every other host, names
    included, counts as reachable from the network (no DNS lookup at start-up)."""
    host = address.rpartition(":")[0] if ":" in address else address
    host = host.strip().strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unprotected_reason(
    *,
    num_nodes: int,
    node_rank: int,
    listen: str,
    peers: Sequence[str],
    has_token: bool,
    has_tls: bool,
    insecure: bool,
) -> str | None:
    """Why this daemon must not start as configured, or None (one line, naming the fixes)."""
    if num_nodes < 2 or has_token or has_tls or insecure:
        return None
    exposed = [a for a in (listen, *peers) if a and not is_loopback(a)]
    if not exposed:
        return None
    where = f"listens on {listen}" if listen in exposed else f"talks to {exposed[0]}"
    return (
        f"node {node_rank} of a {num_nodes}-node job {where}, which is not a loopback "
        "address, without peer authentication: any process that reaches the port could join "
        "the job, stop it or read its sample ids. Pass --job-token-file FILE (the same secret "
        "on every node), or mTLS with --tls-cert, --tls-key and --tls-ca, or --insecure on an "
        "isolated network where every host is trusted"
    )
