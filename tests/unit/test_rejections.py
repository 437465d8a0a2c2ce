"""Rejections for operators: the verdict on an epoch that trained nothing, the rate-limited log."""

from __future__ import annotations

from odbd.ingest.rejections import REJECT_FIXES, RejectionLog, empty_epoch_failure
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
