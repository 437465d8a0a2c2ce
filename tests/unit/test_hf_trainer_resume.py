"""ODBTrainer.train(resume_from_checkpoint=...) refuses a checkpoint it cannot resume exactly
by naming the file and the fix, before the Trainer loads anything or the client connects
(its socket does not exist: a connect would raise DaemonUnavailableError instead)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from odbclient import ODBClient  # noqa: E402
from odbclient.adapters.hf_checkpoint import (  # noqa: E402
    CheckpointStateError,
    ClientCheckpoint,
    read_client_state,
    write_client_state,
)

pytestmark = pytest.mark.timeout(120)


def make_trainer(tmp_path: Path, job_id: str = "") -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from odbclient.adapters.hf import ODBTrainer

    config = GPT2Config(vocab_size=16, n_positions=16, n_embd=8, n_layer=1, n_head=1)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    client = ODBClient(
        rank=0, socket=str(tmp_path / "none.sock"), connect_timeout_s=0.1, job_id=job_id
    )
    torch.manual_seed(0)
    return ODBTrainer(model=GPT2LMHeadModel(config), args=args, odb_client=client)


def plain_checkpoint(tmp_path: Path, step: int = 5) -> Path:
    """What a plain transformers Trainer leaves: no odbd client state."""
    path = tmp_path / "out" / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def odbd_state(**overrides: Any) -> ClientCheckpoint:
    fields = dict(rank=0, world_size=1, job_id="job-a", global_step=5,
                  client={"version": 1, "epoch": 0, "step": 5})  # fmt: skip
    return ClientCheckpoint(**{**fields, **overrides})


def assert_refused_untouched(trainer: Any, resume: Any, *words: str) -> None:
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError) as refused:
        trainer.train(resume_from_checkpoint=resume)
    for word in words:
        assert word in str(refused.value), str(refused.value)
    assert "Nothing was trained" in str(refused.value) or "nothing was trained" in str(
        refused.value
    )
    assert trainer.state.global_step == 0 and trainer.odb_batches.last is None
    assert all((a == b).all() for a, b in zip(before, trainer.model.parameters(), strict=True))
    trainer.odb_batches.client.close()


@pytest.mark.parametrize("resume", [True, "path"])
def test_a_plain_trainer_checkpoint_is_refused_naming_the_missing_file(
    tmp_path: Path, resume: bool | str
) -> None:
    checkpoint = plain_checkpoint(tmp_path)
    trainer = make_trainer(tmp_path)
    assert_refused_untouched(
        trainer,
        str(checkpoint) if resume == "path" else True,
        f"{checkpoint}/odbd_client_rank0.json does not exist",
        "plain transformers Trainer",
    )


def test_a_checkpoint_of_another_world_is_refused_with_the_world_to_launch(tmp_path: Path):
    checkpoint = plain_checkpoint(tmp_path)
    write_client_state(checkpoint, odbd_state(world_size=4))
    assert_refused_untouched(
        make_trainer(tmp_path),
        str(checkpoint),
        "saved by rank 0 of a job of 4 ranks, but this is rank 0 of 1",
        "--world 4",
    )


def test_a_checkpoint_of_another_job_is_refused_naming_both_jobs(tmp_path: Path) -> None:
    checkpoint = plain_checkpoint(tmp_path)
    write_client_state(checkpoint, odbd_state(job_id="job-a"))
    assert_refused_untouched(
        make_trainer(tmp_path, job_id="job-b"),
        str(checkpoint),
        "odbd_client_rank0.json was saved by odbd job 'job-a'",
        "built for job 'job-b'",
    )


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps({"format": "odbd-client-state", "version": 9}), json.dumps([1])],
)
def test_an_unreadable_client_state_is_refused(tmp_path: Path, content: str) -> None:
    checkpoint = plain_checkpoint(tmp_path)
    (checkpoint / "odbd_client_rank0.json").write_text(content)
    assert_refused_untouched(make_trainer(tmp_path), str(checkpoint), "odbd_client_rank0.json")


def test_resume_true_without_any_checkpoint_is_refused(tmp_path: Path) -> None:
    assert_refused_untouched(make_trainer(tmp_path), True, "holds no checkpoint-N directory")


def test_the_client_state_round_trips_and_the_newest_checkpoint_is_read(tmp_path: Path):
    state = odbd_state(client={"version": 1, "epoch": 1, "step": 3, "update": 2})
    write_client_state(tmp_path / "checkpoint-5", state)
    assert not list(tmp_path.glob("**/*.partial"))
    assert read_client_state(tmp_path / "checkpoint-5", rank=0, world_size=1) == state
    with pytest.raises(CheckpointStateError, match="rank 1's odbd stream"):
        read_client_state(tmp_path / "checkpoint-5", rank=1, world_size=2)
