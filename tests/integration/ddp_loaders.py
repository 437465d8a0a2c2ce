"""The three data paths the DDP trainer can train from, behind one per-step record.

- `odbd`: ODBClient batches (token-budgeted, step-aligned, loss_scale from the daemon).
- `fixed`: a plain DataLoader with DistributedSampler and a fixed batch size (loss_scale 1,
  the usual DDP mean of per-rank means).
- `paper`: the paper's own `online-dynamic-batching` package (`odb.ODBDataLoader`), run in the
  benchmark's separate venv; uneven step counts are handled by DDP's Join, as its docs say.

Imports of odbclient and odb are local to their loader, so this module runs in either venv.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tests.integration.ddp_data import IGNORE_INDEX, LongTailTokens
from tests.integration.ddp_model import pad_collate


@dataclass(frozen=True, kw_only=True)
class Step:
    """One rank's input for one optimizer step, whatever produced it."""

    epoch: int
    step: int
    tensors: dict[str, torch.Tensor]  # input_ids (B, T) right-padded with 0, labels with -100
    ids: list[int]  # dataset identities in batch order (empty for an idle filler)
    idle: bool
    loss_scale: float
    num_tokens: int  # loss-bearing tokens of this rank's batch
    global_num_tokens: int | None = None  # over every rank of the step (odbd only)
    # odbd's optimizer update of this micro-step (Batch.update_*), when it runs windows.
    update: dict[str, Any] | None = None

    @property
    def update_start(self) -> bool:
        return self.update is None or self.update["step"] == 0

    @property
    def update_end(self) -> bool:
        return self.update is None or bool(self.update["end"])

    def record(self) -> dict[str, Any]:
        ids = self.tensors["input_ids"]
        extra = {} if self.update is None else {"update": self.update}
        return {
            **extra,
            "epoch": self.epoch,
            "step": self.step,
            "ids": self.ids,
            "idle": self.idle,
            "loss_scale": self.loss_scale,
            "num_tokens": self.num_tokens,
            "global_num_tokens": self.global_num_tokens,
            "padded": 0 if self.idle else int(ids.numel()),
        }


# --- odbd --------------------------------------------------------------------------------------


def odbd_epoch(client: Any) -> Iterator[Step]:
    for batch in client:
        yield Step(
            epoch=batch.epoch,
            step=batch.step,
            tensors=batch.tensors,
            ids=list(batch.sample_ids),
            idle=batch.is_idle,
            loss_scale=batch.loss_scale,
            num_tokens=batch.num_tokens,
            global_num_tokens=batch.global_num_tokens,
            update=_update(batch) if batch.windowed else None,
        )


def _update(batch: Any) -> dict[str, Any]:
    return {
        "index": batch.update_index,
        "end": batch.update_end,
        "step": batch.update_step,
        "num_steps": batch.update_num_steps,
        "tokens": batch.update_tokens,
        "samples": batch.update_samples,
        "short": batch.update_short,
    }


# --- plain DataLoader + DistributedSampler -----------------------------------------------------


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, dataset: LongTailTokens) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, dict[str, Any]]:
        return index, self.dataset[index]


def _collate_indexed(items: Sequence[tuple[int, dict[str, Any]]]) -> tuple[list[int], dict]:
    return [i for i, _ in items], pad_collate([s for _, s in items])


def fixed_loader(
    dataset: LongTailTokens, *, batch_size: int, world: int, rank: int, seed: int, workers: int
) -> torch.utils.data.DataLoader:
    sampler = torch.utils.data.DistributedSampler(
        _Indexed(dataset), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=False
    )
    return torch.utils.data.DataLoader(
        _Indexed(dataset),
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=_collate_indexed,
        num_workers=workers,
    )


def fixed_epoch(loader: torch.utils.data.DataLoader, epoch: int) -> Iterator[Step]:
    loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    for step, (ids, tensors) in enumerate(loader):
        yield Step(
            epoch=epoch,
            step=step,
            tensors=tensors,
            ids=ids,
            idle=False,
            loss_scale=1.0,
            num_tokens=int((tensors["labels"] != IGNORE_INDEX).sum()),
        )


# --- the paper's ODBDataLoader -----------------------------------------------------------------

SAMPLE_ID_KEY = "sample_id"


class _WithId(torch.utils.data.Dataset):
    def __init__(self, dataset: LongTailTokens) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[index], SAMPLE_ID_KEY: torch.tensor(index)}


def _paper_collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    import odb

    out: dict[str, Any] = pad_collate(samples)
    out[SAMPLE_ID_KEY] = [int(s[SAMPLE_ID_KEY]) for s in samples]
    for key in (odb.TOTAL_BATCH_SIZE_KEY, odb.TOTAL_TOKENS_KEY):
        if key in samples[0]:  # ODB's grouping writes its step totals into every sample
            out[key] = samples[0][key]
    return out


def paper_loader(
    dataset: LongTailTokens, *, token_budget: int, buffer: int, world: int, rank: int, seed: int
) -> Any:
    import odb

    sampler = torch.utils.data.DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=False
    )
    return odb.ODBDataLoader(
        _WithId(dataset),
        token_budget=token_budget,
        buffer_size=buffer,
        loss_scaling="exact",
        join=True,
        batch_size=1,
        sampler=sampler,
        num_workers=1,  # the fewest it allows; 2 cores are shared by every rank
        collate_fn=_paper_collate,
    )


def paper_epoch(loader: Any, epoch: int, world: int) -> Iterator[Step]:
    import odb

    loader.sampler.set_epoch(epoch)
    for step, batch in enumerate(loader):
        info = odb.pop_step_info(batch, loss_scaling="exact", world_size=world)
        ids = batch.pop(SAMPLE_ID_KEY)
        tensors = {k: batch[k] for k in ("input_ids", "labels")}
        yield Step(
            epoch=epoch,
            step=step,
            tensors=tensors,
            ids=ids,
            idle=False,
            loss_scale=float(info.loss_scale),
            num_tokens=int((tensors["labels"] != IGNORE_INDEX).sum()),
        )
