"""`accelerator.save_state()` / `load_state()` carry the rank's odbd client state when the loop
uses ODBAccelerate (one CPU process, a real Accelerator): the state round-trips, and a
checkpoint that cannot resume exactly is refused by name before Accelerate loads anything
(the model keeps its weights, the client its position)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402

from odbclient import ODBClient  # noqa: E402
from odbclient.adapters.hf_checkpoint import (  # noqa: E402
    CheckpointStateError,
    ClientCheckpoint,
    write_client_state,
)
from odbclient.errors import StateDictError  # noqa: E402
from tests.unit.test_client_logic import (  # noqa: E402, F401 (the fake daemon fixture)
    FakeDaemon,
    client_for,
    daemon,
    epoch_end,
    job_end,
    wait_until_cancelled,
    with_update,
)

pytestmark = pytest.mark.timeout(120)


def make_loop(
    tmp_path: Path, *, seed: int, client: ODBClient | None = None, **accelerator_args: Any
) -> Any:
    """A fresh Accelerator (its state is per process, not per object) with a model, an
    optimizer and ODBAccelerate; `seed` makes the weights differ between loops."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from odbclient.adapters.accelerate import ODBAccelerate

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, **accelerator_args)
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    if client is None:
        client = ODBClient(rank=0, socket=str(tmp_path / "none.sock"), connect_timeout_s=0.1)
    return accelerator, model, ODBAccelerate(accelerator, client)


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_save_state_writes_the_ranks_client_state_and_load_state_restores_it(tmp_path: Path):
    accelerator, model, odb = make_loop(tmp_path, seed=1)
    odb.client.load_state_dict({"version": 1, "epoch": 1, "step": 3, "update": 2})
    accelerator.save_state(str(tmp_path / "ckpt"))
    saved = json.loads((tmp_path / "ckpt" / "odbd_client_rank0.json").read_text())
    assert (saved["rank"], saved["world_size"], saved["job_id"]) == (0, 1, "")
    assert saved["client"] == {"version": 1, "epoch": 1, "step": 3, "update": 2}
    assert not list((tmp_path / "ckpt").glob("custom_checkpoint_*"))  # hooks, not registered
    saved_weights = weights(model)

    accelerator, model, odb = make_loop(tmp_path, seed=2)
    assert not same(weights(model), saved_weights)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert same(weights(model), saved_weights)
    assert odb.client.state_dict() == {"version": 1, "epoch": 1, "step": 3, "update": 2}
    assert odb.client.epoch == 1  # where a `for epoch in range(odb.client.epoch, n)` starts
    assert odb.resumed_from == tmp_path / "ckpt" / "odbd_client_rank0.json"


def test_load_state_of_the_newest_automatic_checkpoint_continues_accelerates_numbering(
    tmp_path: Path,
) -> None:
    """Accelerate restarts its count at 0 after load_state(): the next save_state() raised on
    the existing checkpoint_0 (or, rotated away, wrote one that the next resume skips)."""
    from accelerate.utils import ProjectConfiguration

    def project() -> Any:
        return ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)

    accelerator, _, odb = make_loop(tmp_path, seed=1, project_config=project())
    accelerator.save_state()
    odb.client.load_state_dict({"version": 1, "epoch": 0, "step": 7})
    accelerator.save_state()
    accelerator, _, odb = make_loop(tmp_path, seed=2, project_config=project())
    accelerator.load_state()  # the newest: checkpoint_1
    assert odb.client.state_dict() == {"version": 1, "epoch": 0, "step": 7}
    assert accelerator.save_iteration == 2
    accelerator.save_state()
    assert (tmp_path / "checkpoints" / "checkpoint_2" / "odbd_client_rank0.json").exists()


def plain_checkpoint(tmp_path: Path) -> Path:
    """accelerator.save_state() of a loop without ODBAccelerate: no odbd client state."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(1)
    accelerator.prepare(torch.nn.Linear(4, 2))
    accelerator.save_state(str(tmp_path / "plain"))
    return tmp_path / "plain"


def assert_refused_untouched(tmp_path: Path, checkpoint: Path, *words: str, **loop: Any) -> None:
    accelerator, model, odb = make_loop(tmp_path, seed=2, **loop)
    before = weights(model)
    with pytest.raises(CheckpointStateError) as refused:
        accelerator.load_state(str(checkpoint))
    for word in words:
        assert word in str(refused.value), str(refused.value)
    assert same(weights(model), before), "the model was loaded before the refusal"
    assert odb.client.state_dict() == {"version": 1, "epoch": 0, "step": 0}
    assert odb.resumed_from is None


def test_a_checkpoint_saved_without_odbaccelerate_is_refused_naming_the_missing_file(
    tmp_path: Path,
) -> None:
    checkpoint = plain_checkpoint(tmp_path)
    assert_refused_untouched(
        tmp_path,
        checkpoint,
        f"{checkpoint}/odbd_client_rank0.json does not exist",
        "accelerator.save_state() in a loop without ODBAccelerate",
        "Nothing was trained",
    )


def test_a_checkpoint_of_another_world_is_refused_with_the_launch_to_use(tmp_path: Path) -> None:
    checkpoint = plain_checkpoint(tmp_path)
    write_client_state(checkpoint, ClientCheckpoint(0, 2, "job-a", 0, {"version": 1, "epoch": 0,
                                                                        "step": 4}))  # fmt: skip
    assert_refused_untouched(
        tmp_path,
        checkpoint,
        "saved by rank 0 of a job of 2 ranks, but this is rank 0 of 1",
        "accelerate launch --num_processes 2",
        "--world 2",
    )


def test_a_checkpoint_of_another_job_is_refused_naming_both_jobs(tmp_path: Path) -> None:
    checkpoint = plain_checkpoint(tmp_path)
    write_client_state(checkpoint, ClientCheckpoint(0, 1, "job-a", 0, {"version": 1, "epoch": 0,
                                                                        "step": 4}))  # fmt: skip
    client = ODBClient(rank=0, socket=str(tmp_path / "none.sock"), job_id="job-b")
    assert_refused_untouched(
        tmp_path,
        checkpoint,
        "odbd_client_rank0.json was saved by odbd job 'job-a'",
        "built for job 'job-b'",
        client=client,
    )


@pytest.mark.timeout(60)
def test_load_state_after_the_loop_started_is_refused_before_anything_is_loaded(
    tmp_path: Path,
    daemon: FakeDaemon,  # noqa: F811 (the fixture imported above)
) -> None:
    def script(hello: Any, context: Any) -> Any:
        yield daemon.welcome()
        yield epoch_end(0, num_steps=0)
        yield job_end()

    daemon.script = script
    accelerator, model, odb = make_loop(tmp_path, seed=1)
    accelerator.save_state(str(tmp_path / "ckpt"))
    with client_for(daemon) as client:
        accelerator, model, odb = make_loop(tmp_path, seed=2, client=client)
        assert list(odb) == [] and client.started
        before = weights(model)
        with pytest.raises(StateDictError, match=r"load_state\(.*\) after ODBAccelerate started"):
            accelerator.load_state(str(tmp_path / "ckpt"))
        assert same(weights(model), before)
    assert len(daemon.hellos) == 1 and not daemon.hellos[0].resume


@pytest.mark.timeout(60)
def test_save_state_inside_an_odbd_update_is_refused_before_accelerate_writes_anything(
    tmp_path: Path,
    daemon: FakeDaemon,  # noqa: F811 (the fixture imported above)
) -> None:
    def script(hello: Any, context: Any) -> Any:
        yield daemon.welcome()
        for step in range(2):
            yield with_update(daemon.step(0, step, [2]), 0, step, 2)
        wait_until_cancelled(context)

    daemon.script = script
    with client_for(daemon) as client:
        accelerator, _, odb = make_loop(tmp_path, seed=1, client=client)
        steps = iter(odb)
        assert not next(steps).batch.update_end
        with pytest.raises(
            StateDictError, match=r"save_state\(.*mid\): state_dict\(\) in the middle"
        ):
            accelerator.save_state(str(tmp_path / "mid"))
        assert list((tmp_path / "mid").iterdir()) == []  # no model, optimizer or RNG file
        assert next(steps).batch.update_end
        accelerator.save_state(str(tmp_path / "end"))
    saved = json.loads((tmp_path / "end" / "odbd_client_rank0.json").read_text())
    assert saved["client"] == {"version": 1, "epoch": 0, "step": 2, "update": 1}
    assert saved["job_id"] == "test"  # the daemon's, for the resume's job check
