"""A trainer rank that feeds odbd's packed batches to a transformers Llama as they are.

    python -m tests.integration.hf_packed_trainer --rank R --socket S --report FILE \\
        --data-arg size=N ...

For every batch (odbd --collate packed) it runs a random-init tiny LlamaForCausalLM in float64
(sdpa, no KV cache) on `batch.tensors` as they come, and on the batch's samples one by one from
the dataset (`ddp_data.LongTailTokens` with Hugging Face labels), and writes the relative error
of the per-token losses and of the gradients of their mean, plus the same for the batch with
the boundaries ignored (positions 0..T-1), one JSON line per step.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import transformers

from odbclient import ODBClient
from tests.integration.ddp_data import LongTailTokens
from tests.integration.ddp_trainer import data_kwargs


def tiny_llama(vocab: int) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().train()


def token_losses(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    shifted = inputs["labels"][:, 1:].reshape(-1)
    keep = shifted != -100
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat[keep], shifted[keep], reduction="none")


def losses_and_grad(model: Any, inputs: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad()
    per_token = torch.cat([token_losses(model, x) for x in inputs])
    (per_token.sum() / per_token.numel()).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return per_token.detach(), grad.clone()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm()) if a.shape == b.shape else float("inf")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hf_packed_trainer")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--report", required=True)
    # The daemon's --epochs decides how many epochs the client yields; the harness passes every
    # trainer module --epochs, so it is accepted and not used.
    p.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    dataset = LongTailTokens(**data_kwargs(args.data_arg))
    model = tiny_llama(dataset.vocab)
    client = ODBClient(rank=args.rank, socket=args.socket, deadline_s=120.0)
    try:
        with open(args.report, "a") as report:
            for batch in client:
                record: dict[str, Any] = {"step": batch.step, "idle": batch.is_idle}
                record |= {"epoch": batch.epoch, "ids": list(batch.sample_ids)}
                if not batch.is_idle:
                    packed = losses_and_grad(model, [batch.tensors])
                    alone = [
                        {k: torch.from_numpy(v)[None] for k, v in dataset[i].items()}
                        for i in batch.sample_ids
                    ]
                    reference = losses_and_grad(model, alone)
                    crossing = {k: batch.tensors[k] for k in ("input_ids", "labels")}
                    ignored = losses_and_grad(model, [crossing])
                    record |= {
                        "shape": list(batch["input_ids"].shape),  # type: ignore[union-attr]
                        "loss_error": relative(packed[0], reference[0]),
                        "grad_error": relative(packed[1], reference[1]),
                        "ignored_loss_error": relative(ignored[0], reference[0]),
                    }
                report.write(json.dumps(record) + "\n")
            report.write(json.dumps({"done": True}) + "\n")
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
