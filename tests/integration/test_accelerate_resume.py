"""`accelerator.load_state()` after a crash between two `save_state()` checkpoints of an
Accelerate loop fed by `ODBAccelerate` (exact resume with Accelerate's own checkpoints).

Real `accelerate launch --multi_gpu --num_processes 2` (gloo CPU ranks, `Accelerator(cpu=True)`)
on one daemon with `--state-dir`, a tiny Llama, `save_state()` every few optimizer steps with
automatic checkpoint naming; without accumulation, and with `--accumulate 2`. Run 1 trains a
step or two past its first checkpoint of epoch 1, and every process of the job is SIGKILLed.
Then the ranks restart with `load_state()` while the daemon keeps running (issue 23: it
rewinds, making the samples of the steps after the checkpoint again by id): they continue at
the step after the checkpoint with the checkpoint's weights and get the same samples in the
same steps as run 1 did, every sample of both epochs is trained exactly once counting run 1 up
to the checkpoint, the run ends at the job's end, every process exits 0 and no shared memory
is left. (A daemon that dies too restarts from --state-dir: test_hf_resume.py.)
"""

from __future__ import annotations

import json
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
)

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
SCRIPT = "tests.integration.accelerate_resume_train"


@dataclass(frozen=True)
class Case:
    accumulate: int  # odbd --accumulate: micro-steps per optimizer step
    size: int  # samples per epoch
    save_every: int  # optimizer steps per checkpoint
    hang_after: int  # optimizer steps trained past the checkpoint before the crash


CASES = [
    pytest.param(Case(accumulate=1, size=48, save_every=3, hang_after=2), id="no-accumulation"),
    # The adapter's update-boundary checkpoints with --accumulate 2: `make soak`, to keep
    # `make test` near 15 min (the daemon side runs in test_ddp_resume.py's accumulate test).
    pytest.param(
        Case(accumulate=2, size=96, save_every=2, hang_after=1),
        id="accumulate-2",
        marks=pytest.mark.soak,
    ),
]


def start_job(out: Path, socket: str, *script_args: str) -> subprocess.Popen[bytes]:
    # A free port per launch: gloo's store is new, and no other job's 29500 is taken.
    cmd = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", str(WORLD),
           "--num_machines", "1", "--main_process_ip", "127.0.0.1",
           "--main_process_port", str(free_ports(1)[0]), "--mixed_precision", "no",
           "--dynamo_backend", "no", "-m", SCRIPT, "--out-dir", str(out), *script_args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "ODBD_SOCKET": socket, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # accelerate launch sets what it starts
    log = open(out / "launch.log", "ab")  # noqa: SIM115 (closed right after the spawn)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    log.close()
    return proc


def logs(out: Path, cluster: LocalCluster) -> str:
    text = (out / "launch.log").read_text(errors="replace") if out.exists() else ""
    return f"--- accelerate launch\n{text[-6000:]}\n--- daemon\n{cluster.log(0)}"


@pytest.mark.skipif(not os.path.exists(ACCELERATE), reason="accelerate's launcher not installed")
@pytest.mark.parametrize("case", CASES)
def test_accelerate_load_state_resumes_exactly_after_a_crash(tmp_path: Path, case: Case) -> None:
    out = tmp_path / "job"
    out.mkdir()
    state_dir = tmp_path / "state"
    args = daemon_args(size=case.size, accumulate=case.accumulate, state_dir=state_dir)
    script_args = ["--save-every", str(case.save_every)]
    cluster = LocalCluster(ClusterSpec(nodes=1, ranks_per_node=WORLD, daemon_args=args))
    socket = cluster.sockets[0]
    job = None
    try:
        cluster.start()
        # Run 1: a crash a step or two after the first checkpoint of epoch 1.
        job = start_job(out, socket, *script_args, "--hang-after-checkpoint", str(case.hang_after))
        run1 = crash_past_the_checkpoint(job, out, socket, SCRIPT, lambda: logs(out, cluster))
        saved = [r for r in run1[0] if "saved" in r][-1]
        assert (out / "acc" / "checkpoints" / f"checkpoint_{saved['saved']}").is_dir()

        # The ranks restart from the checkpoint; the running daemon rewinds for them.
        job = start_job(out, socket, *script_args, "--resume")
        assert job.wait(timeout=scaled(150)) == 0, logs(out, cluster)
        assert cluster.wait(scaled(60)) == [0], logs(out, cluster)
    finally:
        if job is not None and job.poll() is None:
            kill_job(job, out, SCRIPT)
        cluster.stop()
    assert cluster.leftover_segments() == []  # the killed daemon's too
    check_exact_resume(out, case, saved, run1)


def check_exact_resume(out: Path, case: Case, saved: dict, run1: dict[int, list[dict]]) -> None:
    checkpoint = saved["updates"]  # optimizer steps in the checkpoint
    trained: dict[int, list[dict]] = {}  # odbd steps trained into the final model
    for rank in range(WORLD):
        records = records_of(out, rank)
        resumed, done = records[len(run1[rank]) :], records[-1]
        loaded = resumed[0]
        # the checkpoint's weights, optimizer-step count and epoch came back
        assert loaded["loaded"] == saved["saved"] and loaded["updates"] == checkpoint, loaded
        assert loaded["weights"] == saved["weights"] and loaded["epoch"] == 1, (loaded, saved)
        # the steps between the checkpoint and the crash are trained again: same odbd steps
        lost = [(r["epoch"], r["step"]) for r in micro(run1[rank]) if r["update"] > checkpoint]
        again = [(r["epoch"], r["step"]) for r in micro(resumed)[: len(lost)]]
        assert again == lost and lost, (again, lost)
        first = [r["ids"] for r in micro(run1[rank]) if r["update"] > checkpoint]
        assert [r["ids"] for r in micro(resumed)[: len(lost)]] == first, "other samples"
        assert micro(resumed)[0]["update"] == checkpoint + 1, resumed[:2]
        trained[rank] = [r for r in micro(run1[rank]) if r["update"] <= checkpoint]
        trained[rank] += micro(resumed)
        assert_steps_follow_on(rank, trained[rank])
        updates = sorted({r["update"] for r in trained[rank]})
        assert updates == list(range(1, len(updates) + 1)) and done["updates"] == updates[-1]
        # saves after the resume continue Accelerate's numbering (checkpoint_N+1, ...)
        later = [r["saved"] for r in resumed if "saved" in r]
        assert later == list(range(saved["saved"] + 1, saved["saved"] + 1 + len(later))), later
    assert_every_sample_once(trained, case.size)
    # every checkpoint left by the rotation (total_limit=2) holds every rank's state
    checkpoints = sorted((out / "acc" / "checkpoints").glob("checkpoint_*"))
    assert 1 <= len(checkpoints) <= 2, checkpoints
    for path in checkpoints:
        for rank in range(WORLD):
            state = json.loads((path / f"odbd_client_rank{rank}.json").read_text())
            assert (state["rank"], state["world_size"]) == (rank, WORLD), state
