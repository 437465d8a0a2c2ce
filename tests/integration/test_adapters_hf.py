"""The Hugging Face Trainer and Accelerate adapters on real DDP ranks (issue: real training).

One daemon serves two gloo ranks; each rank trains a tiny Llama built from a config (random
weights, float64, no download) through `odbclient.adapters`. The test checks what an adapter
must do: feed every odbd batch (every identity once, equal steps on every rank, training ends
with the job although `max_steps` is larger), and apply `loss_scale` so that the first step's
DDP gradient is one process's per-token mean gradient over both ranks' samples.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.integration.ddp_data import LongTailTokens  # noqa: E402
from tests.integration.ddp_hf_trainer import flat_grad, tiny_llama  # noqa: E402
from tests.integration.ddp_launch import Reports, launch_ranks, odbd_cluster  # noqa: E402
from tests.integration.ddp_model import pad_collate  # noqa: E402
from tests.integration.harness import scaled  # noqa: E402

pytestmark = pytest.mark.timeout(180)

# label_shift=0: Hugging Face labels (the model shifts); every sample starts with a masked prompt.
DATA = {"size": 40, "seed": 1, "label_shift": 0}
WORLD, MAX_STEPS = 2, 10_000


def launch(
    framework: str,
    out_dir: Path,
    *,
    data: dict = DATA,
    daemon_args: tuple[str, ...] = (),
    trainer_args: tuple[str, ...] = ("--max-steps", str(MAX_STEPS)),
) -> tuple[list[int | None], str]:
    """Runs the ranks to their end: their exit codes and every log (ranks, then the daemon)."""
    cluster = odbd_cluster(
        nodes=1,
        ranks_per_node=WORLD,
        data=data,
        daemon_args=["--token-budget", "256", "--buffer", "8", *daemon_args],
    )
    try:
        cluster.start()
        # No wait for the sockets: ranks import torch meanwhile; ODBClient waits for the daemon.
        ranks = launch_ranks(
            world=WORLD, nproc_per_node=WORLD, out_dir=out_dir, sockets=cluster.sockets,
            module="tests.integration.ddp_hf_trainer",
            trainer_args=["--framework", framework, *trainer_args],
        )  # fmt: skip
        codes = ranks.wait(150.0)
    finally:
        cluster.stop()
    return codes, f"{ranks.logs()}\n{cluster.log(0)}"


def train(
    framework: str,
    out_dir: Path,
    *,
    data: dict = DATA,
    daemon_args: tuple[str, ...] = (),
    trainer_args: tuple[str, ...] = ("--max-steps", str(MAX_STEPS)),
) -> Reports:
    codes, logs = launch(
        framework, out_dir, data=data, daemon_args=daemon_args, trainer_args=trainer_args
    )
    assert codes == [0] * WORLD, f"{codes}\n{logs}"
    for log in out_dir.glob("trainer*.log"):
        assert "not to be a single sample" not in log.read_text(), logs
    return Reports.read(out_dir, WORLD)


def hf_gradient(samples: list[dict], scale: float = 1.0) -> torch.Tensor:
    """One process, HF's own causal-LM loss over `samples`, times `scale`.

    HF computes that loss in float32 (ForCausalLMLoss upcasts the logits with .float(), which
    for a float64 model is a downcast), so gradients agree to float32 precision, not float64.
    Passing num_items_in_batch makes it the sum over tokens / that count: the per-token mean.
    """
    batch = pad_collate(samples)
    model = tiny_llama()
    count = int((batch["labels"][:, 1:] != -100).sum())
    loss = model(**batch, num_items_in_batch=count).loss
    (loss * scale).backward()
    return flat_grad(model)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def aligned_steps(reports: Reports, size: int, epochs: int) -> list[list[dict]]:
    """Every rank's steps, after checking that the ranks took as many steps as the Trainer
    counted and trained every sample once per epoch."""
    steps = [reports.steps(rank) for rank in range(WORLD)]
    n = len(steps[0])
    assert all(len(s) == n for s in steps) and reports.done(0)["global_step"] == n
    for epoch in range(epochs):
        assert Counter(reports.ids(epoch)) == Counter(range(size)), epoch
    return steps


def check_adapter_run(reports: Reports, out_dir: Path) -> None:
    steps = [reports.steps(rank) for rank in range(WORLD)]
    assert len({len(s) for s in steps}) == 1, "ranks took different step counts"
    assert Counter(reports.ids(0)) == Counter(range(DATA["size"])), "identities lost or repeated"
    done = reports.done(0)
    assert done["global_step"] == len(steps[0]) < MAX_STEPS, "did not stop at the job's end"
    dataset = LongTailTokens(**DATA)
    per_rank = [[dataset[i] for i in steps[rank][0]["ids"]] for rank in range(WORLD)]
    ddp = torch.load(out_dir / "grad-first.pt")
    reference = hf_gradient([s for samples in per_rank for s in samples])
    error = relative_error(ddp, reference)
    assert error < 1e-5, f"first step's DDP gradient is off by {error:.2e} (relative)"
    # Without the adapter's loss_scale, DDP would average the ranks' means: visibly different.
    unscaled = sum(hf_gradient(samples, 1 / WORLD) for samples in per_rank if samples)
    assert relative_error(unscaled, reference) > 1e-3, "step 0 cannot tell scaled from unscaled"


def test_hf_trainer_adapter_trains_every_batch_with_exact_loss_scaling(tmp_path: Path) -> None:
    check_adapter_run(train("hf", tmp_path), tmp_path)


def test_accelerate_adapter_trains_every_batch_with_exact_loss_scaling(tmp_path: Path) -> None:
    check_adapter_run(train("accelerate", tmp_path), tmp_path)


@pytest.mark.parametrize(("framework", "model"), [("hf", "gpt2"), ("accelerate", "llama")])
def test_adapters_refuse_packed_batches_into_a_model_that_attends_across_samples(
    tmp_path: Path, framework: str, model: str
) -> None:
    """Issue 27: a tiny random GPT-2 (sdpa) or Llama (eager) with use_cache=True (the configs'
    default; the Trainer's only with TrainingArguments(use_cache=True)) attends across a packed
    row's samples without any error; the adapter probes the model at the first packed batch
    and every rank stops before training, naming the model, its kernel and the fix."""
    codes, logs = launch(
        framework, tmp_path, daemon_args=("--collate", "packed"),
        trainer_args=("--model", model, "--cache", "on"),
    )  # fmt: skip
    assert all(code not in (0, None) for code in codes), f"{codes}\n{logs}"
    kernel = "sdpa" if model == "gpt2" else "eager"
    assert f"PackedAttentionError: model {model} with attention '{kernel}'" in logs, logs
    assert "Nothing was trained. Fix: set model.config.use_cache = False (" in logs, logs
    for rank in range(WORLD):
        records = (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
        assert not [r for r in records if '"step"' in r], "a step trained before the refusal"


@pytest.mark.parametrize(("framework", "model"), [("hf", "llama"), ("accelerate", "gpt2")])
def test_adapters_accept_packed_batches_into_a_model_that_keeps_samples_apart(
    tmp_path: Path, framework: str, model: str
) -> None:
    """The same models with use_cache=False pass the probe and train every sample once."""
    reports = train(
        framework, tmp_path, daemon_args=("--collate", "packed"),
        trainer_args=("--max-steps", str(MAX_STEPS), "--model", model, "--cache", "off"),
    )  # fmt: skip
    assert Counter(reports.ids(0)) == Counter(range(DATA["size"])), "identities lost or repeated"
    logs = "\n".join(p.read_text() for p in tmp_path.glob("trainer*.log"))
    assert "PackedAttentionError" not in logs


@pytest.mark.parametrize("framework", ["hf", "accelerate"])
def test_adapters_report_compute_so_the_auto_cost_model_fits(
    tmp_path: Path, framework: str
) -> None:
    """Issue 27: the adapters time each step's own compute (forward, backward without the
    all-reduce's waits, optimizer) and report it, so `--cost-model auto` fits on HF Trainer
    and Accelerate jobs; without the reports the daemon never logs a fit."""
    data = {**DATA, "size": 64}
    codes, logs = launch(
        framework,
        tmp_path,
        data=data,
        daemon_args=(
            "--cost-model",
            "auto",
            "--cost-warmup",
            "8",
            "--steps-ahead",
            "2",
            "--epochs",
            "2",
        ),
    )
    assert codes == [0] * WORLD, f"{codes}\n{logs}"
    reports = Reports.read(tmp_path, WORLD)
    assert Counter(reports.ids(0)) == Counter(range(64)), "identities lost or repeated"
    fits = re.findall(r"cost model fitted to (\d+) rank-steps: (\S+) s/padded token", logs)
    assert fits, f"no cost model fit: the adapter reported no compute\n{logs[-3000:]}"
    assert int(fits[-1][0]) >= 8 and float(fits[-1][1]) > 0


def test_importing_odbclient_and_its_adapters_package_loads_no_framework() -> None:
    code = (
        "import sys, odbclient, odbclient.adapters; from odbclient import ODBClient; "
        "assert not {'transformers', 'accelerate'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_hf_trainer_follows_odbd_progress_without_max_steps(tmp_path: Path) -> None:
    """No max_steps: the progress bar's total follows odbd's estimate (exact at the end), a
    cosine schedule with warm-up lands on its floor at the job's last step, and training stops
    there without an empty epoch (the Trainer's "not a single sample" warning)."""
    data, lr, epochs = {**DATA, "size": 64}, 1e-3, 2
    reports = train(
        "hf", tmp_path, data=data, daemon_args=("--epochs", str(epochs)),
        trainer_args=("--max-steps", "0", "--lr-schedule", "cosine", "--warmup-steps", "2",
                      "--lr", str(lr)),
    )  # fmt: skip
    steps = aligned_steps(reports, data["size"], epochs)
    n = len(steps[0])
    # Progress is the same on every rank; fractions never decrease; each epoch's last step
    # knows it is the last, with the exact count.
    assert [r["progress"] for r in steps[0]] == [r["progress"] for r in steps[1]]
    progress = [r["progress"] for r in steps[0]]
    for key in ("epoch_sample_fraction", "epoch_token_fraction"):
        for epoch in range(epochs):
            values = [
                p[key] for p, r in zip(progress, steps[0], strict=True) if r["epoch"] == epoch
            ]
            assert values == sorted(values) and values[-1] == 1.0, (key, epoch, values)
    jobs = [p["job_fraction"] for p in progress]
    assert jobs == sorted(jobs) and jobs[-1] == 1.0 and jobs[-2] < 1.0, jobs
    for epoch in range(epochs):
        rows = [(r, p) for r, p in zip(steps[0], progress, strict=True) if r["epoch"] == epoch]
        assert rows[-1][1]["epoch_steps_exact"] and rows[-1][1]["epoch_steps_estimate"] == len(rows)
        # exact from the round that plans the epoch's last step on (a suffix), never wrong
        exact = [p["epoch_steps_exact"] for _, p in rows]
        assert exact == sorted(exact), rows
        assert all(
            p["epoch_steps_estimate"] == len(rows) for _, p in rows if p["epoch_steps_exact"]
        )
    assert steps[0][-1]["max_steps"] == n, "the progress bar's total is not the run's length"
    # Warm-up (HF's convention: step 0 at LR 0), then cosine to 0 over the job fraction.
    lrs = [r["lr"] for r in steps[0]]
    assert lrs[0] == 0.0 and abs(lrs[1] - lr / 2) < 1e-12, lrs[:3]
    near_floor = [i for i, v in enumerate(lrs) if i >= 2 and v <= 0.01 * lr]
    assert near_floor and near_floor[0] >= 0.95 * (n - 1), (n, lrs)
    assert lrs[-1] <= 0.01 * lr, lrs


def test_hf_trainer_max_steps_ends_an_endless_job_and_logs_true_rates(tmp_path: Path) -> None:
    """max_steps on a running endless job (--epochs 0): exactly max_steps steps on every rank,
    the schedule at its floor on the last, the daemon exits 0 (every rank called end_job()),
    and the logs carry odbd's epoch and throughput (issue 23: the Trainer raised its cap at
    every step and ran 170+ steps at LR 0; it logged 3.2e11 samples/s and epoch 9.1e-13)."""
    cap, lr = 6, 1e-3
    cluster = odbd_cluster(
        nodes=1, ranks_per_node=WORLD, data=DATA,
        daemon_args=["--token-budget", "256", "--buffer", "8", "--epochs", "0"],
    )  # fmt: skip
    try:
        cluster.start()
        ranks = launch_ranks(
            world=WORLD, nproc_per_node=WORLD, out_dir=tmp_path, sockets=cluster.sockets,
            module="tests.integration.ddp_hf_trainer",
            trainer_args=["--framework", "hf", "--max-steps", str(cap), "--lr-schedule",
                          "cosine", "--lr", str(lr)],
        )  # fmt: skip
        codes = ranks.wait(150.0)
        assert codes == [0] * WORLD, f"{codes}\n{ranks.logs()}\n{cluster.log(0)}"
        assert cluster.wait(scaled(15)) == [0], cluster.log(0)
    finally:
        cluster.stop()
    reports = Reports.read(tmp_path, WORLD)
    for rank in range(WORLD):
        steps, done = reports.steps(rank), reports.done(rank)
        assert len(steps) == cap and done["global_step"] == cap, (len(steps), done)
        # Step k runs at the schedule of the k steps done before it (HF's convention).
        cosine = [lr * 0.5 * (1 + math.cos(math.pi * k / cap)) for k in range(cap)]
        assert [r["lr"] for r in steps] == pytest.approx(cosine, rel=1e-9), steps
        assert {r["max_steps"] for r in steps} == {cap}
        final = done["final_log"]
        samples = sum(len(r["ids"]) for k in range(WORLD) for r in reports.steps(k))
        assert final["train_samples_per_second"] == pytest.approx(
            samples / final["train_runtime"], rel=0.01, abs=0.01
        ), final
        epochs = done["logged_epochs"]
        assert epochs == sorted(epochs) and 0.01 < epochs[0] < epochs[-1] < 1 + cap, epochs
        last = steps[-1]
        assert epochs[-1] >= last["epoch"] and epochs[-1] <= last["epoch"] + 1, (epochs, last)


@pytest.mark.soak  # make soak: ~30 s of DDP ranks; the plain loop's end_job is in make test
def test_accelerate_loop_ends_an_endless_job_at_its_own_update_cap(tmp_path: Path) -> None:
    """The Accelerate example's own cap with --accumulate 2 on an endless job: end_job() after
    the 3rd update on every rank, 6 micro-steps each, and the daemon exits 0."""
    cluster = odbd_cluster(
        nodes=1, ranks_per_node=WORLD, data=DATA,
        daemon_args=["--token-budget", "256", "--buffer", "8", "--epochs", "0",
                     "--accumulate", "2"],
    )  # fmt: skip
    try:
        cluster.start()
        ranks = launch_ranks(
            world=WORLD, nproc_per_node=WORLD, out_dir=tmp_path, sockets=cluster.sockets,
            module="tests.integration.ddp_hf_trainer",
            trainer_args=["--framework", "accelerate", "--max-steps", "3"],
        )  # fmt: skip
        codes = ranks.wait(150.0)
        assert codes == [0] * WORLD, f"{codes}\n{ranks.logs()}\n{cluster.log(0)}"
        assert cluster.wait(scaled(15)) == [0], cluster.log(0)
        log = cluster.log(0)
    finally:
        cluster.stop()
    assert "every rank called end_job()" in log and "lost" not in log, log
    reports = Reports.read(tmp_path, WORLD)
    for rank in range(WORLD):
        steps = reports.steps(rank)
        assert reports.done(rank)["global_step"] == 3 and len(steps) == 6, steps
        assert [r["update"]["end"] for r in steps] == [False, True] * 3


def test_hf_trainer_evaluates_an_eval_dataset_between_odbd_steps(tmp_path: Path) -> None:
    """eval_strategy="steps" with an eval_dataset: the Trainer's own eval batches (no loss
    scale) go through ODBTrainer.compute_loss between odbd's steps (found by hand: KeyError
    'odb_loss_scale' at the first evaluation killed every rank)."""
    data, epochs = {**DATA, "size": 48}, 2
    reports = train(
        "hf", tmp_path, data=data, daemon_args=("--epochs", str(epochs)),
        trainer_args=("--max-steps", "0", "--eval-steps", "3"),
    )  # fmt: skip
    steps = aligned_steps(reports, data["size"], epochs)
    n = len(steps[0])
    losses = reports.done(0)["eval_losses"]
    # every 3 steps, and once more at the end when the job does not end on a multiple of 3
    assert n // 3 <= len(losses) <= n // 3 + 1, (n, losses)
    assert all(math.isfinite(v) for v in losses), losses
    assert reports.done(1)["eval_losses"] == losses  # the Trainer gathers eval over ranks


def micro_steps_and_updates(reports: Reports) -> tuple[list[list[dict]], dict]:
    """Per rank, every micro-step's record; rank 0's records by (epoch, update index)."""
    micro = [[r for r in reports.steps(rank) if r.get("micro") or r["update"]["end"]]
             for rank in range(WORLD)]  # fmt: skip
    updates: dict[tuple[int, int], list[dict]] = {}
    for record in micro[0]:
        updates.setdefault((record["epoch"], record["update"]["index"]), []).append(record)
    return micro, updates


def first_update_samples(micro: list[list[dict]], data: dict) -> list[dict]:
    dataset = LongTailTokens(**data)
    return [
        dataset[i]
        for rank in range(WORLD)
        for r in micro[rank]
        if (r["epoch"], r["update"]["index"]) == (0, 0)
        for i in r["ids"]
    ]


def test_accelerate_adapter_accumulates_an_odbd_update_under_no_sync(tmp_path: Path) -> None:
    """odbd --accumulate 3 with the Accelerate loop (`odb.sync`, step on update_end): one
    optimizer step per update, and the first update's gradient is the per-token mean's."""
    reports = train("accelerate", tmp_path, daemon_args=("--accumulate", "3"))
    micro, updates = micro_steps_and_updates(reports)
    assert len({len(m) for m in micro}) == 1, "ranks took different micro-step counts"
    assert sorted(i for m in micro for r in m for i in r["ids"]) == list(range(DATA["size"]))
    assert all(len(r) == 3 or r[0]["update"]["short"] for r in updates.values()), updates
    assert reports.done(0)["global_step"] == len(updates)
    ddp = torch.load(tmp_path / "grad-first.pt")
    error = relative_error(ddp, hf_gradient(first_update_samples(micro, DATA)))
    assert error < 1e-5, f"first update's DDP gradient is off by {error:.2e} (relative)"


def test_hf_trainer_with_gradient_accumulation_4_steps_once_per_odbd_update(
    tmp_path: Path,
) -> None:
    """gradient_accumulation_steps=4 with odbd --accumulate 4: every Trainer optimizer step is
    one odbd update of 4 micro-steps (the epoch's last may be shorter and is padded with
    zero-scaled fillers); the first update's DDP gradient is one process's per-token mean over
    all of its samples, and the logs carry tokens per update."""
    data = {**DATA, "size": 64}
    reports = train(
        "hf", tmp_path, data=data, daemon_args=("--accumulate", "4", "--epochs", "2"),
        trainer_args=("--max-steps", "0", "--grad-accum", "4"),
    )  # fmt: skip
    micro = [[r for r in reports.steps(rank) if r.get("micro")] for rank in range(WORLD)]
    assert len({len(m) for m in micro}) == 1, "ranks took different micro-step counts"
    for epoch in range(2):
        ids = sorted(i for m in micro for r in m if r["epoch"] == epoch for i in r["ids"])
        assert ids == list(range(data["size"])), f"epoch {epoch}: identities lost or repeated"
    updates: dict[tuple[int, int], list[dict]] = {}
    for record in micro[0]:
        updates.setdefault((record["epoch"], record["update"]["index"]), []).append(record)
    for (epoch, index), records in updates.items():
        short = records[0]["update"]["short"]
        assert len(records) == 4 or short, (epoch, index, len(records))
        assert [r["update"]["end"] for r in records][-1]
    shorts = [key for key, records in updates.items() if records[0]["update"]["short"]]
    assert shorts, "no epoch ended with a short update (the fillers' path); change the data"
    optimizer_steps = [r for r in reports.steps(0) if not r.get("micro")]
    assert [(r["epoch"], r["update"]["index"]) for r in optimizer_steps] == list(updates)
    assert reports.done(0)["global_step"] == len(updates), "one optimizer step per odbd update"
    first = [
        LongTailTokens(**data)[i]
        for rank in range(WORLD)
        for r in micro[rank]
        if (r["epoch"], r["update"]["index"]) == (0, 0)
        for i in r["ids"]
    ]
    ddp = torch.load(tmp_path / "grad-first.pt")
    error = relative_error(ddp, hf_gradient(first))
    assert error < 1e-5, f"first update's DDP gradient is off by {error:.2e} (relative)"
    logs = "".join(p.read_text() for p in tmp_path.glob("trainer*.log"))
    assert "'tokens_per_update'" in logs, logs[-2000:]
