"""Many hosts on one machine: 4 daemons in their own network namespaces, each with its own
address, every spoke-to-hub byte through a userspace fault proxy (issue 25).

The kernel here has no netem, so the network's faults are made by tests/fault_proxy.py in this
process (tests/integration/netns.py builds the namespaces). A round trip of 50 ms, a partition
shorter than --round-timeout, one longer, and a crashed node brought back from --state-dir.
Skipped, saying why, where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from odbd.demo.cluster import ClusterSpec
from tests.fault_proxy import FaultProxy
from tests.integration.faults_cluster import FaultCluster, synthetic
from tests.integration.harness import http_get, scaled
from tests.integration.netns import PEER_PORT, NetnsCluster, Network, unavailable

_WHY = unavailable()
pytestmark = [
    pytest.mark.netns,  # 1-2 min each on the shared machine: `make test-netns`, not `make test`
    pytest.mark.timeout(240),
    pytest.mark.skipif(bool(_WHY), reason=_WHY),
]

NODES = 4
SIZE = 240


@pytest.fixture
def net() -> Iterator[tuple[Network, FaultProxy]]:
    """4 namespaces and the proxy in front of the hub; deleted even when the test fails."""
    with ExitStack() as stack:
        network = stack.enter_context(Network.create(NODES))
        proxy = FaultProxy(listen=(network.proxy_host, 0), target=(network.address(0), PEER_PORT))
        stack.enter_context(proxy)
        yield network, proxy


def _cluster(net: tuple[Network, FaultProxy], *extra: str, **kwargs: object) -> FaultCluster:
    network, proxy = net

    def make(spec: ClusterSpec) -> NetnsCluster:
        return NetnsCluster(spec, network, hub=proxy.address_str)

    args = [*synthetic(SIZE, workers=1), "--buffer", "8", "--token-budget", "1024", *extra]
    return FaultCluster(
        nodes=NODES, ranks_per_node=1, daemon_args=args, make_cluster=make, **kwargs
    )  # type: ignore[arg-type]


def _trained_or_failed(fc: FaultCluster, steps: int) -> bool:
    """Every rank trained `steps` steps; raises at once if a rank failed before (rather than
    waiting out the deadline of something that cannot happen any more)."""
    failed = [e for r in range(fc.world) for e in fc.errors(r)]
    assert not failed, f"a rank failed before the fault: {failed[0]}\n{fc.describe()}"
    return all(fc.steps_seen(r) >= steps for r in range(fc.world))


def _name(net: tuple[Network, FaultProxy], node: int) -> str:
    return f"node {node} ({net[0].address(node)}:{PEER_PORT})"


def _round_buckets(fc: FaultCluster, node: int) -> dict[float, float]:
    assert isinstance(fc.cluster, NetnsCluster)
    text = http_get(fc.cluster.metrics_url(node))
    found = re.findall(r'^odbd_round_duration_seconds_bucket\{le="([^"]+)"\} (\S+)', text, re.M)
    return {float(le): float(v) for le, v in found}


def test_four_nodes_at_50_ms_rtt_train_every_sample_once(net):
    network, proxy = net
    proxy.set(delay_s=0.025, jitter_s=0.005)  # every spoke: 25-30 ms each way
    with _cluster(net, "--steps-ahead", "4", metrics=True) as fc:
        fc.start_trainers("--hold-s", "60", "--hold-until", str(fc.cluster.tmp / "release"))
        fc.wait_until(
            lambda: all(any("done" in r for r in fc.records(rank)) for rank in range(fc.world)),
            "every rank finished the epoch",
        )
        spoke = _round_buckets(fc, 1)  # trainers still attached: the daemons are draining
        (fc.cluster.tmp / "release").touch()
        daemon_codes, trainer_codes = fc.wait_done(120)
        fc.assert_clean_exit(daemon_codes, trainer_codes)
        steps = fc.assert_aligned()
        fc.assert_exactly_once(SIZE)
    # The delay was real: a spoke's round is its offer's trip to the hub and the plan's back
    # (50-60 ms); the barrier times a round from the spoke's exchange call, and an offer sent
    # while the previous round was still open can be on its way earlier, so most, not all.
    rounds, under_rtt = spoke[float("inf")], spoke[0.05]
    assert rounds >= 4 and under_rtt <= rounds / 4, f"{under_rtt} of {rounds} rounds took < 50 ms"
    for node in range(1, NODES):
        traffic = proxy.traffic(network.address(node))
        assert traffic.up > 0 and traffic.down > 0, (node, traffic)
    print(f"\nNETNS 50 ms RTT: {NODES} nodes, {steps} steps per rank, {rounds:.0f} rounds")


def test_a_partition_shorter_than_the_round_timeout_is_absorbed(net):
    network, proxy = net
    round_timeout, cut_s = round(scaled(10.0), 1), 3.0
    args = ("--round-timeout", str(round_timeout), "--steps-ahead", "4")
    with _cluster(net, *args, metrics=True) as fc:
        release = fc.cluster.tmp / "release"
        fc.start_trainers("--step-sleep-s", "0.02", "--hold-s", "60", "--hold-until", str(release))
        fc.wait_until(lambda: _trained_or_failed(fc, 3), "every rank trained 3 steps")
        with proxy.partition(network.address(2)):
            time.sleep(cut_s)  # the fault itself: shorter than --round-timeout
        fc.wait_until(
            lambda: all(any("done" in r for r in fc.records(rank)) for rank in range(fc.world)),
            "every rank finished the epoch",
        )
        hub = _round_buckets(fc, 0)
        release.touch()
        daemon_codes, trainer_codes = fc.wait_done(120)
        fc.assert_clean_exit(daemon_codes, trainer_codes)
        fc.assert_aligned()
        fc.assert_exactly_once(SIZE)
    slow = hub[float("inf")] - max(v for le, v in hub.items() if le <= cut_s / 2)
    assert slow >= 1, f"no round at the hub waited for the partitioned node: {hub}"
    print(f"\nNETNS partition {cut_s:g} s < --round-timeout {round_timeout:g} s: absorbed, "
          f"{slow:.0f} round(s) over {cut_s / 2:g} s at the hub")  # fmt: skip


def test_a_partition_longer_than_the_round_timeout_fails_the_job_naming_the_node(net):
    network, proxy = net
    # Short, so the test is; scaled, so that a loaded machine's slow trainer start-up is not
    # itself a missed round deadline (seen at load 29: ranks took over 60 s to attach).
    round_timeout = round(scaled(4.0), 1)
    with _cluster(net, "--round-timeout", str(round_timeout), "--steps-ahead", "4") as fc:
        fc.start_trainers("--step-sleep-s", "0.02")
        fc.wait_until(lambda: _trained_or_failed(fc, 2), "every rank trained 2 steps")
        cut = time.monotonic()
        proxy.set(network.address(2), partitioned=True)  # and never heals
        exits: dict[int, float] = {}
        deadline = cut + round_timeout + scaled(30)
        while len(exits) < NODES and time.monotonic() < deadline:
            for node, proc in enumerate(fc.daemons):
                if node not in exits and proc.poll() is not None:
                    exits[node] = time.monotonic() - cut
            time.sleep(0.05)
        assert len(exits) == NODES, f"still running after the deadline: {exits}\n{fc.describe()}"
        fc.wait_done(60)
        name = _name(net, 2)
        for node in (0, 1, 3):
            assert fc.daemons[node].returncode == 1, fc.describe()
            assert name in fc.log(node), fc.log(node)
            [error] = fc.errors(node)  # rank = node
            assert error["error"] == "JobFailedError" and name in error["message"], error
        assert fc.daemons[2].returncode == 1, fc.describe()  # it lost the hub
        [cut_off] = fc.errors(2)
        assert cut_off["error"] == "JobFailedError", cut_off
    print(f"\nNETNS partition of node 2 > --round-timeout {round_timeout:g} s: every daemon "
          f"failed naming it, the last after {max(exits.values()):.1f} s; node 2's trainer: "
          f"{cut_off['message'][:300]}")  # fmt: skip


def test_a_crashed_node_restarted_from_state_dir_rejoins_and_the_job_completes(net, tmp_path):
    network, proxy = net
    proxy.set(delay_s=0.005)
    state = tmp_path / "state"
    stop_after = 4
    # --steps-ahead 4: the daemons are still planning when node 2 dies (a job planned to its
    # end has no rounds left in which to notice a lost peer).
    args = ("--state-dir", str(state), "--round-timeout", "20", "--steps-ahead", "4")
    with _cluster(net, *args) as fc:
        saved = {r: tmp_path / f"rank{r}.state.json" for r in range(fc.world)}
        first = [
            fc.start_trainer([r], "--stop-after", str(stop_after), "--state-out", str(saved[r]))
            for r in range(fc.world)
        ]
        for t in first:
            assert t.wait(timeout=scaled(120)) == 0, fc.describe()
        os.kill(fc.daemons[2].pid, signal.SIGKILL)  # the host of node 2 crashes
        fc.daemons[2].wait()
        name = _name(net, 2)
        fc.wait_until(
            lambda: all(fc.daemons[n].poll() is not None for n in range(NODES)),
            "every daemon stopped after losing node 2",
        )
        for node in (0, 1, 3):
            assert name in fc.log(node), fc.log(node)
        _unlink_segments(fc, 2)  # a SIGKILLed daemon cannot unlink its arena
        fc.trainers.clear()
        for node in range(NODES):  # the job restarts on every node, as docs/faults.md says
            fc.cluster.start_node(node)
        fc.cluster.wait_sockets(scaled(60))
        for r in range(fc.world):
            fc.start_trainer([r], "--state-in", str(saved[r]))
        daemon_codes, trainer_codes = fc.wait_done(120)
        fc.assert_clean_exit(daemon_codes, trainer_codes)
        fc.assert_aligned()
        fc.assert_exactly_once(SIZE)
        restarts = [fc.log(n).count("journal") for n in range(NODES)]
        steps = fc.assert_aligned()
    assert all(restarts), f"a daemon did not resume from its journal: {restarts}"
    print(f"\nNETNS node 2 crashed after {stop_after} steps, every node restarted from "
          f"--state-dir: {steps} steps per rank, every sample once")  # fmt: skip


def _unlink_segments(fc: FaultCluster, node: int) -> None:
    prefix = f"odbd-{fc.cluster.spec.job_id}-{node}-"
    for name in fc.cluster.leftover_segments():
        if name.startswith(prefix):
            os.unlink(f"/dev/shm/{name}")
