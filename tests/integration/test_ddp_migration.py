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

from odbd.demo.cluster import ClusterSpec, LocalCluster
from tests.integration.ddp_launch import DATASET, Reports, data_flags, launch_ranks
from tests.integration.ddp_model import ModelConfig
from tests.integration.harness import http_get, scaled

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


def counter(text: str, name: str, direction: str) -> float:
    found = re.search(rf'^{name}_total{{direction="{direction}"}} (\S+)$', text, re.M)
    assert found, f"{name}_total{{direction={direction}}} missing from /metrics"
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
