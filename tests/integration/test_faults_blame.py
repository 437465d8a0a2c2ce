"""A failed round names the real culprit (issue 11): a rank that stopped calling next(), or the
hub itself when it was frozen past the round deadline, never an innocent peer."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import grpc
import pytest

from tests.integration.faults_cluster import FaultCluster, synthetic

pytestmark = pytest.mark.timeout(240)

SIZE = 2000


def _args(round_timeout_s: float) -> list[str]:
    # Slow producers and many small steps keep rounds going for the whole test.
    args = [*synthetic(SIZE, workers=1, delay_s=0.005), "--buffer", "8", "--token-budget", "1024"]
    return [*args, "--round-timeout", str(round_timeout_s), "--steps-ahead", "4"]


def _wait_exits(fc: FaultCluster, timeout_s: float) -> list[int | None]:
    fc.wait_until(lambda: all(d.poll() is not None for d in fc.daemons), "every daemon exited",
                  timeout_s)  # fmt: skip
    return [d.returncode for d in fc.daemons]


def _every_rank_trains(fc: FaultCluster) -> None:
    """Starts every rank's trainer and returns once each trained a few steps (the job runs)."""
    fc.start_trainers("--step-sleep-s", "0.01")
    fc.wait_until(lambda: all(fc.steps_seen(r) >= 3 for r in range(fc.world)), "every rank trained")


def test_a_rank_that_stops_iterating_is_named_by_every_daemon_and_trainer():
    timeout_s = 8.0
    with FaultCluster(nodes=2, ranks_per_node=1, daemon_args=_args(timeout_s)) as fc:
        fc.start_trainer([0], "--step-sleep-s", "0.01")
        fc.start_trainer([1], "--step-sleep-s", "0.01", "--stop-after", "5", "--stop-how", "hang")
        codes = _wait_exits(fc, timeout_s + 60)
        assert codes == [1, 1], fc.describe()
        for node in (0, 1):
            log = fc.log(node)
            assert "node 1 (" in log and "rank 1 has" in log, log
            assert "steps undelivered from epoch 0 step 5" in log, log
            assert "its client is attached" in log, log
        fc.wait_until(lambda: fc.errors(0) != [], "rank 0 learned why the job failed")
        [error] = fc.errors(0)
        assert error["error"] == "JobFailedError", error
        assert "rank 1 has" in error["message"] and "client is attached" in error["message"]


def test_a_frozen_hub_blames_itself_not_its_peer():
    timeout_s = 2.0
    with FaultCluster(nodes=2, ranks_per_node=1, daemon_args=_args(timeout_s)) as fc:
        _every_rank_trains(fc)
        hub = fc.daemons[0].pid
        os.kill(hub, signal.SIGSTOP)
        time.sleep(3 * timeout_s)  # the fault itself: frozen past the deadline and its grace
        os.kill(hub, signal.SIGCONT)
        codes = _wait_exits(fc, 60)
        assert codes == [1, 1], fc.describe()
        log = fc.log(0)
        assert "this daemon (node 0, the hub) itself did not run for" in log, log
        assert "is not to blame" in log, log
        fc.wait_until(lambda: fc.errors(0) != [], "rank 0 learned why the job failed")
        [error] = fc.errors(0)
        assert "itself did not run for" in error["message"], error


def test_a_spoke_frozen_past_the_deadline_learns_the_hub_s_verdict_not_an_internal_error():
    # Found by hand (node 1 of 2 SIGSTOPped 20 s, --round-timeout 15): on SIGCONT its round
    # loop wrote its next offer into the stream the hub had finished, before its reader saw
    # the hub's verdict; grpc's InvalidStateError failed the job as "an internal error (a bug
    # in odbd ...)" with a traceback, and that is what node 1's trainers were told.
    timeout_s = 2.0
    with FaultCluster(nodes=2, ranks_per_node=1, daemon_args=_args(timeout_s)) as fc:
        _every_rank_trains(fc)
        spoke = fc.daemons[1].pid
        os.kill(spoke, signal.SIGSTOP)
        hub_waits: set[str] = set()  # what `odbd status` of the hub said meanwhile

        def hub_exited() -> bool:
            with contextlib.suppress(grpc.RpcError):
                hub_waits.add(fc.status(0, timeout_s=1.0).waiting_for)
            return fc.daemons[0].poll() is not None

        try:  # the hub fails the round at its deadline and exits while node 1 is frozen
            fc.wait_until(hub_exited, "the hub exited", 60)
        finally:
            os.kill(spoke, signal.SIGCONT)
        sent = "not every other node has sent its offer for round"
        assert any(w.startswith(sent) and "--round-timeout 2 s" in w for w in hub_waits), hub_waits
        codes = _wait_exits(fc, 60)
        assert codes == [1, 1], fc.describe()
        assert "node 1 (" in fc.log(0) and "did not contribute" in fc.log(0), fc.log(0)
        log = fc.log(1)
        assert "internal error" not in log and "Traceback" not in log, log
        fc.wait_until(lambda: fc.errors(1) != [], "rank 1 learned why the job failed")
        [error] = fc.errors(1)
        assert error["error"] == "JobFailedError", error
        assert "internal error" not in error["message"], error
        print(f"\nFAULT frozen spoke: rank 1 was told {error['message']!r}")
