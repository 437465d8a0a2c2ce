"""Rejections for operators: the verdict on an epoch that trained nothing, the rate-limited log."""

from __future__ import annotations

import asyncio
import sys

import pytest

from odbclient.wire.odbd.v1 import ingest_pb2
from odbd.daemon.round_wait import wait_reason
from odbd.ingest.rejections import (
    PRODUCER_CRASH,
    REJECT_FIXES,
    RejectionLog,
    empty_epoch_failure,
    samples_made,
)
from odbd.ingest.service import size_refusal
from odbd.ingest.supervisor import (
    ProducerSupervisor,
    SupervisorConfig,
    deaths_without_progress,
    restart_delay_s,
)
from odbd.ingest.validate import MalformedMessage, check_rejections
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

    assert why(producers=0).startswith("no producer is attached: start producers")
    building = why(producers=0, starting=(2, 41.6))  # spawned workers still in the factory
    assert building.startswith("no producer is attached yet: 2 --workers processes started 42 s")
    assert "start producers" not in building
    assert why(starting=(2, 41.6)) == "2 producers attached and making samples"
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


def test_producer_crash_is_the_daemons_reason_a_producer_cannot_send_it() -> None:
    batch = ingest_pb2.RejectBatch(
        rejections=[ingest_pb2.Rejection(view_key=1, reason=PRODUCER_CRASH, detail="x")]
    )
    with pytest.raises(MalformedMessage, match="unknown rejection reason 'producer_crash'"):
        check_rejections(batch)
    assert PRODUCER_CRASH in KNOWN_REJECT_REASONS  # exported at 0 from the start


def test_restart_delays_double_from_half_a_second_up_to_half_a_minute() -> None:
    assert [restart_delay_s(n) for n in (1, 2, 3, 4, 7, 8, 100)] == [
        0.5,
        1.0,
        2.0,
        4.0,
        30.0,
        30.0,
        30.0,
    ]


@pytest.mark.timeout(60)
def test_a_worker_that_dies_at_start_while_others_make_samples_backs_off() -> None:
    """Its deaths never add up to giving up (the node makes samples), so without the backoff it
    was restarted twice a second for the whole job."""

    class CrashingAtStart(ProducerSupervisor):
        def command(self, name: str) -> list[str]:  # producer_main refuses the unknown flag
            return [sys.executable, "-m", "odbclient.producer.producer_main", "--no-such-flag"]

    waits: list[float] = []
    made = iter(range(1_000_000))

    async def run() -> int:
        done = asyncio.Event()

        async def sleep(seconds: float) -> None:
            waits.append(seconds)
            if len(waits) >= 12:
                done.set()

        config = SupervisorConfig(socket="", dataset="", dataset_args=(), workers=1, job_id="t")
        supervisor = CrashingAtStart(config, lambda: None, progress=lambda: next(made), sleep=sleep)
        await supervisor.start()
        await done.wait()
        await supervisor.stop()
        return supervisor.num_restarts

    num_restarts = asyncio.run(run())
    assert num_restarts >= 5
    # Each restart: the fixed 0.5 s for the daemon's accounting, then the rest of the backoff.
    backoff = [a + b for a, b in zip(waits[::2], waits[1::2], strict=False)]
    assert backoff[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]
