"""Trainer-side collation cost per sample for each batch form (issue 13), in one process.

The samples are encoded in the shm layout and decoded back as zero-copy views, as the trainer
sees them in shared memory; each form then collates the same batches (16 samples) into fresh
tensors. Text: ddp_data's long-tailed tokens. VLM: docs/examples/vlm_dataset.py (0-4 images of
4-64 patches x 24 floats); its padded baseline pads pixel_values and image_grid_thw along the
first dimension (what odbd does without --concat).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from odbclient.shm import decode, encode_into, encoded_size
from odbclient.trainer.collate import BatchForm, collate
from tests.integration.ddp_data import LongTailTokens

BATCH = 16
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "vlm_dataset.py"
CONCAT = frozenset({"pixel_values", "image_grid_thw"})


@dataclass(frozen=True, slots=True)
class Form:
    name: str
    data: str  # "text" or "vlm"
    form: BatchForm


FORMS = (
    Form("text, padded (baseline)", "text", BatchForm()),
    Form("text, packed", "text", BatchForm(packed=True)),
    Form("VLM, padded, pixel_values padded (baseline)", "vlm", BatchForm()),
    Form("VLM, padded, --concat pixel_values image_grid_thw", "vlm", BatchForm(concat_keys=CONCAT)),
    Form("VLM, packed, --concat pixel_values image_grid_thw", "vlm",
         BatchForm(packed=True, concat_keys=CONCAT)),
)  # fmt: skip


def shm_views(samples: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The samples encoded one after another in one buffer and decoded as views of it."""
    sizes = [encoded_size(s) for s in samples]
    buffer = bytearray(sum(sizes))
    views, offset = [], 0
    for sample, size in zip(samples, sizes, strict=True):
        encode_into(memoryview(buffer)[offset : offset + size], sample)
        views.append(decode(memoryview(buffer)[offset : offset + size]))
        offset += size
    return views


def datasets(num_samples: int) -> dict[str, list[dict[str, np.ndarray]]]:
    spec = importlib.util.spec_from_file_location("vlm_dataset", EXAMPLE)
    assert spec is not None and spec.loader is not None
    vlm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vlm)
    text, images = LongTailTokens(size=num_samples, seed=1), vlm.build(size=num_samples, seed=1)
    return {
        "text": shm_views([text[i] for i in range(num_samples)]),
        "vlm": shm_views([images[i] for i in range(num_samples)]),
    }


def microseconds_per_sample(samples: list[dict[str, np.ndarray]], form: BatchForm) -> float:
    batches = [samples[i : i + BATCH] for i in range(0, len(samples) - BATCH + 1, BATCH)]
    collate(batches[0], pads={}, form=form)  # warm-up
    started = time.perf_counter()
    for batch in batches:
        collate(batch, pads={}, form=form)
    return (time.perf_counter() - started) * 1e6 / (len(batches) * BATCH)


def measure(num_samples: int, runs: int) -> list[tuple[str, float, float]]:
    """(form name, median us/sample, median / its baseline) for every form; runs interleaved."""
    data = datasets(num_samples)
    times: dict[str, list[float]] = {f.name: [] for f in FORMS}
    for _ in range(runs):
        for f in FORMS:
            times[f.name].append(microseconds_per_sample(data[f.data], f.form))
    medians = {name: statistics.median(values) for name, values in times.items()}
    baseline = {f.data: medians[f.name] for f in FORMS if "baseline" in f.name}
    return [(f.name, medians[f.name], medians[f.name] / baseline[f.data]) for f in FORMS]
