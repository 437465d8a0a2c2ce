"""Many hosts on one machine: one network namespace per daemon, a fault proxy between them.

Each node gets a namespace with one veth pair to the root namespace and an address of its own,
10.77.X.(node+1)/32 (X picked per network so concurrent runs do not collide). The only route a
node has is to the proxy address 10.77.X.254, held by the root end of every pair; nodes cannot
reach each other directly, so every byte between a spoke and the hub passes the FaultProxy
(tests/fault_proxy.py) in the test process, which tells the nodes apart by source address.
Nothing routes to any other network: no traffic leaves the machine.

    with Network.create(4) as net, FaultProxy(listen=(net.proxy_host, 0),
                                              target=(net.address(0), HUB_PORT)) as proxy:
        cluster = NetnsCluster(spec, net, hub=proxy.address_str)

Creating namespaces needs root and iproute2; `unavailable()` says why not where they cannot be
made. `Network.close()` deletes the veths and namespaces (also those half made by a failed
`create`).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from odbd.demo.cluster import ClusterSpec, LocalCluster

PEER_PORT = 7070  # every node has its own namespace: the same port everywhere
METRICS_PORT = 9090
_counter = itertools.count()


def unavailable() -> str:
    """Why network namespaces cannot be made here ("" when they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the tests as root, as CI does"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip` on PATH (apt-get install iproute2)"
    probe = f"odbd-probe-{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    _run("ip", "netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    return ""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _free_subnet() -> int:
    """An X with no 10.77.X.0/24 address on this machine (another run may hold one)."""
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    start = (os.getpid() + next(_counter) * 7) % 250
    for step in range(250):
        x = (start + step) % 250 + 1
        if f"10.77.{x}." not in used:
            return x
    raise RuntimeError("every 10.77.X.0/24 subnet is in use on this machine")


@dataclass
class Network:
    nodes: int
    subnet: int
    tag: str  # unique per network: names of its namespaces and veths
    namespaces: list[str] = field(default_factory=list)
    veths: list[str] = field(default_factory=list)  # root ends (deleting one deletes the pair)

    @classmethod
    def create(cls, nodes: int) -> Network:
        tag = f"{os.getpid() % 100000}x{next(_counter)}"
        net = cls(nodes, _free_subnet(), tag)
        try:
            for node in range(nodes):
                net._add_node(node)
        except BaseException:
            net.close()
            raise
        return net

    @property
    def proxy_host(self) -> str:
        return f"10.77.{self.subnet}.254"

    def address(self, node: int) -> str:
        return f"10.77.{self.subnet}.{node + 1}"

    def namespace(self, node: int) -> str:
        return f"odbd-{self.tag}-n{node}"

    def exec_prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(node)]

    def _add_node(self, node: int) -> None:
        ns, root_end, node_end = (
            self.namespace(node),
            f"ob{self.tag}h{node}",
            f"ob{self.tag}n{node}",
        )
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _run("ip", "link", "add", root_end, "type", "veth", "peer", "name", node_end)
        self.veths.append(root_end)
        _run("ip", "link", "set", node_end, "netns", ns)
        _run("ip", "addr", "add", f"{self.proxy_host}/32", "dev", root_end)
        _run("ip", "link", "set", root_end, "up")
        _run("ip", "route", "add", f"{self.address(node)}/32", "dev", root_end)
        inside = ["ip", "netns", "exec", ns, "ip"]
        _run(*inside, "link", "set", "lo", "up")
        _run(*inside, "addr", "add", f"{self.address(node)}/32", "dev", node_end)
        _run(*inside, "link", "set", node_end, "up")
        _run(*inside, "route", "add", f"{self.proxy_host}/32", "dev", node_end)

    def close(self) -> None:
        for veth in self.veths:
            _run("ip", "link", "del", veth, check=False)
        for ns in self.namespaces:
            _run("ip", "netns", "del", ns, check=False)
        self.veths, self.namespaces = [], []

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NetnsCluster(LocalCluster):
    """A LocalCluster whose daemon i runs in namespace i of `net`, listening on its own address;
    every node's --peers names `hub` (the proxy) for node 0, so spokes reach the hub only
    through it. Unix sockets and shm are shared by the namespaces (one machine, one /dev/shm):
    trainers and producers run as in any LocalCluster."""

    def __init__(self, spec: ClusterSpec, net: Network, *, hub: str) -> None:
        super().__init__(spec)
        # Off loopback a daemon refuses to run without peer authentication: a job token, the
        # same on every node, as a real multi-host job would have.
        self.token = self.tmp / "job-token"
        self.token.write_bytes(os.urandom(32).hex().encode())
        os.chmod(self.token, 0o600)
        self.net = net
        self.hub = hub
        self.peer_ports = [PEER_PORT] * spec.nodes
        self.metrics_ports = [METRICS_PORT] * spec.nodes if spec.metrics else []

    def peer_address(self, node: int) -> str:
        return f"{self.net.address(node)}:{PEER_PORT}"

    def metrics_url(self, node: int) -> str:
        return f"http://{self.net.address(node)}:{METRICS_PORT}/metrics"

    def command(self, node: int) -> list[str]:
        spec = self.spec
        peers = ",".join([self.hub] + [self.peer_address(n) for n in range(1, spec.nodes)])
        args = [*self.net.exec_prefix(node), sys.executable, "-m", "odbd"]
        args += ["--world", str(self.world), "--nproc-per-node", str(spec.ranks_per_node)]
        args += ["--node-rank", str(node), "--socket", self.sockets[node], "--job-id", spec.job_id]
        args += ["--peers", peers, "--listen", self.peer_address(node)]
        args += ["--job-token-file", str(self.token)]
        if self.metrics_ports:
            args += ["--metrics-host", self.net.address(node), "--metrics-port", str(METRICS_PORT)]
        args += list(spec.daemon_args)
        if node < len(spec.per_node_args):
            args += list(spec.per_node_args[node])
        return args
