"""DDP training end to end on padding-free packed batches (issue 13, `--collate packed`).

Two daemons x two ranks with `--collate packed`; four gloo ranks run the tiny transformer in
float64 without optimizer steps (`ddp_trainer --grads --packed`): each rank's batch is one row
of its samples with position_ids restarting per sample and a block-diagonal causal mask built
from cu_seq_lens_q; labels are Hugging Face's (the model shifts, odbd's -100 separator sits at
each sample's first token). Recomputed in one process, sample by sample (no packing at all):

- every sample is trained once per epoch, on every rank the same number of steps;
- padding is exactly 0: each rank's row holds exactly its samples' tokens, and a group of
  several samples holds at most --token-budget tokens;
- the daemon's token counts are the loss terms of the samples, and the gradient DDP produced
  at every step equals the per-token mean gradient over the step's samples (exact loss scales).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.ddp_data import LongTailTokens
from tests.integration.ddp_launch import run_odbd_training
from tests.integration.ddp_model import ModelConfig, build_model, flat_grad, token_loss_sum
from tests.integration.harness import describe, run_cluster

DDP_DATA = Path(__file__).resolve().parent / "ddp_data.py"

pytestmark = pytest.mark.timeout(150)

# label_shift=0: HF labels (labels = input_ids with the prompt masked, labels[0] = -100)
DATA = {"size": 56, "seed": 6, "median_len": 24, "max_len": 200, "label_shift": 0}
BUDGET = 256
WORLD = 4
MODEL = ModelConfig()


def shifted_loss_sum(model: torch.nn.Module, sample: dict) -> torch.Tensor:
    """One sample alone: position t predicts labels[t + 1] (HF's shift)."""
    ids = torch.from_numpy(sample["input_ids"])[None]
    labels = torch.from_numpy(sample["labels"])
    return token_loss_sum(model, ids[:, :-1], labels[None, 1:])


def per_token_mean_gradient(dataset: LongTailTokens, ids: list[int]) -> torch.Tensor:
    model = build_model(MODEL, seed=0, dtype=torch.float64)
    count = sum(int((dataset[i]["labels"][1:] != -100).sum()) for i in ids)
    total = sum(shifted_loss_sum(model, dataset[i]) for i in ids)
    (total / count).backward()  # type: ignore[union-attr]
    return flat_grad(model)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_packed_ddp_trains_every_sample_once_without_padding_at_exact_scales(
    tmp_path: Path,
) -> None:
    cluster, reports, daemon_codes, rank_codes = run_odbd_training(
        nodes=2,
        ranks_per_node=2,
        data=DATA,
        daemon_args=["--token-budget", str(BUDGET), "--buffer", "8", "--collate", "packed"],
        trainer_args=["--grads", "--packed", "--dtype", "float64", *MODEL.to_args()],
        out_dir=tmp_path,
    )
    assert rank_codes == [0] * WORLD and daemon_codes == [0, 0], (
        f"{rank_codes} {daemon_codes}\n{cluster.log(0)}\n{cluster.log(1)}"
    )
    dataset = LongTailTokens(**DATA)
    per_rank = [reports.steps(rank) for rank in range(WORLD)]
    assert len({len(steps) for steps in per_rank}) == 1, "ranks ran different step counts"
    assert sorted(reports.ids(0)) == list(range(DATA["size"])), "not every sample once"
    grouped = 0
    for ranks in zip(*per_rank, strict=True):
        key = (ranks[0]["epoch"], ranks[0]["step"])
        for r in ranks:
            tokens = sum(int(dataset.lengths[i]) for i in r["ids"])
            if not r["idle"]:
                assert r["padded"] == tokens, f"rank row of step {key} is not padding-free"
            if len(r["ids"]) > 1:
                grouped += 1
                assert tokens <= BUDGET, f"packed group over the budget at step {key}"
            # HF labels: the loss terms are labels[1:] != -100, which odbd counts exactly
            # because labels[0] is a masked prompt token.
            loss_terms = sum(int((dataset[i]["labels"][1:] != -100).sum()) for i in r["ids"])
            assert r["num_tokens"] == loss_terms
        assert {r["global_num_tokens"] for r in ranks} == {sum(r["num_tokens"] for r in ranks)}
        reference = per_token_mean_gradient(dataset, [i for r in ranks for i in r["ids"]])
        grad = torch.load(tmp_path / f"grad-e{key[0]}-s{key[1]}.pt")
        assert relative_error(grad, reference) < 1e-9, f"step {key}"
    assert grouped > 0, "no rank-step packed several samples; change the data"
    # The epoch's flush leaves ranks without samples: their one-token fillers ran forward and
    # backward through the same mask code (loss_scale 0), and the gradients above still match.
    assert any(r["idle"] for ranks in per_rank for r in ranks), "no idle filler; change the data"


def test_a_transformers_llama_takes_packed_odbd_batches_as_they_are() -> None:
    """The batches of a real daemon (--collate packed), given to LlamaForCausalLM as they are,
    give the per-token losses and gradients of the same samples run one by one (float64)."""
    data = {**DATA, "size": 40}
    flags = [f"{k}={v}" for k, v in data.items()]
    result = run_cluster(
        nodes=1,
        ranks_per_node=1,
        daemon_args=[
            "--dataset",
            f"{DDP_DATA}:make",
            "--workers",
            "1",
            *[a for f in flags for a in ("--dataset-arg", f)],
            "--token-budget",
            str(BUDGET),
            "--buffer",
            "16",
            "--collate",
            "packed",
        ],  # fmt: skip
        trainer_args={0: [f"--data-arg={f}" for f in flags]},
        trainer_module="tests.integration.hf_packed_trainer",
    )
    assert result.trainer_codes == [0] and result.daemon_codes == [0], describe(result)
    steps = [r for r in result.steps(0) if not r["idle"]]
    assert sorted(i for r in steps for i in r["ids"]) == list(range(data["size"]))
    assert any(len(r["ids"]) > 1 for r in steps)
    for r in steps:
        assert r["shape"][0] == 1  # one packed row
        assert r["loss_error"] < 1e-9 and r["grad_error"] < 1e-9, r
    assert max(r["ignored_loss_error"] for r in steps if len(r["ids"]) > 1) > 1e-3
