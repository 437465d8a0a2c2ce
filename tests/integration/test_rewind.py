"""torchrun --max-restarts against daemons that keep running (issue 23: rewind on a running
daemon), and daemons restarted without --state-dir facing a checkpoint.

Real `torchrun --nproc-per-node 2` (gloo) over two daemons, one rank per node (rewind_train.py:
an all_reduce per step, `client.state_dict()` checkpoints). A rank is SIGKILLed some steps
past the last checkpoint; torchrun stops the other rank and starts both again, and they load
the checkpoint. The daemons are not touched: each rewinds its rank to the checkpoint's step,
makes the samples of the steps since again by id and sends the same steps again.

What must hold: torchrun and both daemons exit 0; every step a run trained again holds the
same samples as the first time; counting each run up to the checkpoint the next one loaded,
every epoch trains every identity once (plus the sampler's tail repeats); both ranks take the
same steps. Neighbours (`make soak`, to keep `make test` near 15 min): the kill at an epoch's
end, twice in a row, a checkpoint in the previous epoch, both ranks killed, under CPU load.

And the refusal: a daemon started again without --state-dir cannot know what the
checkpoint's steps held; it refuses the trainers by name before anything is trained, on two
nodes (and on one: `make soak`), and when only one of two nodes lost its state, that node is
named.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from odbd.demo.cluster import ClusterSpec, LocalCluster, free_ports
from tests.integration.ddp_data import dataset_args
from tests.integration.ddp_launch import DATASET, REPO
from tests.integration.harness import read_jsonl, scaled
from tests.integration.resume_job import stop_launcher

pytestmark = pytest.mark.timeout(300)

WORLD, EPOCHS, SIZE = 2, 2, 96
SCRIPT = "tests.integration.rewind_train"


def daemon_args() -> list[str]:
    args = ["--dataset", f"{DATASET}:make", *dataset_args(size=SIZE, seed=3), "--workers", "1"]
    return args + ["--epochs", str(EPOCHS), "--token-budget", "256", "--buffer", "8",
                   "--shm-size", "32M"]  # fmt: skip


def start_torchrun(out: Path, sockets: list[str], restarts: int, *script_args: str):
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nnodes", "1", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_ports(1)[0]), "--nproc-per-node", str(WORLD)]
    cmd += ["--max-restarts", str(restarts), "-m", SCRIPT, "--out-dir", str(out)]
    cmd += ["--epochs", str(EPOCHS), "--pg-timeout-s", str(scaled(60)), *script_args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "ODBD_SOCKETS": ",".join(sockets),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    log = open(out / "torchrun.log", "ab")  # noqa: SIM115 (closed right after the spawn)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    log.close()
    return proc


def logs(out: Path, cluster: LocalCluster) -> str:
    text = (out / "torchrun.log").read_text(errors="replace") if out.exists() else ""
    daemons = "\n".join(f"--- daemon {n}\n{cluster.log(n)}" for n in range(cluster.spec.nodes))
    return f"--- torchrun\n{text[-6000:]}\n{daemons}"


def runs_of(out: Path, rank: int, tag: str = "") -> list[list[dict]]:
    runs = []
    while (path := out / f"rank{rank}.run{len(runs)}{tag}.jsonl").exists():
        runs.append(read_jsonl(path))
    return runs


def position(state: dict | None) -> tuple[int, int]:
    return (0, 0) if state is None else (state["epoch"], state["step"])


def check_rewound_job(out: Path, num_runs: int) -> None:
    trained: dict[int, list[dict]] = {}
    for rank in range(WORLD):
        runs = runs_of(out, rank)
        assert len(runs) == num_runs, (rank, len(runs))
        assert runs[-1][-1] == {"done": True}, runs[-1][-3:]
        trained[rank] = []
        for n, run in enumerate(runs):
            steps = [r for r in run if "step" in r]
            if n + 1 < len(runs):
                resume = position(runs[n + 1][0]["loaded"])
                again = {(r["epoch"], r["step"]): (r["ids"], r["data"]) for r in steps}
                later = [r for r in runs[n + 1] if "step" in r]
                replayed = [r for r in later if (r["epoch"], r["step"]) in again]
                assert replayed, f"rank {rank} run {n + 1} trained no step again"
                assert [(r["epoch"], r["step"]) for r in later[: len(replayed)]] == [
                    (r["epoch"], r["step"]) for r in replayed
                ], "the steps trained again come first"
                assert position({"epoch": later[0]["epoch"], "step": later[0]["step"]}) == resume
                for r in replayed:  # the same samples in the same steps, the same bytes
                    assert (r["ids"], r["data"]) == again[(r["epoch"], r["step"])], (rank, n, r)
                steps = [r for r in steps if (r["epoch"], r["step"]) < resume]
            trained[rank] += steps
        for epoch in range(EPOCHS):
            numbers = [r["step"] for r in trained[rank] if r["epoch"] == epoch]
            assert numbers == list(range(len(numbers))), (rank, epoch, numbers)
    assert [(r["epoch"], r["step"]) for r in trained[0]] == [
        (r["epoch"], r["step"]) for r in trained[1]
    ]
    for epoch in range(EPOCHS):
        ids = [i for rank in range(WORLD) for r in trained[rank] if r["epoch"] == epoch
               for i in r["ids"]]  # fmt: skip
        counts = Counter(ids)
        tail = WORLD * math.ceil(SIZE / WORLD) - SIZE
        assert set(counts) == set(range(SIZE)), f"epoch {epoch}: identities never trained"
        assert len(ids) == SIZE + tail, f"epoch {epoch}: identities trained twice: {counts}"


CASES = [
    # (checkpoints after (epoch, step), kills [run, rank, epoch, step]; step -1: the epoch's end)
    pytest.param([[0, 2]], [[0, 1, 0, 6]], id="mid-epoch"),
    pytest.param(
        [[0, 4]], [[0, 1, 1, 3]], id="checkpoint-in-the-previous-epoch", marks=pytest.mark.soak
    ),
    pytest.param([[0, 3]], [[0, 1, 0, -1]], id="at-the-epochs-end", marks=pytest.mark.soak),
    pytest.param(
        [[0, 2], [0, 6]], [[0, 1, 0, 4], [1, 0, 0, 8]], id="twice-in-a-row", marks=pytest.mark.soak
    ),
    pytest.param([[0, 2]], [[0, 0, 0, 5], [0, 1, 0, 5]], id="both-ranks", marks=pytest.mark.soak),
]


@pytest.mark.parametrize(("save_at", "kills"), CASES)
def test_torchrun_restarts_resume_from_the_checkpoint_on_the_running_daemons(
    tmp_path: Path, save_at: list, kills: list
) -> None:
    run_rewound_job(tmp_path, save_at, kills)


@pytest.mark.soak
def test_a_rewind_under_cpu_load(tmp_path: Path) -> None:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        run_rewound_job(tmp_path, [[0, 2]], [[0, 1, 0, 6]])
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def run_rewound_job(tmp_path: Path, save_at: list, kills: list) -> None:
    out = tmp_path / "job"
    out.mkdir()
    # keep the last checkpoint's previous epoch in the history even in the smallest case
    spec = ClusterSpec(nodes=WORLD, ranks_per_node=1, daemon_args=daemon_args())
    cluster = LocalCluster(spec)
    restarts = len({kill[0] for kill in kills})
    job = None
    try:
        cluster.start()
        args = ["--save-at", json.dumps(save_at), "--kill", json.dumps(kills)]
        job = start_torchrun(out, cluster.sockets, restarts, *args)
        assert job.wait(timeout=scaled(200)) == 0, logs(out, cluster)
        assert cluster.wait(scaled(60)) == [0, 0], logs(out, cluster)
        for node in range(WORLD):  # the running daemons rewound; nobody restarted them
            assert "rewinding" in cluster.log(node), logs(out, cluster)
            for line in cluster.log(node).splitlines():
                if "rewind" in line:
                    print(f"FAULT node {node}: {line}")  # with -s: when, how many samples
    finally:
        if job is not None:
            stop_launcher(job, out, SCRIPT)
        cluster.stop()
    assert cluster.leftover_segments() == []
    check_rewound_job(out, restarts + 1)


# -- daemons restarted without --state-dir -------------------------------------------------


def first_run_then_daemons_die(
    out: Path, cluster: LocalCluster, nodes_restarted: list[int]
) -> None:
    """Run 1 checkpoints at epoch 0 step 2 and dies at step 5 (no torchrun restart); then the
    given daemons are SIGKILLed and started again with their current flags."""
    args = ["--save-at", "[[0, 2]]", "--kill", "[[0, 1, 0, 5]]"]
    job = start_torchrun(out, cluster.sockets, 0, *args)
    try:
        assert job.wait(timeout=scaled(120)) != 0, logs(out, cluster)
    finally:
        stop_launcher(job, out, SCRIPT)
    assert all((out / f"ckpt{r}.json").exists() for r in range(WORLD)), logs(out, cluster)
    for node in nodes_restarted:
        cluster.processes[node].send_signal(signal.SIGKILL)
        cluster.processes[node].wait()
    for node in nodes_restarted:
        cluster.start_node(node)


def resume_refused(out: Path, cluster: LocalCluster) -> str:
    """The trainers load the checkpoint: the job fails before any step is trained."""
    job = start_torchrun(out, cluster.sockets, 0, "--tag", ".resume")
    try:
        assert job.wait(timeout=scaled(120)) != 0, logs(out, cluster)
    finally:
        stop_launcher(job, out, SCRIPT)
    for rank in range(WORLD):
        for run in runs_of(out, rank, ".resume"):
            assert [r for r in run if "step" in r] == [], f"rank {rank} trained after a refusal"
    return logs(out, cluster)


@pytest.mark.parametrize("nodes", [pytest.param(1, marks=pytest.mark.soak), 2])
def test_a_daemon_restarted_without_state_dir_refuses_a_checkpoint_by_name(
    tmp_path: Path, nodes: int
) -> None:
    out = tmp_path / "job"
    out.mkdir()
    spec = ClusterSpec(nodes=nodes, ranks_per_node=WORLD // nodes, daemon_args=daemon_args())
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        sockets = [cluster.sockets[cluster.node_of(r)] for r in range(WORLD)]
        cluster.sockets = sockets  # one per rank, for the trainers
        first_run_then_daemons_die(out, cluster, list(range(nodes)))
        text = resume_refused(out, cluster)
    finally:
        cluster.stop()
    assert "RankRefusedError" in text, text
    for node in range(nodes):
        assert f"node {node}'s daemon has handed it no step since it started" in text, text
    assert "without --state-dir" in text and "Nothing was trained" in text, text


def test_a_mixed_restart_names_the_node_that_lost_its_state(tmp_path: Path) -> None:
    out = tmp_path / "job"
    out.mkdir()
    state = [["--state-dir", str(tmp_path / f"state{n}")] for n in range(WORLD)]
    spec = ClusterSpec(nodes=WORLD, ranks_per_node=1, daemon_args=daemon_args(),
                       per_node_args=state)  # fmt: skip
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        spec.per_node_args = [state[0], []]  # node 1 comes back without its --state-dir
        first_run_then_daemons_die(out, cluster, [0, 1])
        text = resume_refused(out, cluster)
        cluster.wait(scaled(60))
        text = logs(out, cluster)
    finally:
        cluster.stop()
    assert "node 1's daemon has handed it no step since it started" in text, text
    # node 0 resumed from its journal; the round with node 1 fails naming node 1
    assert "node 1 started afresh, without a --state-dir journal" in text, text
    assert "node 0's daemon" not in text, text
    assert "every trainer must load the state_dict of the same checkpoint" not in text, text


@pytest.mark.soak
def test_a_checkpoint_older_than_rewind_steps_is_refused_naming_the_bound(tmp_path: Path) -> None:
    out = tmp_path / "job"
    out.mkdir()
    spec = ClusterSpec(nodes=WORLD, ranks_per_node=1, daemon_args=[*daemon_args(),
                       "--rewind-steps", "2"])  # fmt: skip
    cluster = LocalCluster(spec)
    job = None
    try:
        cluster.start()
        args = ["--save-at", "[[0, 1]]", "--kill", "[[0, 1, 0, 6]]"]
        job = start_torchrun(out, cluster.sockets, 1, *args)
        assert job.wait(timeout=scaled(200)) != 0, logs(out, cluster)
        text = logs(out, cluster)
    finally:
        if job is not None:
            stop_launcher(job, out, SCRIPT)
        cluster.stop()
    assert "RankRefusedError" in text and "--rewind-steps" in text, text
    assert "it keeps the last 2 steps of each rank" in text, text
    for rank in range(WORLD):
        runs = runs_of(out, rank)
        assert [r for r in runs[1] if "step" in r] == [], "trained after the refusal"


# -- with the job's end (issue 23's features together) ---------------------------------------

END_CASES = [
    # --max-updates 24 over epochs of ~15 steps: the checkpoint in epoch 0, the kill in epoch 1
    pytest.param(["--max-updates", "24"], [[0, 4]], [[0, 1, 1, 3]], [], 24, id="max-updates"),
    # rank 0 calls end_job() at step 8 while rank 1 dies there; both resume at step 3 and call
    # it again at step 8 of run 1 (the first call's point stays recorded on node 0)
    pytest.param(
        ["--end-timeout", "60"],
        [[0, 2]],
        [[0, 1, 0, 8]],
        [[0, 0, 8], [1, 0, 8]],  # [run, epoch, step]: every rank of that run
        9,
        id="end-job-across-the-kill",
        marks=pytest.mark.soak,
    ),  # fmt: skip
]


@pytest.mark.parametrize(("extra", "save_at", "kills", "ends", "steps"), END_CASES)
def test_an_endless_job_rewinds_and_still_ends_after_exactly_its_steps(
    tmp_path: Path, extra: list, save_at: list, kills: list, ends: list, steps: int
) -> None:
    """`--epochs 0` ended by --max-updates or end_job(), with a rank killed and both resumed
    from an older checkpoint on the running daemons: counting the first run up to the
    checkpoint, every rank trains exactly `steps` steps, the steps trained again hold the same
    samples, job_fraction is (k + 1) / N from the checkpoint on, and everything exits 0."""
    out = tmp_path / "job"
    out.mkdir()
    args = daemon_args()
    args[args.index("--epochs") + 1] = "0"
    cluster = LocalCluster(ClusterSpec(nodes=WORLD, ranks_per_node=1,
                                       daemon_args=[*args, *extra]))  # fmt: skip
    job = None
    try:
        cluster.start()
        script = ["--until-job-end", "--save-at", json.dumps(save_at), "--kill", json.dumps(kills),
                  "--end-at", json.dumps(ends)]  # fmt: skip
        job = start_torchrun(out, cluster.sockets, 1, *script)
        assert job.wait(timeout=scaled(200)) == 0, logs(out, cluster)
        assert cluster.wait(scaled(60)) == [0, 0], logs(out, cluster)
        text = logs(out, cluster)
    finally:
        if job is not None:
            stop_launcher(job, out, SCRIPT)
        cluster.stop()
    assert "rewinding" in text and "lost" not in text and "undelivered" not in text, text
    trained = []
    for rank in range(WORLD):
        first, second = runs_of(out, rank)
        resume = position(second[0]["loaded"])
        again = {(r["epoch"], r["step"]): r["data"] for r in first if "step" in r}
        rows = [r for r in first if "step" in r and (r["epoch"], r["step"]) < resume]
        rows += [r for r in second if "step" in r]
        assert second[-1] == {"done": True}
        for r in second:  # the steps trained again: the same bytes as the first time
            if "step" in r and (r["epoch"], r["step"]) in again:
                assert r["data"] == again[(r["epoch"], r["step"])], (rank, r)
        assert len(rows) == steps, (rank, [(r["epoch"], r["step"]) for r in rows])
        if "--max-updates" in extra:
            assert [r["fraction"] for r in rows] == [(k + 1) / steps for k in range(steps)]
        trained.append([(r["epoch"], r["step"]) for r in rows])
    assert trained[0] == trained[1]
