"""StepBatch.progress from real daemons: the same on every rank, fractions that never decrease,
exact on each epoch's last step, in both epoch modes (join: the flush round ends an epoch;
--no-join: the step that reaches the sample quota)."""

from __future__ import annotations

import threading
from dataclasses import asdict

import pytest

from odbclient import ODBClient
from odbd.demo.cluster import ClusterSpec, LocalCluster
from tests.integration.harness import synthetic_args

pytestmark = pytest.mark.timeout(180)

SIZE, EPOCHS, WORLD = 120, 2, 2


def progress_per_rank(cluster: LocalCluster) -> dict[int, list[tuple[int, int, dict]]]:
    """Every rank's (epoch, step, progress) of the whole job, one client thread per rank."""
    seen: dict[int, list[tuple[int, int, dict]]] = {rank: [] for rank in range(WORLD)}
    errors: list[BaseException] = []
    loops = dict.fromkeys(range(WORLD), 0)  # epochs the documented loop ran, per rank

    def train(rank: int) -> None:
        try:
            with ODBClient(rank=rank, socket=cluster.sockets[0], deadline_s=120) as client:
                while not client.job_ended:
                    seen[rank] += [(b.epoch, b.step, asdict(b.progress)) for b in client]
                    loops[rank] += 1
        except BaseException as error:  # reported by the test thread
            errors.append(error)

    threads = [threading.Thread(target=train, args=(rank,)) for rank in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert not errors and not any(t.is_alive() for t in threads), (errors, cluster.log(0))
    # job_ended is true once the last epoch's loop ends: no extra, empty epoch (found by hand)
    assert loops == dict.fromkeys(range(WORLD), EPOCHS), loops
    return seen


@pytest.mark.parametrize("mode", [[], ["--no-join"]], ids=["join", "no-join"])
def test_progress_is_identical_monotone_and_exact_at_each_end(mode: list[str]) -> None:
    spec = ClusterSpec(
        nodes=1,
        ranks_per_node=WORLD,
        daemon_args=[*synthetic_args(SIZE), "--buffer", "8", "--shm-size", "64M",
                     "--epochs", str(EPOCHS), *mode],
    )  # fmt: skip
    with LocalCluster(spec) as cluster:
        cluster.wait_sockets()
        seen = progress_per_rank(cluster)
        assert cluster.wait(30) == [0], cluster.log(0)
    assert seen[0] == seen[1], "ranks disagree on progress"
    rows = seen[0]
    for epoch in range(EPOCHS):
        epoch_rows = [p for e, _, p in rows if e == epoch]
        for key in ("epoch_sample_fraction", "epoch_token_fraction", "epoch_tokens"):
            values = [p[key] for p in epoch_rows]
            assert values == sorted(values), (epoch, key, values)
        last = epoch_rows[-1]
        assert last["epoch_steps_exact"] and last["epoch_steps_estimate"] == len(epoch_rows)
        # exact from the round planning the epoch's last step on: a suffix, with the true count
        exact = [p["epoch_steps_exact"] for p in epoch_rows]
        assert exact == sorted(exact), exact
        assert {p["epoch_steps_estimate"] for p in epoch_rows if p["epoch_steps_exact"]} == {
            len(epoch_rows)
        }
        assert last["epoch_sample_fraction"] == 1.0 and last["epoch_token_fraction"] == 1.0
        assert all(p["epoch_sample_fraction"] < 1.0 for p in epoch_rows[:-1])
    jobs = [p["job_fraction"] for _, _, p in rows]
    assert jobs == sorted(jobs) and jobs[-1] == 1.0 and jobs[-2] < 1.0
    assert rows[-1][2]["job_steps_estimate"] == len(rows)
    # The estimate tightens: in the second half of each epoch it is within 20 % of the truth.
    for epoch in range(EPOCHS):
        epoch_rows = [p for e, _, p in rows if e == epoch]
        n = len(epoch_rows)
        for p in epoch_rows[n // 2 :]:
            assert abs(p["epoch_steps_estimate"] - n) <= max(0.2 * n, 1), (epoch, n, p)
    assert cluster.leftover_segments() == []
