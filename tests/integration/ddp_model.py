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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.config.max_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_len {self.config.max_len}")
        x = self.embed(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


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
