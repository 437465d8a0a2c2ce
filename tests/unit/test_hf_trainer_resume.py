"""ODBTrainer refuses a Trainer checkpoint resume by name (found by hand: accelerate's
skip_first_batches raised AttributeError on odbd's batches, after the model was restored)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from odbclient import ODBClient  # noqa: E402


@pytest.mark.timeout(120)
@pytest.mark.parametrize("resume", [True, "out/checkpoint-5"])
def test_resume_from_checkpoint_is_refused_with_the_way_to_resume(
    tmp_path: Path, resume: bool | str
) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from odbclient.adapters.hf import ODBTrainer

    config = GPT2Config(vocab_size=16, n_positions=16, n_embd=8, n_layer=1, n_head=1)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    client = ODBClient(rank=0, socket=str(tmp_path / "none.sock"), connect_timeout_s=0.1)
    torch.manual_seed(0)
    trainer = ODBTrainer(model=GPT2LMHeadModel(config), args=args, odb_client=client)
    with pytest.raises(ValueError, match="resuming from a Trainer checkpoint is not supported"):
        trainer.train(resume_from_checkpoint=resume)
    client.close()
