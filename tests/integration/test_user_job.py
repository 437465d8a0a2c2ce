"""A user's training job, start to end, as a user builds and launches it (issue 10).

The daemon is started alone with `--dataset` pointing at a module that trains a BPE tokenizer
with `tokenizers` and tokenizes an in-memory Hugging Face `datasets.Dataset` with `map`
(rows of Python lists). Well after it has planned its first rounds (>= 70 s, the time a real
job spends loading a model), real `torchrun --nproc-per-node 2` starts two ranks that train a
randomly initialised `transformers` GPT-2 with the Hugging Face Trainer adapter, a cosine
schedule with warm-up, two epochs, and steps slowed to >= 2 s.

What must hold: every process exits 0 (torchrun, both ranks, the daemon, its producer); every
sample is trained exactly once per epoch; both ranks take the same steps; the learning rate
reaches its floor within 5 % of the last step; no spurious Trainer warning; nothing is left in
/dev/shm.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

from tests.integration.ddp_launch import REPO, Reports  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SIZE, WORLD, EPOCHS = 48, 2, 2
LATE_START_S = 70.0  # a real job loads its model for a minute or more before the first step
STEP_S = 2.0
DATASET = Path(__file__).with_name("user_job_data.py")


def start_daemon(tmp: Path, socket: str, job_id: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "odbd", "--world", str(WORLD), "--nproc-per-node", str(WORLD)]
    cmd += ["--dataset", f"{DATASET}:build", "--dataset-arg", f"size={SIZE}", "--workers", "1"]
    cmd += ["--epochs", str(EPOCHS), "--token-budget", "256", "--buffer", "16"]
    cmd += ["--shm-size", "64M", "--socket", socket, "--job-id", job_id]
    log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 (closed right after the spawn)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    log.close()
    return proc


def start_torchrun(tmp: Path, socket: str) -> subprocess.Popen[bytes]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(WORLD)]
    cmd += ["-m", "tests.integration.user_job_train", "--out-dir", str(tmp)]
    cmd += ["--step-s", str(STEP_S), "--epochs", str(EPOCHS)]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "ODBD_SOCKET": socket,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",  # the model is built from a config: nothing is downloaded
    }
    log = open(tmp / "torchrun.log", "wb")  # noqa: SIM115 (closed right after the spawn)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    log.close()
    return proc


def wait_late_start(daemon: subprocess.Popen[bytes], tmp: Path) -> None:
    """The daemon runs alone for LATE_START_S; it must stay up (nobody is attached yet)."""
    try:
        daemon.wait(timeout=LATE_START_S)
    except subprocess.TimeoutExpired:
        return
    log = (tmp / "daemon.log").read_text(errors="replace")
    pytest.fail(f"the daemon exited with {daemon.returncode} before any trainer came:\n{log}")


def logs(tmp: Path) -> str:
    parts = [f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in
             sorted(tmp.glob("*.log"))]  # fmt: skip
    return "\n".join(parts)


def stop(*processes: subprocess.Popen[bytes]) -> None:
    for proc in processes:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def lr_floor_step(lrs: list[float]) -> int:
    """The first step whose LR is within 5 % of the peak above the floor (0 for cosine)."""
    peak = max(lrs)
    return next(i for i, lr in enumerate(lrs) if lr <= 0.05 * peak)


def test_torchrun_hf_trainer_on_a_hf_dataset_with_late_trainers_runs_to_the_end(
    tmp_path: Path,
) -> None:
    socket = str(tmp_path / "odbd.sock")
    job_id = f"userjob{os.getpid()}"
    daemon = start_daemon(tmp_path, socket, job_id)
    torchrun = None
    try:
        wait_late_start(daemon, tmp_path)
        torchrun = start_torchrun(tmp_path, socket)
        assert torchrun.wait(timeout=420) == 0, logs(tmp_path)
        assert daemon.wait(timeout=120) == 0, logs(tmp_path)
    finally:
        stop(*(p for p in (torchrun, daemon) if p is not None))

    daemon_log = (tmp_path / "daemon.log").read_text(errors="replace")
    assert "restarting it" not in daemon_log, daemon_log  # the producer never died
    assert "Traceback" not in daemon_log, daemon_log
    trainer_log = (tmp_path / "torchrun.log").read_text(errors="replace")
    assert "not to be a single sample" not in trainer_log, trainer_log

    reports = Reports.read(tmp_path, WORLD)
    steps = [reports.steps(rank) for rank in range(WORLD)]
    assert len(steps[0]) == len(steps[1]) > 0, "ranks took different step counts"
    for epoch in range(EPOCHS):
        ids = reports.ids(epoch)
        assert Counter(ids) == Counter(range(SIZE)), f"epoch {epoch}: not every sample once"
    for rank in range(WORLD):
        assert reports.done(rank), f"rank {rank} wrote no closing line:\n{logs(tmp_path)}"
        lrs = [record["lr"] for record in steps[rank]]
        last = len(lrs) - 1
        assert lr_floor_step(lrs) >= 0.95 * last, f"rank {rank}: LR hit its floor early: {lrs}"
        assert lrs[-1] <= 0.05 * max(lrs), f"rank {rank}: LR never reached its floor: {lrs}"
        assert lrs[0] < max(lrs), f"rank {rank}: no warm-up: {lrs}"
    leftover = [n for n in os.listdir("/dev/shm") if n.startswith(f"odbd-{job_id}-")]
    assert not leftover, leftover
    print(f"USERJOB steps per rank {len(steps[0])}, elapsed ok; lr {steps[0][0]['lr']:.2e}..")
