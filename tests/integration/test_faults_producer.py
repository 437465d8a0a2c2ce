"""Fault: a producer SIGKILLed while it works on a sample (issue 6, item 1)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from tests.integration.faults_cluster import FaultCluster, synthetic
from tests.integration.harness import scaled

pytestmark = pytest.mark.timeout(180)

SHM_BYTES = 64 << 20
WORKERS = 1
LANE_BYTES = (SHM_BYTES // (WORKERS + 2)) // 64 * 64  # odbd.daemon.app: one lane per producer


def test_producer_killed_mid_sample_loses_nothing_and_its_lane_is_reclaimed():
    size = 301
    # Each sample takes 30 ms to "preprocess", so the producer is almost always inside
    # dataset[i] (holding leases, with nothing committed for them) when the kill lands.
    # --steps-ahead 1: the daemon plans only as the trainers consume, so production follows
    # them; otherwise, on a loaded machine, the producer finished the whole epoch while the
    # trainers were still starting and the kill found nothing to lose (issue 11).
    args = [*synthetic(size, workers=WORKERS, delay_s=0.03), "--buffer", "16"]
    args += ["--steps-ahead", "1"]
    with FaultCluster(nodes=2, ranks_per_node=2, daemon_args=args) as fc:
        release = fc.cluster.tmp / "release"
        fc.start_trainers("--hold-s", str(scaled(120)), "--hold-until", str(release))
        fc.wait_until(lambda: fc.steps_seen(2) >= 2, "node 1's ranks trained 2 steps")
        victim = fc.producer_pids(1)[0]
        fc.wait_until(lambda: _stopped_holding_leases(fc, victim), "node 1's producer holds leases")
        killed_s = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        # SIGKILL ends a stopped process too; no SIGCONT (the supervisor may already have
        # reaped the pid, and a recycled pid must never be signalled).
        restarted_s = fc.wait_until(
            lambda: fc.log(1).count(" attached (lane ") == 1 + WORKERS,
            "the supervisor restarted the killed producer and it attached",
            timeout_s=30,
        )
        fc.wait_until(
            lambda: all(any("done" in r for r in fc.records(rank)) for rank in range(fc.world)),
            "every rank finished the epoch",
            timeout_s=120,
        )
        # The trainers hold on after the job, so the daemon is still draining: only the live
        # producer's lane is in use; the dead producer's lane (with whatever it half-wrote)
        # went back to the arena once its committed samples were delivered.
        status = fc.status(1)
        assert status.phase == "draining", status
        assert status.shm_used_bytes == WORKERS * LANE_BYTES, status
        assert status.leased_samples == 0 and status.buffered_samples == 0, status
        release.touch()
        daemon_codes, trainer_codes = fc.wait_done(60)
        fc.assert_clean_exit(daemon_codes, trainer_codes)
        fc.assert_aligned()
        fc.assert_exactly_once(size)
        log = fc.log(1)
        assert "exited with status -9; restarting it" in log, log
        detached = [line for line in log.splitlines() if "detached;" in line]
        assert detached and "0 leases go back" not in detached[0], detached
        print(f"\nFAULT producer-kill: restart seen after {restarted_s:.2f} s "
              f"(kill at t={killed_s:.1f}); {detached[0].split(': ', 1)[-1]}")  # fmt: skip


def _stopped_holding_leases(fc: FaultCluster, producer: int, node: int = 1) -> bool:
    """Stops `producer` (SIGSTOP) and leaves it stopped if it holds leases: then the kill that
    follows lands mid-sample (with one producer per node, its own leases) however slowly the
    test itself runs."""
    os.kill(producer, signal.SIGSTOP)
    if fc.status(node).leased_samples > 0:
        return True
    os.kill(producer, signal.SIGCONT)
    return False


def test_hung_producer_leases_expire_and_are_re_leased_to_another():
    # --steps-ahead 1 and 400 samples: production follows the trainers and lasts seconds, so
    # the job is still running when the test acts; under load the whole job of 200 samples
    # once ended first and the status call found the daemon gone (issue 11).
    size = 400
    args = [*synthetic(size, workers=2, delay_s=0.02), "--buffer", "16", "--lease-timeout", "2"]
    args += ["--steps-ahead", "1"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.start_trainers()
        fc.wait_until(lambda: fc.steps_seen(0) >= 2, "rank 0 trained 2 steps")
        victim = fc.producer_pids(0)[0]
        # Hung, not dead: its stream stays open. Stopped only while leases are held.
        fc.wait_until(lambda: _stopped_holding_leases(fc, victim, node=0), "producers hold leases")
        try:
            took_s = fc.wait_until(
                lambda: "leases expired without a commit" in fc.log(0),
                "the hung producer's leases expired",
                timeout_s=30,
            )
        finally:
            # Its late commits are stale and must be dropped. Stopped inside dataset[i], it is
            # killed as hung once --lease-timeout passes there (and restarted): gone already.
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)
        daemon_codes, trainer_codes = fc.wait_done(90)
        fc.assert_clean_exit(daemon_codes, trainer_codes)
        fc.assert_aligned()
        fc.assert_exactly_once(size)
        print(f"\nFAULT producer-hang: leases expired {took_s:.2f} s after SIGSTOP "
              "(--lease-timeout 2)")  # fmt: skip
