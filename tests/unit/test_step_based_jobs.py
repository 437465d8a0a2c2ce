"""Issue 23, item 1, as pure decisions: --max-updates progress, what end_job() points decide,
a rank queue cut at its end point, the offer that carries the points, the flags, and the
schedule's clock by tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest

from odbd import cli
from odbd.daemon import offer_codec
from odbd.daemon.end_requests import EndOutcome, end_decision, missing_failure
from odbd.daemon.locations import Location
from odbd.errors import ConfigError
from odbd.planner.progress import JobShape, StepFacts, capped_job_progress, step_progress
from odbd.serve.rank_queue import QueuedItem, RankQueue
from tests.unit.test_rank_queue import job_end, keys, marker, send_all


def test_capped_progress_without_accumulation_is_exact_from_the_first_step() -> None:
    fractions, steps = capped_job_progress(12, 0, 0, [True] * 5, [1.0] * 5)
    assert fractions == [(k + 1) / 12 for k in range(5)] and steps == [12] * 5
    fractions, steps = capped_job_progress(12, 9, 9, [True] * 3, [1.0] * 3)
    assert fractions == [10 / 12, 11 / 12, 1.0] and steps == [12, 12, 12]


def test_capped_progress_with_windows_counts_updates_and_their_micro_steps() -> None:
    # --accumulate 2, --max-updates 2: micro-steps at 1/4, 2/4, 3/4 and 1.0 of the job.
    fractions, steps = capped_job_progress(2, 0, 0, [False, True, False, True], [0.5, 1, 0.5, 1])
    assert fractions == [0.25, 0.5, 0.75, 1.0] and steps == [4, 4, 4, 4]


def test_end_decision_waits_ends_or_fails_naming_the_ranks() -> None:
    world = range(4)
    assert end_decision(world, {}).outcome is EndOutcome.NONE
    waiting = end_decision(world, {0: (1, 5), 1: (1, 5)})
    assert waiting.outcome is EndOutcome.WAIT and waiting.point == (1, 5)
    done = end_decision(world, dict.fromkeys(world, (1, 5)))
    assert done.outcome is EndOutcome.END and done.point == (1, 5)
    assert done.reason == "every rank called end_job() at epoch 1 step 5"
    split = end_decision(world, {0: (1, 5), 1: (1, 5), 2: (1, 6)})
    assert split.outcome is EndOutcome.FAIL
    assert "(ranks 0, 1 at epoch 1 step 5; rank 2 at epoch 1 step 6)" in split.reason


def test_missing_ranks_are_named_with_their_nodes() -> None:
    nodes = {r: r // 2 for r in range(4)}
    message = missing_failure(range(4), {0: (0, 3), 1: (0, 3)}, 60.0, nodes)
    assert message.startswith(
        "ranks 2, 3 (node 1) did not call ODBClient.end_job() within --end-timeout 60 s of "
        "ranks 0, 1 calling it at epoch 0 step 3"
    )
    one_node = missing_failure(range(2), {0: (0, 3)}, 2.0, {0: 0, 1: 0})
    assert one_node.startswith("rank 1 did not call ODBClient.end_job() within")


def _step(epoch: int, index: int) -> QueuedItem:
    return QueuedItem(epoch, index, event=f"s{epoch}/{index}", locations=[Location(0, index, 8)])


def test_a_rank_queue_drops_what_lies_past_its_end_point_but_keeps_the_job_end() -> None:
    queue = RankQueue(rank=0)
    queue.push([_step(0, 0), _step(0, 1), marker(0), _step(1, 0), _step(1, 1)])
    sent = send_all(queue)
    assert keys(sent) == [(0, 0), (0, 1), (0, -1), (1, 0), (1, 1)]
    queue.deliver(1, 0)  # the trainer took epoch 1 step 0, then called end_job() before step 1
    freed = queue.end_at(1, 1)
    assert [loc.offset for loc in freed] == [1] and queue.queued_steps() == 0
    later = queue.push([_step(1, 2), marker(1), job_end(1)])
    assert [loc.offset for loc in later] == [2], "steps planned past the end are freed at once"
    assert [i.job_end is not None for i in send_all(queue)] == [True]
    queue.attached = True
    queue.attached = False
    assert queue.took_job_end


def test_an_end_point_at_an_epoch_start_keeps_the_previous_epoch_end() -> None:
    queue = RankQueue(rank=0)
    queue.push([_step(0, 0), marker(0), _step(1, 0)])
    queue.end_at(1, 0)
    assert keys(send_all(queue)) == [(0, 0), (0, -1)]


def test_the_offer_carries_end_points_and_stays_as_before_without_them() -> None:
    plain = offer_codec.NodeOffer(node=1, epoch=2, units=(), rejected={})
    ended = offer_codec.NodeOffer(node=1, epoch=2, units=(), rejected={}, ended=((2, 3, 4),))
    assert b"ended" not in offer_codec.encode(plain)
    assert offer_codec.decode(offer_codec.encode(ended)).ended == ((2, 3, 4),)
    assert offer_codec.decode(offer_codec.encode(plain)).ended == ()


def _config(argv: list[str], environ: dict[str, str] | None = None):
    environ = environ or {}
    parser = cli.daemon_parser()
    cli.apply_environment(parser, environ)
    argv = ["--world", "1", "--nproc-per-node", "1", "--dataset-size", "8", *argv]
    args = parser.parse_args(argv)
    cli.default_epochs_for_max_updates(args, argv, environ)
    return cli.config_from_args(args, environ)


def test_max_updates_runs_endless_epochs_unless_epochs_is_given() -> None:
    config = _config(["--max-updates", "12"])
    assert (config.max_updates, config.epochs) == (12, 0)
    assert config.fingerprint(8)["max_updates"] == "12"
    assert "max_updates" not in _config([]).fingerprint(8)
    with pytest.raises(ConfigError, match="--max-updates 12 ends the job by updates"):
        _config(["--max-updates", "12", "--epochs", "3"])
    with pytest.raises(ConfigError, match="--max-updates 12 ends the job by updates"):
        _config(["--max-updates", "12"], {"ODBD_EPOCHS": "2"})
    assert _config(["--max-updates", "12", "--epochs", "0"]).epochs == 0


def test_odbd_version_prints_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("odbd ") and out.split()[1][0].isdigit()


def test_the_job_fraction_follows_tokens_not_one_steps_sample_count() -> None:
    """A step of 50 short samples moves the sample fraction by 5 points, five normal steps'
    worth; the job's fraction (tokens) moves by about one step's tokens (issue 23: an LR
    driven by the sample fraction dropped 27 % in one step)."""
    job = JobShape(dataset_size=1000, epochs=1)

    def at(step: int, consumed: int, tokens: int) -> tuple[float, float]:
        facts = StepFacts(0, step, consumed, consumed, tokens, False, 0, mean_tokens=100.0)
        p = step_progress(job, facts)
        return p.epoch_sample_fraction, p.job_fraction

    sample_before, job_before = at(9, 100, 10_000)  # ten steps of 10 samples x 100 tokens
    sample_after, job_after = at(10, 150, 10_500)  # then 50 samples of 10 tokens
    assert sample_after - sample_before == pytest.approx(0.05)
    normal_step = at(10, 110, 11_000)[1] - job_before
    assert 0 < job_after - job_before < 1.1 * normal_step
    assert job_before == pytest.approx(10_000 / (10_000 + 900 * 100))


def test_without_a_mean_the_token_fraction_is_as_before() -> None:
    facts = StepFacts(0, 0, 50, 10, 80, False, 0)
    p = step_progress(JobShape(dataset_size=100, epochs=1), facts)
    assert math.isclose(p.epoch_token_fraction, 10 / 60)
    assert p.job_fraction == p.epoch_token_fraction
    assert np.isfinite(p.job_fraction)


def test_a_higher_mean_in_a_later_round_never_takes_the_fraction_back() -> None:
    job = JobShape(dataset_size=1000, epochs=1)
    before = step_progress(job, StepFacts(0, 9, 100, 100, 10_000, False, 0, mean_tokens=100.0))
    after = step_progress(
        job,
        StepFacts(0, 10, 110, 110, 11_000, False, 0, mean_tokens=150.0,
                  token_floor=before.epoch_token_fraction),
    )  # fmt: skip
    assert after.epoch_token_fraction == before.epoch_token_fraction
    assert after.job_fraction == before.job_fraction
