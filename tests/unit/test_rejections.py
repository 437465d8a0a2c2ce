"""Rejections for operators: the verdict on an epoch that trained nothing, the rate-limited log."""

from __future__ import annotations

from odbclient.wire.odbd.v1 import ingest_pb2
from odbd.daemon.round_loop import wait_reason
from odbd.ingest.rejections import (
    REJECT_FIXES,
    RejectionLog,
    empty_epoch_failure,
    samples_made,
)
from odbd.ingest.service import size_refusal
from odbd.ingest.supervisor import deaths_without_progress
from odbd.metrics.collector import KNOWN_REJECT_REASONS


def test_every_known_reason_has_a_fix() -> None:
    assert set(REJECT_FIXES) == set(KNOWN_REJECT_REASONS)


def test_an_all_rejected_epoch_names_counts_the_first_detail_and_the_fix() -> None:
    message = empty_epoch_failure(
        0,
        {"missing_length_key": 180, "not_a_dict": 20},
        {"missing_length_key": "sample 3: no 'tokens' key", "not_a_dict": "sample 5: tuple"},
    )
    assert message == (
        "epoch 0 trained nothing: all 200 samples were rejected (missing_length_key: 180, "
        "not_a_dict: 20); first missing_length_key: sample 3: no 'tokens' key. Fix: "
        + REJECT_FIXES["missing_length_key"]
    )


def test_an_epoch_with_nothing_trained_and_nothing_rejected_still_fails_with_a_reason() -> None:
    assert "trains nothing" in empty_epoch_failure(2, {}, {})


def test_the_first_of_each_reason_is_logged_in_full_then_counted_every_interval() -> None:
    log = RejectionLog(interval_s=10.0)
    assert log.record("not_a_dict", 0.0) == (True, None)
    assert log.record("too_large", 0.5) == (True, None)
    assert log.record("not_a_dict", 1.0) == (False, None)  # the interval starts
    assert log.record("not_a_dict", 5.0) == (False, None)
    assert log.record("too_large", 11.0) == (False, {"not_a_dict": 2, "too_large": 1})
    assert log.record("not_a_dict", 12.0) == (False, None)


def test_quarantines_are_not_samples_made_for_the_give_up_rule() -> None:
    assert samples_made(10, {"not_a_dict": 3, "producer_crash": 2}) == 13


def test_deaths_count_towards_giving_up_only_without_samples_made_in_between() -> None:
    deaths: list[float] = []
    for t in (0.0, 1.0, 2.0):
        deaths = deaths_without_progress(deaths, t, progressed=False)
    assert deaths == [0.0, 1.0, 2.0]
    assert deaths_without_progress(deaths, 3.0, progressed=True) == [3.0]  # a fresh run
    assert deaths_without_progress(deaths, 61.5, progressed=False) == [2.0, 61.5]  # window


def test_the_wait_line_says_why_nothing_arrives() -> None:
    def why(**facts: object) -> str:
        base: dict = dict(producers=2, buffered=0, rejected={}, lanes_full=False)
        return wait_reason(**{**base, **facts})

    assert why(producers=0).startswith("no producer is attached")
    assert why(lanes_full=True).startswith("every producer waits for lane space")
    assert "every sample since the last round was rejected {'not_a_dict': 9}" in why(
        rejected={"not_a_dict": 9}
    )
    assert why(buffered=3, rejected={"not_a_dict": 9}) == "2 producers attached and making samples"


def test_a_producer_with_another_dataset_size_is_refused_naming_both() -> None:
    hello = ingest_pb2.ProducerHello(name="external-7", dataset_size=90)
    refusal = size_refusal(hello, 100)
    assert refusal is not None and "has 90 samples" in refusal and "serves 100" in refusal
    assert size_refusal(hello, 90) is None
    assert size_refusal(ingest_pb2.ProducerHello(name="no-len"), 100) is None  # no len()
