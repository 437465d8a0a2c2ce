"""Batch exposes its tensors like a mapping and carries the step facts of DESIGN.md 2.2."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from odbclient import Batch


def make_batch(**overrides: object) -> Batch:
    fields: dict[str, object] = {
        "tensors": {"input_ids": torch.ones(2, 3, dtype=torch.int64), "labels": torch.zeros(2, 3)},
        "epoch": 1,
        "step": 7,
        "num_samples": 2,
        "num_tokens": 5,
        "global_num_samples": 16,
        "global_num_tokens": 40,
        "sample_ids": (11, 4),
        "is_idle": False,
        "loss_scale": 1.25,
    }
    fields.update(overrides)
    return Batch(**fields)  # type: ignore[arg-type]


def test_getitem_is_a_shortcut_for_tensors() -> None:
    batch = make_batch()
    assert batch["input_ids"] is batch.tensors["input_ids"]
    assert "labels" in batch and "pixels" not in batch
    assert batch.keys() == ["input_ids", "labels"] and list(batch) == ["input_ids", "labels"]
    with pytest.raises(KeyError):
        batch["pixels"]


def test_batch_unpacks_as_keyword_arguments() -> None:
    def model(input_ids: torch.Tensor, labels: torch.Tensor) -> int:
        return input_ids.shape[0] + labels.shape[0]

    assert model(**make_batch()) == 4


def test_step_facts() -> None:
    batch = make_batch()
    assert (batch.epoch, batch.step, batch.num_samples, batch.num_tokens) == (1, 7, 2, 5)
    assert (batch.global_num_samples, batch.global_num_tokens) == (16, 40)
    assert batch.sample_ids == (11, 4) and batch.loss_scale == 1.25 and not batch.is_idle


def test_batch_is_frozen_and_keyword_only() -> None:
    batch = make_batch()
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.step = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        Batch({}, 0, 0, 0, 0, 0, 0, (), False, 0.0)  # type: ignore[misc]


def test_to_moves_every_tensor() -> None:
    moved = make_batch().to("cpu")
    assert set(moved) == {"input_ids", "labels"}
    assert moved["input_ids"].device.type == "cpu"


def test_repr_leaves_out_tensor_values() -> None:
    text = repr(make_batch(is_idle=True, loss_scale=0.0))
    assert "is_idle=True" in text and "tensor(" not in text
