"""Fault: a peer daemon dies (non-hub, hub) or is merely slow (issue 6, item 4).

A dead peer must fail every other daemon within its deadline with an error naming the peer, and
its trainers must get JobFailedError, not a hang. A peer stopped for less than --round-timeout
is the round's straggler and the job completes.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from odbclient.connect import DEFAULT_PREFETCH
from tests.integration.faults_cluster import FaultCluster, synthetic
from tests.integration.harness import http_get, scaled

pytestmark = pytest.mark.timeout(180)

ROUND_TIMEOUT_S = 10.0
SIZE = 600


def _args(*extra: str) -> list[str]:
    # Slow producers and ~50 steps per rank keep the job running for several seconds.
    args = [*synthetic(SIZE, workers=1, delay_s=0.01), "--buffer", "8", "--token-budget", "1024"]
    return [*args, "--round-timeout", str(ROUND_TIMEOUT_S), "--steps-ahead", "4", *extra]


def _kill_and_watch(fc: FaultCluster, victim: int) -> tuple[float, float]:
    """SIGKILLs daemon `victim` mid-epoch; returns (slowest daemon exit, slowest trainer error)."""
    fc.start_trainers("--step-sleep-s", "0.02")
    # Every trainer attached and training: a trainer still starting when its daemon dies gets
    # a connect error instead, and the kill would land before the epoch is underway.
    fc.wait_until(
        lambda: all(fc.steps_seen(r) >= 3 for r in range(fc.world)), "every rank trained 3 steps"
    )
    killed = time.time()
    fc.daemons[victim].kill()
    survivors = [n for n in range(len(fc.daemons)) if n != victim]
    exits = {}
    deadline = time.monotonic() + ROUND_TIMEOUT_S + scaled(10)
    while len(exits) < len(survivors) and time.monotonic() < deadline:
        for node in survivors:
            if node not in exits and fc.daemons[node].poll() is not None:
                exits[node] = time.time() - killed
        time.sleep(0.02)
    assert len(exits) == len(survivors), f"survivors still running {exits}\n{fc.describe()}"
    fc.wait_done(30)
    errors = [e for r in range(fc.world) for e in fc.errors(r)]
    assert len(errors) == fc.world, fc.describe()
    return max(exits.values()), max(e["t"] for e in errors) - killed


def _cleanup_dead_node(fc: FaultCluster, node: int) -> None:
    """A SIGKILLed daemon cannot unlink its arena: its restart would reclaim it; here we do."""
    prefix = f"odbd-{fc.cluster.spec.job_id}-{node}-"
    for name in fc.cluster.leftover_segments():
        if name.startswith(prefix):
            os.unlink(f"/dev/shm/{name}")
    assert fc.cluster.leftover_segments() == [], "a surviving daemon left shared memory"


def test_killed_peer_fails_every_daemon_naming_it_and_trainers_get_job_failed():
    with FaultCluster(nodes=3, ranks_per_node=1, daemon_args=_args()) as fc:
        daemon_s, trainer_s = _kill_and_watch(fc, victim=2)
        name = f"node 2 (127.0.0.1:{fc.cluster.peer_ports[2]})"
        for node in (0, 1):
            assert fc.daemons[node].returncode == 1, fc.describe()
            assert name in fc.log(node), fc.log(node)
        for rank in (0, 1):
            [error] = fc.errors(rank)
            assert error["error"] == "JobFailedError" and name in error["message"], error
        [error] = fc.errors(2)  # its own daemon is gone: the stream broke
        assert error["error"] == "DaemonConnectionError", error
        _cleanup_dead_node(fc, 2)
        print(f"\nFAULT peer-kill (node 2): daemons failed after {daemon_s:.2f} s, trainers "
              f"raised after {trainer_s:.2f} s")  # fmt: skip


def test_killed_hub_fails_every_daemon_naming_it_and_trainers_get_job_failed():
    with FaultCluster(nodes=3, ranks_per_node=1, daemon_args=_args()) as fc:
        daemon_s, trainer_s = _kill_and_watch(fc, victim=0)
        name = f"node 0 (127.0.0.1:{fc.cluster.peer_ports[0]})"
        for node in (1, 2):
            assert fc.daemons[node].returncode == 1, fc.describe()
            assert name in fc.log(node), fc.log(node)
        for rank in (1, 2):
            [error] = fc.errors(rank)
            assert error["error"] == "JobFailedError" and name in error["message"], error
        _cleanup_dead_node(fc, 0)
        print(f"\nFAULT peer-kill (hub): daemons failed after {daemon_s:.2f} s, trainers "
              f"raised after {trainer_s:.2f} s")  # fmt: skip


def test_killed_relay_fails_every_daemon_naming_it_and_the_node_it_cut_off():
    """Fan-out 1 makes the 3 nodes a chain 0 - 1 - 2: node 1 relays node 2's contributions
    and the hub's results. Killed, it is named by the hub (with node 2, cut off with it) and by
    node 2, whose stream to it broke, within the round deadline."""
    with FaultCluster(nodes=3, ranks_per_node=1, daemon_args=_args("--round-fanout", "1")) as fc:
        daemon_s, trainer_s = _kill_and_watch(fc, victim=1)
        name = f"node 1 (127.0.0.1:{fc.cluster.peer_ports[1]})"
        for node in (0, 2):
            assert fc.daemons[node].returncode == 1, fc.describe()
            assert name in fc.log(node), fc.log(node)
        assert "and the node it relays for (2), which the loss cut off" in fc.log(0), fc.log(0)
        assert f"lost the stream to {name}, its relay to the hub" in fc.log(2), fc.log(2)
        for rank in (0, 2):
            [error] = fc.errors(rank)
            assert error["error"] == "JobFailedError" and name in error["message"], error
        _cleanup_dead_node(fc, 1)
        print(f"\nFAULT relay-kill (node 1 of a chain): daemons failed after {daemon_s:.2f} s, "
              f"trainers raised after {trainer_s:.2f} s")  # fmt: skip
        assert daemon_s < ROUND_TIMEOUT_S


def test_peer_killed_after_the_last_round_was_planned_fails_the_survivor_at_once():
    """A small epoch is planned whole at start-up, so the kill lands while the survivor only
    waits for its trainers to take the job's end: it must fail at once naming the lost node,
    as mid-epoch, not train on alone (its ranks' collectives would hang) nor wait out
    --attach-timeout."""
    args = [*synthetic(48), "--buffer", "8", "--token-budget", "1024", "--steps-ahead", "1000"]
    args += ["--round-timeout", str(ROUND_TIMEOUT_S), "--attach-timeout", "120"]
    with FaultCluster(nodes=2, ranks_per_node=1, daemon_args=args) as fc:
        fc.wait_until(
            lambda: all("epoch 0 planned" in fc.log(n) for n in (0, 1)), "both nodes planned"
        )
        fc.start_trainer([0], "--step-sleep-s", "1.0")  # steps take longer than the deadline
        fc.wait_until(lambda: fc.steps_seen(0) >= 1, "rank 0 trained a step")
        killed = time.monotonic()
        fc.daemons[1].kill()
        deadline = killed + scaled(10)
        while fc.daemons[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        waited_s = time.monotonic() - killed
        assert fc.daemons[0].returncode == 1, f"after {waited_s:.1f} s\n{fc.describe()}"
        name = f"node 1 (127.0.0.1:{fc.cluster.peer_ports[1]})"
        assert f"lost {name}" in fc.log(0), fc.log(0)
        fc.wait_done(30)
        [error] = fc.errors(0)
        assert error["error"] == "JobFailedError" and name in error["message"], error
        _cleanup_dead_node(fc, 1)
        print(f"\nFAULT peer-kill after the last round: the survivor failed after {waited_s:.2f} s")


def test_slow_peer_is_the_straggler_and_the_round_completes():
    stop_s = 3.0
    with FaultCluster(nodes=3, ranks_per_node=1, daemon_args=_args(), metrics=True) as fc:
        release = fc.cluster.tmp / "release"
        fc.start_trainers("--hold-s", "60", "--hold-until", str(release))
        fc.wait_until(lambda: fc.steps_seen(0) >= 3, "rank 0 trained 3 steps")
        os.kill(fc.daemons[2].pid, signal.SIGSTOP)
        time.sleep(stop_s)  # the fault itself: shorter than --round-timeout
        os.kill(fc.daemons[2].pid, signal.SIGCONT)
        fc.wait_until(
            lambda: all(any("done" in r for r in fc.records(rank)) for rank in range(fc.world)),
            "every rank finished the epoch",
        )
        hub_metrics = _scrape(fc)  # trainers still attached: the hub is draining, not gone
        release.touch()
        daemon_codes, trainer_codes = fc.wait_done(90)
        fc.assert_clean_exit(daemon_codes, trainer_codes)
        fc.assert_aligned()
        fc.assert_exactly_once(SIZE)
        last = {m[0]: float(m[1]) for m in re.findall(
            r'^odbd_round_last_peer_total\{peer="(\d)"\} (\S+)', hub_metrics, re.M)}  # fmt: skip
        assert last.get("2", 0) >= 1, last
        slow = _rounds_over(hub_metrics, stop_s / 2)
        assert slow >= 1, "no round waited for the stopped peer"
        print(
            f"\nFAULT slow peer: SIGSTOP {stop_s:g} s < --round-timeout {ROUND_TIMEOUT_S:g} s; "
            f"{slow} round(s) took > {stop_s / 2:g} s at the hub; last-peer counts {last}"
        )


def _scrape(fc: FaultCluster) -> str:
    url = f"http://127.0.0.1:{fc.cluster.metrics_ports[0]}/metrics"
    return http_get(url)


def _rounds_over(metrics: str, seconds: float) -> int:
    buckets = re.findall(
        r'^odbd_round_duration_seconds_bucket\{le="([^"]+)"\} (\S+)', metrics, re.M
    )
    total = float(next(v for le, v in buckets if le == "+Inf"))
    below = max((float(v) for le, v in buckets if le != "+Inf" and float(le) <= seconds), default=0)
    return int(total - below)


def test_trainers_learn_of_a_lost_peer_before_their_queued_steps():
    """With 64 steps queued ahead, survivors must not train on (DDP would hang on the dead
    node's ranks): the failure preempts the queue after at most the prefetched batches."""
    args = [*synthetic(SIZE, workers=1), "--buffer", "8", "--token-budget", "1024"]
    args += ["--round-timeout", str(ROUND_TIMEOUT_S)]  # default --steps-ahead 64
    with FaultCluster(nodes=3, ranks_per_node=1, daemon_args=args) as fc:
        fc.start_trainers("--step-sleep-s", "0.3")
        fc.wait_until(lambda: fc.steps_seen(0) >= 2, "rank 0 trained 2 steps")
        fc.wait_until(lambda: fc.status(0).ranks[0].queued_steps >= 20, "a deep queue on node 0")
        killed = time.time()
        fc.daemons[2].kill()
        fc.wait_done(60)
        for rank in (0, 1):
            [error] = fc.errors(rank)
            assert error["error"] == "JobFailedError", (error, fc.describe())
            after = [r["step"] for r in fc.steps(rank) if r["t"] > killed]
            # prefetched batches + the steps trained while the failure was detected (< 1 s)
            bound = DEFAULT_PREFETCH + 4
            assert len(after) <= bound, f"rank {rank} trained steps {after} after the kill"
        _cleanup_dead_node(fc, 2)
