"""Round barrier settings (one frozen dataclass) and the wire limits every daemon must share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from odbd.errors import ConfigError
from odbd.round.tree import DEFAULT_FANOUT, TreeLayout

# 2: the job token is proven by challenge-response (auth.py) instead of sent in the Hello.
# 3: the live round runs on the split planner (daemon/split_round.py): two exchanges per round,
# summaries then step totals, each reduced by the hub to one result for every node.
# 4: the round exchanges travel a relay tree of fan-out --round-fanout (tree.py): a daemon joins
# its parent, relays aggregate their subtree's contributions and relay results and aborts down.
PROTOCOL_VERSION = 4
# A round result carries every node's payload in one message: up to a few hundred KB per node
# per round today, so 64 MiB leaves room for 64 nodes with ~1 MB offers each.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_ENVELOPE_SLACK_BYTES = 64 * 1024  # round number, node ranks and per-payload framing

SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # gRPC shares ports by default (SO_REUSEPORT): a second daemon on the same port would bind
    # "successfully" and steal half the peers. Refuse instead, so a clash is a clear bind error.
    ("grpc.so_reuseport", 0),
    # Spokes ping an idle stream to detect a silently dead hub; accept those pings.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # Bounds on what a stranger's connections hold: the TLS/HTTP2 handshake must finish within
    # 10 s, a connection without any call is closed after 60 s (a client reconnects on its
    # next call), and one connection opens at most 16 streams at once.
    ("grpc.server_handshake_timeout_ms", 10_000),
    ("grpc.max_connection_idle_ms", 60_000),
    ("grpc.max_concurrent_streams", 16),
)
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


def max_payload_bytes(num_nodes: int) -> int:
    """The largest payload one node may contribute per round (its share of one round message)."""
    return (MAX_MESSAGE_BYTES - _ENVELOPE_SLACK_BYTES) // max(num_nodes, 1)


def parse_address(address: str, what: str) -> tuple[str, int]:
    """Splits "host:port" (IPv6 as "[::1]:port"); raises ConfigError naming `what` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{what} {address!r} is not HOST:PORT (e.g. 127.0.0.1:7070)")
    return host, int(port)


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerTls:
    """mTLS of the peer listener and the spokes' channel: PEM bytes, read once at startup.

    Every daemon presents `cert_chain` (signed by the job's CA, naming its --peers host) and
    accepts only peers whose certificate `root_certificates` signed.
    """

    cert_chain: bytes
    private_key: bytes
    root_certificates: bytes

    def __post_init__(self) -> None:
        for name in ("cert_chain", "private_key", "root_certificates"):
            if b"-----BEGIN " not in getattr(self, name):
                flag = {"cert_chain": "--tls-cert", "private_key": "--tls-key"}.get(name)
                raise ConfigError(f"{flag or '--tls-ca'} is not a PEM file (no -----BEGIN line)")

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.root_certificates,
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.cert_chain,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundConfig:
    """How this daemon takes part in the job's round barrier."""

    job_id: str
    node_rank: int
    num_nodes: int
    peers: tuple[str, ...]  # node -> "host:port" of its peer listener; peers[0] is the hub
    listen: str  # this daemon's peer listener, "HOST:PORT" (port 0 = any); "" = none (non-hub)
    fingerprint: Mapping[str, str]  # setting -> canonical value; must match on every daemon
    job_token: bytes = b""  # shared secret of the job's daemons; empty admits any peer
    join_timeout_s: float = 60.0  # start(): every node joins the hub within this
    round_timeout_s: float = 60.0  # a round: all contributions arrive within this of the first
    tls: PeerTls | None = None  # None: plaintext peer traffic (the token still authenticates)
    # The hub closes a Join stream that has not sent its Hello and Proof within this.
    hello_timeout_s: float = 10.0
    # this daemon was restarted from a --state-dir journal: a node that never joins may be one
    # that kept running (only every daemon restarted together can resume the job)
    from_journal: bool = False
    # Barrier rounds per planner round (the live daemons: 2, split_exchange.py), so that
    # messages name the planner's round: barrier round 7 is "round 3 (exchange 2 of 2)".
    exchanges_per_round: int = 1
    # Children per daemon in the relay tree (tree.py): the hub writes to at most this many.
    fanout: int = DEFAULT_FANOUT

    def round_name(self, barrier_round: int) -> str:
        """A barrier round as operators know it: the planner's round (and its exchange)."""
        n = self.exchanges_per_round
        if n == 1:
            return str(barrier_round)
        return f"{barrier_round // n} (exchange {barrier_round % n + 1} of {n})"

    def __post_init__(self) -> None:
        TreeLayout(max(self.num_nodes, 1), self.fanout)  # raises ConfigError on a bad fan-out
        self._check_layout()
        self._check_addresses()
        if self.join_timeout_s <= 0 or self.round_timeout_s <= 0 or self.hello_timeout_s <= 0:
            raise ConfigError(
                f"round barrier timeouts must be > 0 s, got join {self.join_timeout_s} s and "
                f"round {self.round_timeout_s} s"
            )
        bad = [
            k
            for k, v in self.fingerprint.items()
            if not (isinstance(k, str) and isinstance(v, str))
        ]
        if bad:
            raise ConfigError(f"fingerprint settings must map str to str; bad keys: {bad}")
        # A private copy: the caller's mapping may change after the handshake compared it.
        object.__setattr__(self, "fingerprint", dict(self.fingerprint))

    def _check_layout(self) -> None:
        if self.num_nodes < 1:
            raise ConfigError(f"number of nodes must be >= 1, got {self.num_nodes}")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ConfigError(
                f"node rank {self.node_rank} is outside 0..{self.num_nodes - 1} for a job of "
                f"{self.num_nodes} nodes; pass --node-rank with this node's index"
            )
        if self.num_nodes > 1 and len(self.peers) != self.num_nodes:
            raise ConfigError(
                f"--peers lists {len(self.peers)} addresses but the job has {self.num_nodes} "
                "nodes; list every daemon's peer address in node-rank order, node 0 first"
            )

    def _check_addresses(self) -> None:
        for node, address in enumerate(self.peers):
            parse_address(address, f"--peers entry of node {node}")
        if self.listen:
            parse_address(self.listen, "--listen")
        elif self.is_hub:
            raise ConfigError("node 0 is the hub of the round barrier and needs --listen HOST:PORT")
        parent = self.parent
        if parent is not None and parse_address(self.peers[parent], "parent")[1] == 0:
            raise ConfigError(
                f"the address {self.peers[parent]} of node {parent} has port 0; node "
                f"{self.node_rank} joins the round exchanges through it (its parent in the relay "
                f"tree of fan-out {self.fanout}), so give node {parent} a fixed --listen port"
            )
        if self.children and not self.listen:
            raise ConfigError(
                f"node {self.node_rank} relays the round exchanges of nodes "
                f"{', '.join(map(str, self.children))} (fan-out {self.fanout}) and needs "
                "--listen HOST:PORT"
            )

    @property
    def is_hub(self) -> bool:
        return self.num_nodes > 1 and self.node_rank == 0

    @property
    def hub_address(self) -> str:
        return self.peers[0] if self.peers else ""

    @property
    def layout(self) -> TreeLayout:
        return TreeLayout(self.num_nodes, self.fanout)

    @property
    def parent(self) -> int | None:
        """The node this daemon joins (None: the hub, or a job of one node)."""
        return self.layout.parent(self.node_rank) if self.num_nodes > 1 else None

    @property
    def children(self) -> list[int]:
        """The nodes that join this daemon (it relays for them, or is their hub)."""
        return self.layout.children(self.node_rank)

    @property
    def parent_address(self) -> str:
        parent = self.parent
        return self.peers[parent] if parent is not None else ""

    @property
    def settings(self) -> Mapping[str, str]:
        """What the handshake compares: the fingerprint plus the job's node count and tree."""
        return {
            "num_nodes": str(self.num_nodes),
            # Only when set, like the daemon's optional settings: a Hello built for the
            # default tree (tools, tests) still matches. A daemon of another fan-out would also
            # be refused as nobody's child (handshake.py), but this names the flag.
            **({"round_fanout": str(self.fanout)} if self.fanout != DEFAULT_FANOUT else {}),
            **self.fingerprint,
        }
