"""A tiny causal transformer and its per-token loss, shared by the DDP tests and benchmarks.

Only torch: the benchmark runs this module in a separate venv that has torch but not odbd.
Batches are right-padded (odbd's collation, or `pad_collate` here), so a causal model needs no
attention mask: position t attends to positions <= t, and every pad sits after the last real
token of its row. Labels are already shifted (see `ddp_data`): labels[t] is the target of
position t, -100 where there is no loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (torch convention)
from torch import nn

IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab: int = 64
    dim: int = 32
    heads: int = 2
    layers: int = 2
    max_len: int = 512

    def to_args(self) -> list[str]:
        return [f"--model-{k.replace('_', '-')}={v}" for k, v in asdict(self).items()]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if mask is None:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.pos = nn.Embedding(config.max_len, config.dim)
        self.blocks = nn.ModuleList(Block(config.dim, config.heads) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seq_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Padded rows (B, T), or one packed row (1, T) of samples whose boundaries are the
        cumulative lengths `cu_seq_lens` (odbd --collate packed): attention then stays inside
        each sample (a block-diagonal causal mask) and positions restart per sample."""
        t = input_ids.shape[1]
        positions = (
            torch.arange(t, device=input_ids.device) if position_ids is None else position_ids
        )
        if int(positions.max()) >= self.config.max_len:
            raise ValueError(
                f"position {int(positions.max())} exceeds max_len {self.config.max_len}"
            )
        x = self.embed(input_ids) + self.pos(positions)
        mask = None if cu_seq_lens is None else document_mask(cu_seq_lens, t)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def document_mask(cu_seq_lens: torch.Tensor, total: int) -> torch.Tensor:
    """(T, T) bool: query i may attend key j iff both are in one sample and j <= i."""
    sizes = (cu_seq_lens[1:] - cu_seq_lens[:-1]).long()
    sample = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    index = torch.arange(total)
    return (sample[:, None] == sample[None, :]) & (index[None, :] <= index[:, None])


def build_model(
    config: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The same initial weights in every process for the same seed."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = TinyCausalLM(config).to(dtype)
    torch.random.set_rng_state(generator_state)
    return model


def token_loss_sum(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy over the loss-bearing tokens (labels != -100)."""
    logits = model(input_ids)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def mean_token_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The rank's per-token mean loss, as a Hugging Face causal LM computes it."""
    count = int((batch["labels"] != IGNORE_INDEX).sum())
    return token_loss_sum(model, batch["input_ids"], batch["labels"]) / max(count, 1)


def packed_mean_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The rank's per-token mean loss on a packed batch with Hugging Face labels: the model
    shifts (position t predicts labels[t + 1]), and odbd's -100 separator at each sample's
    first label keeps a sample's last token from predicting the next sample."""
    logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seq_lens_q"])
    targets = batch["labels"][:, 1:].reshape(-1)
    total = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), targets, ignore_index=IGNORE_INDEX,
        reduction="sum",
    )  # fmt: skip
    return total / max(int((targets != IGNORE_INDEX).sum()), 1)


def pad_collate(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-pads input_ids with 0 and labels with -100, as odbd's default --pad does."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros((len(samples), longest), dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[row, :n] = torch.as_tensor(sample["input_ids"])
        labels[row, :n] = torch.as_tensor(sample["labels"])
    return {"input_ids": ids, "labels": labels}


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in model.parameters()
        ]
    )


def evaluate(model: nn.Module, samples: Sequence[Mapping[str, Any]], batch_size: int = 16) -> float:
    """Per-token mean loss over `samples` (no grad)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(samples), batch_size):
            batch = pad_collate(samples[start : start + batch_size])
            total += float(token_loss_sum(model, batch["input_ids"], batch["labels"]))
            count += int((batch["labels"] != IGNORE_INDEX).sum())
    return total / max(count, 1)


def uniform_loss(vocab: int) -> float:
    """The loss of a model that knows nothing: log(vocab)."""
    return math.log(vocab)
