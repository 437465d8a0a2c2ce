"""Flags and bad input of the batch forms (issue 13): --collate, --concat, --max-patches."""

from __future__ import annotations

import numpy as np
import pytest

from odbclient.samples import RejectReason, SampleForm, SampleRejected, inspect_sample
from odbd.config import DaemonConfig
from odbd.errors import ConfigError
from odbd.planner.config import Collate
from odbd.round.fingerprint import fingerprint_mismatch
from odbd.world import World
from tests.unit.test_cli import parse, run_cli

BASE = ["--world", "2", "--nproc-per-node", "2", "--dataset-size", "10"]


def config(**kwargs) -> DaemonConfig:
    return DaemonConfig(world=World(2, 2), dataset_size=10, **kwargs)


def test_flags_reach_the_planner_and_the_fingerprint() -> None:
    cfg = parse(
        [*BASE, "--collate", "packed", "--concat", "pixel_values", "--max-patches", "512"], {}
    )
    assert cfg.collate is Collate.PACKED and cfg.concat == ("pixel_values",)
    planner = cfg.planner(10)
    assert planner.collate is Collate.PACKED and planner.max_patches == 512
    fp = cfg.fingerprint(10)
    assert fp["collate"] == "packed" and fp["concat"] == "pixel_values"
    assert fp["max_patches"] == "512" and fp["patch_source"] == "key:pixel_values"
    # A peer started without them is refused at the handshake, naming the setting.
    other = config().fingerprint(10)
    assert "collate" in (fingerprint_mismatch(fp, other) or "")
    # The defaults add nothing: daemons of a release before issue 13 still match.
    assert not {"collate", "concat", "max_patches"} & set(other)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_patches": 64}, "--max-patches 64 needs a patch count per sample"),
        ({"patch_key": "a", "patch_count_key": "b", "max_patches": 1}, "pass one of them"),
        ({"concat": ("labels",)}, "--concat labels names the length or labels key"),
        ({"concat": ("x", "x")}, "names a key twice"),
    ],
)
def test_bad_batch_form_settings_are_one_clear_error(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        config(**kwargs)


def test_cli_refuses_max_patches_without_a_source(capsys) -> None:
    code, err = run_cli([*BASE, "--max-patches", "10"], {}, capsys)
    assert code == 2 and "--patch-key" in err and err.count("\n") == 1


def sample(**extra) -> dict[str, np.ndarray]:
    ids = np.arange(5, dtype=np.int64)
    return {"input_ids": ids, "labels": ids, **extra}


def facts(s, form):
    return inspect_sample(s, length_key="input_ids", labels_key="labels", form=form)


def test_patch_counts_come_from_a_first_dimension_or_a_count_key() -> None:
    pixels = np.zeros((7, 3), np.float32)
    assert facts(sample(pixel_values=pixels), SampleForm(patch_key="pixel_values")).patches == 7
    n = np.asarray(9, np.int64)
    assert facts(sample(n=n), SampleForm(patch_count_key="n")).patches == 9
    assert facts(sample(), SampleForm()).patches == 0


@pytest.mark.parametrize(
    ("s", "form", "reason", "text"),
    [
        (sample(), SampleForm(concat_keys=("pixel_values",)), RejectReason.BAD_CONCAT_KEY,
         "--concat pixel_values: the sample has no such key"),
        (sample(pixel_values=np.float32(1)), SampleForm(concat_keys=("pixel_values",)),
         RejectReason.BAD_CONCAT_KEY, "a scalar"),
        (sample(), SampleForm(patch_key="pixel_values"), RejectReason.BAD_PATCH_COUNT,
         "--patch-key pixel_values: the sample has no such key"),
        (sample(n=np.array([1.5])), SampleForm(patch_count_key="n"),
         RejectReason.BAD_PATCH_COUNT, "one non-negative integer"),
    ],
)  # fmt: skip
def test_samples_that_break_the_form_are_rejected_naming_key_and_fix(s, form, reason, text):
    with pytest.raises(SampleRejected) as caught:
        facts(s, form)
    assert caught.value.reason is reason and text in caught.value.detail


def test_concat_keys_come_repeated_or_comma_separated_also_from_the_environment() -> None:
    assert parse([*BASE, "--concat", "a", "--concat", "b,c"], {}).concat == ("a", "b", "c")
    assert parse(BASE, {"ODBD_CONCAT": "pixel_values,image_grid_thw"}).concat == (
        "pixel_values",
        "image_grid_thw",
    )
