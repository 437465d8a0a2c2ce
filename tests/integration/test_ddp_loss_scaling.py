"""Exact loss scaling, proven on real DDP gradients (DESIGN.md 3.4; issue: real training).

Two daemons x two ranks serve a long-tailed dataset; four gloo ranks run the tiny transformer
in float64 without optimizer steps (`--grads`), so every step's gradient is taken at the
initial weights and rank 0 saves what DDP produced. This test recomputes, in one process:

- the per-token mean loss over all of the step's samples (every rank's batch together): with
  `--loss-scaling exact` DDP's gradient must equal its gradient to float64 precision;
- DDP's own arithmetic, (1/W) * sum_r loss_scale_r * grad(mean_r), which every mode must match,
  so `sample` and `none` are shown to differ from the per-token mean for the right reason
  (different token counts per rank), not through noise.

Token counts are the samples' loss-bearing tokens (labels != -100; ddp_data pre-shifts the
labels and masks a prompt), which is the paper's t_r.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.ddp_data import LongTailTokens
from tests.integration.ddp_launch import run_odbd_training
from tests.integration.ddp_model import (
    ModelConfig,
    build_model,
    flat_grad,
    pad_collate,
    token_loss_sum,
)

pytestmark = pytest.mark.timeout(150)

DATA = {"size": 48, "seed": 3, "median_len": 20, "max_len": 160}
WORLD = 4
MODEL = ModelConfig()


def ddp_gradients(mode: str, out_dir: Path) -> tuple[dict, dict[tuple[int, int], torch.Tensor]]:
    """Runs the job; (reports, (epoch, step) -> the gradient DDP produced)."""
    cluster, reports, daemon_codes, rank_codes = run_odbd_training(
        nodes=2,
        ranks_per_node=2,
        data=DATA,
        daemon_args=["--token-budget", "256", "--buffer", "8", "--loss-scaling", mode],
        trainer_args=["--grads", "--dtype", "float64", *MODEL.to_args()],
        out_dir=out_dir,
    )
    assert rank_codes == [0] * WORLD and daemon_codes == [0, 0], (
        f"{rank_codes} {daemon_codes}\n{cluster.log(0)}\n{cluster.log(1)}"
    )
    steps = {
        (r["epoch"], r["step"]): [reports.steps(rank)[i] for rank in range(WORLD)]
        for i, r in enumerate(reports.steps(0))
    }
    grads = {key: torch.load(out_dir / f"grad-e{key[0]}-s{key[1]}.pt") for key in steps}
    return steps, grads


def gradient_of(loss_fn: object) -> torch.Tensor:
    model = build_model(MODEL, seed=0, dtype=torch.float64)
    loss_fn(model).backward()  # type: ignore[operator]
    return flat_grad(model)


def per_token_mean_gradient(dataset: LongTailTokens, ids: list[int]) -> torch.Tensor:
    """One process, every sample of the step: sum of token losses / number of loss tokens."""
    batch = pad_collate([dataset[i] for i in ids])
    count = int((batch["labels"] != -100).sum())
    return gradient_of(lambda m: token_loss_sum(m, batch["input_ids"], batch["labels"]) / count)


def ddp_arithmetic_gradient(dataset: LongTailTokens, ranks: list[dict]) -> torch.Tensor:
    """(1/W) * sum_r loss_scale_r * grad(mean loss of rank r's own batch)."""
    total = None
    for record in ranks:
        if record["idle"]:
            continue  # loss_scale 0: an idle filler adds an exact zero
        batch = pad_collate([dataset[i] for i in record["ids"]])
        count = int((batch["labels"] != -100).sum())
        scale = record["loss_scale"] / len(ranks)
        grad = gradient_of(
            lambda m, b=batch, c=count, s=scale: (
                s * token_loss_sum(m, b["input_ids"], b["labels"]) / c
            )
        )
        total = grad if total is None else total + grad
    assert total is not None
    return total


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def assert_token_counts(dataset: LongTailTokens, ranks: list[dict]) -> None:
    """The daemon's t_r are the loss-bearing tokens (labels != -100) of the samples it sent."""
    for record in ranks:
        assert record["num_tokens"] == sum(dataset.loss_tokens(i) for i in record["ids"])
    assert {r["global_num_tokens"] for r in ranks} == {sum(r["num_tokens"] for r in ranks)}


def test_exact_loss_scaling_gives_the_single_process_per_token_gradient(tmp_path: Path) -> None:
    dataset = LongTailTokens(**DATA)
    steps, grads = ddp_gradients("exact", tmp_path)
    assert sorted(i for ranks in steps.values() for r in ranks for i in r["ids"]) == list(
        range(DATA["size"])
    )
    for key, ranks in steps.items():
        assert_token_counts(dataset, ranks)
        reference = per_token_mean_gradient(dataset, [i for r in ranks for i in r["ids"]])
        assert relative_error(grads[key], reference) < 1e-10, f"step {key}"


# `none` under soak for make test's length: the same arithmetic check with another weighing.
@pytest.mark.parametrize("mode", ["sample", pytest.param("none", marks=pytest.mark.soak)])
def test_sample_and_none_scaling_differ_when_token_counts_differ(mode: str, tmp_path: Path) -> None:
    dataset = LongTailTokens(**DATA)
    steps, grads = ddp_gradients(mode, tmp_path)
    differing = 0
    for key, ranks in steps.items():
        assert_token_counts(dataset, ranks)
        # DDP did exactly what the mode's loss_scale says...
        assert relative_error(grads[key], ddp_arithmetic_gradient(dataset, ranks)) < 1e-10
        if mode == "sample":
            total = sum(len(r["ids"]) for r in ranks)
            assert [r["loss_scale"] for r in ranks] == pytest.approx(
                [WORLD * len(r["ids"]) / total for r in ranks]
            )
        # ...which is not the per-token mean when the ranks' token counts differ: `sample`
        # weighs a rank by its samples (equal only if tokens per sample match), `none` weighs
        # every rank alike (equal only if every rank holds the same number of tokens).
        real = [r for r in ranks if not r["idle"]]
        if mode == "sample":
            differ = len({r["num_tokens"] / len(r["ids"]) for r in real}) > 1
        else:
            differ = len({r["num_tokens"] for r in ranks}) > 1
        reference = per_token_mean_gradient(dataset, [i for r in real for i in r["ids"]])
        if differ:
            assert relative_error(grads[key], reference) > 1e-3, f"step {key} {ranks}"
            differing += 1
    assert differing > 0, "no step had ranks with different token counts; change DATA"
