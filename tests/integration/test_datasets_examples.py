"""Datasets as users have them (issue 10), through a real daemon, producer and ODBClient.

Each docs/examples factory is served for one short epoch; the test rebuilds the same dataset
in-process and checks every sample arrived once, token for token, in the documented dtypes.
The HF case is a real in-memory `datasets.Dataset` tokenized with `map` by a BPE tokenizer
trained on the spot, in its default format (Python lists) and with set_format numpy / torch.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from odbclient import ODBClient
from odbclient.errors import JobFailedError
from odbd.demo.cluster import ClusterSpec, LocalCluster
from tests.integration.harness import http_get

pytestmark = pytest.mark.timeout(240)

EXAMPLES = Path(__file__).parents[2] / "docs" / "examples"
TIMEOUT_S = 180.0  # the machine may be busy with both cores taken


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve_one_epoch(
    example: str,
    args: dict[str, Any],
    *,
    token_budget: int,
    on_batch: Callable[[LocalCluster], None] = lambda cluster: None,
) -> tuple[list[tuple[list[int], dict[str, torch.Tensor]]], LocalCluster]:
    """Every non-idle batch of one epoch of `example:build(**args)` on 1 node, 1 rank;
    `on_batch(cluster)` runs after each batch, while the daemon still serves."""
    daemon_args = ["--dataset", f"{EXAMPLES / example}.py:build", "--workers", "1"]
    for key, value in args.items():
        daemon_args += ["--dataset-arg", f"{key}={value}"]
    daemon_args += ["--epochs", "1", "--shm-size", "32M", "--token-budget", str(token_budget)]
    spec = ClusterSpec(nodes=1, ranks_per_node=1, daemon_args=daemon_args, metrics=True)
    cluster = LocalCluster(spec)
    batches = []
    with cluster:
        cluster.wait_sockets(TIMEOUT_S)
        with ODBClient(rank=0, socket=cluster.sockets[0], deadline_s=TIMEOUT_S) as client:
            for batch in client:
                if not batch.is_idle:
                    tensors = {key: batch[key].clone() for key in batch.keys()}
                    batches.append((list(batch.sample_ids), tensors))
                on_batch(cluster)
        codes = cluster.wait(TIMEOUT_S)
    assert codes == [0], cluster.log(0)
    assert cluster.leftover_segments() == [], "shared memory left behind"
    return batches, cluster


def check_every_sample(
    batches: list[tuple[list[int], dict[str, torch.Tensor]]],
    expected: Callable[[int], dict[str, np.ndarray]],
    size: int,
    pads: dict[str, int],
) -> None:
    """Each identity arrives once; each key equals `expected(i)`, right-padded with its pad."""
    seen = [i for ids, _ in batches for i in ids]
    assert sorted(seen) == list(range(size)), "samples lost or repeated"
    for ids, tensors in batches:
        for row, identity in enumerate(ids):
            for key, want in expected(identity).items():
                got = tensors[key][row].numpy()
                assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
                if key in pads:  # a 1-D key: the sample, then padding to the batch's longest
                    np.testing.assert_array_equal(got[: len(want)], want, err_msg=key)
                    assert (got[len(want) :] == pads[key]).all(), key
                else:
                    np.testing.assert_array_equal(got, want, err_msg=key)


@pytest.mark.parametrize("fmt", ["", "numpy", "torch"])
def test_hf_dataset_tokenized_with_map_is_served_in_every_format(fmt: str) -> None:
    size = 48
    args = {"size": size, "vocab_size": 200} | ({"format": fmt} if fmt else {})
    batches, _ = serve_one_epoch("hf_dataset", args, token_budget=512)
    ds = load_example("hf_dataset").build(size=size, vocab_size=200)  # the lists format

    def expected(i: int) -> dict[str, np.ndarray]:
        row = ds[i]
        return {k: np.asarray(row[k], np.int64) for k in ("input_ids", "labels")}

    check_every_sample(batches, expected, size, {"input_ids": 0, "labels": -100})
    assert max(len(ds[i]["input_ids"]) for i in range(size)) > 2 * min(
        len(ds[i]["input_ids"]) for i in range(size)
    ), "the corpus should have varied lengths, or grouping is not exercised"


def test_numpy_example_is_served_token_for_token() -> None:
    size = 40
    batches, _ = serve_one_epoch("numpy_dataset", {"size": size, "max_len": 96}, token_budget=384)
    ds = load_example("numpy_dataset").build(size=size, max_len=96)
    check_every_sample(batches, ds.__getitem__, size, {"input_ids": 0, "labels": -100})


def test_multimodal_example_stacks_images_and_pads_tokens() -> None:
    size, max_visual = 24, 64
    args = {"size": size, "max_visual": max_visual}
    batches, _ = serve_one_epoch("multimodal_dataset", args, token_budget=1024)
    module = load_example("multimodal_dataset")
    ds = module.build(size=size, max_visual=max_visual)
    check_every_sample(batches, ds.__getitem__, size, {"input_ids": 0, "labels": -100})
    for ids, tensors in batches:
        assert tensors["pixel_values"].shape == (len(ids), *module.IMAGE_SHAPE)
        assert tensors["num_image_tokens"].shape == (len(ids),)
        image_tokens = (tensors["input_ids"] == module.IMAGE_TOKEN).sum(dim=1)
        assert torch.equal(image_tokens, tensors["num_image_tokens"])
    assert math.isfinite(float(sum(t["pixel_values"].sum() for _, t in batches)))


def test_samples_longer_than_the_budget_are_counted_and_the_first_is_logged_once() -> None:
    size, budget = 40, 64
    args = {"size": size, "min_len": 8, "max_len": 96}
    scraped: list[str] = []

    def scrape(cluster: LocalCluster) -> None:  # the daemon exits once the epoch is done
        scraped.append(http_get(f"http://127.0.0.1:{cluster.metrics_ports[0]}/metrics"))

    batches, cluster = serve_one_epoch("numpy_dataset", args, token_budget=budget, on_batch=scrape)
    ds = load_example("numpy_dataset").build(**args)
    longer = [i for i in range(size) if len(ds[i]["input_ids"]) > budget]
    assert longer, "the dataset should have samples over the budget"
    for ids, tensors in batches:  # each trained alone
        if any(i in longer for i in ids):
            assert len(ids) == 1 and tensors["input_ids"].shape[1] > budget
    assert f"odbd_oversized_samples_total {float(len(longer))}" in scraped[-1]
    log = cluster.log(0)
    assert log.count("more than --token-budget") == 1, log
    first = next(i for i in log.split("\n") if "more than --token-budget" in i)
    identity = int(first.split("sample ")[1].split()[0])
    assert identity in longer
    assert f"sample {identity} has {len(ds[identity]['input_ids'])} tokens" in first
    assert "trained alone in its own group" in first and "raise --token-budget" in first


def test_a_hf_dataset_that_keeps_its_text_column_fails_the_job_naming_the_column_and_fix() -> None:
    """Issue 10 as reported: every sample refused. Before, one WARNING per sample naming
    `not_a_dict` and an epoch of 0 steps; now one line naming the column and the fix, and the
    job fails with it."""
    size = 24
    daemon_args = ["--dataset", f"{EXAMPLES / 'hf_dataset'}.py:build", "--workers", "1"]
    daemon_args += ["--dataset-arg", f"size={size}", "--dataset-arg", "keep_text=1"]
    daemon_args += ["--epochs", "1", "--shm-size", "32M", "--token-budget", "512"]
    cluster = LocalCluster(ClusterSpec(nodes=1, ranks_per_node=1, daemon_args=daemon_args))
    with cluster:
        cluster.wait_sockets(TIMEOUT_S)
        with ODBClient(rank=0, socket=cluster.sockets[0], deadline_s=TIMEOUT_S) as client:
            with pytest.raises(JobFailedError) as failed:
                list(client)
        codes = cluster.wait(TIMEOUT_S)
    message = str(failed.value)
    # Issue 24: the job fails once the rejections pass --max-reject-fraction (0.01), before
    # the epoch that would train nothing ends.
    assert "past --max-reject-fraction 0.01 (unsupported_value: " in message, message
    assert "sample key 'text' holds a str" in message, message
    assert "dataset.remove_columns(['text'])" in message, message
    assert codes == [1], cluster.log(0)
    log = cluster.log(0)
    assert log.count("holds a str") <= 2, log  # the first rejection's line (+ the job's error)
    assert cluster.leftover_segments() == [], "shared memory left behind"
