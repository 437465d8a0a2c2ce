"""--cost-model auto on real DDP (issue 14 part 3): the learned model is the same on every daemon.

Two daemons x one gloo rank train the tiny transformer with `ddp_trainer --timed`: every rank
times its own forward/backward plus explicit O(sum l^2) work (`--quadratic-dim`) and reports
it with `ODBClient.report_compute`. Each daemon logs every refit with the coefficients' repr
(exact floats): the logs must list the same fits, at the same rounds, on both daemons, or their
plans would differ. The fit must also be sane: a > 0, a clearly quadratic b, and a median error
a fit can reach with the timing noise of this shared machine. Speed is the benchmark's business
(tests/bench/test_bench_cost_model.py); this test only checks correctness.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.ddp_launch import run_odbd_training
from tests.integration.test_ddp_loss_scaling import MODEL

pytestmark = pytest.mark.timeout(300)

DATA = {"size": 1200, "seed": 3, "median_len": 48, "max_len": 512, "sigma": 1.0}
FIT = re.compile(
    r"round (\d+): cost model fitted to (\d+) rank-steps: (\S+) s/padded token, (\S+) s/l\^2, "
    r"(\S+) s/step, median error ([\d.]+)% \(fixed model ([\d.]+)%\)"
)


def fits_in(log: str) -> list[tuple[str, ...]]:
    return [m.groups() for m in FIT.finditer(log)]


def test_auto_cost_model_is_fitted_identically_on_every_daemon(tmp_path: Path) -> None:
    cluster, reports, daemon_codes, rank_codes = run_odbd_training(
        nodes=2,
        ranks_per_node=1,
        data=DATA,
        daemon_args=["--epochs", "1", "--token-budget", "1024", "--buffer", "32",
                     "--cost-model", "auto", "--steps-ahead", "8"],
        trainer_args=["--timed", "--quadratic-dim", "256", "--epochs", "1", *MODEL.to_args()],
        out_dir=tmp_path,
        timeout_s=240.0,
    )  # fmt: skip
    logs = [cluster.log(0), cluster.log(1)]
    assert rank_codes == [0, 0] and daemon_codes == [0, 0], f"{rank_codes} {daemon_codes}\n{logs}"
    steps = [reports.steps(rank) for rank in range(2)]
    assert len(steps[0]) == len(steps[1]) > 0
    assert all(r["compute_s"] > 0 for s in steps for r in s)
    fits = [fits_in(log) for log in logs]
    assert fits[0], f"no fit logged: warm-up never ended?\n{logs[0][-3000:]}"
    assert fits[0] == fits[1], "the daemons fitted different cost models"
    _, observations, a, b, c, error, _ = fits[0][-1]
    assert int(observations) >= 64
    assert float(a) > 0 and float(b) > 0 and float(c) >= 0
    # 256-wide scores per sample: the quadratic term outweighs the linear one past a few
    # hundred tokens; the fixed default (b/a = 1.2e-5) would have it at 83 000.
    assert float(a) / float(b) < 5000
    assert float(error) < 50.0
