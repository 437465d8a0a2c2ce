"""`odbd status` text: one screen of facts, with producers waiting for lane space called out."""

from __future__ import annotations

from odbclient.wire.odbd.v1 import admin_pb2
from odbd.status import render


def reply(**fields: object) -> admin_pb2.StatusReply:
    base: dict[str, object] = dict(
        job_id="j", node_rank=0, num_nodes=2, epoch=1, round=7, dataset_size=100,
        epoch_emitted_samples=25, buffered_samples=12, leased_samples=30, producers=2,
        shm_used_bytes=3 << 20, shm_capacity_bytes=64 << 20, phase="running",
        ranks=[admin_pb2.RankStatus(rank=0, attached=True, queued_steps=3, delivered_steps=9,
                                    wait_s=1.0, compute_s=99.0)],
    )  # fmt: skip
    base.update(fields)
    return admin_pb2.StatusReply(**base)  # type: ignore[arg-type]


def test_status_shows_the_node_quota_and_ranks() -> None:
    text = render(reply())
    assert "node 0/2" in text and "quota 25/100 (25.0%)" in text
    assert "producers 2  shm 3.0/64.0 MiB" in text  # nobody waiting: no remark
    assert "99.0%" in text  # rank 0's overlap


def test_status_names_producers_waiting_for_lane_space() -> None:
    assert "producers 2 (1 waiting for lane space)  shm" in render(reply(producers_lane_full=1))


def test_status_says_what_the_next_round_waits_for_and_the_last_error() -> None:
    text = render(reply(waiting_for="its producers filled 0 of 8 samples", last_error="boom"))
    assert "next round waits because its producers filled 0 of 8 samples" in text
    assert text.endswith("last error: boom")
    assert "waits for" not in render(reply())


def test_status_shows_the_cost_model_in_use_and_its_fit() -> None:
    warm = admin_pb2.CostModelStatus(
        mode="auto", state="warmup", a=1.0, b=1.2e-5, c=1800.0, observations=40
    )
    text = render(reply(cost_model=warm))
    assert "cost model auto: fixed a=1 b=1.2e-05 c=1800" in text
    assert "fit warmup over 40 rank-steps" in text and "s/token" not in text
    fitted = admin_pb2.CostModelStatus(
        mode="auto", state="fitted", learned=True, a=1.0, b=2e-3, c=1500.0, a_seconds=2e-6,
        b_seconds=4e-9, c_seconds=3e-3, fit_error=0.031, fixed_error=0.25, observations=512,
    )  # fmt: skip
    text = render(reply(cost_model=fitted))
    assert "cost model auto: learned a=1 b=0.002 c=1500" in text
    assert "2e-06 s/token, 4e-09 s/token², 3 ms/step, error 3.1% (fixed model 25.0%)" in text


def test_status_separates_planned_from_trained_with_throughput_and_padding() -> None:
    rank = admin_pb2.RankStatus(
        rank=0, attached=True, queued_steps=40, delivered_steps=28, wait_s=1.0, compute_s=99.0,
        delivered_samples=700, delivered_loss_tokens=70000, delivered_real_tokens=75000,
        delivered_padded_tokens=100000, trained_epoch=0, trained_epoch_steps=28,
    )  # fmt: skip
    text = render(
        reply(
            ranks=[rank], phase="draining", planned_epoch=1, planned_epoch_steps=31,
            planned_epoch_steps_exact=True, planned_epoch_steps_so_far=31, planned_steps=62,
            trained_epoch=0, trained_epoch_steps=28, trained_epoch_planned_steps=31,
            trained_epoch_samples=1400, trained_samples_per_s=12.5, trained_tokens_per_s=1250,
            rate_window_s=30,
        )
    )  # fmt: skip
    assert "phase draining (every step planned; trainers still to take 40)" in text
    assert "planned  epoch 1 step 31 of 31  steps 62" in text
    assert "trained  epoch 0 step 28 of 31  samples 1400 (every rank)" in text
    assert "node 12.5 samples/s  1250 tokens/s (last 30 s)" in text
    assert "delivered  padding 25.0%  overlap 99.0%  queued 40 steps" in text


def test_status_before_any_delivery_says_nothing_was_trained() -> None:
    idle = admin_pb2.RankStatus(rank=0, attached=False, queued_steps=9)
    text = render(reply(ranks=[idle], planned_epoch_steps=13, planned_epoch_steps_so_far=9))
    assert "planned  epoch 0 step 9 of ~13" in text
    assert "trained  nothing yet" in text


def test_status_shows_samples_moved_between_nodes_with_migrate_auto() -> None:
    text = render(
        reply(migrate=True, migrated_out_samples=12, migrated_out_bytes=3 << 20,
              migrated_in_samples=2, migrated_in_bytes=1 << 19, migration_rounds_dealt=4,
              migration_rounds_balanced=3, migration_rounds_none=1)
    )  # fmt: skip
    assert "moved    out 12 samples (3.0 MiB)  in 2 samples (0.5 MiB)  (--migrate auto)" in text
    assert "rounds   4 dealt, 3 balanced, 1 moved nothing (the hub's moves decisions)" in text
    off = render(reply())
    assert "moved" not in off and "dealt" not in off  # --migrate off: no lines
