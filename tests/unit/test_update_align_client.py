"""odbd --align updates on the client (issue 26): setups whose collectives run in every
micro-step are refused before training, with the fix."""

from __future__ import annotations

from enum import Enum

import pytest
import torch

from odbclient.adapters.batches import ODBBatches
from odbclient.batch import Batch
from odbclient.errors import ProtocolError
from odbclient.update_align import (
    per_layer_collectives,
    refuse_distributed_type,
    refuse_per_layer_collectives,
)


class FullyShardedDataParallel(torch.nn.Module):  # the name FSDP's wrapper class has
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner


class DistributedType(Enum):  # Accelerate's names
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"


def test_fsdp_anywhere_in_the_model_is_refused() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert per_layer_collectives(plain) is None
    refuse_per_layer_collectives(plain)  # DDP-style models pass
    wrapped = torch.nn.Sequential(FullyShardedDataParallel(torch.nn.Linear(2, 2)))
    with pytest.raises(ProtocolError, match=r"FSDP .*--align steps"):
        refuse_per_layer_collectives(wrapped)


def test_accelerate_fsdp_and_zero_3_are_refused_zero_2_is_not() -> None:
    refuse_distributed_type(DistributedType.MULTI_GPU, None)
    refuse_distributed_type(DistributedType.DEEPSPEED, 2)
    with pytest.raises(ProtocolError, match="DeepSpeed ZeRO-3"):
        refuse_distributed_type(DistributedType.DEEPSPEED, 3)
    with pytest.raises(ProtocolError, match="FSDP"):
        refuse_distributed_type(DistributedType.FSDP, None)


class _Client:
    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.batches)


def test_the_hf_batches_refuse_per_rank_micro_steps() -> None:
    batch = Batch(
        tensors={}, epoch=0, step=0, num_samples=1, num_tokens=3, global_num_samples=2,
        global_num_tokens=6, sample_ids=(0,), is_idle=False, loss_scale=1.0, update_end=False,
        update_num_steps=2, windowed=True, update_per_rank=True,
    )  # fmt: skip
    batches = ODBBatches(_Client([batch]), micro_steps_per_update=2)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="--align updates.*Nothing was trained"):
        next(iter(batches))
