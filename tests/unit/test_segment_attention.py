"""segment_attention.py: a packed row through the per-sample attention equals its samples
run one by one (float64, random-init tiny Llama), its cost follows the samples' squares, and
the packed probe accepts it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from odbclient import check_packed_model
from odbclient.trainer.segment_attention import (
    SEGMENT_ATTENTION,
    register_segment_attention,
    segment_bounds,
)

LENGTHS = (7, 1, 12, 5)  # a one-token sample too


def tiny_llama(attn: str, dtype: torch.dtype = torch.float64) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation=attn, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(dtype).train()


def packed_row(lengths: tuple[int, ...]) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "input_ids": torch.randint(0, 64, (1, total)),
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }


def one_by_one(model: Any, row: dict[str, torch.Tensor], lengths: tuple[int, ...]) -> torch.Tensor:
    out, start = [], 0
    for n in lengths:
        ids = row["input_ids"][:, start : start + n]
        out.append(model(input_ids=ids, position_ids=torch.arange(n)[None]).logits)
        start += n
    return torch.cat(out, dim=1)


def test_bounds_come_from_cu_seq_lens_or_position_resets() -> None:
    row = packed_row(LENGTHS)
    spans = [(0, 7), (7, 8), (8, 20), (20, 25)]
    assert segment_bounds(None, row["cu_seq_lens_q"], 1, 25) == [spans]
    assert segment_bounds(row["position_ids"], None, 1, 25) == [spans]
    assert segment_bounds(None, None, 2, 25) == [[(0, 25)], [(0, 25)]]
    plain = torch.arange(25)[None].expand(2, -1)
    assert segment_bounds(plain, None, 2, 25) == [[(0, 25)], [(0, 25)]]


@pytest.mark.parametrize("keys", ["cu_seq_lens", "position_ids only"])
def test_packed_logits_and_gradients_equal_the_samples_run_one_by_one(keys: str) -> None:
    name = register_segment_attention()
    model = tiny_llama(name)
    row = packed_row(LENGTHS)
    if keys == "position_ids only":
        row = {k: v for k, v in row.items() if k in ("input_ids", "position_ids")}
    packed = model(**row).logits
    alone = one_by_one(model, row, LENGTHS)
    assert packed.shape == alone.shape
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)
    # The same as transformers' own sdpa (block-diagonal mask over the row), gradients too.
    reference = tiny_llama("sdpa")
    reference.load_state_dict(model.state_dict())
    expected = reference(**row).logits
    torch.testing.assert_close(packed, expected, rtol=1e-10, atol=1e-10)
    packed.square().mean().backward()
    expected.square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-10, msg=n)


def test_ignoring_the_boundaries_changes_the_logits_so_the_check_can_fail() -> None:
    """Without restarting positions the row is one sample: the comparison above is not vacuous."""
    model = tiny_llama(register_segment_attention())
    row = packed_row(LENGTHS)
    whole = model(input_ids=row["input_ids"], position_ids=torch.arange(25)[None]).logits
    assert (whole - one_by_one(model, row, LENGTHS)).abs().max() > 1e-3


def test_a_padded_batch_runs_like_sdpa_under_causal_attention() -> None:
    model = tiny_llama(register_segment_attention())
    reference = tiny_llama("sdpa")
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(
        model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-10, atol=1e-10
    )


def test_the_packed_probe_accepts_it() -> None:
    model = tiny_llama(register_segment_attention(), dtype=torch.float32)
    verdict = check_packed_model(model, ("input_ids", "labels", "position_ids", "cu_seq_lens_q"))
    assert verdict is not None and verdict.honours_boundaries
    assert verdict.kernel == SEGMENT_ATTENTION
    assert verdict.packed_error < 1e-5 < 0.05 < verdict.ignored_error


def test_a_packed_row_costs_its_samples_squares_not_the_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """16 samples of 256 in one row of 4096: sdpa scores the 4096^2 pairs, the segment kernel
    16 x 256^2, a sixteenth. Counted, not timed (the speed is docs/bench/packed.md's, measured
    by tests/bench/packed_kernel_ab.py): every attention call's query x key pairs."""
    scored: list[int] = []
    attend = torch.nn.functional.scaled_dot_product_attention

    def counting(query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        scored.append(query.shape[0] * query.shape[1] * query.shape[-2] * key.shape[-2])
        return attend(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    name = register_segment_attention()
    row = packed_row((256,) * 16)
    pairs = {}
    for attn in ("sdpa", name):
        scored.clear()
        with torch.no_grad():
            tiny_llama(attn, dtype=torch.float32).eval()(**row)
        pairs[attn] = sum(scored)
    assert pairs["sdpa"] > 0 and pairs["sdpa"] == 16 * pairs[name]
