"""The daemon's life against real processes: the job's end waits for every rank (no fixed
grace), the attach deadline, signals (Ctrl-C with nobody attached, a second signal), a refused
second daemon on a live socket, and a failure that still releases everything."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from odbclient import ODBClient
from odbclient.errors import JobFailedError
from odbclient.trainer.batch import Batch
from odbclient.wire.odbd.v1 import admin_pb2, admin_pb2_grpc
from odbd.demo.cluster import ClusterSpec, LocalCluster
from tests.integration.harness import scaled, synthetic_args
from tests.integration.test_ops_health_drain import SERVING, health, steps, wait_until

# A small job: 2 ranks, 2 epochs of 120 samples, a few dozen steps per rank.
SMALL_JOB = [*synthetic_args(120, workers=1), "--buffer", "16", "--token-budget", "2048"]
SMALL_JOB += ["--shm-size", "64M", "--epochs", "2"]


def status(socket: str) -> admin_pb2.StatusReply:
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        return admin_pb2_grpc.AdminStub(channel).Status(admin_pb2.StatusRequest(), timeout=2)


def start_trainer(
    cluster: LocalCluster, rank: int, tmp: Path, *extra: str, epochs: int = 2
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "odbd.demo.trainer", "--rank", str(rank)]
    command += ["--socket", cluster.sockets[0], "--report", str(tmp / f"rank{rank}.jsonl")]
    command += ["--epochs", str(epochs), *extra]
    with open(tmp / f"trainer{rank}.log", "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def trainer_log(tmp: Path, rank: int) -> str:
    path = tmp / f"trainer{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def producer_pids(socket: str) -> list[int]:
    """Live processes running a producer against `socket` (daemon-spawned or not)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and socket.encode() in cmdline and b"producer" in b" ".join(cmdline):
            pids.append(int(entry.name))
    return pids


def both_trained(tmp: Path, num_steps: int) -> bool:
    return all(len(steps(tmp / f"rank{rank}.jsonl")) >= num_steps for rank in (0, 1))


def reap(processes: list[subprocess.Popen[bytes]]) -> None:
    for p in processes:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait()


def assert_released(cluster: LocalCluster) -> None:
    assert cluster.leftover_segments() == [], "shared memory left behind"
    assert not os.path.exists(cluster.sockets[0]), "socket file left behind"
    deadline = time.monotonic() + 10  # a killed producer is reaped by init a moment later
    while producer_pids(cluster.sockets[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert producer_pids(cluster.sockets[0]) == [], "a producer outlived its daemon"


# -- 1. the job's end ------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "late_s",
    [0.0, pytest.param(70.0, marks=pytest.mark.soak, id="past-the-old-60s-grace")],
)
def test_trainers_that_attach_after_the_last_round_was_planned_get_every_step(
    tmp_path: Path, late_s: float
) -> None:
    """Issue 10: trainers started a minute after the daemon planned everything got nothing and
    the daemon exited 0. The trainers start once `odbd status` says every round is planned
    (plus `late_s`: the soak run waits past the old 60 s grace)."""
    spec = ClusterSpec(nodes=1, ranks_per_node=2, daemon_args=[*SMALL_JOB, "--steps-ahead", "1000"])
    trainers: list[subprocess.Popen[bytes]] = []
    with LocalCluster(spec) as cluster:
        cluster.wait_sockets(60)
        sock = cluster.sockets[0]
        wait_until("every round planned", lambda: status(sock).phase == "draining", 90)
        planned = status(sock)
        assert all(r.queued_steps > 0 and not r.attached for r in planned.ranks), planned
        time.sleep(late_s)  # the scenario itself (how late the trainers come), not a sync
        trainers = [start_trainer(cluster, rank, tmp_path) for rank in (0, 1)]
        try:
            codes = [t.wait(timeout=120) for t in trainers]
            assert cluster.wait(60) == [0], cluster.log(0)
        finally:
            reap(trainers)
        assert codes == [0, 0], trainer_log(tmp_path, 0) + trainer_log(tmp_path, 1)
        for rank in (0, 1):
            report = (tmp_path / f"rank{rank}.jsonl").read_text()
            trained = steps(tmp_path / f"rank{rank}.jsonl")
            queued = next(r.queued_steps for r in planned.ranks if r.rank == rank)
            assert len(trained) == queued, (rank, len(trained), queued)
            assert '"done": true' in report
        assert "every local rank took the job's end" in cluster.log(0)
    assert_released(cluster)


def take(batches: Iterator[Batch], count: int) -> None:
    for _ in range(count):
        next(batches)


def train_to_the_end(client: ODBClient, batches: Iterator[Batch], epochs: int) -> int:
    """Finishes the current epoch's iterator, then the remaining epochs; steps taken."""
    taken = sum(1 for _ in batches)
    for _ in range(epochs - 1):
        taken += sum(1 for _ in client)
    return taken


@pytest.mark.timeout(180)
def test_the_end_of_job_waits_for_an_attached_rank_past_every_deadline_then_exits_0() -> None:
    """No fixed grace: with --attach-timeout 4 and --drain-timeout 2, a rank that is attached
    but takes nothing for 3x the attach deadline after the last round was planned is still
    waited for; once it goes on, every step is trained and the daemon exits 0. (Trainers run
    in this process: a trainer process takes longer than 4 s to import torch here.)"""
    attach_timeout_s = 4.0
    args = [*SMALL_JOB, "--steps-ahead", "1000", "--drain-timeout", "2"]
    args += ["--attach-timeout", str(attach_timeout_s)]
    spec = ClusterSpec(nodes=1, ranks_per_node=2, daemon_args=args)
    with LocalCluster(spec) as cluster:
        cluster.wait_sockets(60)  # a client started earlier would back off for seconds
        sock = cluster.sockets[0]
        clients = [ODBClient(rank=r, socket=sock, connect_timeout_s=60) for r in (0, 1)]
        try:
            batches = [iter(c) for c in clients]
            for b in batches:
                take(b, 2)  # both ranks attached and training
            wait_until("every round planned", lambda: status(sock).phase == "draining", 90)
            rank0_steps = 2 + train_to_the_end(clients[0], batches[0], epochs=2)
            paused = time.monotonic()  # rank 1: attached, prefetch full, taking nothing
            while time.monotonic() - paused < 3 * attach_timeout_s:
                assert cluster.processes[0].poll() is None, cluster.log(0)
                rank1 = next(r for r in status(sock).ranks if r.rank == 1)
                assert rank1.attached and rank1.queued_steps > 0, rank1
                time.sleep(0.2)
            rank1_steps = 2 + train_to_the_end(clients[1], batches[1], epochs=2)
            assert all(c.job_ended or c.summary for c in clients)
        finally:
            for c in clients:
                c.close()
        assert cluster.wait(60) == [0], cluster.log(0)
        assert rank0_steps == rank1_steps > 4
        assert "every local rank took the job's end" in cluster.log(0)
    assert_released(cluster)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("absence", ["never-attaches", "detaches-mid-job"])
def test_an_absent_rank_fails_the_job_at_the_attach_deadline_naming_it(absence: str) -> None:
    attach_timeout_s = 3.0
    # Endless: rank 0 is still training when the deadline comes (a finished rank keeps its
    # successful end; in DDP it could not have finished without rank 1 anyway).
    args = [*SMALL_JOB, "--epochs", "0", "--attach-timeout", str(attach_timeout_s)]
    spec = ClusterSpec(nodes=1, ranks_per_node=2, daemon_args=args)
    with LocalCluster(spec) as cluster:
        cluster.wait_sockets(60)  # a client started earlier would back off for seconds
        sock = cluster.sockets[0]
        rank0 = ODBClient(rank=0, socket=sock, connect_timeout_s=60)
        try:
            batches = iter(rank0)
            take(batches, 1)
            if absence == "detaches-mid-job":
                with ODBClient(rank=1, socket=sock, connect_timeout_s=60) as rank1:
                    take(iter(rank1), 3)  # then it leaves with steps undelivered
            absent_from = time.monotonic()
            with pytest.raises(JobFailedError, match="rank 1") as failure:
                train_to_the_end(rank0, batches, epochs=sys.maxsize)
            told_s = time.monotonic() - absent_from
        finally:
            rank0.close()
        assert cluster.wait(60) == [1], cluster.log(0)
        log = cluster.log(0)
        expected = (
            "never attached" if absence == "never-attaches" else "detached and did not come back"
        )
        assert f"rank 1 {expected} within --attach-timeout 3 s" in log, log
        assert "--attach-timeout" in str(failure.value)
        assert told_s < attach_timeout_s + 20, told_s  # the deadline, not a hang
        print(f"FAULT {absence}: JobFailedError {told_s:.2f} s after rank 1 was absent")
    assert_released(cluster)


# -- 2. and 5. signals -----------------------------------------------------------------------


def own_group_cluster(spec: ClusterSpec) -> LocalCluster:
    """A cluster whose daemon leads its own process group, like a shell's foreground job: a
    terminal's Ctrl-C is killpg(SIGINT) of that group."""
    cluster = LocalCluster(spec)
    log = open(cluster.log_dir / "daemon0.log", "ab")  # noqa: SIM115 (closed below)
    cluster.processes.append(
        subprocess.Popen(
            cluster.command(0), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    )
    log.close()
    return cluster


@pytest.mark.timeout(120)
def test_ctrl_c_with_no_trainer_attached_exits_within_2_s_without_restarting_producers() -> None:
    spec = ClusterSpec(nodes=1, ranks_per_node=2, daemon_args=[*SMALL_JOB, "--epochs", "0"])
    cluster = own_group_cluster(spec)
    try:
        cluster.wait_sockets(60)
        sock = cluster.sockets[0]
        wait_until("steps queued", lambda: all(r.queued_steps for r in status(sock).ranks), 60)
        assert status(sock).producers == 1 and producer_pids(sock)
        signalled = time.monotonic()
        os.killpg(cluster.processes[0].pid, signal.SIGINT)  # the whole foreground group
        code = cluster.processes[0].wait(timeout=30)
        took_s = time.monotonic() - signalled
    finally:
        cluster.stop()
    log = cluster.log(0)
    print(f"FAULT ctrl-c with nobody attached: exited {took_s:.2f} s after SIGINT")
    assert took_s < 2.0, (took_s, log)
    assert code == 1, log  # the steps planned for ranks that never attached are lost: said so
    assert "stopped (SIGINT) before trainers took everything" in log, log
    assert "restarting it" not in log and "exited with status" not in log, log
    assert "fork_posix" not in log, log
    assert_released(cluster)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("first", "second"), [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT)]
)
def test_a_second_signal_exits_at_once_and_still_releases_shm_socket_and_producers(
    tmp_path: Path, first: signal.Signals, second: signal.Signals
) -> None:
    # --steps-ahead 32 over the trainers' prefetch 8: a stopped trainer leaves queued steps the
    # daemon cannot send, so the drain must wait. With 8 (= the prefetch) every queued step and
    # the job's end could already sit in the socket (CI, 2026-11-26: the drain ended at once).
    args = [*SMALL_JOB, "--epochs", "0", "--steps-ahead", "32", "--drain-timeout", "60"]
    cluster = own_group_cluster(ClusterSpec(nodes=1, ranks_per_node=2, daemon_args=args))
    trainers: list[subprocess.Popen[bytes]] = []
    try:
        cluster.wait_sockets(60)
        wait_until("SERVING", lambda: health(cluster.sockets[0]) == SERVING, 60)
        trainers = [start_trainer(cluster, r, tmp_path, epochs=1000) for r in (0, 1)]
        wait_until("2 steps trained on both ranks", lambda: both_trained(tmp_path, 2), 90)
        for t in trainers:
            os.kill(t.pid, signal.SIGSTOP)  # attached, taking nothing: the drain would wait 60 s
        daemon = cluster.processes[0]
        daemon.send_signal(first)
        wait_until("the drain began", lambda: f"{first.name} received" in cluster.log(0), 30)
        signalled = time.monotonic()
        daemon.send_signal(second)
        code = daemon.wait(timeout=30)
        took_s = time.monotonic() - signalled
    finally:
        reap(trainers)
        cluster.stop()
    log = cluster.log(0)
    assert code == 128 + second, log
    print(f"FAULT {first.name} then {second.name}: exit {code} {took_s:.2f} s after the second")
    assert took_s < 10, took_s
    assert f"second signal ({second.name})" in log, log
    assert_released(cluster)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_trainers_are_told_which_signal_stopped_the_daemon(
    tmp_path: Path, sig: signal.Signals
) -> None:
    args = [*SMALL_JOB, "--epochs", "0", "--steps-ahead", "8"]
    spec = ClusterSpec(nodes=1, ranks_per_node=2, daemon_args=args)
    trainers: list[subprocess.Popen[bytes]] = []
    with LocalCluster(spec) as cluster:
        cluster.wait_sockets(60)
        trainers = [start_trainer(cluster, r, tmp_path, epochs=1000) for r in (0, 1)]
        try:
            wait_until("2 steps trained on both ranks", lambda: both_trained(tmp_path, 2), 90)
            cluster.processes[0].send_signal(sig)
            assert cluster.wait(60) == [0], cluster.log(0)  # they took everything queued
            codes = [t.wait(timeout=30) for t in trainers]
        finally:
            reap(trainers)
        assert codes == [1, 1]
        for rank in (0, 1):
            assert f"the daemon was stopped ({sig.name})" in trainer_log(tmp_path, rank)
    assert_released(cluster)


@pytest.mark.timeout(60)
def test_sigint_while_the_job_forms_stops_at_once_and_releases_everything() -> None:
    spec = ClusterSpec(
        nodes=2, ranks_per_node=1, daemon_args=["--dataset-size", "10", "--shm-size", "16M"]
    )
    cluster = LocalCluster(spec)
    try:
        cluster.start_node(0)  # node 1 never comes: the job cannot form
        wait_until("the socket", lambda: os.path.exists(cluster.sockets[0]), 30)
        signalled = time.monotonic()
        cluster.processes[0].send_signal(signal.SIGINT)
        code = cluster.processes[0].wait(timeout=20)
        took_s = time.monotonic() - signalled
    finally:
        cluster.stop()
    assert code == 0, cluster.log(0)
    assert "stopped (SIGINT) before the job formed" in cluster.log(0)
    print(f"FAULT SIGINT while the job forms: exited {took_s:.2f} s after it")
    assert took_s < 10, took_s  # not the 120 s join timeout
    assert_released(cluster)


# -- 3. a refused daemon ----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_second_daemon_on_a_live_socket_exits_2_in_one_line_and_leaves_it_serving(
    tmp_path: Path,
) -> None:
    args = ["--dataset-size", "10", "--epochs", "0", "--shm-size", "16M"]
    with LocalCluster(ClusterSpec(nodes=1, ranks_per_node=1, daemon_args=args)) as cluster:
        cluster.wait_sockets(60)
        sock = cluster.sockets[0]
        before = os.stat(sock).st_ino
        second = subprocess.run(
            [*cluster.command(0), "--job-id", "other-job"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"another daemon is serving on {sock}" in lines[0], lines
        assert os.path.exists(sock) and os.stat(sock).st_ino == before
        assert status(sock).job_id == cluster.spec.job_id  # the first one still answers
        assert not any(n.startswith("odbd-other-job-") for n in os.listdir("/dev/shm"))
    assert cluster.processes[0].returncode == 0, cluster.log(0)
    assert_released(cluster)


# -- 4. a failure still releases everything ----------------------------------------------------


def _can_mount_a_private_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=16k tmpfs $d && umount $d && rmdir $d"
    return (
        subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0
    )


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    not _can_mount_a_private_tmpfs(), reason="needs unshare -rm (user + mount namespaces)"
)
def test_a_full_state_dir_fails_the_job_cleanly_and_still_releases_shm_and_socket(
    tmp_path: Path,
) -> None:
    """Issue 11: ENOSPC in --state-dir killed the round loop with a raw traceback, a second
    ENOSPC in the journal's close() stopped shutdown before the arena was unlinked, and the
    trainers got DaemonConnectionError. The daemon runs in its own mount namespace where
    --state-dir is a 16 KiB tmpfs: the journal really runs out of space after a few rounds."""
    state = tmp_path / "state"
    state.mkdir()
    args = [*SMALL_JOB, "--epochs", "0", "--state-dir", str(state)]
    cluster = LocalCluster(ClusterSpec(nodes=1, ranks_per_node=2, daemon_args=args))
    # mode=0700: a tmpfs root is 1777 by default, which --state-dir refuses (issue 29).
    mount = f'mount -t tmpfs -o size=16k,mode=0700 tmpfs "{state}" && exec "$@"'
    log = open(cluster.log_dir / "daemon0.log", "ab")  # noqa: SIM115 (closed below)
    command = ["unshare", "-rm", "sh", "-c", mount, "sh", *cluster.command(0)]
    cluster.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
    log.close()
    try:
        cluster.wait_sockets(60)
        clients = [
            ODBClient(rank=r, socket=cluster.sockets[0], connect_timeout_s=60) for r in (0, 1)
        ]
        try:
            iterators = [iter(c) for c in clients]  # both attached before the disk fills
            for client, batches in zip(clients, iterators, strict=True):
                with pytest.raises(JobFailedError, match="No space left on device"):
                    train_to_the_end(client, batches, epochs=sys.maxsize)
        finally:
            for c in clients:
                c.close()
        code = cluster.processes[0].wait(timeout=60)
    finally:
        cluster.stop()
    daemon_log = cluster.log(0)
    assert code == 1, daemon_log
    assert "No space left on device" in daemon_log, daemon_log
    assert "Traceback" not in daemon_log, daemon_log
    assert_released(cluster)


# A daemon killed with SIGKILL (the OOM killer) leaves 16 MiB of arena in a 24 MiB /dev/shm.
_STALE_ARENA_THEN_RUN = """
mount -t tmpfs -o size=24m tmpfs /dev/shm || exit 97
"$0" -c 'import os, sys
from odbd.ingest.arena import Arena
Arena.create("killed-job", 0, 16 << 20)
os._exit(0)' || exit 98
exec "$@"
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    not _can_mount_a_private_tmpfs(), reason="needs unshare -rm (user + mount namespaces)"
)
def test_a_dead_daemon_s_arena_filling_dev_shm_is_named_with_its_rm() -> None:
    """The next job's daemon cannot reserve its arena: the error must say that odbd's own
    stale segment takes the space (only a daemon of that job and node rank would reclaim it),
    and how to remove it, not only "lower --shm-size"."""
    cluster = LocalCluster(ClusterSpec(nodes=1, ranks_per_node=1, daemon_args=SMALL_JOB))
    command = ["unshare", "-rm", "sh", "-c", _STALE_ARENA_THEN_RUN, sys.executable]
    command += cluster.command(0)
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=scaled(60))
    finally:
        cluster.stop()
    log = run.stdout + run.stderr
    assert run.returncode == 1, log
    assert "/dev/shm has" in log and "lower --shm-size or enlarge /dev/shm" in log, log
    assert "odbd-killed-job-0-0 (16.0 MiB, stale: its daemon, pid" in log, log
    assert log.rstrip().endswith("remove them: rm /dev/shm/odbd-killed-job-0-0"), log
    assert "Traceback" not in log, log


@pytest.mark.timeout(120)
def test_a_producer_stuck_in_the_dataset_dies_with_a_sigkilled_daemon() -> None:
    dataset = str(Path(__file__).with_name("stuck_dataset.py")) + ":make"
    args = ["--dataset", dataset, "--workers", "1", "--shm-size", "16M", "--buffer", "16"]
    with LocalCluster(ClusterSpec(nodes=1, ranks_per_node=1, daemon_args=args)) as cluster:
        cluster.wait_sockets(60)
        sock = cluster.sockets[0]
        wait_until("the producer attached", lambda: status(sock).producers == 1, 60)
        wait_until("a lease in the producer's hands", lambda: status(sock).leased_samples, 60)
        stuck = producer_pids(sock)
        assert len(stuck) == 1
        cluster.processes[0].kill()  # no shutdown: only the kernel can stop the producer now
        cluster.processes[0].wait()
        killed = time.monotonic()
        wait_until("the producer gone", lambda: not producer_pids(sock), 30)
        print(
            f"FAULT daemon SIGKILLed: stuck producer gone {time.monotonic() - killed:.2f} s later"
        )
    for name in cluster.leftover_segments():  # a SIGKILLed daemon cannot unlink its arena
        os.unlink(f"/dev/shm/{name}")


@pytest.mark.timeout(300)
def test_two_daemons_started_at_once_with_one_node_rank_leave_one_running_and_one_clear_error(
    tmp_path: Path,
) -> None:
    """Found by hand on 2026-11-26: two daemons of one job started at the same moment with the
    same --node-rank (a NODE_RANK typo) each unlinked the other's half-created segment as
    stale, and both died with `internal error (a bug in odbd ...)` and a traceback. Now the
    second finds the first's segment being created (or taken) and exits 1 in one line; the
    first serves on. 256 MiB each: reserving it takes long enough for the two to overlap."""
    job_id = f"same-rank-{os.getpid()}"
    command = [sys.executable, "-m", "odbd", "--world", "1", "--nproc-per-node", "1"]
    command += ["--node-rank", "0", "--job-id", job_id, "--dataset-size", "10", "--epochs", "0"]
    command += ["--shm-size", "256M"]
    procs = [
        subprocess.Popen(
            [*command, "--socket", str(tmp_path / f"d{i}.sock")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + scaled(90)
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        failed = [p for p in procs if p.poll() is not None]
        assert len(failed) == 1, [p.returncode for p in procs]
        survivor = procs[1 - procs.index(failed[0])]
        output = failed[0].communicate(timeout=scaled(30))[0]
        assert failed[0].returncode == 1, output
        assert "cannot share a node's arena" in output and "own --node-rank" in output, output
        assert "Traceback" not in output and "internal error" not in output, output
        sock = str(tmp_path / f"d{procs.index(survivor)}.sock")
        wait_until("the survivor serves its socket", lambda: os.path.exists(sock), 60)
        assert status(sock).job_id == job_id
        survivor.send_signal(signal.SIGTERM)
        survivor.communicate(timeout=scaled(60))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"odbd-{job_id}-")]
