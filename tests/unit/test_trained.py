"""odbd.daemon.trained: what the trainers took, and at what rate, apart from what was planned."""

from __future__ import annotations

import pytest

from odbd.daemon.trained import (
    DeliveryRate,
    NodeTrained,
    RankTrained,
    StepCounts,
    epochs_trained,
    padding,
    steps_trained,
)
from odbd.serve.rank_queue import QueuedItem, RankQueue


def counts(samples: int = 4, last: bool = False) -> StepCounts:
    return StepCounts(samples, samples * 10, samples * 9, samples * 12, samples * 2, last)


def test_a_rank_counts_delivered_steps_and_the_epoch_it_trained_to_the_end() -> None:
    r = RankTrained()
    r.add(0, 0, counts())
    r.add(0, 1, counts(2, last=True))
    assert (r.steps, r.samples, r.loss_tokens, r.epochs_trained) == (2, 6, 60, 1)
    r.add(1, 0, counts(3))
    assert (r.epoch, r.epoch_steps, r.epoch_global_samples) == (1, 1, 6)
    assert padding(r.real_tokens, r.padded_tokens) == pytest.approx(0.25)
    assert padding(0, 0) == 0.0


def test_the_node_trained_an_epoch_when_its_slowest_rank_did() -> None:
    fast, slow = RankTrained(), RankTrained()
    fast.add(0, 0, counts(last=True))
    assert epochs_trained([fast, slow]) == 0 and steps_trained(0, [fast, slow]) == 0
    slow.add(0, 0, counts(last=True))
    assert epochs_trained([fast, slow]) == 1 and steps_trained(0, [fast, slow]) is None


def test_the_queue_adds_a_steps_counts_only_once_it_is_delivered() -> None:
    q = RankQueue(0)
    q.push([QueuedItem(0, k, b"x", [], counts(last=k == 2)) for k in range(3)])
    assert q.take_ready_steps(8, 8, 1 << 20)
    assert q.trained.steps == 0  # sent, not delivered
    q.deliver(0, 1)
    assert (q.trained.steps, q.trained.samples, q.trained.epochs_trained) == (2, 8, 0)
    q.deliver(0, 2)
    assert q.trained.epochs_trained == 1


def test_the_rate_is_over_the_window_from_the_first_reports_start() -> None:
    rate = DeliveryRate(window_s=10.0)
    rate.record(100.0, 50, 500, took_s=5.0)  # the trainer asked from t=95
    assert rate.rate(100.0).samples_per_s == pytest.approx(10.0)
    rate.record(120.0, 250, 2500)
    # the last 10 s: from 115 (running total 50 then) to 125
    assert rate.rate(125.0).samples_per_s == pytest.approx(200 / 10)
    assert rate.rate(131.0).tokens_per_s == pytest.approx(0.0)  # nothing in the window
    assert DeliveryRate().rate(1.0).samples_per_s == 0.0


def test_the_trained_line_comes_once_per_epoch_every_local_rank_finished() -> None:
    a, b = RankTrained(), RankTrained()
    node = NodeTrained(ranks={0: a, 1: b})
    a.add(0, 0, counts(last=True))
    assert node.on_report(1.0, 0.5) == []
    b.add(0, 0, counts(last=True))
    [line] = node.on_report(2.0, 0.5)
    assert line.startswith("epoch 0 trained: local ranks 0,1 took its last step")
    assert node.on_report(3.0, 0.5) == []


def test_a_step_of_a_later_epoch_means_the_earlier_ones_were_trained() -> None:
    r = RankTrained()
    r.add(0, 3, counts())  # epoch 0's last step carried no epoch_last (join flush: no step)
    r.add(1, 0, counts())
    assert r.epochs_trained == 1


def test_after_a_resume_no_line_for_epochs_trained_before_it() -> None:
    a = RankTrained()
    node = NodeTrained(ranks={0: a})
    a.add(2, 7, counts())  # resumed in epoch 2
    assert node.on_report(1.0, 0.1) == []
    a.add(2, 8, counts(last=True))
    [line] = node.on_report(2.0, 0.1)
    assert line.startswith("epoch 2 trained")


def test_many_reports_a_second_keep_few_points_and_the_same_rate() -> None:
    rate = DeliveryRate(window_s=10.0, resolution_s=0.5)
    for i in range(1, 2001):  # 200 reports a second for 10 s, 1 sample each
        rate.record(i / 200, i, 10 * i, took_s=0.005)
    assert len(rate.times) <= 10 / 0.5 + 3
    assert rate.rate(10.0).samples_per_s == pytest.approx(200, rel=0.06)


def test_a_rewind_puts_the_position_back_and_keeps_the_totals() -> None:
    r = RankTrained()
    for step in range(3):
        r.add(0, step, counts(last=step == 2))
    r.add(1, 0, counts(5))
    r.rewind((0, 2), (0, 1), 16)  # the trainer resumes at epoch 0 step 2
    assert (r.epoch, r.epoch_steps, r.epoch_global_samples, r.epochs_trained) == (0, 2, 16, 0)
    assert (r.last_step, r.steps, r.samples) == ((0, 1), 4, 17)
    r.add(0, 2, counts(last=True))  # sent again: the totals count it again
    assert (r.epoch_steps, r.epochs_trained, r.steps, r.samples) == (3, 1, 5, 21)
    r.rewind((0, 0), None, 0)  # the history reaches no step before the resume point
    assert (r.epoch, r.epoch_steps, r.last_step, r.epochs_trained) == (0, 0, None, 0)
