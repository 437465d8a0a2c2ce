"""Issue 24: the schema vote's rules, the rejection budget, token-id promotion and the flags
that used to be accepted or misreported (each case failed before its fix)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from odbclient.errors import DatasetLoadError
from odbclient.producer.dataset import load_dataset
from odbclient.producer.sample_plan import SamplePlanner
from odbclient.samples import (
    RejectReason,
    SampleForm,
    SampleRejected,
    check_finite,
    promote_token_ids,
    schema_hash,
)
from odbd.cli import apply_environment, config_from_args, daemon_parser
from odbd.daemon import offer_codec
from odbd.daemon.round_loop import RoundLoop
from odbd.ingest.rejections import budget_failure, empty_dataset_failure, over_budget
from odbd.ingest.schema_vote import describe_schema, schema_disagreement, winning_schema
from odbd.planner.types import SampleTable, UnitOffer
from tests.unit.test_cli import run_cli

BASE = ["--world", "1", "--nproc-per-node", "1"]


@pytest.fixture
def no_daemon(monkeypatch):
    import odbd.daemon.app

    def refuse(*args, **kwargs):
        raise AssertionError("the daemon started: the bad input was accepted")

    monkeypatch.setattr(odbd.daemon.app, "run_daemon", refuse)


# -- the schema ---------------------------------------------------------------------------------


def test_the_majority_schema_wins_and_a_tie_goes_to_the_first_arrival():
    assert winning_schema([7, 3, 3, 3]) == (3, 3)
    assert winning_schema([5, 9, 9, 5]) == (5, 2)
    with pytest.raises(ValueError):
        winning_schema([])


def test_nodes_that_chose_different_schemas_fail_naming_each_node_and_schema():
    same = {0: (1, "input_ids int64[*]"), 1: (1, "input_ids int64[*]")}
    assert schema_disagreement(same) is None
    assert schema_disagreement({0: (1, "a")}) is None
    text = schema_disagreement({0: (1, "input_ids int64[*]"), 1: (2, "input_ids float32[*]")})
    assert text is not None
    assert "node 0: input_ids int64[*]; node 1: input_ids float32[*]" in text
    assert "Make the dataset uniform on every node" in text
    assert describe_schema(None, 255) == "schema 00000000000000ff"


def test_the_offer_carries_the_nodes_schema_and_an_offer_without_one_reads_as_none():
    table = SampleTable.of(np.arange(2), np.full(2, 5), np.full(2, 5))
    offer = offer_codec.NodeOffer(0, 0, (UnitOffer(0, table, False),), {"zero_length": 1})
    assert offer_codec.decode(offer_codec.encode(offer)).schema is None
    chosen = offer_codec.NodeOffer(1, 0, (), {}, schema=(2**63 + 5, "input_ids int64[*]"))
    assert offer_codec.decode(offer_codec.encode(chosen)).schema == (
        2**63 + 5,
        "input_ids int64[*]",
    )


def test_narrower_integer_token_ids_and_labels_are_promoted_to_int64_other_keys_kept():
    ids32 = np.arange(5, dtype=np.int32)
    sample = {"input_ids": ids32, "labels": ids32.astype(np.int16), "mask": ids32}
    out = promote_token_ids(sample, ("input_ids", "labels"))
    assert out["input_ids"].dtype == np.int64 and out["labels"].dtype == np.int64
    assert out["mask"].dtype == np.int32 and (out["input_ids"] == ids32).all()
    good = {"input_ids": np.arange(5), "labels": np.arange(5), "mask": ids32}
    assert schema_hash(out) == schema_hash(good)
    assert promote_token_ids(good, ("input_ids", "labels")) is good  # nothing to do: no copy
    tensor = promote_token_ids({"input_ids": torch.arange(3, dtype=torch.int32)}, ("input_ids",))
    assert tensor["input_ids"].dtype == torch.int64
    floats = {"input_ids": np.zeros(3, np.float32)}  # not an integer: the user's choice
    assert promote_token_ids(floats, ("input_ids",)) is floats
    assert promote_token_ids((1, 2), ("input_ids",)) == (1, 2)  # not_a_dict: rejected later


# -- the rejection budget -----------------------------------------------------------------------


def test_the_budget_is_past_only_above_the_fraction_of_the_dataset():
    assert not over_budget(4, 400, 0.01) and over_budget(5, 400, 0.01)
    assert over_budget(1, 400, 0.0) and not over_budget(400, 400, 1.0)


def test_a_job_past_its_budget_fails_in_one_line_with_counts_ids_and_the_fix():
    text = budget_failure(
        0,
        {"preprocess_error": 340, "zero_length": 2},
        400,
        0.01,
        [3, 5, 8, 9, 11, 12],
        {"preprocess_error": "sample 3: dataset[3] raised OSError: read failed"},
    )
    assert "\n" not in text
    assert text.startswith(
        "epoch 0 rejected 342 of 400 samples (85.5 %), past --max-reject-fraction 0.01 "
        "(preprocess_error: 340, zero_length: 2); first ids on this node: 3, 5, 8, 9, 11; "
        "first preprocess_error: sample 3: dataset[3] raised OSError: read failed. Fix: fix the "
        "exception __getitem__ raises"
    ), text
    assert text.endswith("raise --max-reject-fraction")
    assert "--dataset x:y has len() 0" in empty_dataset_failure("x:y")


def test_max_reject_fraction_is_read_checked_and_in_the_fingerprint(capsys, no_daemon, tmp_path):
    parser = daemon_parser()
    apply_environment(parser, {"ODBD_MAX_REJECT_FRACTION": "0.5"})
    argv = [*BASE, "--dataset-size", "5", "--socket", str(tmp_path / "s.sock")]
    config = config_from_args(parser.parse_args(argv), {})
    assert config.max_reject_fraction == 0.5
    assert config.fingerprint(5)["max_reject_fraction"] == "0.5"
    code, err = run_cli([*argv, "--max-reject-fraction", "2"], {}, capsys)
    assert code == 2 and "--max-reject-fraction: expected a fraction in 0..1" in err, err


# -- flags that were accepted or misreported (issue 24, item 4) ---------------------------------


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--dataset-size", "0"], {}, "argument --dataset-size: expected an integer in 1.."),
        (
            ["--dataset-size", "5", "--steps-ahead", "0"],
            {},
            "argument --steps-ahead: expected an integer >= 1, got '0'",
        ),
        (
            ["--dataset-size", "5", "--shm-size", "-16M"],
            {},
            "argument --shm-size: must be positive: expected a size like 512M or 4G, got '-16M'",
        ),
        (
            ["--dataset-size", "5"],
            {"ODBD_TOKEN_BUDGET": "1e4.5"},
            "ODBD_TOKEN_BUDGET='1e4.5': expected an integer, got '1e4.5'",
        ),
        (
            ["--dataset-size", "5"],
            {"ODBD_TOKEN_BUDGET": "12.5"},
            "ODBD_TOKEN_BUDGET='12.5': expected an integer, got '12.5', which is not a whole",
        ),
    ],
)
def test_a_bad_value_is_refused_in_one_line_naming_the_flag(
    argv, environ, message, capsys, no_daemon
):
    code, err = run_cli([*BASE, *argv], environ, capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_token_budget_written_as_a_float_that_is_an_integer_is_read(tmp_path):
    parser = daemon_parser()
    apply_environment(parser, {"ODBD_TOKEN_BUDGET": "1e4"})
    argv = [*BASE, "--dataset-size", "5", "--socket", str(tmp_path / "s.sock")]
    assert config_from_args(parser.parse_args(argv), {}).token_budget == 10000


def test_a_negative_demo_dataset_size_names_the_factorys_own_argument():
    with pytest.raises(DatasetLoadError) as error:
        load_dataset("odbd.demo.dataset:synthetic", {"size": -5})
    text = str(error.value)
    assert "size must be an integer >= 1" in text and "--dataset-arg size=N" in text
    assert "--num-samples" not in text


# -- the wait line (issue 24, item 4) -----------------------------------------------------------


class _Queue:
    def __init__(self, rank: int, queued: int) -> None:
        self.rank, self._queued, self.attached = rank, queued, True

    def queued_steps(self) -> int:
        return self._queued

    def first_undelivered(self) -> tuple[int, int]:
        return (0, 5)


def _loop(queued: list[int], *, lanes_full: bool, slow=None) -> SimpleNamespace:
    state = SimpleNamespace(
        buffered_now=lambda: 3,
        planner=SimpleNamespace(unit_capacity=8),
        leases=[],
        rejected={},
    )
    return SimpleNamespace(
        config=SimpleNamespace(steps_ahead=4),
        queues={r: _Queue(r, q) for r, q in enumerate(queued)},
        state=state,
        producers=lambda: 2,
        lanes_full=lambda: lanes_full,
        starting=lambda: (0, 0.0),
        slow_sample=lambda: slow,
    )


def test_a_stopped_rank_is_named_first_and_not_told_to_raise_shm_size():
    """Before: "...every producer waits for lane space: raise --shm-size or lower --buffer, and
    shared memory is held by undelivered steps (rank 1 ...)": the rank came last."""
    why = RoundLoop._wait_reason(_loop([0, 40], lanes_full=True), True)  # type: ignore[arg-type]
    assert why.startswith(
        "shared memory is held by undelivered steps (rank 1 has 40 steps undelivered from "
        "epoch 0 step 5, its client is attached); a rank that stopped calling next()"
    ), why
    assert "raise --shm-size" not in why and "which those undelivered steps hold" in why
    alone = RoundLoop._wait_reason(_loop([0, 0], lanes_full=True), True)  # type: ignore[arg-type]
    assert alone.endswith("every producer waits for lane space: raise --shm-size or lower --buffer")


def test_a_producer_long_inside_one_sample_is_named_in_the_wait_line():
    """Before: a dataset[i] that took 60 s read as "2 producers attached and making samples"."""
    slow = ("worker-0", 17, 42.4)
    why = RoundLoop._wait_reason(_loop([0], lanes_full=False, slow=slow), True)  # type: ignore[arg-type]
    assert "producer worker-0 has been inside dataset[17] for 42 s" in why, why
    assert "making samples" not in why


# -- --check-finite ------------------------------------------------------------------------------


def test_check_finite_names_the_key_the_count_and_the_first_index():
    ok = {"input_ids": np.arange(4), "score": np.ones(3, np.float32)}
    check_finite(ok)
    bad = {"input_ids": np.arange(4), "pixel_values": np.array([[1.0, np.nan], [np.inf, 2.0]])}
    with pytest.raises(SampleRejected) as rejected:
        check_finite(bad)
    assert rejected.value.reason is RejectReason.NON_FINITE
    assert "key 'pixel_values' holds 2 NaN or inf values of 4 (the first at flat index 1)" in (
        rejected.value.detail
    )
    with pytest.raises(SampleRejected):
        check_finite({"x": torch.tensor([0.0, float("-inf")], dtype=torch.bfloat16)})
    check_finite({"x": torch.arange(3)})  # integers cannot hold NaN


def test_the_planner_checks_values_per_sample_only_under_check_finite():
    """A sample's values, not its structure: the planner's per-structure cache must not skip
    the check for a later sample of a known structure."""
    good = {"input_ids": np.arange(4), "score": np.ones(2, np.float32)}
    bad = {"input_ids": np.arange(4), "score": np.array([1.0, np.nan], np.float32)}
    plain = SamplePlanner(length_key="input_ids", labels_key="labels")
    plain.facts(good)
    plain.facts(bad)  # off: NaN passes, as before
    checked = SamplePlanner(
        length_key="input_ids", labels_key="labels", form=SampleForm(check_finite=True)
    )
    checked.facts(good)
    with pytest.raises(SampleRejected):
        checked.facts(bad)
