"""Ingest faults (issue 11): samples that kill their producer, jobs whose every sample is
rejected, producers that cannot attach. Real daemons, producers and trainer processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.faults_cluster import FaultCluster, synthetic

pytestmark = pytest.mark.timeout(180)

CRASH_DATASET = str(Path(__file__).with_name("crash_dataset.py"))


def _dataset(factory: str, size: int, workers: int = 1, **args: object) -> list[str]:
    out = ["--dataset", f"{CRASH_DATASET}:{factory}", "--workers", str(workers)]
    out += ["--dataset-arg", f"size={size}"]
    for key, value in args.items():
        out += ["--dataset-arg", f"{key}={value}"]
    return out


def _job_failed(fc: FaultCluster) -> list[str]:
    """Every trainer rank's JobFailedError message (asserting each rank got one)."""
    messages = []
    for rank in range(fc.world):
        errors = fc.errors(rank)
        assert [e["error"] for e in errors] == ["JobFailedError"], (rank, fc.describe())
        messages.append(errors[0]["message"])
    return messages


@pytest.mark.parametrize("join", [True, False], ids=["join", "no-join"])
def test_every_sample_not_a_dict_fails_the_job_on_every_daemon_naming_the_reason(join):
    size = 200
    args = [*_dataset("tuples", size), "--buffer", "8", *([] if join else ["--no-join"])]
    with FaultCluster(nodes=2, ranks_per_node=1, daemon_args=args) as fc:
        fc.start_trainers("--deadline-s", "120")
        daemon_codes, trainer_codes = fc.wait_done(120)
        assert daemon_codes == [1, 1], fc.describe()
        assert trainer_codes == [0, 0], fc.describe()  # the trainer script records the error
        for message in _job_failed(fc):
            assert "trained nothing" in message and "not_a_dict" in message, message
            assert "__getitem__ must return a dict" in message, message
        for node in range(2):
            log = fc.log(node)
            assert "trained nothing" in log and "ERROR" in log, log[-3000:]
            assert log.count("not_a_dict") < 10, "one line per rejected sample"
        assert fc.cluster.leftover_segments() == []


def test_a_length_key_missing_from_every_sample_fails_the_job_with_the_fix():
    size = 120
    args = [*synthetic(size), "--length-key", "tokens", "--buffer", "8"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.start_trainers("--deadline-s", "120")
        daemon_codes, trainer_codes = fc.wait_done(120)
        assert daemon_codes == [1], fc.describe()
        for message in _job_failed(fc):
            assert f"all {size} samples were rejected (missing_length_key: {size})" in message
            assert "check --length-key" in message, message
