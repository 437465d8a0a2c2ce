"""A transformers causal LM takes odbd's packed batches as they are (issue 13).

A randomly initialised tiny Llama (built from a config: no download) in float64 gives, on one
packed batch from odbclient's collation, the same per-token losses and the same gradients as on
the same samples run one by one; ignoring the boundaries (plain positions 0..T-1, so attention
crosses samples) is shown to differ.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odbclient.trainer.collate import BatchForm, collate

transformers = pytest.importorskip("transformers")

VOCAB = 97
LENGTHS = [7, 1, 12, 3, 9, 2]
PACKED = BatchForm(packed=True)


def make_samples(seed: int = 0) -> list[dict[str, np.ndarray]]:
    """HF labels (the model shifts): labels = input_ids with a masked prompt, labels[0] = -100."""
    rng = np.random.default_rng(seed)
    samples = []
    for n in LENGTHS:
        ids = rng.integers(1, VOCAB, size=n).astype(np.int64)
        labels = ids.copy()
        labels[: max(1, n // 3)] = -100  # prompt, which includes the first token
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def tiny_llama(attn: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation=attn,
        # Training runs without a KV cache; with one, transformers 5.24 does not look for
        # packed position_ids and attention crosses samples (docs/training.md says so).
        use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().train()


def token_losses(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """Cross-entropy of every shifted label that is not -100, in order."""
    labels = inputs["labels"]
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    shifted = labels[:, 1:].reshape(-1)
    keep = shifted != -100
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat[keep], shifted[keep], reduction="none")


def one_by_one(model: torch.nn.Module, samples) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    losses = [
        token_losses(model, {k: torch.from_numpy(v)[None] for k, v in s.items()}) for s in samples
    ]
    per_token = torch.cat(losses)
    (per_token.sum() / per_token.numel()).backward()
    return per_token.detach(), [p.grad.clone() for p in model.parameters()]


def packed(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    per_token = token_losses(model, inputs)
    (per_token.sum() / per_token.numel()).backward()
    return per_token.detach(), [p.grad.clone() for p in model.parameters()]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# sdpa only: Llama's eager attention computes its softmax in float32 whatever the model dtype,
# so it agrees with itself run one by one to ~1e-9 only (measured 1.2e-9), not float64's 1e-15.
@pytest.mark.parametrize("attn", ["sdpa"])
def test_packed_batch_matches_samples_one_by_one_in_float64(attn: str) -> None:
    samples = make_samples()
    batch = collate(samples, pads={}, form=PACKED).tensors
    assert batch["input_ids"].shape == (1, sum(LENGTHS))
    model = tiny_llama(attn)
    reference, reference_grads = one_by_one(model, samples)
    # The model takes the batch as it is: input_ids, labels, position_ids, cu_seq_lens_q/k and
    # max_length_q/k (the latter are ignored by sdpa/eager, used by FlashAttention varlen).
    # (HF's own loss casts logits to float32, hence the looser tolerance on it.)
    loss = model(**batch).loss.detach()
    assert float(loss) == pytest.approx(float(reference.mean()), rel=1e-6)
    got, grads = packed(model, batch)
    assert got.shape == reference.shape
    assert relative_error(got, reference) < 1e-9
    for g, r in zip(grads, reference_grads, strict=True):
        assert relative_error(g, r) < 1e-9


def test_ignoring_sample_boundaries_changes_losses_and_gradients() -> None:
    samples = make_samples()
    batch = collate(samples, pads={}, form=PACKED).tensors
    model = tiny_llama("sdpa")
    reference, reference_grads = one_by_one(model, samples)
    # Without restarting positions HF sees one sequence: attention crosses the samples.
    crossing = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    got, grads = packed(model, crossing)
    assert relative_error(got, reference) > 1e-3
    assert max(relative_error(g, r) for g, r in zip(grads, reference_grads, strict=True)) > 1e-3


def test_the_label_separator_keeps_the_last_token_from_predicting_the_next_sample() -> None:
    samples = make_samples()
    for s in samples:
        s["labels"][0] = 5  # not masked: the collation must mask it
    batch = collate(samples, pads={}, form=PACKED).tensors
    starts = batch["cu_seq_lens_q"][:-1].long()
    assert (batch["labels"][0, starts] == -100).all()
    assert batch["labels"].shape == batch["position_ids"].shape == (1, sum(LENGTHS))
