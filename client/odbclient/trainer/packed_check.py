"""Does a model honour the sample boundaries of odbd's packed batches? (issue 27)

`odbd --collate packed` hands a rank one padding-free row of several samples, with
`position_ids` restarting at each sample and `cu_seq_lens_*` / `max_length_*` (Hugging Face's
padding-free convention). A model only trains correctly on it if its attention keeps every
sample to itself. transformers 5.24 does so for Llama, Qwen2, GPT-2... under eager and sdpa
(it builds a block-diagonal mask from the restarting positions; FlashAttention varlen reads
cu_seq_lens) unless something in the call overrides that, silently: a KV cache (use_cache=True,
most configs' default: issue 27's GPT-2 report, logits off by 0.83) or an attention_mask in the
samples (a mask of ones: the model masks padding only).

A table of (model type, kernel) pairs cannot see those, nor a user's model, a new transformers
release or a custom attention function, so this is a probe: one forward of a tiny packed row
(two samples, 8 tokens, no gradient, eval mode), called as the trainer calls the model, against
the same samples one by one and against the row with the boundaries ignored. It runs once, on
the model as it will train (its device, dtype, kernel and settings), and costs three forward
passes of a few tokens (a few ms on CPU; flex attention compiles its kernel for the probe's
shape first). The decision is relative: packing's error must be under `TOLERANCE` of what
ignoring the boundaries changes, which holds in float32 and bfloat16 alike. A refusal
probes again without the cache, then without the mask, to name the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from odbclient.errors import ODBClientError

log = logging.getLogger(__name__)

# Packing may change the second sample's logits by at most this fraction of what ignoring the
# boundaries changes (measured on tiny random Llama/Qwen2/GPT-2: < 1e-6 in float32, 0 in
# bfloat16 when they honour them; 0.13-1.0 when a KV cache or an attention_mask overrides them).
TOLERANCE = 0.05
PROBE_LENGTHS = (5, 3)  # two samples; the second one's logits tell whether it saw the first


class PackedAttentionError(ODBClientError, ValueError):
    """The model attends across the samples of a packed row: its losses would be wrong."""


@dataclass(frozen=True, slots=True)
class PackedVerdict:
    """What the probe measured on one model, called as the trainer calls it."""

    model_type: str  # config.model_type, or the class name
    kernel: str  # config._attn_implementation ("eager", "sdpa", "flash_attention_2", ...)
    packed_error: float  # max |logits| difference, packed vs one by one (second sample)
    ignored_error: float  # the same with the boundaries ignored (positions 0..T-1)
    # Why it fails where a second probe without it passes: "use_cache", "attention_mask".
    causes: tuple[str, ...] = ()

    @property
    def honours_boundaries(self) -> bool:
        if self.ignored_error == 0.0:
            return True  # the second sample's logits do not depend on the first at all
        return self.packed_error <= TOLERANCE * self.ignored_error

    def refusal(self) -> str:
        fixes = []
        if "use_cache" in self.causes:
            fixes.append(
                "set model.config.use_cache = False (or pass use_cache=False; under the "
                "Trainer TrainingArguments(use_cache=False), its default) for training: with a "
                "KV cache transformers builds its mask from the cache and not from the "
                "restarting position_ids"
            )
        if "attention_mask" in self.causes:
            fixes.append(
                "drop the attention_mask key from your samples (packed rows need none; with one, "
                "transformers masks padding only and not the sample boundaries)"
            )
        if not fixes:
            fixes.append(
                "run odbd with --collate padded, or use a model and kernel that honour packed "
                "position_ids or cu_seq_lens (e.g. Llama/Qwen2/GPT-2 with sdpa, eager or "
                "flash_attention_2, or odbclient.trainer.segment_attention's 'odbd_segments', "
                "which also costs only the samples' squares on CPU; docs/training.md lists the "
                "tested ones)"
            )
        fix = "; and ".join(fixes)
        return (
            f"model {self.model_type} with attention {self.kernel!r} ignores the sample "
            f"boundaries of odbd's packed batches: its logits for a packed row differ by "
            f"{self.packed_error:.3g} from the same samples run one by one "
            f"({self.ignored_error:.3g} with the boundaries dropped on purpose), so each sample "
            "would attend to the ones before it in its row and train on wrong losses. Nothing "
            f"was trained. Fix: {fix}"
        )


def attention_kernel(model: Any) -> str:
    """The model's attention implementation as transformers names it ("unknown" if none)."""
    config = getattr(_unwrap(model), "config", None)
    kernel = getattr(config, "_attn_implementation", None)
    return str(kernel) if kernel else "unknown"


def model_type(model: Any) -> str:
    inner = _unwrap(model)
    return str(getattr(getattr(inner, "config", None), "model_type", "") or type(inner).__name__)


def probe_packed(
    model: Any, batch_keys: Iterable[str] = (), *, no_cache: bool = False, no_mask: bool = False
) -> PackedVerdict:
    """Runs the probe (see the module docstring) on `model`, called as the trainer calls it:
    `model(**batch.tensors)` with the packed keys, plus an all-ones attention_mask when the
    batches carry one (`batch_keys`). `no_cache` / `no_mask` probe with use_cache=False / without
    the mask instead (check_packed_model's diagnosis)."""
    inner = _unwrap(model)
    device = _device_of(inner)
    vocab = int(getattr(getattr(inner, "config", None), "vocab_size", 0) or 32)
    first, second = PROBE_LENGTHS
    total = first + second
    # Distinct tokens, so the second sample's context differs from its absence.
    ids = ((torch.arange(total, device=device) * 7 + 3) % max(vocab, 2))[None]
    restart = torch.cat([torch.arange(first), torch.arange(second)]).to(device)[None]
    cu = torch.tensor([0, first, total], dtype=torch.int32, device=device)
    packed: dict[str, Any] = {
        "input_ids": ids,
        "position_ids": restart,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": first,
        "max_length_k": first,
    }
    if "attention_mask" in set(batch_keys) and not no_mask:
        packed["attention_mask"] = torch.ones_like(ids)
    if no_cache:
        packed["use_cache"] = False
    # The references are right whatever the model's settings: one sample alone, no cache.
    alone = {
        "input_ids": ids[:, first:],
        "position_ids": torch.arange(second, device=device)[None],
        "use_cache": False,
    }
    ignored = {
        "input_ids": ids,
        "position_ids": torch.arange(total, device=device)[None],
        "attention_mask": torch.ones_like(ids),
        "use_cache": False,
    }
    with _eval(inner), torch.no_grad():
        tail_packed = _logits(inner, packed)[:, first:]
        tail_ignored = _logits(inner, ignored)[:, first:]
        tail_alone = _logits(inner, alone)
    return PackedVerdict(
        model_type=model_type(inner),
        kernel=attention_kernel(inner),
        packed_error=float((tail_packed - tail_alone).abs().max()),
        ignored_error=float((tail_ignored - tail_alone).abs().max()),
    )


def check_packed_model(model: Any, batch_keys: Iterable[str] = ()) -> PackedVerdict | None:
    """Refuses (PackedAttentionError) a model that ignores packed batches' sample boundaries.

    Call it once before training on `odbd --collate packed` batches, with the keys of the
    batches (`batch.tensors`); ODBTrainer and ODBAccelerate(model=...) do, at the first packed
    batch. The error names the model, its kernel and the fix: a second probe without the KV
    cache, then without the attention_mask, tells whether one of them is the cause. A model
    the probe cannot run (no `.logits`, other input names, a sharded wrapper) is not refused:
    a warning says the check was skipped, and it returns None.
    """
    keys = frozenset(batch_keys)
    try:
        verdict = probe_packed(model, keys)
        if not verdict.honours_boundaries:
            verdict = dataclasses.replace(verdict, causes=_causes(model, keys))
    except Exception as error:  # noqa: BLE001 - any model; the check is advisory then
        log.warning(
            "could not check whether %s honours packed sample boundaries (%s: %s); training "
            "goes on unchecked: compare its per-sample losses on one packed batch with the "
            "samples run one by one, or use --collate padded",
            model_type(model), type(error).__name__, error,
        )  # fmt: skip
        return None
    if not verdict.honours_boundaries:
        raise PackedAttentionError(verdict.refusal())
    log.info(
        "packed batches: model %s with attention %r keeps samples apart (logit difference "
        "%.3g packed vs one by one, %.3g with the boundaries ignored)",
        verdict.model_type, verdict.kernel, verdict.packed_error, verdict.ignored_error,
    )  # fmt: skip
    return verdict


def _causes(model: Any, keys: frozenset[str]) -> tuple[str, ...]:
    """The fewest of the KV cache and the attention_mask whose removal makes packing right
    (empty: the kernel itself ignores the boundaries)."""
    masked = "attention_mask" in keys
    trials: list[tuple[tuple[str, ...], dict[str, bool]]] = [(("use_cache",), {"no_cache": True})]
    if masked:
        trials.append((("attention_mask",), {"no_mask": True}))
        trials.append((("use_cache", "attention_mask"), {"no_cache": True, "no_mask": True}))
    for causes, flags in trials:
        if probe_packed(model, keys, **flags).honours_boundaries:
            return causes
    return ()


def is_packed_batch(inputs: Any) -> bool:
    """Whether a batch's tensors are odbd's packed form (cu_seq_lens present)."""
    return hasattr(inputs, "keys") and "cu_seq_lens_q" in inputs


def _unwrap(model: Any) -> Any:
    """The model inside DDP / Accelerate / torch.compile wrappers."""
    for attr in ("module", "_orig_mod"):
        while isinstance(getattr(model, attr, None), torch.nn.Module):
            model = getattr(model, attr)
    return model


def _device_of(model: Any) -> torch.device:
    for parameter in model.parameters():
        return torch.device(parameter.device)
    return torch.device("cpu")


def _logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    out = model(**inputs)
    logits = out["logits"] if isinstance(out, dict) else out.logits
    return torch.as_tensor(logits).float()


@contextlib.contextmanager
def _eval(model: Any) -> Iterator[None]:
    """Eval mode for the probe (dropout off), the caller's mode after."""
    training = bool(getattr(model, "training", False))
    model.eval()
    try:
        yield
    finally:
        model.train(training)
