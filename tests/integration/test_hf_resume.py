"""`ODBTrainer.train(resume_from_checkpoint=True)` after a crash between two checkpoints
(issue: exact resume inside the Hugging Face Trainer).

Real `torchrun --nproc-per-node 2` (gloo, CPU) on one daemon with `--state-dir`, a tiny Llama,
a checkpoint every few optimizer steps; without accumulation, and with
gradient_accumulation_steps=2 on `--accumulate 2`. Run 1 trains a step or two past its first
checkpoint of epoch 1, and every process of the job is SIGKILLed. Then:
(a) the trainers restart with resume_from_checkpoint=True while the daemon keeps running: it
    already freed the steps after the checkpoint, which the restored model never trained,
    so both ranks are refused by name before training anything (a crash right after the
    checkpoint, with no step past it delivered, resumes exactly on the running daemon);
(b) the daemon is SIGKILLed and restarted with its --state-dir, and the trainers again: the job
    continues at the step after the checkpoint, the steps after it are trained again, once,
    every sample of both epochs is trained exactly once counting run 1 up to the checkpoint,
    the LR continues as an uninterrupted run's, the run ends on the job's last step, and
    torchrun and the daemon exit 0.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from odbd.demo.cluster import ClusterSpec, LocalCluster, free_ports
from tests.integration.ddp_data import dataset_args
from tests.integration.ddp_launch import DATASET, REPO
from tests.integration.harness import admin_status, poll_until, read_jsonl, scaled

pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

WORLD, EPOCHS, LR = 2, 2, 1e-3


@dataclass(frozen=True)
class Case:
    accumulate: int  # odbd --accumulate = the Trainer's gradient_accumulation_steps
    size: int  # samples per epoch
    save_steps: int
    hang_after: int  # optimizer steps trained past the checkpoint before the crash (0: none)


CASES = [
    pytest.param(Case(accumulate=1, size=48, save_steps=3, hang_after=2), id="no-accumulation"),
    pytest.param(Case(accumulate=2, size=96, save_steps=2, hang_after=1), id="accumulate-2"),
    pytest.param(
        Case(accumulate=1, size=48, save_steps=3, hang_after=0), id="crash-at-the-checkpoint"
    ),
]


def start_torchrun(out: Path, socket: str, *trainer_args: str) -> subprocess.Popen[bytes]:
    torchrun = Path(sys.executable).with_name("torchrun")
    # A new torchrun per run: its store is new, so no rank reads a predecessor's gloo address.
    cmd = [str(torchrun), "--nnodes", "1", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_ports(1)[0]), "--nproc-per-node", str(WORLD)]
    cmd += ["-m", "tests.integration.hf_resume_train", "--out-dir", str(out), *trainer_args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "ODBD_SOCKET": socket, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    log = open(out / "torchrun.log", "ab")  # noqa: SIM115 (closed right after the spawn)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    log.close()
    return proc


def kill_job(torchrun: subprocess.Popen[bytes], out: Path) -> None:
    """SIGKILL torchrun and its ranks (each runs in a session of its own, so a signal to
    torchrun's process group would miss them): found by their command line naming `out`."""
    for pid in [torchrun.pid, *ranks_of(out)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    torchrun.wait()
    poll_until(lambda: not ranks_of(out), "the killed ranks to be gone", scaled(30))


def ranks_of(out: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes()
            if entry.name.isdigit() and b"hf_resume_train" in cmdline and bytes(out) in cmdline:
                found.append(int(entry.name))
    return [pid for pid in found if pid != os.getpid()]


def records_of(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}.jsonl"
    return read_jsonl(path) if path.exists() else []


def micro(records: list[dict]) -> list[dict]:
    """The odbd steps (micro-steps) taken, in order."""
    return [r for r in records if r.get("micro")]


def optimizer_steps(records: list[dict]) -> list[dict]:
    return [r for r in records if "global_step" in r and "done" not in r]


def delivered(socket: str) -> list[int] | None:
    try:
        return [int(r.delivered_steps) for r in admin_status(socket).ranks]
    except grpc.RpcError:
        return None


def logs(out: Path, cluster: LocalCluster) -> str:
    text = (out / "torchrun.log").read_text(errors="replace") if out.exists() else ""
    return f"--- torchrun\n{text[-6000:]}\n--- daemon\n{cluster.log(0)}"


@pytest.mark.parametrize("case", CASES)
def test_hf_trainer_resumes_from_its_checkpoint_exactly_after_a_crash(
    tmp_path: Path, case: Case
) -> None:
    out = tmp_path / "job"
    out.mkdir()
    daemon_args = ["--dataset", f"{DATASET}:make", *dataset_args(size=case.size, seed=3)]
    daemon_args += ["--workers", "1", "--epochs", str(EPOCHS), "--token-budget", "256"]
    daemon_args += ["--buffer", "8", "--shm-size", "32M", "--state-dir", str(tmp_path / "state")]
    if case.accumulate > 1:
        daemon_args += ["--accumulate", str(case.accumulate)]
    trainer_args = ["--grad-accum", str(case.accumulate), "--save-steps", str(case.save_steps)]
    cluster = LocalCluster(ClusterSpec(nodes=1, ranks_per_node=WORLD, daemon_args=daemon_args))
    socket = cluster.sockets[0]
    job = None
    try:
        cluster.start()
        # Run 1: a crash a step or two after the first checkpoint of epoch 1.
        hang = ["--hang-after-checkpoint", str(case.hang_after)]
        job = start_torchrun(out, socket, *trainer_args, *hang)
        poll_until(
            lambda: (
                all((out / f"hung{r}").exists() for r in range(WORLD)) or job.poll() is not None
            ),
            "both ranks to train past the checkpoint",
            scaled(120),
        )
        assert job.poll() is None, logs(out, cluster)
        taken = [len(micro(records_of(out, r))) for r in range(WORLD)]
        # prefetch 2: every step taken is reported at once; wait until the daemon has them all
        poll_until(lambda: delivered(socket) == taken, "the daemon to have every Delivered")
        kill_job(job, out)
        run1 = {r: records_of(out, r) for r in range(WORLD)}
        checkpoint = optimizer_steps(run1[0])[-1]["global_step"] - case.hang_after
        assert (out / "hf" / f"checkpoint-{checkpoint}").is_dir(), logs(out, cluster)

        job = start_torchrun(out, socket, *trainer_args, "--resume")
        if case.hang_after == 0:
            # (a) with nothing past the checkpoint delivered: the running daemon resumes it.
            assert job.wait(timeout=scaled(150)) == 0, logs(out, cluster)
            assert cluster.wait(scaled(60)) == [0], logs(out, cluster)
            cluster.stop()
            return check_exact_resume(out, case, checkpoint, run1, cluster.spec.job_id)
        # (a) Trainers restart, the daemon kept running: refused by name, nothing trained.
        assert job.wait(timeout=scaled(120)) != 0, logs(out, cluster)
        text = logs(out, cluster)
        assert "RankRefusedError: resuming from" in text and "odbd_client_rank" in text, text
        assert "but this daemon already handed its previous trainer" in text, text
        assert "--state-dir" in text, text
        assert {r: records_of(out, r) for r in range(WORLD)} == run1, "trained before the error"
        kill_job(job, out)

        # (b) Everything restarts: the daemon from its --state-dir journal.
        cluster.processes[0].send_signal(signal.SIGKILL)
        cluster.processes[0].wait()
        cluster.start_node(0)
        job = start_torchrun(out, socket, *trainer_args, "--resume")
        assert job.wait(timeout=scaled(150)) == 0, logs(out, cluster)
        assert cluster.wait(scaled(60)) == [0], logs(out, cluster)
    finally:
        if job is not None and job.poll() is None:
            kill_job(job, out)
        cluster.stop()
    assert cluster.leftover_segments() == []  # the killed daemon's too
    check_exact_resume(out, case, checkpoint, run1, cluster.spec.job_id)


def check_exact_resume(
    out: Path, case: Case, checkpoint: int, run1: dict[int, list[dict]], job_id: str
) -> None:
    trained: dict[int, list[dict]] = {}  # odbd steps trained into the final model
    for rank in range(WORLD):
        records = read_jsonl(out / f"rank{rank}.jsonl")
        resumed, done = records[len(run1[rank]) :], records[-1]
        # the steps between the checkpoint and the crash are trained again: same odbd steps
        lost = [(r["epoch"], r["step"]) for r in micro(run1[rank]) if r["update"] > checkpoint]
        again = [(r["epoch"], r["step"]) for r in micro(resumed)[: len(lost)]]
        assert again == lost and bool(lost) == (case.hang_after > 0), (again, lost)
        assert micro(resumed)[0]["update"] == checkpoint + 1, resumed[0]
        trained[rank] = [r for r in micro(run1[rank]) if r["update"] <= checkpoint]
        trained[rank] += micro(resumed)
        for epoch in range(EPOCHS):
            steps = [r["step"] for r in trained[rank] if r["epoch"] == epoch]
            assert steps == list(range(len(steps))), (rank, epoch, steps)
        updates = [r for r in optimizer_steps(run1[rank]) if r["global_step"] <= checkpoint]
        updates += optimizer_steps(resumed)
        gsteps = [r["global_step"] for r in updates]
        assert gsteps == list(range(1, len(gsteps) + 1)), gsteps
        # the Trainer's epoch is odbd's, before and after the resume
        assert all(math.floor(r["trainer_epoch"]) == r["epoch"] for r in updates), updates
        # linear over odbd's job fraction: an uninterrupted run's LR at every step
        fractions = [0.0] + [r["fraction"] for r in updates]
        for record, before in zip(updates, fractions, strict=False):
            assert record["lr"] == pytest.approx(LR * (1.0 - before), rel=1e-9, abs=1e-15), record
        # ends on the job's last step; the progress bar's total is the steps trained
        assert updates[-1]["fraction"] == 1.0
        assert done["done"] and done["global_step"] == gsteps[-1] == done["max_steps"], done
    for epoch in range(EPOCHS):
        ids = [i for rank in range(WORLD) for r in trained[rank] if r["epoch"] == epoch
               for i in r["ids"]]  # fmt: skip
        tail = WORLD * math.ceil(case.size / WORLD) - case.size
        counts = Counter(ids)
        assert set(counts) == set(range(case.size)), f"epoch {epoch}: samples never trained"
        assert len(ids) == case.size + tail, f"epoch {epoch}: samples trained twice: {counts}"
    # every checkpoint left by the rotation (save_total_limit=2) holds every rank's state
    checkpoints = sorted((out / "hf").glob("checkpoint-*"))
    assert 1 <= len(checkpoints) <= 2, checkpoints
    for path in checkpoints:
        assert {p.name for p in path.glob("odbd_client_rank*.json")} == {
            f"odbd_client_rank{r}.json" for r in range(WORLD)
        }, path
        for rank in range(WORLD):
            saved = json.loads((path / f"odbd_client_rank{rank}.json").read_text())
            assert (saved["rank"], saved["world_size"], saved["job_id"]) == (rank, WORLD, job_id)
