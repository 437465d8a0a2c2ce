"""Batch forms beside padding (issue 13): padding-free packed rows and keys concatenated along
their first dimension. Pure: no I/O, no daemon.

Packed (odbd `--collate packed`), Hugging Face's padding-free conventions
(`DataCollatorWithFlattening(return_flash_attn_kwargs=True)`), for B samples of lengths l_i and
T = sum l_i:
- every 1-D key becomes one row `(1, T)`: the samples one after another;
- the labels key gets -100 at each sample's first token (HF's `separator_id`): a causal LM
  shifts labels by one, so the last token of sample i would otherwise be trained to predict the
  first token of sample i + 1;
- `position_ids` `(1, T)` int64 restart at 0 for each sample (HF detects the packing from them
  on sdpa/eager/flex, or uses `cu_seq_lens_*` with FlashAttention varlen);
- `cu_seq_lens_q` = `cu_seq_lens_k` `(B + 1,)` int32: 0, l_0, l_0 + l_1, ..., T;
- `max_length_q` = `max_length_k`: the longest l_i, a Python int as HF passes it.

Concatenated keys (odbd `--concat KEY`, both forms): KEY's arrays `(n_i, *trailing)` are joined
along their first dimension into `(sum n_i, *trailing)` with no batch dimension (how VLMs take
`pixel_values` of varying patch counts and per-image `image_grid_thw`), and `KEY_offsets`
`(B + 1,)` int64 says where each sample's rows start: sample i owns rows
`offsets[i]:offsets[i + 1]` (zero rows for a sample without images).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np
import torch

from odbclient.errors import CollateError

POSITION_IDS = "position_ids"
CU_SEQ_LENS = ("cu_seq_lens_q", "cu_seq_lens_k")
MAX_LENGTH = ("max_length_q", "max_length_k")
LABEL_SEPARATOR = -100  # HF's separator_id: the ignore index of CrossEntropyLoss
PACKED_EXTRA_KEYS = frozenset({POSITION_IDS, *CU_SEQ_LENS, *MAX_LENGTH})


def offsets_key(key: str) -> str:
    """Where a concatenated key's per-sample row offsets go in the batch."""
    return f"{key}_offsets"


def concat_rows(key: str, arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """`arrays` joined along dim 0, and the (B + 1,) int64 row offsets of each sample.

    Raises CollateError naming the key when a sample's array is a scalar or its dimensions after
    the first differ from sample 0's (they cannot be joined).
    """
    first = arrays[0]
    for index, array in enumerate(arrays):
        if array.ndim == 0 or array.shape[1:] != first.shape[1:] or array.dtype != first.dtype:
            raise CollateError(
                f"--concat {key}: sample {index} has {array.dtype}{list(array.shape)} but sample "
                f"0 has {first.dtype}{list(first.shape)}; a concatenated key needs a first "
                "dimension (rows, e.g. patches) and the same dtype and trailing dimensions in "
                "every sample: fix preprocessing or drop --concat {key}".replace("{key}", key)
            )
    counts = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return np.concatenate(arrays, axis=0), offsets


def pack_rows(key: str, arrays: Sequence[np.ndarray], *, separator_at_starts: bool) -> np.ndarray:
    """1-D `arrays` as one (1, T) row; with `separator_at_starts`, -100 at each sample's first
    entry (the labels key)."""
    for index, array in enumerate(arrays):
        if array.ndim != 1 or array.dtype != arrays[0].dtype:
            raise CollateError(
                f"key {key!r} is packed into one row but sample {index} has "
                f"{array.dtype}{list(array.shape)} and sample 0 {arrays[0].dtype}"
                f"{list(arrays[0].shape)}; packed keys are 1-D with one dtype"
            )
    row = np.concatenate(arrays)[None, :]
    if separator_at_starts:
        if row.dtype.kind not in "if":
            raise CollateError(
                f"labels key {key!r} has dtype {row.dtype}, which cannot hold the separator -100; "
                "store labels as a signed integer type"
            )
        starts = np.zeros(len(arrays), dtype=np.int64)
        np.cumsum([len(a) for a in arrays[:-1]], out=starts[1:])
        row[0, starts[np.asarray([len(a) for a in arrays]) > 0]] = LABEL_SEPARATOR
    return row


def sequence_fields(lengths: Sequence[int]) -> dict[str, torch.Tensor | int]:
    """position_ids, cu_seq_lens_q/k and max_length_q/k of samples with these lengths."""
    sizes = np.asarray(lengths, dtype=np.int64)
    cu = np.zeros(len(sizes) + 1, dtype=np.int32)
    np.cumsum(sizes, out=cu[1:])
    total = int(cu[-1])
    # position within its own sample: global index minus that sample's start
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), sizes)
    longest = int(sizes.max()) if sizes.size else 0
    out: dict[str, torch.Tensor | int] = {POSITION_IDS: torch.from_numpy(positions[None, :])}
    for name in CU_SEQ_LENS:
        out[name] = torch.from_numpy(cu.copy())
    for name in MAX_LENGTH:
        out[name] = longest
    return out


def check_reserved_keys(keys: Collection[str], concat_keys: Collection[str]) -> None:
    """Sample keys must not collide with the keys packing and --concat add to the batch."""
    added = PACKED_EXTRA_KEYS | {offsets_key(k) for k in concat_keys}
    clash = sorted(set(keys) & added)
    if clash:
        raise CollateError(
            f"sample keys {clash} collide with keys odbd adds to packed / concatenated batches "
            f"({sorted(added)}); rename them in preprocessing"
        )


def missing_concat_keys(sample: Mapping[str, object], concat_keys: Collection[str]) -> list[str]:
    return [k for k in concat_keys if k not in sample]
