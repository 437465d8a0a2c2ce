"""A killed job restarts from --state-dir and trainers' state_dicts: nothing lost or repeated."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import grpc
import pytest

from odbd.demo.cluster import ClusterSpec, LocalCluster
from tests.integration.harness import admin_status, poll_until, read_jsonl, scaled, synthetic_args

pytestmark = pytest.mark.timeout(240)


def _trainers(cluster, args_of) -> list[subprocess.Popen[bytes]]:
    procs = []
    for rank in range(cluster.world):
        cmd = [sys.executable, "-m", "odbd.demo.trainer", "--rank", str(rank)]
        cmd += ["--socket", cluster.sockets[cluster.node_of(rank)], *args_of(rank)]
        log = open(cluster.tmp / f"trainer{rank}.log", "ab")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def _planned_ahead(cluster: LocalCluster, node: int) -> bool:
    """The daemon of `node` holds steps no trainer took, or has already given up on them: its
    end-of-job drain (60 s) can run out first when the trainers start slowly under load."""
    if cluster.processes[node].poll() is not None:
        return True
    try:
        return any(r.queued_steps for r in admin_status(cluster.sockets[node]).ranks)
    except grpc.RpcError:
        return cluster.processes[node].poll() is not None  # it exited while we asked


@pytest.mark.parametrize("nodes", [1, 2])
def test_killed_job_resumes_from_state_dir_without_loss_or_duplicates(nodes, tmp_path):
    _kill_and_resume(nodes, tmp_path, tear=False)


@pytest.mark.soak  # 40 s on 2 busy cores: `make soak`
def test_a_killed_relay_tree_resumes_from_state_dir(tmp_path):
    """Three daemons in a chain 0 - 1 - 2 (--round-fanout 1: node 1 relays node 2's rounds),
    all killed and restarted from --state-dir: the tree forms again and resumes exactly."""
    _kill_and_resume(3, tmp_path, tear=False, extra=("--round-fanout", "1"))


def test_a_journal_torn_mid_append_is_cut_and_the_job_resumes(tmp_path):
    """Issue 11: the crash tore the last frame; the restart cuts it, warns, and resumes exactly."""
    cluster = _kill_and_resume(2, tmp_path, tear=True)
    for node in range(2):
        log = cluster.log(node)
        assert "WARNING" in log and "a frame is torn" in log, log
        assert f"node{node}.journal" in log and "dropping the last 37 bytes" in log, log


def _tear(journal: Path) -> None:
    """Appends the first 37 bytes of a copy of the last frame: a crash mid-append."""
    data = journal.read_bytes()
    pos, last = 12, 0  # after the file header: b"ODBDJRNL" + u32 layout version
    while pos < len(data):
        last = pos
        pos += 8 + int.from_bytes(data[pos : pos + 4], "little")
    journal.write_bytes(data + data[last : last + 37])


def test_a_journal_on_a_full_device_stops_the_daemon_with_the_fix(tmp_path):
    """ENOSPC from the kernel at the journal's first write: --state-dir is a full 4 KiB tmpfs
    in the daemon's own mount namespace (a symlink to /dev/full did it before issue 29; the
    journal now refuses symlinks)."""
    state = tmp_path / "state"
    state.mkdir()
    spec = ClusterSpec(
        nodes=1,
        ranks_per_node=1,
        daemon_args=[*synthetic_args(20), "--shm-size", "16M", "--state-dir", str(state)],
    )
    cluster = LocalCluster(spec)
    fill = (
        f'mount -t tmpfs -o size=4k,mode=0700 tmpfs "{state}" && '
        f'head -c 4096 /dev/zero > "{state}/filler"; exec "$@"'
    )
    log_file = open(cluster.log_dir / "daemon0.log", "ab")  # noqa: SIM115 (closed below)
    command = ["unshare", "-rm", "sh", "-c", fill, "sh", *cluster.command(0)]
    cluster.processes.append(subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT))
    log_file.close()
    try:
        (code,) = cluster.wait(60)
    finally:
        cluster.stop()
    log = cluster.log(0)
    assert code == 1, log
    assert "Traceback" not in log and "Errno 28" not in log, log
    assert "cannot write the --state-dir journal" in log and "No space left on device" in log
    assert "The job stops" in log and "free space" in log, log
    assert cluster.leftover_segments() == []


def _kill_and_resume(
    nodes: int, tmp_path: Path, *, tear: bool, extra: tuple[str, ...] = ()
) -> LocalCluster:
    size, epochs, stop_after = 150, 2, 5
    spec = ClusterSpec(
        nodes=nodes,
        ranks_per_node=2,
        daemon_args=[
            *synthetic_args(size), "--buffer", "4", "--token-budget", "2048",
            "--epochs", str(epochs), "--shm-size", "64M", "--state-dir", str(tmp_path / "state"),
            *extra,
        ],
    )  # fmt: skip
    cluster = LocalCluster(spec)
    report = {r: cluster.tmp / f"rank{r}.jsonl" for r in range(cluster.world)}
    state = {r: tmp_path / f"rank{r}.state.json" for r in range(cluster.world)}
    try:
        cluster.start()
        cluster.wait_sockets(scaled(60))
        first = _trainers(
            cluster,
            lambda r: ["--report", str(report[r]), "--epochs", str(epochs),
                       "--stop-after", str(stop_after), "--state-out", str(state[r])],
        )  # fmt: skip
        for t in first:
            assert t.wait(timeout=scaled(120)) == 0
        # The daemons planned ahead of what the trainers took: those steps must be discarded.
        poll_until(
            lambda: all(_planned_ahead(cluster, node) for node in range(nodes)),
            "every daemon has steps planned but not delivered",
        )
        for proc in cluster.processes:  # the crash: no drain, no cleanup
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if tear:
            for node in range(nodes):
                _tear(tmp_path / "state" / f"node{node}.journal")
        for node in range(nodes):
            cluster.start_node(node)
        cluster.wait_sockets(scaled(60))
        second = _trainers(
            cluster,
            lambda r: ["--report", str(report[r]), "--epochs", str(epochs),
                       "--state-in", str(state[r])],
        )  # fmt: skip
        for t in second:
            assert t.wait(timeout=scaled(120)) == 0
        codes = cluster.wait(scaled(60))
    finally:
        cluster.stop()
    assert codes == [0] * nodes, cluster.log(0)
    ends = {r: [x["summary"] for x in read_jsonl(p) if "epoch_end" in x] for r, p in report.items()}
    for rank, summaries in ends.items():  # the restored tally counts every node's identities
        assert {e["epoch"] for e in summaries} >= {epochs - 1}, (rank, summaries)
        assert {e["num_identities"] for e in summaries} == {size}, (rank, summaries)
    records = {r: [x for x in read_jsonl(p) if "step" in x] for r, p in report.items()}
    world = cluster.world
    tail = world * math.ceil(size / world) - size
    for epoch in range(epochs):
        per_rank = [[x["step"] for x in records[r] if x["epoch"] == epoch] for r in range(world)]
        assert all(s == list(range(len(per_rank[0]))) for s in per_rank), (cluster.tmp, per_rank)
        ids = [i for r in range(world) for x in records[r] if x["epoch"] == epoch for i in x["ids"]]
        counts = Counter(ids)
        assert set(counts) == set(range(size)), f"epoch {epoch}: identities lost"
        assert sum(c - 1 for c in counts.values()) <= tail, f"epoch {epoch}: duplicates"
        assert len(ids) == size + tail
    assert cluster.leftover_segments() == []
    return cluster
