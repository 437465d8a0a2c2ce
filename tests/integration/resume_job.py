"""What the exact-resume tests of the adapters share (test_hf_resume.py: the HF Trainer's
resume_from_checkpoint; test_accelerate_resume.py: Accelerate's load_state): one daemon with
`--state-dir`, a job killed a step or two past a checkpoint, the daemon's restart from its
journal (or none: the running daemon rewinds), and the exactly-once check over both runs."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc

from odbd.demo.cluster import LocalCluster
from tests.integration.ddp_data import dataset_args
from tests.integration.ddp_launch import DATASET
from tests.integration.harness import admin_status, poll_until, read_jsonl, scaled

WORLD, EPOCHS = 2, 2


def daemon_args(*, size: int, accumulate: int, state_dir: Path) -> list[str]:
    """A small job of `size` samples per epoch, EPOCHS epochs, one worker, a journal."""
    args = ["--dataset", f"{DATASET}:make", *dataset_args(size=size, seed=3)]
    args += ["--workers", "1", "--epochs", str(EPOCHS), "--token-budget", "256"]
    args += ["--buffer", "8", "--shm-size", "32M", "--state-dir", str(state_dir)]
    return args + (["--accumulate", str(accumulate)] if accumulate > 1 else [])


def records_of(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}.jsonl"
    return read_jsonl(path) if path.exists() else []


def micro(records: list[dict]) -> list[dict]:
    """The odbd steps (micro-steps) taken, in order."""
    return [r for r in records if r.get("micro")]


def delivered(socket: str | list[str]) -> list[int] | None:
    """Each rank's delivered steps, over the daemons of `socket` (one, or one per node in
    node order)."""
    try:
        sockets = [socket] if isinstance(socket, str) else socket
        return [int(r.delivered_steps) for s in sockets for r in admin_status(s).ranks]
    except grpc.RpcError:
        return None


def processes_of(out: Path, script: str) -> list[int]:
    """The running processes of `script` whose command line names `out`."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            if entry.name.isdigit() and script.encode() in cmdline and bytes(out) in cmdline:
                found.append(int(entry.name))
    return [pid for pid in found if pid != os.getpid()]


def kill_job(launcher: subprocess.Popen[bytes], out: Path, script: str) -> None:
    """SIGKILL the launcher and its ranks (each may run in a session of its own, so a signal
    to the launcher's process group would miss them)."""
    for pid in [launcher.pid, *processes_of(out, script)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    launcher.wait()
    poll_until(lambda: not processes_of(out, script), "the killed ranks to be gone", scaled(30))


def stop_launcher(launcher: subprocess.Popen[bytes], out: Path, script: str) -> None:
    """SIGTERM first: the launcher (torchrun) passes it to its ranks, each in a session of its
    own, which a SIGKILL of the launcher would leave behind; any rank still alive after that
    is killed."""
    if launcher.poll() is None:
        launcher.terminate()
        try:
            launcher.wait(timeout=scaled(30))
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
    for pid in processes_of(out, script):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def crash_past_the_checkpoint(
    job: subprocess.Popen[bytes],
    out: Path,
    socket: str | list[str],
    script: str,
    logs: Callable[[], str],
) -> dict[int, list[dict]]:
    """Waits until every rank hangs past its checkpoint and the daemon has every Delivered
    (so it freed those steps), kills the job and returns each rank's records of the run."""
    poll_until(
        lambda: all((out / f"hung{r}").exists() for r in range(WORLD)) or job.poll() is not None,
        "both ranks to train past the checkpoint",
        scaled(120),
    )
    assert job.poll() is None, logs()
    taken = [len(micro(records_of(out, r))) for r in range(WORLD)]
    # prefetch 2: every step taken is reported at once; wait until the daemon has them all
    poll_until(lambda: delivered(socket) == taken, "the daemon to have every Delivered")
    kill_job(job, out, script)
    return {r: records_of(out, r) for r in range(WORLD)}


def restart_daemon(cluster: LocalCluster) -> None:
    """SIGKILL the job's one daemon and start it again: it resumes from its --state-dir."""
    cluster.processes[0].send_signal(signal.SIGKILL)
    cluster.processes[0].wait()
    cluster.start_node(0)


def assert_steps_follow_on(rank: int, trained: list[dict]) -> None:
    """Each epoch's steps trained into the final model are 0, 1, 2, ... with none twice."""
    for epoch in range(EPOCHS):
        steps = [r["step"] for r in trained if r["epoch"] == epoch]
        assert steps == list(range(len(steps))), (rank, epoch, steps)


def assert_every_sample_once(trained: dict[int, list[dict]], size: int) -> None:
    """Over every rank, each epoch trained every sample once (plus the sampler's tail
    repeats that make the epoch divide by the world)."""
    for epoch in range(EPOCHS):
        ids = [i for rank in range(WORLD) for r in trained[rank] if r["epoch"] == epoch
               for i in r["ids"]]  # fmt: skip
        tail = WORLD * math.ceil(size / WORLD) - size
        counts = Counter(ids)
        assert set(counts) == set(range(size)), f"epoch {epoch}: samples never trained"
        assert len(ids) == size + tail, f"epoch {epoch}: samples trained twice: {counts}"
