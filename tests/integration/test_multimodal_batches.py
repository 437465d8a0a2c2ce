"""Multimodal samples end to end (issue 13): `--concat` keys and a `--max-patches` budget.

Two daemons x two ranks serve `docs/examples/vlm_dataset.py` (0-4 images per sample, 4 to 64
patches per image) with `--concat pixel_values --concat image_grid_thw --max-patches N`;
trainer processes (`vlm_trainer`) check every sample's patches, grids and tokens against the
dataset byte for byte. Padded and packed batch forms:

- every sample is trained once and every rank runs the same number of steps;
- every group respects both budgets (tokens: padded area or sum of lengths <= L; patches:
  sum <= N), except a single sample over one of them, which goes alone (and is warned once);
- samples without images and batches holding several images both occur;
- loss scales are exact: W * t_r / sum_r t_r with t_r the loss-bearing tokens of the samples.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.integration.harness import describe, run_cluster

pytestmark = pytest.mark.timeout(120)

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "vlm_dataset.py"
SIZE, SEED = 96, 5
BUDGET, MAX_PATCHES = 1024, 160
WORLD = 4


def dataset():
    spec = importlib.util.spec_from_file_location("vlm_dataset", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(size=SIZE, seed=SEED)


@pytest.mark.parametrize("collate", ["padded", "packed"])
def test_concat_keys_and_patch_budget_reach_trainers_intact(collate: str) -> None:
    data = [f"--data-arg=size={SIZE}", f"--data-arg=seed={SEED}"]
    result = run_cluster(
        nodes=2,
        ranks_per_node=2,
        daemon_args=[
            "--dataset",
            str(EXAMPLE) + ":build",
            "--workers",
            "1",
            "--dataset-arg",
            f"size={SIZE}",
            "--dataset-arg",
            f"seed={SEED}",
            "--token-budget",
            str(BUDGET),
            "--buffer",
            "8",
            "--collate",
            collate,
            "--concat",
            "pixel_values",
            "--concat",
            "image_grid_thw",
            "--max-patches",
            str(MAX_PATCHES),
        ],  # fmt: skip
        trainer_args={rank: data for rank in range(WORLD)},
        trainer_module="tests.integration.vlm_trainer",
    )
    assert result.trainer_codes == [0] * WORLD and result.daemon_codes == [0, 0], describe(result)
    ds = dataset()
    per_rank = [result.steps(rank) for rank in range(WORLD)]
    assert len({len(s) for s in per_rank}) == 1, "ranks ran different step counts"
    assert sorted(result.emitted_ids(0)) == list(range(SIZE)), "not every sample once"
    over_patches = [i for i in range(SIZE) if len(ds[i]["pixel_values"]) > MAX_PATCHES]
    several_images = 0
    for step in zip(*per_rank, strict=True):
        global_tokens = sum(r["num_tokens"] for r in step)
        for r in step:
            assert r["global_num_tokens"] == global_tokens
            if r["idle"]:
                assert r["loss_scale"] == 0
                continue
            assert r["content_ok"], f"rank batch {r['ids']} arrived altered"
            lengths, patches = r["lengths"], r["patches"]
            area = sum(lengths) if collate == "packed" else max(lengths) * len(lengths)
            if len(lengths) > 1:
                assert area <= BUDGET and sum(patches) <= MAX_PATCHES, r
            assert not set(r["ids"]) & set(over_patches) or len(r["ids"]) == 1
            tokens = sum(int((ds[i]["labels"] != -100).sum()) for i in r["ids"])
            assert r["num_tokens"] == tokens
            assert r["loss_scale"] == pytest.approx(WORLD * tokens / global_tokens, rel=1e-12)
            several_images += sum(len(ds[i]["image_grid_thw"]) for i in r["ids"]) > 1
            keys = {"pixel_values_offsets", "image_grid_thw_offsets"}
            if collate == "packed":
                keys |= {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k"}
            assert keys <= set(r["keys"])
    no_images = [i for i in range(SIZE) if len(ds[i]["image_grid_thw"]) == 0]
    assert no_images and several_images and over_patches, "change the data: a case is missing"
    logs = result.cluster.log(0) + result.cluster.log(1)
    assert 1 <= logs.count("more than --max-patches") <= 2  # once per daemon at most
