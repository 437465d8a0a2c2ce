"""--align updates on real DDP gradients (issue 26): ranks aligned at optimizer updates.

One daemon x two gloo ranks, and two daemons x one rank (the split planner's third exchange,
daemon/split_updates.py), `--accumulate 3 --align updates`, the tiny transformer in float64
without optimizer steps (`ddp_trainer --grads`). Each rank runs its own micro-steps of an
update (the client drops the slots it skips), `no_sync()` on all but its last, where DDP
all-reduces once; rank 0 saves the gradient DDP produced for each update. Recomputed in one
process, the per-token mean loss over every sample of the update (both ranks, every
micro-step) must have the same gradient to float64 precision. The ranks must run different
micro-step counts in some updates, and the same updates (indices, per epoch), and each
epoch must train every identity once.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.integration.ddp_data import LongTailTokens
from tests.integration.ddp_launch import run_odbd_training
from tests.integration.test_ddp_loss_scaling import MODEL, per_token_mean_gradient, relative_error

pytestmark = pytest.mark.timeout(240)

EPOCHS = 2
WORLD = 2
# Small buffers and a long tail: the planner's rounds leave a unit short of groups, which
# --align steps splits into more micro-steps and --align updates deals unevenly instead.
DATA = {"size": 80, "seed": 3, "median_len": 20, "max_len": 160}
DAEMON = ["--token-budget", "256", "--buffer", "8", "--accumulate", "3", "--align", "updates"]


@pytest.mark.parametrize(
    ("nodes", "world", "extra"),
    [
        (1, WORLD, ()),
        # 2 daemons x 2 ranks: the split planner's third exchange (daemon/split_updates.py);
        # each node deals its own groups, the hub's grid gives every update the length of the
        # busiest rank of either node
        (2, 4, ()),
        # and with cross-node moves first (four exchanges a round, migration_live.py)
        (2, 4, ("--migrate", "auto")),
    ],
)
def test_ranks_run_their_own_micro_steps_and_updates_keep_the_per_token_mean(
    tmp_path: Path, nodes: int, world: int, extra: tuple[str, ...]
) -> None:
    cluster, reports, daemon_codes, rank_codes = run_odbd_training(
        nodes=nodes,
        ranks_per_node=world // nodes,
        data=DATA,
        daemon_args=["--epochs", str(EPOCHS), *DAEMON, *extra],
        trainer_args=["--grads", "--dtype", "float64", "--epochs", str(EPOCHS), *MODEL.to_args()],
        out_dir=tmp_path,
        timeout_s=200.0,
    )
    logs = "\n".join(cluster.log(n) for n in range(nodes))
    assert rank_codes == [0] * world and daemon_codes == [0] * nodes, f"{rank_codes}\n{logs}"
    # (epoch, update) -> rank -> its micro-steps' records, in order
    updates: dict[tuple[int, int], dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for rank in range(world):
        for record in reports.steps(rank):
            updates[(record["epoch"], record["update"]["index"])][rank].append(record)
    uneven = 0
    for key, per_rank in updates.items():
        assert sorted(per_rank) == list(range(world)), f"update {key}: not every rank ran it"
        counts = []
        for rank, micro in per_rank.items():
            heads = [m["update"] for m in micro]
            # a rank's own micro-steps: numbered from 0, update_end on its last only
            assert [h["step"] for h in heads] == list(range(len(micro))), (key, rank, heads)
            assert [h["end"] for h in heads] == [False] * (len(micro) - 1) + [True]
            assert {h["num_steps"] for h in heads} == {len(micro)}
            counts.append(len(micro))
        uneven += len(set(counts)) > 1
        # one step grid on every node: the update starts at the same step on every rank
        starts = {micro[0]["step"] for micro in per_rank.values()}
        assert len(starts) == 1, f"update {key} starts at steps {starts} on different ranks"
        tokens = sum(r["num_tokens"] for micro in per_rank.values() for r in micro)
        assert {m["update"]["tokens"] for micro in per_rank.values() for m in micro} == {tokens}
    for epoch in range(EPOCHS):
        indices = sorted(u for e, u in updates if e == epoch)
        assert indices == list(range(len(indices))) and len(indices) >= 3, indices
        ids = sorted(reports.ids(epoch))
        assert ids == list(range(DATA["size"])), f"epoch {epoch} does not cover every identity"
    assert uneven > 0, "no update had ranks with different micro-step counts; change the data"

    dataset = LongTailTokens(**DATA)
    worst = 0.0
    for key, per_rank in updates.items():
        ids = [i for micro in per_rank.values() for r in micro for i in r["ids"]]
        grad = torch.load(tmp_path / f"grad-e{key[0]}-u{key[1]}.pt")
        error = relative_error(grad, per_token_mean_gradient(dataset, ids))
        worst = max(worst, error)
        assert error < 1e-9, f"update {key}: relative error {error:.3g}"
    print(f"--align updates, {nodes} node(s): {len(updates)} updates, {uneven} with uneven "
          f"micro-steps per rank, "
          f"worst relative gradient error {worst:.3g}")  # fmt: skip


def test_a_restart_resumes_every_rank_after_the_same_update(tmp_path: Path) -> None:
    """1 daemon x 2 ranks (DATA, where ranks run different micro-step counts), --align
    updates: every rank checkpoints after its own last micro-step of update 1 of epoch 1
    (possibly at different steps), yet all resume at the same step, with update 2, and
    epoch 1 trains every identity once across both runs."""
    from collections import Counter

    from tests.integration.test_ddp_resume import cluster_job_id, run_phase

    job_id = cluster_job_id()
    flags = ("--accumulate", "3", "--align", "updates")
    phase = {"nodes": 1, "data": DATA}
    first, _ = run_phase(tmp_path, job_id, ["--stop-after-update", "1:1"], flags, **phase)
    before = {rank: len(first.steps(rank)) for rank in range(WORLD)}
    for rank in range(WORLD):
        last = first.steps(rank)[-1]
        assert (last["epoch"], last["update"]["index"], last["update"]["end"]) == (1, 1, True)
    stopped = [first.steps(rank)[-1]["step"] for rank in range(WORLD)]
    second, logs = run_phase(tmp_path, job_id, ["--resume"], flags, **phase)
    heads = set()
    for rank in range(WORLD):
        resumed = second.steps(rank)[before[rank] :]
        assert resumed, f"rank {rank} trained nothing after the restart\n{logs}"
        head = resumed[0]
        assert (head["epoch"], head["update"]["index"], head["update"]["step"]) == (1, 2, 0)
        heads.add(head["step"])
        indices = [r["update"]["index"] for r in second.steps(rank, 1)]
        assert indices == sorted(indices) and set(indices) == set(range(indices[-1] + 1))
    assert len(heads) == 1, f"ranks resumed at different steps {heads}"
    print(f"ranks ended update 1 of epoch 1 at steps {stopped}, all resumed at {heads}")
    assert Counter(second.ids(1)) == Counter(range(DATA["size"])), "epoch 1 twice or never"
