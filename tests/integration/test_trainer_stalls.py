"""A trainer that waits in vain learns from its DaemonTimeoutError what the daemon reports:
its phase, last error and what the next round waits for (issue 10: a stalled trainer only
said "check odbd status")."""

from __future__ import annotations

from pathlib import Path

import pytest

from odbclient import ODBClient
from odbclient.errors import DaemonTimeoutError
from odbd.demo.cluster import ClusterSpec, LocalCluster
from tests.integration.harness import admin_status, poll_until, scaled

pytestmark = pytest.mark.timeout(120)


def test_timeout_names_what_the_round_waits_for() -> None:
    # External producers (--dataset-size) of which none ever connects: the round waits for them.
    spec = ClusterSpec(
        nodes=1,
        ranks_per_node=2,
        daemon_args=["--dataset-size", "10", "--shm-size", "16M"],
    )
    with LocalCluster(spec) as cluster:
        cluster.wait_sockets()
        with ODBClient(rank=0, socket=cluster.sockets[0], connect_timeout_s=30, deadline_s=4) as c:
            with pytest.raises(DaemonTimeoutError) as raised:
                next(iter(c))
    message = str(raised.value)
    assert f"no batch from odbd on unix:{cluster.sockets[0]} for rank 0 in 4 s" in message
    assert "the daemon reports phase running" in message, message
    assert "its next round waits because its producers filled 0 of the" in message, message
    assert "no producer is attached" in message, message
    assert "0 producers" in message and "local ranks not attached: [1]" in message, message
    assert cluster.leftover_segments() == []


def _train_every_sample_once_to_the_end(cluster: LocalCluster) -> None:
    """Rank 0 trains the job's 16 samples to its end; the daemon then exits 0."""
    ids: list[int] = []
    with ODBClient(rank=0, socket=cluster.sockets[0], deadline_s=scaled(60)) as client:
        while not client.job_ended:
            ids += [i for batch in client for i in batch.sample_ids]
    assert sorted(ids) == list(range(16))
    assert cluster.wait(scaled(30)) == [0], cluster.log(0)


def test_workers_still_building_the_dataset_are_named_not_called_missing(tmp_path: Path) -> None:
    # Found by hand (a 45 s factory): while the spawned workers built the dataset, the wait
    # line and `odbd status` said "no producer is attached: start producers on this node".
    release = tmp_path / "built"
    dataset = str(Path(__file__).with_name("slow_build_dataset.py")) + ":make"
    args = ["--dataset", dataset, "--dataset-arg", f"release={release}", "--workers", "1"]
    args += ["--shm-size", "16M", "--buffer", "16"]
    with LocalCluster(ClusterSpec(nodes=1, ranks_per_node=1, daemon_args=args)) as cluster:
        cluster.wait_sockets(scaled(60))
        sock = cluster.sockets[0]
        poll_until(
            lambda: "no producer is attached yet" in admin_status(sock).waiting_for,
            "the daemon says why its round waits",
        )
        waiting = admin_status(sock).waiting_for
        assert "1 --workers process started" in waiting and "has not connected" in waiting
        assert "the --dataset factory runs in every worker" in waiting, waiting
        assert "start producers on this node" not in waiting, waiting
        release.touch()  # the build ends: the worker connects and the epoch is served
        _train_every_sample_once_to_the_end(cluster)
    assert cluster.leftover_segments() == []


def test_a_daemon_building_its_dataset_says_so_until_it_opens_its_socket(tmp_path: Path) -> None:
    # Found by a probe of real jobs: a 45 s factory left the daemon's log empty and its socket
    # absent (`odbd status`: "is odbd running there?") until the build returned.
    release = tmp_path / "built"
    dataset = str(Path(__file__).with_name("slow_build_dataset.py")) + ":make"
    args = ["--dataset", dataset, "--dataset-arg", f"release={release}", "--workers", "1"]
    args += ["--dataset-arg", "in_daemon=1", "--shm-size", "16M", "--buffer", "16"]
    with LocalCluster(ClusterSpec(nodes=1, ranks_per_node=1, daemon_args=args)) as cluster:
        poll_until(
            lambda: "building --dataset" in cluster.log(0),
            "the daemon says it builds its dataset",
        )
        line = next(x for x in cluster.log(0).splitlines() if "building --dataset" in x)
        assert f"building --dataset {dataset} to learn its size:" in line, line
        assert "the daemon opens its socket (producers, trainers, `odbd status`)" in line
        assert not Path(cluster.sockets[0]).exists()  # not serving yet: still building
        release.touch()
        cluster.wait_sockets(scaled(60))
        assert f"built --dataset {dataset} in" in cluster.log(0)
        _train_every_sample_once_to_the_end(cluster)
    assert cluster.leftover_segments() == []
