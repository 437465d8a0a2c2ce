"""The data-path bench's trainer checks every row of every batch (tests/bench/datapath_trainer.py):
cheaper since issue 15, it must still refuse a batch whose rows are not its samples'."""

from __future__ import annotations

import pytest
import torch

from odbclient import Batch
from tests.bench.datapath_trainer import check_rows


def batch_of(rows: torch.Tensor, sample_ids: tuple[int, ...]) -> Batch:
    return Batch(
        tensors={"input_ids": rows}, epoch=0, step=3, num_samples=len(sample_ids),
        num_tokens=rows.numel(), global_num_samples=len(sample_ids),
        global_num_tokens=rows.numel(), sample_ids=sample_ids, is_idle=False, loss_scale=1.0,
    )  # fmt: skip


def rows_of(ids: list[int], length: int = 8) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64).unsqueeze(1).repeat(1, length)


def test_rows_carrying_their_ids_pass() -> None:
    check_rows(batch_of(rows_of([7, 3, 9]), (7, 3, 9)))


@pytest.mark.parametrize("column", [0, -1])
def test_a_row_with_another_id_at_either_end_fails(column: int) -> None:
    rows = rows_of([7, 3, 9])
    rows[1, column] = 4
    with pytest.raises(RuntimeError, match="step 3"):
        check_rows(batch_of(rows, (7, 3, 9)))


def test_rows_in_another_order_or_count_fail() -> None:
    with pytest.raises(RuntimeError):
        check_rows(batch_of(rows_of([3, 7, 9]), (7, 3, 9)))
    with pytest.raises(RuntimeError):
        check_rows(batch_of(rows_of([7, 3]), (7, 3, 9)))
