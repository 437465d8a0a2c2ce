"""Ingest faults (issue 11): samples that kill their producer, jobs whose every sample is
rejected, producers that cannot attach. Real daemons, producers and trainer processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.faults_cluster import FaultCluster, synthetic
from tests.integration.harness import scaled

pytestmark = pytest.mark.timeout(900)  # wait_done deadlines scale with the load (harness.scaled)

CRASH_DATASET = str(Path(__file__).with_name("crash_dataset.py"))
BAD_DATASET = str(Path(__file__).with_name("bad_dataset.py"))


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
    args += ["--max-reject-fraction", "1"]  # the epoch that trains nothing (budget: below)
    with FaultCluster(nodes=2, ranks_per_node=1, daemon_args=args) as fc:
        fc.start_trainers("--deadline-s", "120")
        daemon_codes, trainer_codes = fc.wait_done(60)
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
    args += ["--max-reject-fraction", "1"]  # the epoch that trains nothing (budget: below)
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.start_trainers("--deadline-s", "120")
        daemon_codes, trainer_codes = fc.wait_done(60)
        assert daemon_codes == [1], fc.describe()
        for message in _job_failed(fc):
            assert f"all {size} samples were rejected (missing_length_key: {size})" in message
            assert "check --length-key" in message, message


def _assert_quarantined(fc: FaultCluster, size: int, crash_ids: set[int]) -> None:
    """Every identity but the crashing ones trained exactly once (plus the sampler's tail
    padding), the crashing ones never, and EpochEnd counts them as producer_crash."""
    ids = fc.emitted_ids(0)
    assert set(ids) == set(range(size)) - crash_ids, fc.describe()
    tail = fc.world * -(-size // fc.world) - size
    assert len(ids) <= size - len(crash_ids) + tail, ids
    for rank in range(fc.world):
        summary = [r for r in fc.records(rank) if "epoch_end" in r][-1]["summary"]
        assert summary["rejected_by_reason"] == {"producer_crash": len(crash_ids)}, summary
    log = "".join(fc.log(n) for n in range(len(fc.daemons)))
    for identity in crash_ids:
        assert f"quarantined sample {identity} " in log, log[-3000:]


@pytest.mark.parametrize("how", ["exit", "abort", "segv"])
def test_a_sample_that_kills_its_producer_is_quarantined_and_the_epoch_completes(how):
    size, bad = 160, 77
    args = [*_dataset("crashing", size, workers=2, crash_at=bad, how=how), "--buffer", "8"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.train_to_the_end(60)
        _assert_quarantined(fc, size, {bad})
        log = fc.log(0)
        assert f"ended while making sample {bad} " in log, log[-3000:]
        assert log.count("restarting it") == 2, log[-3000:]  # one death each, then quarantine


def test_a_sample_that_hangs_its_producer_forever_is_quarantined_and_the_epoch_completes():
    """dataset[77] never returns. Before: its lease expired and went to the other worker, which
    hung too; the job then waited forever, saying 2 producers were making samples. Now a worker
    inside one sample for --lease-timeout is killed (a death with that sample in flight)."""
    size, bad = 160, 77
    args = [*_dataset("crashing", size, workers=2, crash_at=bad, how="hang"), "--buffer", "8"]
    args += ["--lease-timeout", "3"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.train_to_the_end(60)
        _assert_quarantined(fc, size, {bad})
        log = fc.log(0)
        hung = f"inside dataset[i] for sample {bad} (view"
        assert log.count(hung) == 2 and "it is hung there, so it was killed" in log, log[-3000:]
        assert "raise --lease-timeout" in log, log[-3000:]
        assert "exited with status -9; restarting it" in log, log[-3000:]


def test_a_producer_out_of_memory_is_restarted_and_every_sample_trains():
    """A dataset that leaks under a memory limit (found by hand on 2026-11-26: 251 of 300
    samples were rejected as preprocess_error, one MemoryError after another, and the job
    exited 0). Now MemoryError ends the producer, which is restarted with fresh memory, and
    the sample it was making is made again: nothing is rejected."""
    size = 200
    args = [*_dataset("leaking", size, workers=1, leak_mib=2, limit_mib=80), "--buffer", "8"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.train_to_the_end(90)
        fc.assert_exactly_once(size)
        log = fc.log(0)
        assert "error: out of memory: the dataset leaks" in log, log[-3000:]
        assert "restarting it" in log and "preprocess_error" not in log, log[-3000:]


def test_packed_samples_whose_labels_are_shorter_than_input_ids_are_rejected_naming_both():
    """Found by hand on 2026-11-26: with --collate packed, labels truncated apart from
    input_ids were joined into a (1, 245) labels row against (1, 254) input_ids, so every later
    sample's labels were shifted against its tokens. Now such a sample is rejected."""
    size, every = 120, 10
    args = [*_dataset("short_labels", size, every=every), "--buffer", "8", "--collate", "packed"]
    args += ["--max-reject-fraction", "0.2"]  # 10 % rejected, on purpose
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.train_to_the_end(60)
        bad = set(range(0, size, every))
        ids = fc.emitted_ids(0)
        assert set(ids) == set(range(size)) - bad and len(ids) == len(set(ids)), fc.describe()
        for rank in range(fc.world):
            summary = [r for r in fc.records(rank) if "epoch_end" in r][-1]["summary"]
            assert summary["rejected_by_reason"] == {"packed_length_mismatch": len(bad)}, summary
        log = fc.log(0)
        assert "key 'labels' has 11 entries but length key 'input_ids' has 12" in log, log[-3000:]


def test_first_and_last_samples_crash_under_one_worker_and_both_are_quarantined():
    """Neighbours: the very first sample a fresh producer makes (--no-shuffle: identity 0),
    the epoch's last one, two crashing ids, and one worker (no other producer to take over)."""
    size = 120
    crash = {0, size - 1}
    args = [*_dataset("crashing", size, workers=1, crash_at=f"0;{size - 1}", how="exit")]
    args += ["--buffer", "8", "--no-shuffle", "--max-reject-fraction", "0.05"]  # 2 of 120
    with FaultCluster(nodes=2, ranks_per_node=1, daemon_args=args) as fc:
        fc.train_to_the_end(60)
        _assert_quarantined(fc, size, crash)


def test_producers_that_cannot_be_kept_alive_fail_the_job_naming_the_command():
    size = 60
    args = [*_dataset("crashing", size, workers=1, crash_at="*", how="exit"), "--buffer", "8"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.start_trainers("--deadline-s", "120")
        daemon_codes, _ = fc.wait_done(60)
        assert daemon_codes == [1], fc.describe()
        for message in _job_failed(fc):
            assert "cannot be kept alive" in message and "exit status 3" in message, message
            assert "-m odbclient.producer.producer_main --socket" in message, message
            assert f"--dataset-arg size={size}" in message, message
            assert "--dataset-arg 'crash_at=*' --dataset-arg how=exit" in message, message  # shlex
        status_error = "cannot be kept alive"
        assert status_error in fc.log(0)


def test_an_external_producer_with_another_dataset_size_is_refused_naming_both_sizes():
    args = ["--dataset-size", "100", "--buffer", "8"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        wrong = fc.start_producer(0, "size=90")
        assert wrong.wait(scaled(60)) == 1, fc.describe()
        said = (fc.cluster.tmp / "producer0.log").read_text()
        assert "90 samples" in said and "serves 100 identities" in said, said
        status = fc.status(0)
        assert "90 samples" in status.last_error and "100 identities" in status.last_error
        assert "ERROR odbd.ingest: refused a producer" in fc.log(0)
        assert status.producers == 0
        fc.start_producer(0, "size=100")  # the daemon still serves the right one
        fc.start_trainers()
        daemon_codes, trainer_codes = fc.wait_done(60)
        fc.assert_clean_exit(daemon_codes, trainer_codes)
        fc.assert_exactly_once(100)


def _external_crashing_producer(fc: FaultCluster, size: int, crash_at: int) -> int:
    """Runs one external producer of the crashing dataset to its end; its exit status."""
    cmd = [
        sys.executable,
        "-m",
        "odbclient.producer.producer_main",
        "--socket",
        fc.cluster.sockets[0],
    ]
    cmd += ["--dataset", f"{CRASH_DATASET}:crashing", "--job-id", fc.cluster.spec.job_id]
    cmd += ["--dataset-arg", f"size={size}", "--dataset-arg", f"crash_at={crash_at}"]
    log = open(fc.cluster.tmp / "producer0.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    fc.producers.append(proc)
    return proc.wait(scaled(120))


def test_an_external_producer_killed_twice_by_one_sample_gets_it_quarantined():
    """The lane header works without the daemon's supervisor: an operator (here the test)
    restarts the external producer, and the second death on the same id quarantines it."""
    size, bad = 60, 7
    args = ["--dataset-size", str(size), "--buffer", "8", "--max-reject-fraction", "0.05"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.start_trainers()
        assert _external_crashing_producer(fc, size, bad) == 3, fc.describe()
        assert f"ended while making sample {bad} " in fc.log(0), fc.describe()
        assert _external_crashing_producer(fc, size, bad) == 3, fc.describe()
        fc.wait_until(lambda: f"quarantined sample {bad} " in fc.log(0), "the quarantine")
        assert _external_crashing_producer(fc, size, bad) == 0, fc.describe()
        daemon_codes, trainer_codes = fc.wait_done(60)
        fc.assert_clean_exit(daemon_codes, trainer_codes)
        fc.assert_aligned()
        _assert_quarantined(fc, size, {bad})


# -- issue 24: bad data never passes silently ---------------------------------------------------


def _bad(factory: str, size: int | None = None, **args: object) -> list[str]:
    out = ["--dataset", f"{BAD_DATASET}:{factory}", "--workers", "1"]
    if size is not None:
        out += ["--dataset-arg", f"size={size}"]
    for key, value in args.items():
        out += ["--dataset-arg", f"{key}={value}"]
    return out


def test_an_int32_first_sample_among_int64_ones_is_promoted_and_every_sample_trains():
    """Before: sample 0's int32 input_ids, committed first, set the job's schema and every
    other sample was rejected as schema_mismatch (1 of 400 trained, exit 0)."""
    size = 400
    args = [*_bad("odd_first", size, odd="int32"), "--buffer", "16", "--no-shuffle"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.train_to_the_end(90)
        fc.assert_exactly_once(size)
        assert "schema_mismatch" not in fc.log(0), fc.log(0)[-3000:]


def test_an_odd_first_sample_loses_the_schema_vote_and_the_good_samples_train():
    """Sample 0 has an extra key: it is rejected naming both schemas, the 399 others train."""
    size = 400
    args = [*_bad("odd_first", size, odd="key"), "--buffer", "16", "--no-shuffle"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.train_to_the_end(90)
        ids = fc.emitted_ids(0)
        assert set(ids) == set(range(1, size)) and len(ids) == len(set(ids)), fc.describe()
        for rank in range(fc.world):
            summary = [r for r in fc.records(rank) if "epoch_end" in r][-1]["summary"]
            assert summary["rejected_by_reason"] == {"schema_mismatch": 1}, summary
        log = fc.log(0)
        assert "rejected sample 0 (view 0): schema_mismatch: this sample has key 'score' " in log
        votes = re.search(r"the job's schema is input_ids int64\[\*\], labels int64\[\*\] "
                          r"\(chosen by (\d+) of the first (\d+) samples\)", log)  # fmt: skip
        assert votes and int(votes[1]) == int(votes[2]) - 1 >= 15, log[-3000:]
        assert "WARNING odbd.round: epoch 0 rejected 1 of 400 samples (0.25 %)" in log, log[-3000:]


def test_85_percent_failing_reads_fail_the_job_in_one_line_with_counts_ids_and_the_fix():
    """Before: 58 of 400 trained, the summary at INFO, and every process exited 0."""
    size = 400
    args = [*_bad("failing_reads", size, percent=85), "--buffer", "8", "--no-shuffle"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.start_trainers("--deadline-s", "120")
        daemon_codes, trainer_codes = fc.wait_done(60)
        assert daemon_codes == [1] and trainer_codes == [0], fc.describe()
        for message in _job_failed(fc):
            assert "past --max-reject-fraction 0.01 (preprocess_error: " in message, message
            assert "first ids on this node: 0, 1, 2, 3, 4" in message, message
            assert "raised OSError: read of shard for sample 0 failed" in message, message
            assert "Fix: fix the exception __getitem__ raises" in message, message
        errors = [line for line in fc.log(0).splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "past --max-reject-fraction" in errors[0], errors
        print(f"\nFAULT 85 % failing reads: {fc.steps_seen(0)} steps trained, {errors[0]}")


def test_the_next_epochs_rejections_count_in_their_own_epoch_budget():
    """3 bad samples of 60 (5 %) under --max-reject-fraction 0.05 over 3 epochs: producers read
    ahead into the next epoch while one is planned, and those rejections counted in the epoch
    being planned: `epoch 0 rejected 4 of 60 samples (6.7 %)`, the job failed (found with
    `--epochs 0 --max-updates` jobs, which loop over many epochs). Now each epoch counts 3."""
    args = [*_bad("failing_reads", 60, percent=3), "--buffer", "8", "--epochs", "3",
            "--max-reject-fraction", "0.05"]  # fmt: skip
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.start_trainers("--deadline-s", "120", "--epochs", "3")
        daemon_codes, trainer_codes = fc.wait_done(60)
        assert daemon_codes == [0] and trainer_codes == [0], fc.describe()
        log = fc.log(0)
    for epoch in range(3):
        assert f"epoch {epoch} rejected 3 of 60 samples (5.00 %)" in log, log[-3000:]


def test_an_empty_dataset_fails_before_the_first_round_and_the_trainers_are_told():
    """Before: the daemon exited 0 and logged nothing."""
    args = ["--dataset", f"{BAD_DATASET}:empty", "--workers", "1", "--buffer", "8"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.start_trainers("--deadline-s", "120")
        daemon_codes, trainer_codes = fc.wait_done(60)
        assert daemon_codes == [1] and trainer_codes == [0], fc.describe()
        for message in _job_failed(fc):
            assert f"--dataset {BAD_DATASET}:empty has len() 0" in message, message
        errors = [line for line in fc.log(0).splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "has len() 0" in errors[0], errors


def test_check_finite_rejects_samples_holding_nan_naming_the_key():
    """Before: NaN in a float key went to the trainers unchecked (it still does by default)."""
    size, every = 120, 40
    args = [*_bad("nan_every", size, every=every), "--buffer", "8", "--check-finite"]
    args += ["--max-reject-fraction", "0.05"]
    with FaultCluster(nodes=1, ranks_per_node=2, daemon_args=args) as fc:
        fc.train_to_the_end(60)
        bad = set(range(0, size, every))
        ids = fc.emitted_ids(0)
        assert set(ids) == set(range(size)) - bad and len(ids) == len(set(ids)), fc.describe()
        summary = [r for r in fc.records(0) if "epoch_end" in r][-1]["summary"]
        assert summary["rejected_by_reason"] == {"non_finite": len(bad)}, summary
        log = fc.log(0)
        assert "non_finite: key 'score' holds 1 NaN or inf values of 3" in log, log[-3000:]


def test_int32_token_ids_on_one_of_two_nodes_train_every_sample():
    """Before: node 1's int32 samples were all rejected as schema_mismatch (200 of 400)."""
    size = 400
    args = [*_bad("odd_first", size), "--buffer", "16"]
    node1 = ["--dataset-arg", "odd=int32_all"]
    with FaultCluster(nodes=2, ranks_per_node=1, daemon_args=args, per_node_args=[[], node1]) as fc:
        fc.train_to_the_end(90)
        fc.assert_exactly_once(size)


def test_nodes_whose_datasets_have_different_schemas_fail_naming_both():
    """Node 1's samples have an extra key: each node's vote picks its own schema, and every
    daemon fails the job at the first round naming both (no node trains the other's data)."""
    size = 200
    args = [*_bad("odd_first", size), "--buffer", "8"]
    node1 = ["--dataset-arg", "odd=key_all"]
    with FaultCluster(nodes=2, ranks_per_node=1, daemon_args=args, per_node_args=[[], node1]) as fc:
        fc.start_trainers("--deadline-s", "120")
        daemon_codes, trainer_codes = fc.wait_done(60)
        assert daemon_codes == [1, 1] and trainer_codes == [0, 0], fc.describe()
        both = "node 0: input_ids int64[*], labels int64[*]; node 1: input_ids int64[*], "
        both += "labels int64[*], score float32[*]"
        for message in _job_failed(fc):
            assert f"different sample schemas ({both})" in message, message
        assert fc.steps_seen(0) == 0 and fc.steps_seen(1) == 0, fc.describe()
