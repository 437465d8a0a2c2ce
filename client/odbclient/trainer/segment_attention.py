"""Attention that runs per sample of a packed row: a packed row costs its samples' squares.

transformers' `sdpa` and `eager` keep the samples of a packed row apart with a block-diagonal
mask, but still compute the row's full T x T scores: a row of T tokens costs `a T + b T^2` and
a packed row of 4096 tokens is slower than 4 padded rows of 1024 (issue 27). FlashAttention
varlen skips the masked blocks, on GPUs only. This module's attention function skips them on
any device: it cuts the row at its sample boundaries (where `position_ids` restart, or
`cu_seq_lens_q`) and runs torch's `scaled_dot_product_attention` once per sample, so the row
costs the sum of its samples' squares, as varlen does.

    from odbclient.trainer.segment_attention import register_segment_attention
    name = register_segment_attention()          # "odbd_segments"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    # or model.set_attn_implementation(name) on a loaded model

Safe for models that call transformers' attention interface with (batch, heads, tokens, dim)
query/key/value and apply rotary positions before it (Llama, Qwen2, Mistral, Gemma...); not for
models with their own attention code (GPT-2 under transformers 5 calls the interface too, but
check with `check_packed_model`). For a custom name transformers builds no attention mask, so a
batch's 2D `attention_mask` is not seen here: right padding is harmless under causal attention
(the padding sits after every real token and its labels are -100), left padding is not: use it
for packed rows and right-padded batches. The cost is one small sdpa call per sample and layer
(a Python loop): worth it when rows hold samples of hundreds of tokens, not of a few.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SEGMENT_ATTENTION = "odbd_segments"


def register_segment_attention(name: str = SEGMENT_ATTENTION) -> str:
    """Registers `segment_attention_forward` with transformers under `name` (idempotent) and
    returns the name to pass as `attn_implementation`."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, segment_attention_forward)
    return name


def segment_bounds(
    position_ids: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
    batch: int,
    length: int,
) -> list[list[tuple[int, int]]]:
    """Per row of the batch, the (start, end) of each sample: from `cu_seq_lens` (one packed
    row), else where `position_ids` do not go up by one (transformers' own packed-sequence
    rule), else the whole row."""
    if cu_seq_lens is not None and batch == 1:
        cu = [int(v) for v in cu_seq_lens.reshape(-1).tolist()]
        spans = [(s, e) for s, e in zip(cu, cu[1:], strict=False) if e > s]
        if spans and spans[-1][1] == length and spans[0][0] == 0:
            return [spans]
    if position_ids is None:
        return [[(0, length)] for _ in range(batch)]
    positions = position_ids.reshape(-1, position_ids.shape[-1])
    if positions.shape[0] != batch:
        positions = positions.expand(batch, -1)
    bounds = []
    for row in positions:
        steps = row[1:] - row[:-1]
        starts = [0, *(int(i) + 1 for i in torch.nonzero(steps != 1).reshape(-1).tolist())]
        bounds.append(list(zip(starts, [*starts[1:], length], strict=True)))
    return bounds


def segment_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (AttentionInterface): query (B, H, T, D), key/value
    (B, H_kv, T, D) in, (B, T, H, D) out, as `sdpa_attention_forward`. A 4D mask (a model that
    builds its own) or a KV cache (query shorter than key) falls back to transformers' sdpa."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    batch, _, length, _ = query.shape
    if attention_mask is not None or key.shape[2] != length:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )  # fmt: skip
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    bounds = segment_bounds(kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"), batch, length)
    rows = []
    for b, spans in enumerate(bounds):
        parts = [
            F.scaled_dot_product_attention(
                query[b : b + 1, :, s:e],
                key[b : b + 1, :, s:e],
                value[b : b + 1, :, s:e],
                dropout_p=dropout,
                scale=scaling,
                is_causal=causal and e - s > 1,
            )  # fmt: skip
            for s, e in spans
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if batch == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None
