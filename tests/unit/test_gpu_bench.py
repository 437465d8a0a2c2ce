"""tests/gpu/bench_training_gpu.py cannot run here (no GPU): its --dry-run runs every in-process
data path on CPU with a tiny model, so a broken import or wiring fails `make test`."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.gpu import bench_training_gpu  # noqa: E402


def test_dry_run_trains_every_in_process_path_and_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    assert bench_training_gpu.main(["--dry-run", "--out", str(out)]) == 0
    table = out.read_text()
    for name in ("DataLoader fixed batch", "HF group_by_length", "HF DataCollatorWithFlattening",
                 "token-budget buckets", "cosmos-rl-style load-balanced"):  # fmt: skip
        assert f"| {name}" in table, table
    assert "| HF DataCollatorWithFlattening | batch 8 | 3 | " in table  # 24 samples, 8 a row


def test_without_a_gpu_it_says_so_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    if bench_training_gpu.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench_training_gpu.main([]) == 2
    assert "--dry-run" in capsys.readouterr().out


def test_the_gpu_paths_cover_every_baseline_and_both_odbd_forms() -> None:
    names = {p.name for p in bench_training_gpu.paths(16384)}
    assert {"odbd padded", "odbd --collate packed", "HF group_by_length"} <= names
    assert len(names) == 7
