"""--migrate auto on the live daemons (issue 26 item 1 d): a real 2-node x 2-rank gloo DDP job
on a node-skewed dataset (node 0's producers make every long sample), so the round's moves
send node 0's samples to node 1 over the bulk channel. Every sample is trained exactly once per
epoch, loss scales stay exact, and /metrics counts the moves."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from odbd.demo.cluster import ClusterSpec, LocalCluster, wait_all
from odbd.metrics.stats import MIGRATION_DECISIONS
from tests.integration.ddp_launch import DATASET, Reports, data_flags, launch_ranks
from tests.integration.ddp_model import ModelConfig
from tests.integration.harness import http_get, poll_until, scaled

pytestmark = pytest.mark.timeout(240)

WORLD, EPOCHS = 4, 2
# skew=4 with --no-shuffle: view i trains on rank i % 4, and i % 4 < 2 are the long samples,
# all of them node 0's.
DATA = {"size": 128, "seed": 0, "skew": WORLD}
TOKEN_BUDGET = 256
TRAINER = ["--epochs", str(EPOCHS), "--eval-size", "16", "--lr", "3e-3", *ModelConfig().to_args()]


def scrape(port: int, into: dict[str, str], stop: threading.Event) -> None:
    """The daemon's last /metrics before it exits with the job (polled while ranks train)."""
    while not stop.wait(0.2):
        try:
            into["text"] = http_get(f"http://127.0.0.1:{port}/metrics", timeout_s=2.0)
        except OSError:
            continue


def counter(text: str, name: str, value: str, label: str = "direction") -> float:
    found = re.search(rf'^{name}_total{{{label}="{value}"}} (\S+)$', text, re.M)
    assert found, f"{name}_total{{{label}={value}}} missing from /metrics"
    return float(found.group(1))


def test_moved_samples_train_once_with_exact_scales_and_are_counted(tmp_path: Path) -> None:
    dataset = ["--dataset", f"{DATASET}:make", "--workers", "1", "--shm-size", "64M"]
    dataset += [f"--dataset-arg={k}={v}" for k, v in DATA.items()]
    spec = ClusterSpec(
        nodes=2, ranks_per_node=2, metrics=True,
        daemon_args=[
            *dataset, "--token-budget", str(TOKEN_BUDGET), "--buffer", "16",
            "--epochs", str(EPOCHS), "--no-shuffle", "--migrate", "auto",
        ],
    )  # fmt: skip
    cluster = LocalCluster(spec)
    scraped: list[dict[str, str]] = [{}, {}]
    stop = threading.Event()
    threads = [
        threading.Thread(target=scrape, args=(port, scraped[n], stop), daemon=True)
        for n, port in enumerate(cluster.metrics_ports)
    ]
    ranks = None
    try:
        cluster.start()
        for t in threads:
            t.start()
        ranks = launch_ranks(
            world=WORLD, nproc_per_node=2, out_dir=tmp_path,
            trainer_args=[*TRAINER, *data_flags(DATA)], sockets=cluster.sockets,
        )  # fmt: skip
        rank_codes = ranks.wait(180.0)
        daemon_codes = cluster.wait(30.0)
    finally:
        stop.set()
        for t in threads:
            t.join(5.0)
        if ranks is not None:
            ranks.wait(0.01)
        cluster.stop()
    assert daemon_codes == [0, 0] and rank_codes == [0] * WORLD, (
        f"daemons {daemon_codes}, ranks {rank_codes}\n{cluster.log(0)}\n{cluster.log(1)}"
    )
    reports = Reports.read(tmp_path, WORLD)
    for epoch in range(EPOCHS):
        assert Counter(reports.ids(epoch)) == Counter(range(DATA["size"])), epoch
        per_rank = [reports.steps(rank, epoch) for rank in range(WORLD)]
        assert len({len(steps) for steps in per_rank}) == 1, "ranks took different step counts"
    for index in range(len(reports.steps(0))):
        scales = [reports.steps(rank)[index]["loss_scale"] for rank in range(WORLD)]
        assert sum(scales) / WORLD == pytest.approx(1.0), (index, scales)
    # Moves happened, and both ends counted the same samples and bytes.
    out0 = counter(scraped[0]["text"], "odbd_migrated_samples", "out")
    in1 = counter(scraped[1]["text"], "odbd_migrated_samples", "in")
    out1 = counter(scraped[1]["text"], "odbd_migrated_samples", "out")
    in0 = counter(scraped[0]["text"], "odbd_migrated_samples", "in")
    moved_bytes = counter(scraped[0]["text"], "odbd_migrated_bytes", "out")
    print(f"moved: node 0 -> 1 {out0:.0f} samples ({moved_bytes:.0f} bytes), 1 -> 0 {out1:.0f}")
    assert out0 + out1 > 0, "nothing moved on a node-skewed dataset"
    assert (out0, out1) == (in1, in0)
    assert counter(scraped[0]["text"], "odbd_migrated_bytes", "out") == counter(
        scraped[1]["text"], "odbd_migrated_bytes", "in"
    )
    # Every daemon counts the hub's decision of every round alike.
    decided = [
        {
            d: counter(scraped[n]["text"], "odbd_migration_rounds", d, "decision")
            for d in MIGRATION_DECISIONS
        }
        for n in range(2)
    ]
    print(f"decisions: {decided[0]}")
    assert decided[0] == decided[1] and decided[0]["none"] < sum(decided[0].values())
    # Node 1's ranks trained samples of node 0's views (i % 4 < 2): they moved.
    node1_ids = {i for rank in (2, 3) for r in reports.steps(rank) for i in r["ids"]}
    assert any(i % WORLD < 2 for i in node1_ids)


def test_a_node_killed_while_samples_move_fails_the_job_naming_it() -> None:
    # Moves run every round here (counted on node 0's /metrics before the kill), so the kill
    # lands between, or during, transfers: either way the survivor fails naming node 1.
    from tests.integration.faults_cluster import FaultCluster, synthetic
    from tests.integration.test_faults_peer import ROUND_TIMEOUT_S, _cleanup_dead_node

    args = [*synthetic(600, workers=1, delay_s=0.01), "--buffer", "8", "--token-budget", "1024"]
    args += ["--round-timeout", str(ROUND_TIMEOUT_S), "--steps-ahead", "4", "--migrate", "auto"]
    with FaultCluster(nodes=2, ranks_per_node=2, daemon_args=args, metrics=True) as fc:
        fc.start_trainers("--step-sleep-s", "0.02")
        url = f"http://127.0.0.1:{fc.cluster.metrics_ports[0]}/metrics"

        def moving() -> bool:
            try:
                text = http_get(url)
            except OSError:  # /metrics listens once the daemons formed the job
                return False
            return counter(text, "odbd_migrated_samples", "out") + counter(
                text, "odbd_migrated_samples", "in"
            ) > 0 and all(fc.steps_seen(r) >= 3 for r in range(fc.world))

        fc.wait_until(moving, "node 0 moved samples and every rank trained 3 steps")
        fc.daemons[1].kill()
        deadline = time.monotonic() + ROUND_TIMEOUT_S + scaled(20)
        while fc.daemons[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fc.daemons[0].returncode == 1, fc.describe()
        assert re.search(r"node 1\b", fc.log(0)), fc.log(0)
        fc.wait_done(30)
        for rank in (0, 1):
            [error] = fc.errors(rank)
            assert error["error"] == "JobFailedError" and "node 1" in error["message"], error
        print(f"\nrank 0 was told: {fc.errors(0)[0]['message'][:300]}")
        _cleanup_dead_node(fc, 1)


def test_a_node_killed_at_start_up_fails_the_job_naming_it() -> None:
    """The start-up neighbour of the kill above: node 1 dies once the job formed, before any
    trainer attached (its bulk port open, round 0 at most begun): the survivor exits 1 at
    once naming node 1, as with --migrate off, and leaves no shared memory."""
    from tests.integration.faults_cluster import FaultCluster, synthetic
    from tests.integration.test_faults_peer import ROUND_TIMEOUT_S, _cleanup_dead_node

    args = [*synthetic(200, workers=1), "--buffer", "8", "--token-budget", "1024"]
    args += ["--round-timeout", str(ROUND_TIMEOUT_S), "--migrate", "auto"]
    with FaultCluster(nodes=2, ranks_per_node=2, daemon_args=args) as fc:
        # A daemon binds its socket before it joins: killed earlier, the survivor waits out
        # the join deadline instead (a forming fault, test_faults_forming.py).
        fc.wait_until(lambda: "all 2 nodes joined" in fc.log(0), "the job formed")
        fc.daemons[1].kill()
        killed = time.monotonic()
        fc.wait_done(ROUND_TIMEOUT_S + 20)
        exited_s = time.monotonic() - killed
        assert fc.daemons[0].returncode == 1, fc.describe()
        assert re.search(r"lost node 1\b", fc.log(0)), fc.log(0)
        print(f"\nthe survivor exited 1 {exited_s:.1f} s after node 1 was killed at start-up")
        _cleanup_dead_node(fc, 1)


@pytest.mark.soak  # two runs of a 2 x 2 gloo job, ~40-60 s on 2 busy cores: `make soak`
def test_a_node_killed_with_samples_in_flight_resumes_from_state_dir_exactly(
    tmp_path: Path,
) -> None:
    """Issue 26: with --migrate auto and --state-dir, node 1 is SIGKILLed while samples move
    (both ways, every round). The survivor fails the job naming node 1; every trainer holds
    a checkpoint of its last step. Both daemons restart from their journals and the trainers
    from their checkpoints: node 0 holds the views it moved out, round 0's moves exchange
    tells it which of them node 1 trained before the resume point, it re-leases only the
    rest, and every sample of each epoch is trained exactly once over both runs."""
    from tests.integration.test_faults_peer import ROUND_TIMEOUT_S

    data = {**DATA, "size": 192}
    dataset = ["--dataset", f"{DATASET}:make", "--workers", "1", "--shm-size", "64M"]
    dataset += [f"--dataset-arg={k}={v}" for k, v in data.items()]
    spec = ClusterSpec(
        nodes=2, ranks_per_node=2, metrics=True,
        daemon_args=[
            *dataset, "--token-budget", str(TOKEN_BUDGET), "--buffer", "16",
            "--epochs", str(EPOCHS), "--no-shuffle", "--migrate", "auto",
            "--state-dir", str(tmp_path / "state"), "--round-timeout", str(ROUND_TIMEOUT_S),
            "--drain-timeout", "2",
            # rounds keep pace with the trainers, so the kill finds moves still to plan and
            # samples moved in but not trained on node 1
            "--steps-ahead", "2",
        ],
    )  # fmt: skip
    cluster = LocalCluster(spec)
    train = [*TRAINER, *data_flags(data)]
    out = tmp_path / "train"
    first = second = None
    try:
        cluster.start()
        first = launch_ranks(
            world=WORLD, nproc_per_node=2, out_dir=out, sockets=cluster.sockets,
            trainer_args=[*train, "--checkpoint-every", "1"],
        )  # fmt: skip
        url = f"http://127.0.0.1:{cluster.metrics_ports[1]}/metrics"

        def moved_and_training() -> bool:
            try:
                text = http_get(url)
            except OSError:  # not listening yet
                return False
            steps = [s for s in Reports.read(out, WORLD).steps(0) if s["epoch"] == 0]
            return counter(text, "odbd_migrated_samples", "in") > 0 and len(steps) >= 3

        poll_until(moved_and_training, "node 1 took moved samples and rank 0 trained 3 steps")
        cluster.processes[1].kill()
        cluster.processes[1].wait()
        codes = first.wait(scaled(120.0))
        [survivor] = wait_all(cluster.processes[:1], scaled(ROUND_TIMEOUT_S + 30))
        log0 = cluster.log(0)
        assert survivor == 1 and re.search(r"node 1\b", log0), f"{survivor}\n{log0}"
        assert codes != [0] * WORLD, "the trainers finished a job whose node was killed"
        records = Reports.read(out, WORLD)
        points = {
            rank: [r["checkpoint"] for r in records.records[rank] if "checkpoint" in r][-1]
            for rank in range(WORLD)
        }
        assert len({tuple(p) for p in points.values()}) == 1, f"ranks checkpointed {points}"
        point = tuple(points[0])
        before = {rank: len(records.records[rank]) for rank in range(WORLD)}
        # the restart: both daemons from their journals, the trainers from their checkpoints
        for node in range(2):
            cluster.start_node(node)
        second = launch_ranks(
            world=WORLD, nproc_per_node=2, out_dir=out, sockets=cluster.sockets,
            trainer_args=[*train, "--resume"],
        )  # fmt: skip
        rank_codes = second.wait(scaled(120.0))
        daemon_codes = cluster.wait(scaled(30.0))
    finally:
        for ranks in (first, second):
            if ranks is not None:
                ranks.wait(0.01)
        cluster.stop()
    logs = f"{cluster.log(0)}\n{cluster.log(1)}"
    assert rank_codes == [0] * WORLD and daemon_codes == [0, 0], f"{rank_codes}\n{logs}"
    full = [(cluster.log_dir / f"daemon{n}.log").read_text(errors="replace") for n in range(2)]
    settled = [line for t in full for line in t.splitlines() if "restart with moves" in line]
    assert settled, logs
    records = Reports.read(out, WORLD)
    kept = {}  # rank -> the steps that count: the first run's to the checkpoint, the second's
    for rank in range(WORLD):
        head = [r for r in records.records[rank][: before[rank]] if "step" in r]
        kept[rank] = [r for r in head if (r["epoch"], r["step"]) <= point]
        kept[rank] += [r for r in records.records[rank][before[rank] :] if "step" in r]
    for epoch in range(EPOCHS):
        ids: list[int] = []
        for rank in range(WORLD):
            mine = [r for r in kept[rank] if r["epoch"] == epoch]
            assert [r["step"] for r in mine] == list(range(len(mine))), (rank, epoch)
            ids += [i for r in mine for i in r["ids"]]
        twice = sorted(i for i, n in Counter(ids).items() if n > 1)
        assert not twice, f"epoch {epoch}: trained twice over both runs: {twice}"
        assert sorted(ids) == list(range(data["size"])), f"epoch {epoch}: samples never trained"
    assert len({len(steps) for steps in kept.values()}) == 1, "ranks took different step counts"
    for index in range(len(kept[0])):
        scales = [kept[rank][index]["loss_scale"] for rank in range(WORLD)]
        assert sum(scales) / WORLD == pytest.approx(1.0), (index, scales)
    print(f"\nkilled node 1 after step {point} (both runs: every sample once per epoch)")
    print("\n".join(line.split(" INFO ", 1)[-1] for line in settled))
