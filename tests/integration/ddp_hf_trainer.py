"""A rank training a tiny Hugging Face Llama through odbd, with the Trainer or Accelerate adapter.

    RANK=... WORLD_SIZE=... (torchrun-like, see ddp_launch) HF_HUB_OFFLINE=1 \\
        python -m tests.integration.ddp_hf_trainer --framework hf|accelerate --out-dir DIR

The model is built from a config with fixed-seed random weights (no download) in float64. Each
rank appends {"epoch", "step", "ids", "idle", "loss_scale"} per step to DIR/rank{r}.jsonl; rank 0
saves the gradient DDP produced for the first step (taken at the initial weights) to
DIR/grad-first.pt, so the test can compare it with one process's per-token mean gradient.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from odbclient import Batch, ODBClient
from tests.integration.rank_exit import end_rank

MODEL_SEED = 0


def tiny_llama(use_cache: bool = True) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="eager",
        use_cache=use_cache,
    )
    torch.manual_seed(MODEL_SEED)
    return LlamaForCausalLM(config).to(torch.float64)


def tiny_gpt2(use_cache: bool = True) -> Any:
    """GPT-2 under sdpa (its default kernel), with GPT-2's default use_cache=True unless off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=512, bos_token_id=0,
        eos_token_id=0, attn_implementation="sdpa", use_cache=use_cache,
    )  # fmt: skip
    torch.manual_seed(MODEL_SEED)
    return GPT2LMHeadModel(config).to(torch.float64)


def build_model(args: argparse.Namespace) -> Any:
    make = tiny_gpt2 if args.model == "gpt2" else tiny_llama
    return make(use_cache=args.cache != "off")  # "default": the configs' default, True


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in
         model.parameters()]
    )  # fmt: skip


class StepLog:
    """Per-step records of one rank, and the first step's gradient on rank 0."""

    def __init__(self, out_dir: Path, rank: int) -> None:
        self.out_dir, self.rank = out_dir, rank
        self.report = open(out_dir / f"rank{rank}.jsonl", "a")  # noqa: SIM115
        self.saved_grad = False

    def step(
        self, batch: Batch, model: torch.nn.Module, *, micro: bool = False, **extra: Any
    ) -> None:
        """One step's record; `micro`: a micro-step inside an update (no gradient saved)."""
        record = {"epoch": batch.epoch, "step": batch.step, "ids": list(batch.sample_ids),
                  "idle": batch.is_idle, "loss_scale": batch.loss_scale,
                  "progress": dataclasses.asdict(batch.progress),
                  "update": {"index": batch.update_index, "end": batch.update_end,
                             "num_steps": batch.update_num_steps,
                             "tokens": batch.update_tokens, "short": batch.update_short},
                  **extra, **({"micro": True} if micro else {})}  # fmt: skip
        self.report.write(json.dumps(record) + "\n")
        self.report.flush()
        if micro:
            return  # (the record says "micro": True)
        if self.rank == 0 and not self.saved_grad:
            torch.save(flat_grad(model).detach().clone(), self.out_dir / "grad-first.pt")
        self.saved_grad = True

    def close(self, **closing: Any) -> None:
        self.report.write(json.dumps({"done": True, **closing}) + "\n")
        self.report.close()


def train_hf(args: argparse.Namespace, client: ODBClient, log: StepLog) -> dict[str, Any]:
    from transformers import TrainerCallback, TrainingArguments

    from odbclient.adapters.hf import ODBTrainer

    class RecordSteps(TrainerCallback):
        def on_pre_optimizer_step(self, _args, state, _control, **kwargs: Any) -> None:
            assert trainer.odb_batches.last is not None
            lr = kwargs["optimizer"].param_groups[0]["lr"]  # the LR of the step being taken
            log.step(trainer.odb_batches.last, kwargs["model"], lr=lr, max_steps=state.max_steps)

    class RecordEvals(TrainerCallback):
        losses: list[float] = []

        def on_evaluate(self, _args, _state, _control, metrics=None, **_: Any) -> None:
            self.losses.append(float((metrics or {}).get("eval_loss", float("nan"))))

    class RecordedTrainer(ODBTrainer):
        """Records every micro-step as the Trainer takes it from the loader: with
        gradient_accumulation_steps it prefetches an update's batches before running them, so
        the callbacks only ever see the update's last one."""

        def get_train_dataloader(self) -> Any:
            batches = super().get_train_dataloader()
            return _Recorded(batches, lambda batch: log.step(batch, self.model, micro=True))

    training_args = TrainingArguments(
        output_dir=str(args.out_dir / "hf"),
        max_steps=args.max_steps,  # 0: no cap, training ends with odbd's job
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        per_device_train_batch_size=1,  # unused: odbd sizes the batches
        gradient_accumulation_steps=args.grad_accum,  # odbd --accumulate must match
        max_grad_norm=0.0,  # no clipping, so the first step's gradient is DDP's own
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,
        # --eval-steps N: the Trainer's own evaluation of an eval_dataset every N steps,
        # between odbd's training steps (its batches carry no loss scale)
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        per_device_eval_batch_size=2,
        # The Trainer sets the model's config.use_cache to this (False unless --cache on).
        use_cache=args.cache == "on",
    )
    eval_dataset = None
    if args.eval_steps:
        rows = torch.arange(8 * 6).remainder(60).add(1).reshape(8, 6)  # 8 samples of 6 tokens
        eval_dataset = [{"input_ids": row, "labels": row} for row in rows]
    trainer_class = RecordedTrainer if args.grad_accum > 1 else ODBTrainer
    trainer = trainer_class(model=build_model(args), args=training_args, odb_client=client,
                            eval_dataset=eval_dataset,
                            callbacks=[RecordSteps(), RecordEvals()])  # fmt: skip
    result = trainer.train()
    history = trainer.state.log_history
    return {"global_step": result.global_step, "train_loss": result.training_loss,
            "eval_losses": RecordEvals.losses, "final_log": history[-1] if history else {},
            "logged_epochs": [h["epoch"] for h in history if "loss" in h]}  # fmt: skip


class _Recorded:
    """Iterates an ODBBatches, calling `record` with each new odbd batch (fillers skipped)."""

    def __init__(self, batches: Any, record: Any) -> None:
        self.batches, self.record = batches, record

    def __iter__(self) -> Any:
        seen = None
        for item in self.batches:
            if self.batches.last is not seen:
                seen = self.batches.last
                self.record(seen)
            yield item


def train_accelerate(args: argparse.Namespace, client: ODBClient, log: StepLog) -> dict:
    from accelerate import Accelerator

    from odbclient.adapters.accelerate import ODBAccelerate

    # --accelerator-default: the docs' bare Accelerator(), which on a machine without GPUs
    # does not join the launched processes (the adapter must say so).
    accelerator = Accelerator() if args.accelerator_default else Accelerator(cpu=True)
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    odb = ODBAccelerate(accelerator, client, model=model)  # checks a packed job's model
    steps = 0
    while not client.job_ended:
        for step in odb:
            with odb.sync(model, step):  # no_sync() before an odbd update's last micro-step
                loss = model(**step.inputs).loss
                odb.backward(loss, step)
            end = step.batch.update_end
            log.step(step.batch, accelerator.unwrap_model(model), micro=not end)
            if end:
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                if steps == args.max_steps:  # the loop's own cap: every rank ends the job here
                    client.end_job()
                    break
    return {"global_step": steps, "world": accelerator.num_processes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ddp_hf_trainer")
    p.add_argument("--framework", choices=["hf", "accelerate"], required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--accelerator-default", action="store_true", help="Accelerator(), no cpu=True")
    p.add_argument("--max-steps", type=int, default=10_000)
    p.add_argument("--lr-schedule", default="constant")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grad-accum", type=int, default=1, help="HF gradient_accumulation_steps")
    p.add_argument("--eval-steps", type=int, default=0, help="HF evaluation every N steps")
    p.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    p.add_argument(
        "--cache", choices=["default", "on", "off"], default="default",
        help="KV cache in training: default = the config's (True) and the Trainer's (False)",
    )  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))  # unset: one process (accelerate launch --cpu)
    client = ODBClient(rank=rank, deadline_s=120.0)
    log = StepLog(args.out_dir, rank)
    train = train_hf if args.framework == "hf" else train_accelerate
    try:
        log.close(**train(args, client, log))
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    end_rank(main())  # an exception propagates before it, with its traceback and status 1
