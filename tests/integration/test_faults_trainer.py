"""Fault: a trainer client disconnects and a new process reconnects as the same rank (item 2)."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.faults_cluster import FaultCluster, synthetic
from tests.integration.harness import scaled

pytestmark = pytest.mark.timeout(180)

CLOSE_RANK, STATE_RANK, CRASH_RANK = 1, 4, 5  # 2 nodes x 3 ranks


def _detached(fc: FaultCluster, rank: int) -> bool:
    node = fc.cluster.node_of(rank)
    return not next(r for r in fc.status(node).ranks if r.rank == rank).attached


def _delivered(fc: FaultCluster, rank: int) -> int:
    node = fc.cluster.node_of(rank)
    return next(r for r in fc.status(node).ranks if r.rank == rank).delivered_steps


def test_reconnecting_trainers_resume_at_the_next_undelivered_step():
    size = 400
    args = [*synthetic(size, workers=1), "--buffer", "8", "--token-budget", "1024"]
    # Few steps queued ahead, so the other ranks really wait for the missing one.
    args += ["--steps-ahead", "4"]
    state = None
    with FaultCluster(nodes=2, ranks_per_node=3, daemon_args=args) as fc:
        state = fc.cluster.tmp / "rank4.state.json"
        fc.start_trainers(skip=(CLOSE_RANK, STATE_RANK, CRASH_RANK))
        # 1: a clean close after 5 steps; 4: a crash after 4 steps with a saved state_dict;
        # 5: a crash after 6 steps with nothing saved (the daemon's Delivered is all we have).
        first = [
            fc.start_trainer([CLOSE_RANK], "--stop-after", "5", "--stop-how", "close"),
            fc.start_trainer([STATE_RANK], "--stop-after", "4", "--stop-how", "kill",
                             "--state-out", str(state)),
            fc.start_trainer([CRASH_RANK], "--stop-after", "6", "--stop-how", "kill"),
        ]  # fmt: skip
        for proc in first:
            proc.wait(timeout=scaled(90))
        for rank in (CLOSE_RANK, STATE_RANK, CRASH_RANK):
            fc.wait_until(lambda rank=rank: _detached(fc, rank), f"rank {rank} detached")
        crash_delivered = _delivered(fc, CRASH_RANK)
        reconnected_s = time.monotonic()
        fc.start_trainer([CLOSE_RANK])
        fc.start_trainer([STATE_RANK], "--state-in", str(state))
        fc.start_trainer([CRASH_RANK])
        daemon_codes, trainer_codes = fc.wait_done(120)
        finished_s = time.monotonic() - reconnected_s
        assert daemon_codes == [0, 0], fc.describe()
        assert trainer_codes[-3:] == [0, 0, 0] and trainer_codes[:2] == [0, 0], trainer_codes
        assert fc.cluster.leftover_segments() == []

        close_steps = [r["step"] for r in fc.steps(CLOSE_RANK)]
        assert close_steps == list(range(len(close_steps))), "clean close: resumed at step 5"
        state_steps = [r["step"] for r in fc.steps(STATE_RANK)]
        assert json.loads(state.read_text())["step"] == 4
        assert state_steps == list(range(len(state_steps))), "state_dict: resumed at step 4"
        crash_steps = [r["step"] for r in fc.steps(CRASH_RANK)]
        # Without a state_dict the new process starts at the first step the daemon had no
        # Delivered for; steps the dead process took but never confirmed are sent again.
        assert crash_steps[:6] == list(range(6))
        assert crash_steps[6] == crash_delivered <= 6, (crash_steps, crash_delivered)
        assert crash_steps[6:] == list(
            range(crash_delivered, len(crash_steps) - 6 + crash_delivered)
        )

        num_steps = len(close_steps)
        for rank in range(fc.world):
            unique = sorted({r["step"] for r in fc.steps(rank)})
            assert unique == list(range(num_steps)), f"rank {rank} saw another step count"
            ends = [r["summary"]["num_steps"] for r in fc.records(rank) if "epoch_end" in r]
            assert ends == [num_steps], (rank, ends)
        # Nothing lost: every identity reached a trainer (the crash re-sends may repeat some).
        assert set(fc.emitted_ids(0)) == set(range(size))
        print(f"\nFAULT trainer-reconnect: {num_steps} steps per rank; crash without state "
              f"re-sent {6 - crash_delivered} step(s); epoch finished {finished_s:.1f} s after "
              "the reconnects")  # fmt: skip
