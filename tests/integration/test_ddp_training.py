"""torch DDP end to end through odbd, and a convergence sanity check (issue: real training).

Two daemons (one per "node") serve the long-tailed token dataset; four gloo ranks, launched the
way torchrun launches them, train the tiny causal transformer for three epochs from ODBClient.
The same model and data trained with a plain DataLoader + DistributedSampler at a fixed batch
size is the convergence reference.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.integration.ddp_launch import Reports, data_flags, launch_ranks, run_odbd_training
from tests.integration.ddp_model import ModelConfig

pytestmark = pytest.mark.timeout(240)

DATA = {"size": 256, "seed": 0}
EPOCHS = 3
WORLD = 4
# Same optimizer, learning rate, epochs, initial weights and held-out set for both runs. The
# token budget is not tuned to the result: it is the one whose mean batch (~5 samples per rank)
# is closest to the reference's fixed batch of 4, so both take a similar number of steps.
TOKEN_BUDGET, FIXED_BATCH = 256, 4
COMMON = ["--epochs", str(EPOCHS), "--eval-size", "64", "--lr", "3e-3", *ModelConfig().to_args()]


@pytest.fixture(scope="module")
def odbd_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Reports, object]:
    cluster, reports, daemon_codes, rank_codes = run_odbd_training(
        nodes=2,
        ranks_per_node=2,
        data=DATA,
        daemon_args=["--token-budget", str(TOKEN_BUDGET), "--buffer", "32"]
        + ["--epochs", str(EPOCHS)],
        trainer_args=COMMON,
        out_dir=tmp_path_factory.mktemp("odbd"),
    )
    assert daemon_codes == [0, 0] and rank_codes == [0] * WORLD, (
        f"daemons {daemon_codes}, ranks {rank_codes}\n{cluster.log(0)}\n{cluster.log(1)}"
    )
    return reports, cluster


def test_ddp_two_nodes_two_ranks_train_every_sample_once_per_epoch(odbd_run) -> None:
    reports, cluster = odbd_run
    assert cluster.leftover_segments() == [], "shared memory left behind"
    for epoch in range(EPOCHS):
        per_rank = [reports.steps(rank, epoch) for rank in range(WORLD)]
        assert len({len(steps) for steps in per_rank}) == 1, "ranks took different step counts"
        assert all([r["step"] for r in steps] == list(range(len(steps))) for steps in per_rank)
        # 256 samples over 4 ranks: no DistributedSampler tail padding, so exactly once each.
        assert Counter(reports.ids(epoch)) == Counter(range(DATA["size"]))
        for steps in per_rank:
            for record in steps:
                assert record["loss"] == record["loss"], "NaN loss"  # fillers included
                if record["idle"]:
                    assert record["loss_scale"] == 0 and record["ids"] == []
                else:
                    # Budget (DESIGN 3.5): only a sample longer than L may exceed it, alone.
                    assert record["padded"] <= TOKEN_BUDGET or len(record["ids"]) == 1
    # Exact scaling: the loss scales of a step average to 1 over the ranks.
    for index, record in enumerate(reports.steps(0)):
        scales = [reports.steps(rank)[index]["loss_scale"] for rank in range(WORLD)]
        assert sum(scales) / WORLD == pytest.approx(1.0), (index, scales, record)


def test_odbd_and_a_fixed_batch_dataloader_reach_comparable_loss(odbd_run, tmp_path: Path):
    reports, _ = odbd_run
    ranks = launch_ranks(
        world=WORLD,
        nproc_per_node=2,
        trainer_args=["--loader", "fixed", "--batch-size", str(FIXED_BATCH), *COMMON]
        + data_flags(DATA),
        out_dir=tmp_path,
    )
    assert ranks.wait(180.0) == [0] * WORLD, ranks.logs()
    fixed = Reports.read(tmp_path, WORLD).done(0)
    odbd = reports.done(0)
    start = fixed["eval_start"]
    assert odbd["eval_start"] == pytest.approx(start)  # same weights, same held-out samples
    fixed_gain, odbd_gain = start - fixed["eval_end"], start - odbd["eval_end"]
    print(f"held-out loss {start:.3f} -> fixed batch {fixed['eval_end']:.3f}, odbd "
          f"{odbd['eval_end']:.3f}")  # fmt: skip
    # Loose on purpose: both learn (>= 15 % of the start), and odbd's improvement is at least
    # three quarters of the fixed batch's (measured here: within ~5 %, either side).
    assert fixed_gain > 0.15 * start
    assert odbd_gain > 0.75 * fixed_gain
