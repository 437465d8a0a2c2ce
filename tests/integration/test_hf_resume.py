"""`ODBTrainer.train(resume_from_checkpoint=True)` after a crash between two checkpoints
(issue: exact resume inside the Hugging Face Trainer; issue 23: rewind on a running daemon).

Real `torchrun --nproc-per-node 2` (gloo, CPU) on one daemon with `--state-dir` (or two
daemons, one rank each), a tiny Llama,
a checkpoint every few optimizer steps; without accumulation, and with
gradient_accumulation_steps=2 on `--accumulate 2`. Run 1 trains a step or two past its first
checkpoint of epoch 1, and every process of the job is SIGKILLed. Then the trainers restart
with resume_from_checkpoint=True:
- while the daemon keeps running (no operator action): it rewinds, so the steps after the
  checkpoint are sent again with the same samples in the same steps (made again by id);
- or after the daemon was SIGKILLed too and restarted with its --state-dir: it rebuilds the
  job from its journal at the checkpoint's step.
Either way the job continues at the step after the checkpoint, the steps after it are trained
again, once, every sample of both epochs is trained exactly once counting run 1 up to the
checkpoint, the LR continues as an uninterrupted run's, the run ends on the job's last step,
and torchrun and the daemon exit 0.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from odbd.demo.cluster import ClusterSpec, LocalCluster, free_ports
from tests.integration.ddp_launch import REPO
from tests.integration.harness import scaled
from tests.integration.resume_job import (
    WORLD,
    assert_every_sample_once,
    assert_steps_follow_on,
    crash_past_the_checkpoint,
    daemon_args,
    kill_job,
    micro,
    records_of,
    restart_daemon,
)

pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

LR = 1e-3
SCRIPT = "tests.integration.hf_resume_train"


@dataclass(frozen=True)
class Case:
    accumulate: int  # odbd --accumulate = the Trainer's gradient_accumulation_steps
    size: int  # samples per epoch
    save_steps: int
    hang_after: int  # optimizer steps trained past the checkpoint before the crash (0: none)
    daemon_dies: bool = False  # the daemon is killed too and restarts from its --state-dir
    nodes: int = 1  # daemons, WORLD // nodes ranks each


CASES = [
    pytest.param(Case(accumulate=1, size=48, save_steps=3, hang_after=2), id="no-accumulation"),
    # The adapter's update-boundary checkpoints with --accumulate 2: `make soak`, to keep
    # `make test` near 15 min (the daemon side runs in test_ddp_resume.py's accumulate test).
    pytest.param(
        Case(accumulate=2, size=96, save_steps=2, hang_after=1),
        id="accumulate-2",
        marks=pytest.mark.soak,
    ),
    pytest.param(
        Case(accumulate=1, size=48, save_steps=3, hang_after=0), id="crash-at-the-checkpoint"
    ),
    pytest.param(
        Case(accumulate=1, size=48, save_steps=3, hang_after=2, daemon_dies=True),
        id="daemon-restarted-from-state-dir",
    ),
    pytest.param(  # the rewind on 2 daemons runs by default in test_rewind.py
        Case(accumulate=1, size=48, save_steps=3, hang_after=2, nodes=2),
        id="two-nodes",
        marks=pytest.mark.soak,
    ),
]


def start_torchrun(out: Path, sockets: list[str], *trainer_args: str) -> subprocess.Popen[bytes]:
    """`sockets`: each rank's daemon socket."""
    torchrun = Path(sys.executable).with_name("torchrun")
    # A new torchrun per run: its store is new, so no rank reads a predecessor's gloo address.
    cmd = [str(torchrun), "--nnodes", "1", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_ports(1)[0]), "--nproc-per-node", str(WORLD)]
    cmd += ["-m", SCRIPT, "--out-dir", str(out), *trainer_args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "ODBD_SOCKETS": ",".join(sockets),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    log = open(out / "torchrun.log", "ab")  # noqa: SIM115 (closed right after the spawn)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    log.close()
    return proc


def optimizer_steps(records: list[dict]) -> list[dict]:
    return [r for r in records if "global_step" in r and "done" not in r]


def logs(out: Path, cluster: LocalCluster) -> str:
    text = (out / "torchrun.log").read_text(errors="replace") if out.exists() else ""
    daemons = "\n".join(f"--- daemon {n}\n{cluster.log(n)}" for n in range(cluster.spec.nodes))
    return f"--- torchrun\n{text[-6000:]}\n{daemons}"


@pytest.mark.parametrize("case", CASES)
def test_hf_trainer_resumes_from_its_checkpoint_exactly_after_a_crash(
    tmp_path: Path, case: Case
) -> None:
    out = tmp_path / "job"
    out.mkdir()
    state_dir = tmp_path / "state"
    args = daemon_args(size=case.size, accumulate=case.accumulate, state_dir=state_dir)
    trainer_args = ["--grad-accum", str(case.accumulate), "--save-steps", str(case.save_steps)]
    spec = ClusterSpec(nodes=case.nodes, ranks_per_node=WORLD // case.nodes, daemon_args=args)
    cluster = LocalCluster(spec)
    sockets = [cluster.sockets[cluster.node_of(rank)] for rank in range(WORLD)]
    job = None
    try:
        cluster.start()
        # Run 1: a crash a step or two after the first checkpoint of epoch 1.
        hang = ["--hang-after-checkpoint", str(case.hang_after)]
        job = start_torchrun(out, sockets, *trainer_args, *hang)
        run1 = crash_past_the_checkpoint(
            job, out, cluster.sockets, SCRIPT, lambda: logs(out, cluster)
        )
        checkpoint = optimizer_steps(run1[0])[-1]["global_step"] - case.hang_after
        assert (out / "hf" / f"checkpoint-{checkpoint}").is_dir(), logs(out, cluster)

        if case.daemon_dies:
            restart_daemon(cluster)  # from its --state-dir journal
        # The trainers restart from the checkpoint; a running daemon rewinds for them.
        job = start_torchrun(out, sockets, *trainer_args, "--resume")
        assert job.wait(timeout=scaled(150)) == 0, logs(out, cluster)
        assert cluster.wait(scaled(60)) == [0] * case.nodes, logs(out, cluster)
    finally:
        if job is not None and job.poll() is None:
            kill_job(job, out, SCRIPT)
        cluster.stop()
    assert cluster.leftover_segments() == []  # the killed daemon's too
    check_exact_resume(out, case, checkpoint, run1, cluster.spec.job_id)
    if case.hang_after and not case.daemon_dies:  # every running daemon rewound its ranks
        assert all("rewinding" in cluster.log(n) for n in range(case.nodes)), logs(out, cluster)


def check_exact_resume(
    out: Path, case: Case, checkpoint: int, run1: dict[int, list[dict]], job_id: str
) -> None:
    trained: dict[int, list[dict]] = {}  # odbd steps trained into the final model
    for rank in range(WORLD):
        records = records_of(out, rank)
        resumed, done = records[len(run1[rank]) :], records[-1]
        # the steps between the checkpoint and the crash are trained again: same odbd steps
        lost = [(r["epoch"], r["step"]) for r in micro(run1[rank]) if r["update"] > checkpoint]
        again = [(r["epoch"], r["step"]) for r in micro(resumed)[: len(lost)]]
        assert again == lost and bool(lost) == (case.hang_after > 0), (again, lost)
        if not case.daemon_dies:  # a rewind: the same samples in the same steps
            first = [r["ids"] for r in micro(run1[rank]) if r["update"] > checkpoint]
            assert [r["ids"] for r in micro(resumed)[: len(lost)]] == first, rank
        assert micro(resumed)[0]["update"] == checkpoint + 1, resumed[0]
        trained[rank] = [r for r in micro(run1[rank]) if r["update"] <= checkpoint]
        trained[rank] += micro(resumed)
        assert_steps_follow_on(rank, trained[rank])
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
    assert_every_sample_once(trained, case.size)
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


def test_hf_trainer_with_max_steps_resumes_on_the_running_daemons_and_ends_the_job(
    tmp_path: Path,
) -> None:
    """Issue 23: the way most fine-tuning runs end. `max_steps` on an endless (`--epochs 0`)
    job of two daemons, one rank each; a crash two steps past the first checkpoint of epoch 1;
    torchrun again with resume_from_checkpoint=True against the daemons that kept running. The
    lost steps come back with the same samples, the Trainer's linear LR over max_steps goes on
    as if uninterrupted, each rank trains exactly max_steps updates, no sample twice in an
    epoch, and at the cap every rank's end_job() ends the job: torchrun and both daemons exit 0.
    """
    size, max_steps, hang_after = 48, 18, 2
    out = tmp_path / "job"
    out.mkdir()
    args = daemon_args(size=size, accumulate=1, state_dir=tmp_path / "state")
    args[args.index("--epochs") + 1] = "0"  # endless: only the Trainer's cap ends it
    trainer_args = ["--save-steps", "3", "--max-steps", str(max_steps)]
    cluster = LocalCluster(ClusterSpec(nodes=2, ranks_per_node=1, daemon_args=args))
    sockets = [cluster.sockets[cluster.node_of(rank)] for rank in range(WORLD)]
    job = None
    try:
        cluster.start()
        job = start_torchrun(out, sockets, *trainer_args, "--hang-after-checkpoint", "2")
        run1 = crash_past_the_checkpoint(
            job, out, cluster.sockets, SCRIPT, lambda: logs(out, cluster)
        )
        checkpoint = optimizer_steps(run1[0])[-1]["global_step"] - hang_after
        assert checkpoint + hang_after < max_steps, logs(out, cluster)  # the crash comes first
        job = start_torchrun(out, sockets, *trainer_args, "--resume")
        assert job.wait(timeout=scaled(150)) == 0, logs(out, cluster)
        assert cluster.wait(scaled(60)) == [0, 0], logs(out, cluster)
    finally:
        if job is not None and job.poll() is None:
            kill_job(job, out, SCRIPT)
        cluster.stop()
    assert cluster.leftover_segments() == []
    assert all("rewinding" in cluster.log(n) for n in range(2)), logs(out, cluster)
    trained: dict[int, list[dict]] = {}
    for rank in range(WORLD):
        records = records_of(out, rank)
        resumed, done = records[len(run1[rank]) :], records[-1]
        lost = [r for r in micro(run1[rank]) if r["update"] > checkpoint]
        assert len(lost) == hang_after
        again = micro(resumed)[: len(lost)]
        assert [(r["epoch"], r["step"], r["ids"]) for r in again] == [
            (r["epoch"], r["step"], r["ids"]) for r in lost
        ], rank
        trained[rank] = [r for r in micro(run1[rank]) if r["update"] <= checkpoint]
        trained[rank] += micro(resumed)
        assert_steps_follow_on(rank, trained[rank])
        updates = [r for r in optimizer_steps(run1[rank]) if r["global_step"] <= checkpoint]
        updates += optimizer_steps(resumed)
        assert [r["global_step"] for r in updates] == list(range(1, max_steps + 1))
        for record in updates:  # linear over max_steps, resumed as if never interrupted
            expected = LR * (1.0 - (record["global_step"] - 1) / max_steps)
            assert record["lr"] == pytest.approx(expected, rel=1e-9, abs=1e-15), record
        assert done["done"] and done["global_step"] == max_steps == done["max_steps"], done
    epochs = {r["epoch"] for rank in trained for r in trained[rank]}
    for epoch in epochs:  # within an epoch, no sample twice over the ranks
        ids = [i for rank in trained for r in trained[rank] if r["epoch"] == epoch
               for i in r["ids"]]  # fmt: skip
        assert len(ids) == len(set(ids)), (epoch, ids)  # 48 samples: no tail repeats
