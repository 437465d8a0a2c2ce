"""`odbd status` and the logs in trained terms: a trainer with a slow step (it holds step K
until the test lets it go) sees the planner far ahead of it, and status says both, with the
trained throughput; the "epoch trained" lines come when the trainer took the epoch's end.

No wall-clock assumption: the slow step lasts until the test has read the status, and the
only timed number asserted (samples/s) is asserted positive."""

from __future__ import annotations

import json
import re
import threading

import pytest

from odbclient import ODBClient
from odbd import status
from odbd.demo.cluster import ClusterSpec, LocalCluster
from tests.integration.harness import admin_status, poll_until, synthetic_args

pytestmark = pytest.mark.timeout(180)

SIZE, EPOCHS, HOLD_AT = 120, 2, 5


def test_status_during_a_slow_step_separates_planned_from_trained(capsys) -> None:
    spec = ClusterSpec(
        nodes=1,
        ranks_per_node=1,
        daemon_args=[*synthetic_args(SIZE), "--buffer", "8", "--shm-size", "64M",
                     "--epochs", str(EPOCHS)],
    )  # fmt: skip
    release = threading.Event()
    seen: list[tuple[int, int, int, int]] = []  # (epoch, step, num_samples, global samples)
    errors: list[BaseException] = []

    def train(socket: str) -> None:
        try:
            with ODBClient(rank=0, socket=socket, deadline_s=120) as client:
                while not client.job_ended:
                    for batch in client:
                        seen.append(
                            (batch.epoch, batch.step, batch.num_samples, batch.global_num_samples)
                        )
                        if len(seen) == HOLD_AT:
                            release.wait(120)  # the slow step
        except BaseException as error:  # reported by the test thread
            errors.append(error)

    with LocalCluster(spec) as cluster:
        cluster.wait_sockets()
        socket = cluster.sockets[0]
        trainer = threading.Thread(target=train, args=(socket,))
        trainer.start()
        try:

            def held() -> bool:
                rank = admin_status(socket).ranks[0]
                return rank.delivered_steps == HOLD_AT and rank.queued_steps > 0

            poll_until(held, f"the trainer delivered {HOLD_AT} steps and more are planned")
            assert status.main(["--socket", socket, "--json"]) == 0
            reply = json.loads(capsys.readouterr().out)
            assert status.main(["--socket", socket]) == 0
            text = capsys.readouterr().out
        finally:
            release.set()
            trainer.join(timeout=150)
        assert not errors and not trainer.is_alive(), (errors, cluster.log(0))
        assert cluster.wait(30) == [0], cluster.log(0)
        log = cluster.log(0)

    rank = reply["ranks"][0]
    held = seen[:HOLD_AT]
    # Trained: exactly what the trainer took, where it is, at a positive rate.
    assert rank["delivered_steps"] == HOLD_AT
    assert rank["delivered_samples"] == sum(n for _, _, n, _ in held)
    assert (reply["trained_epoch"], reply["trained_epoch_steps"]) == (0, HOLD_AT)
    assert reply["trained_epoch_samples"] == sum(g for _, _, _, g in held)
    assert reply["trained_samples_per_s"] > 0 and reply["trained_tokens_per_s"] > 0
    assert reply["epochs_trained"] == 0
    assert 0 <= 1 - rank["delivered_real_tokens"] / rank["delivered_padded_tokens"] < 1
    # Planned: ahead of it by the queue, and status says both.
    assert reply["planned_steps"] >= HOLD_AT + rank["queued_steps"] > HOLD_AT
    assert reply["planned_epoch_steps_so_far"] > HOLD_AT or reply["planned_epoch"] > 0
    assert f"trained  epoch 0 step {HOLD_AT}" in text, text
    assert "samples/s" in text and "tokens/s" in text and "padding" in text, text
    # (planning goes on between the two calls: the text's planned position may be further)
    assert re.search(r"^planned  epoch \d+ step \d+ of ~?\d+  steps \d+", text, re.M), text
    # Logs: each epoch planned first, trained once the trainer took its last step.
    for epoch in range(EPOCHS):
        planned = log.index(f"epoch {epoch} planned: ")
        trained = log.index(f"epoch {epoch} trained: ")
        assert planned < trained, log
    steps = [s for e, s, _, _ in seen if e == 0]
    assert "epoch 0 trained: " in log and len(steps) == max(steps) + 1


def test_status_after_a_rewind_puts_the_trained_position_back_and_counts_deliveries() -> None:
    """A trainer in epoch 1 resumes from its epoch 0 step 3 checkpoint on the running daemon
    (a rewind): status's trained position goes back with the model (it said epoch 1 and 1
    epoch trained while the trainer trained epoch 0 again), and the delivered totals count
    the steps sent again, as delivered_steps always did (they disagreed: the samples and
    tokens of the steps sent again were not counted, so samples/s missed the trainer's work)."""
    spec = ClusterSpec(
        nodes=1,
        ranks_per_node=1,
        daemon_args=[*synthetic_args(60), "--buffer", "8", "--shm-size", "64M", "--epochs", "2"],
    )

    def batches(client: ODBClient):
        while not client.job_ended:
            yield from client

    with LocalCluster(spec) as cluster:
        cluster.wait_sockets()
        socket = cluster.sockets[0]
        first: list[tuple[int, int, int, int]] = []  # (epoch, step, samples, global samples)
        with ODBClient(rank=0, socket=socket, deadline_s=60, prefetch=1) as client:
            for batch in batches(client):  # a batch is delivered once handed to the trainer
                first.append((batch.epoch, batch.step, batch.num_samples,
                              batch.global_num_samples))  # fmt: skip
                if (batch.epoch, batch.step) == (0, 2):
                    checkpoint = client.state_dict()
                if batch.epoch == 1 and batch.step == 2:
                    break
            before = admin_status(socket)
        assert (before.trained_epoch, before.epochs_trained) == (1, 1), before
        with ODBClient(rank=0, socket=socket, deadline_s=60, prefetch=1) as client:
            client.load_state_dict(checkpoint)  # epoch 0 step 3: a rewind
            again = batches(client)
            taken = [next(again), next(again)]
            after = admin_status(socket)
            assert [(b.epoch, b.step) for b in taken] == [(0, 3), (0, 4)]
            for _ in again:
                pass
        assert cluster.wait(30) == [0], cluster.log(0)
        assert "rewinding" in cluster.log(0), cluster.log(0)

    assert (after.trained_epoch, after.trained_epoch_steps, after.epochs_trained) == (0, 5, 0)
    assert after.trained_epoch_samples == sum(g for e, s, _, g in first if e == 0 and s < 5)
    rank, earlier = after.ranks[0], before.ranks[0]
    assert rank.delivered_steps == earlier.delivered_steps + 2 == len(first) + 2
    assert rank.delivered_samples == earlier.delivered_samples + sum(b.num_samples for b in taken)
    assert earlier.delivered_samples == sum(n for _, _, n, _ in first)
