"""packed_check.py: models that attend across a packed row's samples are refused with the fix.

Tiny random-weight transformers models (float32, CPU): Llama and GPT-2 honour the boundaries
under eager and sdpa when called without a KV cache and without an attention_mask; with
either they attend across samples, silently, and the probe names which one to remove. A model
whose kernel ignores the boundaries outright is refused with --collate padded as the fix.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import transformers

from odbclient import PackedAttentionError, check_packed_model
from odbclient.trainer.packed_check import attention_kernel, probe_packed


def tiny_llama(attn: str, use_cache: bool) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation=attn, use_cache=use_cache,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2(attn: str, use_cache: bool) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
        eos_token_id=0, attn_implementation=attn, use_cache=use_cache,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


class RowAttention(torch.nn.Module):
    """A causal LM whose attention runs over the whole row: positions and cu_seq_lens ignored."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        out, _ = self.attn(x, x, x, attn_mask=mask)
        return {"logits": self.head(out)}


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}
PACKED_KEYS = ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_model_without_cache_or_mask_is_accepted(name: str, attn: str) -> None:
    model = MODELS[name](attn, use_cache=False).train()
    verdict = check_packed_model(model, PACKED_KEYS)
    assert verdict is not None and verdict.honours_boundaries
    assert verdict.model_type == name and verdict.kernel == attn
    assert verdict.packed_error < 1e-5 < 0.05 < verdict.ignored_error
    assert model.training  # the probe's eval mode is undone


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_kv_cache_is_refused_naming_the_model_the_kernel_and_use_cache(
    name: str, attn: str
) -> None:
    model = MODELS[name](attn, use_cache=True)
    with pytest.raises(PackedAttentionError) as refused:
        check_packed_model(model, PACKED_KEYS)
    message = str(refused.value)
    assert f"model {name} with attention {attn!r}" in message
    assert "Nothing was trained" in message
    assert "model.config.use_cache = False (" in message
    assert "attention_mask" not in message


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_attention_mask_in_the_samples_is_refused_naming_it(name: str) -> None:
    model = MODELS[name]("sdpa", use_cache=False)
    with pytest.raises(PackedAttentionError, match="drop the attention_mask key"):
        check_packed_model(model, (*PACKED_KEYS, "attention_mask"))


def test_both_causes_are_named_when_both_are_needed() -> None:
    with pytest.raises(PackedAttentionError) as refused:
        check_packed_model(tiny_llama("sdpa", use_cache=True), (*PACKED_KEYS, "attention_mask"))
    assert "use_cache = False" in str(refused.value)
    assert "drop the attention_mask key" in str(refused.value)


def test_a_kernel_that_ignores_the_boundaries_is_refused_with_collate_padded() -> None:
    model = RowAttention()
    verdict = probe_packed(model, PACKED_KEYS)
    assert not verdict.honours_boundaries
    assert verdict.packed_error == pytest.approx(verdict.ignored_error)  # positions unused
    with pytest.raises(PackedAttentionError, match="--collate padded") as refused:
        check_packed_model(model, PACKED_KEYS)
    assert "model RowAttention with attention 'unknown'" in str(refused.value)


def test_a_wrapped_model_is_probed_inside_its_wrapper() -> None:
    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    inner = tiny_llama("sdpa", use_cache=False)
    assert attention_kernel(Wrapper(inner)) == "sdpa"
    assert check_packed_model(Wrapper(inner), PACKED_KEYS) is not None


def test_a_model_the_probe_cannot_run_is_not_refused_but_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class NoLogits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w(x)

    with caplog.at_level(logging.WARNING, logger="odbclient.trainer.packed_check"):
        assert check_packed_model(NoLogits(), PACKED_KEYS) is None
    assert "could not check whether NoLogits honours packed sample boundaries" in caplog.text
