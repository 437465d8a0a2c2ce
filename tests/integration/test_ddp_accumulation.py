"""Optimizer updates over several micro-steps, proven on real DDP gradients (issue 12).

Two daemons x two ranks with `--accumulate 3` or `--tokens-per-update T`; four gloo ranks run
the tiny transformer in float64 without optimizer steps (`ddp_trainer --grads`): each update's
micro-steps run under `no_sync()` except the last, and rank 0 saves the gradient DDP produced
for each update. Recomputed in one process:

- the per-token mean loss over every sample of the update (every rank, every micro-step): the
  accumulated DDP gradient must equal its gradient to float64 precision;
- the naive recipe (per-micro-step per-token means, summed and divided by the update's
  micro-step count, as frameworks that divide by K do), shown to differ.

Every rank must see the same micro-steps per update, updates must tile the epoch, and the
epoch's last update may be short (and must then say so).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.integration.ddp_data import LongTailTokens
from tests.integration.ddp_launch import run_odbd_training
from tests.integration.test_ddp_loss_scaling import (
    MODEL,
    WORLD,
    per_token_mean_gradient,
    relative_error,
)

pytestmark = pytest.mark.timeout(240)

EPOCHS = 2


def run_updates(daemon_args: list[str], data: dict, out_dir: Path) -> tuple[dict, dict]:
    """(epoch, update) -> [per micro-step, per rank record]; (epoch, update) -> DDP gradient."""
    cluster, reports, daemon_codes, rank_codes = run_odbd_training(
        nodes=2,
        ranks_per_node=2,
        data=data,
        daemon_args=["--epochs", str(EPOCHS), *daemon_args],
        trainer_args=["--grads", "--dtype", "float64", "--epochs", str(EPOCHS), *MODEL.to_args()],
        out_dir=out_dir,
        timeout_s=200.0,
    )
    assert rank_codes == [0] * WORLD and daemon_codes == [0, 0], (
        f"{rank_codes} {daemon_codes}\n{cluster.log(0)}\n{cluster.log(1)}"
    )
    updates: dict[tuple[int, int], list[list[dict]]] = defaultdict(list)
    per_rank = [reports.steps(rank) for rank in range(WORLD)]
    assert len({len(steps) for steps in per_rank}) == 1, "ranks ran different step counts"
    for micro in zip(*per_rank, strict=True):
        keys = {(r["epoch"], r["update"]["index"]) for r in micro}
        assert len(keys) == 1, f"ranks disagree on the update of one micro-step: {micro}"
        updates[keys.pop()].append(list(micro))
    grads = {key: torch.load(out_dir / f"grad-e{key[0]}-u{key[1]}.pt") for key in updates}
    return dict(updates), grads


def check_structure(updates: dict) -> list[tuple[int, int]]:
    """Updates tile each epoch, numbered from 0; only an epoch's last may be short."""
    short = []
    for epoch in range(EPOCHS):
        indices = sorted(u for e, u in updates if e == epoch)
        assert indices == list(range(len(indices))) and len(indices) >= 3, indices
        for index in indices:
            micro = updates[(epoch, index)]
            heads = [m[0]["update"] for m in micro]
            assert [h["step"] for h in heads] == list(range(len(micro)))
            assert [h["end"] for h in heads] == [False] * (len(micro) - 1) + [True]
            assert {h["num_steps"] for h in heads} == {len(micro)}
            tokens = sum(r["num_tokens"] for m in micro for r in m)
            samples = sum(len(r["ids"]) for m in micro for r in m)
            assert {h["tokens"] for h in heads} == {tokens}
            assert {h["samples"] for h in heads} == {samples}
            if heads[0]["short"]:
                assert index == indices[-1], f"update {index} of epoch {epoch} is short mid-epoch"
                short.append((epoch, index))
    return short


def naive_gradient(dataset: LongTailTokens, micro: list[list[dict]]) -> torch.Tensor:
    """Each micro-step's per-token mean gradient, summed and divided by the micro-step count."""
    parts = [
        per_token_mean_gradient(dataset, [i for r in ranks for i in r["ids"]])
        for ranks in micro
        if any(r["ids"] for r in ranks)
    ]
    return sum(parts[1:], parts[0]) / len(micro)


def check_gradients(dataset: LongTailTokens, updates: dict, grads: dict) -> int:
    """Every update's DDP gradient is the per-token mean's; returns how often naive differs."""
    differing = 0
    for key, micro in updates.items():
        ids = [i for ranks in micro for r in ranks for i in r["ids"]]
        reference = per_token_mean_gradient(dataset, ids)
        assert relative_error(grads[key], reference) < 1e-9, f"update {key}"
        if len(micro) > 1 and relative_error(naive_gradient(dataset, micro), reference) > 1e-3:
            differing += 1
    return differing


def test_accumulate_3_gives_the_per_token_mean_gradient_of_each_update(tmp_path: Path) -> None:
    data = {"size": 120, "seed": 3, "median_len": 20, "max_len": 160}
    updates, grads = run_updates(
        ["--token-budget", "256", "--buffer", "12", "--accumulate", "3"], data, tmp_path
    )
    short = check_structure(updates)
    for key, micro in updates.items():
        assert len(micro) == 3 or key in short, f"update {key} has {len(micro)} micro-steps"
    assert short, "no epoch ended with a short update; change the data"
    dataset = LongTailTokens(**data)
    ids = sorted(
        i for (e, _), m in updates.items() if e == 0 for s in m for r in s for i in r["ids"]
    )
    assert ids == list(range(data["size"])), "epoch 0 does not cover every identity once"
    assert check_gradients(dataset, updates, grads) > 0, "naive divide-by-K never differed"


def test_tokens_per_update_closes_updates_at_t_tokens_exactly(tmp_path: Path) -> None:
    data = {"size": 480, "seed": 5, "median_len": 20, "max_len": 120}
    target = 2500
    updates, grads = run_updates(
        ["--token-budget", "128", "--buffer", "128", "--tokens-per-update", str(target)],
        data,
        tmp_path,
    )
    short = check_structure(updates)
    full = [
        sum(r["num_tokens"] for m in micro for r in m)
        for key, micro in updates.items()
        if key not in short
    ]
    assert min(full) >= target
    cv = statistics.pstdev(full) / statistics.mean(full)
    print(f"tokens per update: {len(full)} full updates, mean {statistics.mean(full):.0f}, "
          f"cv {cv:.4f}, short {short}")  # fmt: skip
    assert cv < 0.05, f"tokens per update vary by {cv:.1%}: {sorted(full)}"
    steps = {len(m) for m in updates.values()}
    assert len(steps) > 1 or max(steps) > 1, "every update had one micro-step; raise T"
    dataset = LongTailTokens(**data)
    assert check_gradients(dataset, updates, grads) > 0, "naive divide-by-K never differed"
