"""Rejected samples for operators: what each reason means to fix, the verdict on an epoch that
trained nothing, and a log that names each reason once and then only counts.

Pure except `RejectionLog`, which only decides *when* to log (the clock is passed in).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

PRODUCER_CRASH = "producer_crash"  # the daemon's own reason: the id killed its producer twice

# What to change, per reason (the closed set of KNOWN_REJECT_REASONS).
REJECT_FIXES: Mapping[str, str] = {
    "missing_length_key": "every sample must hold the --length-key array; check --length-key "
    "against the keys __getitem__ returns",
    "not_a_dict": "__getitem__ must return a dict of string keys to numpy arrays or tensors "
    "(not a tuple or list)",
    "unsupported_dtype": "convert the arrays to numeric or bool dtypes in __getitem__",
    "preprocess_error": "fix the exception __getitem__ raises (run it by hand on the sample named)",
    "unsupported_value": "return numbers only: drop text columns (dataset.remove_columns) or "
    "tokenize them, and make nested lists rectangular (see docs/datasets.md)",
    "length_key_not_1d": "return the --length-key array 1-D, e.g. tokenizer(...)['input_ids'] "
    "without return_tensors='pt', or squeeze its batch dimension",
    "too_large": "raise the daemon's --shm-size, or shorten the samples",
    "zero_length": "drop samples whose --length-key array is empty",
    "schema_mismatch": "every sample must have the same keys, dtypes and trailing shapes",
    "bad_concat_key": "every sample must hold each --concat key with a first dimension (zero "
    "rows for a sample without images), or drop the --concat flag",
    "bad_patch_count": "every sample must hold the --patch-key array (patches = its first "
    "dimension) or the --patch-count-key integer; check the daemon's flags",
    "packed_length_mismatch": "with --collate packed, give every 1-D key as many entries as the "
    "--length-key array (truncate labels with input_ids), or --concat a per-sample vector",
    "non_finite": "fix the preprocessing that yields NaN or inf (a division by zero, a log of "
    "0, an overflow in float16), or drop --check-finite if such values are meant",
    PRODUCER_CRASH: "__getitem__ kills the process on the sample named (sys.exit, abort, a "
    "crash in a C extension); run it by hand on that sample",
}


def samples_made(ingested: int, rejected: Mapping[str, int]) -> int:
    """Samples a node's producers finished (committed or rejected), for the supervisor's
    give-up rule: a quarantine is not a sample a producer made, so it is not counted."""
    return ingested + sum(n for reason, n in rejected.items() if reason != PRODUCER_CRASH)


DEFAULT_MAX_REJECT_FRACTION = 0.01  # a real corpus has a few bad records; more is a broken pipeline
_FIRST_IDS = 5  # sample ids named in a budget failure


def empty_dataset_failure(dataset: str | None) -> str:
    """Why a job over a dataset of no sample fails before its first round."""
    what = f"--dataset {dataset} has len() 0" if dataset else "the dataset is empty"
    return (
        f"{what}: the job would train nothing, so it fails before its first round; check the "
        "factory's --dataset-arg values and the data files it reads"
    )


def over_budget(rejected: int, dataset_size: int, max_fraction: float) -> bool:
    """An epoch's rejections (over every node) past --max-reject-fraction of its samples.

    Decided as soon as the count passes the budget, not at the epoch's end: the count only
    grows within an epoch, so waiting would only train more of a broken pipeline's data."""
    # 1 never fails: in --no-join jobs the count of an epoch can pass its size (rejections of
    # the next pass of the sampler are counted as they come, before the quota moves on).
    return max_fraction < 1.0 and rejected > max_fraction * max(dataset_size, 1)


def budget_failure(
    epoch: int,
    rejected: Mapping[str, int],
    dataset_size: int,
    max_fraction: float,
    first_ids: Sequence[int],
    first_rejection: Mapping[str, str],
) -> str:
    """The one line a job past its rejection budget fails with: counts per reason, the first
    ids, an example of the commonest reason and its fix, and how to raise the budget.
    `first_ids` and `first_rejection` are this node's (the counts are global)."""
    total = sum(rejected.values())
    ranked = Counter(rejected).most_common()
    counts = ", ".join(f"{reason}: {n}" for reason, n in ranked)
    top = ranked[0][0]
    example = first_rejection.get(top, "")
    ids = ", ".join(str(i) for i in first_ids[:_FIRST_IDS])
    return (
        f"epoch {epoch} rejected {total} of {dataset_size} samples "
        f"({100 * total / max(dataset_size, 1):.1f} %), past --max-reject-fraction "
        f"{max_fraction:g} ({counts})"
        + (f"; first ids on this node: {ids}" if ids else "")
        + (f"; first {top}: {example}" if example else "")
        + f". Fix: {REJECT_FIXES.get(top, 'fix the dataset')}; or, if this many bad samples "
        "is expected, raise --max-reject-fraction"
    )


def epoch_rejection_summary(epoch: int, rejected: Mapping[str, int], dataset_size: int) -> str:
    """The WARNING an epoch with any rejection ends with (counts over every node)."""
    total = sum(rejected.values())
    counts = ", ".join(f"{reason}: {n}" for reason, n in Counter(rejected).most_common())
    return (
        f"epoch {epoch} rejected {total} of {dataset_size} samples "
        f"({100 * total / max(dataset_size, 1):.2f} %) over every node: {counts}"
    )


def empty_epoch_failure(
    epoch: int, rejected: Mapping[str, int], first_rejection: Mapping[str, str]
) -> str:
    """Why the job fails when epoch `epoch` emitted no sample: every daemon decides it from the
    same global counts (the round offers); `first_rejection` is this node's first detail per
    reason, so only the example may differ between nodes."""
    if not rejected:
        return (
            f"epoch {epoch} ended with no sample trained and none rejected; the job trains "
            "nothing: check --dataset-size / the dataset's len() and the trainers' world size"
        )
    counts = ", ".join(f"{reason}: {n}" for reason, n in Counter(rejected).most_common())
    top = Counter(rejected).most_common(1)[0][0]
    example = first_rejection.get(top, "")
    fix = REJECT_FIXES.get(top, "fix the dataset")
    return (
        f"epoch {epoch} trained nothing: all {sum(rejected.values())} samples were rejected "
        f"({counts})" + (f"; first {top}: {example}" if example else "") + f". Fix: {fix}"
    )


@dataclass(slots=True)
class RejectionLog:
    """One WARNING for the first rejection of each reason, then at most one summary per
    `interval_s` (counts by reason since the last line), not one line per sample."""

    interval_s: float = 10.0
    seen: set[str] = field(default_factory=set)
    pending: Counter[str] = field(default_factory=Counter)
    last_summary_s: float | None = None

    def record(self, reason: str, now_s: float) -> tuple[bool, dict[str, int] | None]:
        """(log this one in full, summary to log now or None)."""
        first = reason not in self.seen
        self.seen.add(reason)
        if first:
            return True, None
        self.pending[reason] += 1
        if self.last_summary_s is None:
            self.last_summary_s = now_s  # the first full line started the interval
        if now_s - self.last_summary_s < self.interval_s:
            return False, None
        self.last_summary_s = now_s
        summary, self.pending = dict(self.pending), Counter()
        return False, summary
