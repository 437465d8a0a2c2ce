"""The job's sample schema by agreement, not by first arrival (pure, no I/O).

A schema is what `odbclient.samples.schema_hash` covers: the keys, their dtypes and their
dimensions after the first. Every sample of a job must share one, since trainers collate a
step's samples key by key. It used to be the first committed sample's: one odd sample that
happened to arrive first (int32 input_ids among int64) got every good sample rejected as
schema_mismatch, 1 of 400 trained, and the job exited 0.

Now each daemon holds its first samples aside until SCHEMA_VOTE_SAMPLES of them arrived (or
SCHEMA_VOTE_WAIT_S passed since the first, for a dataset with few valid samples or slow
producers): the schema most of them share wins (a tie goes to the one that arrived first), the
held samples of that schema are buffered, the others rejected naming both schemas. Every node
then puts its schema in its round offers and every daemon checks that they agree: nodes that
chose different schemas fail the job in the same round, naming each node's schema, instead of a
spoke training under one the hub rejects. (Producers also promote narrower integer token ids
and labels to int64 before hashing, `odbclient.samples.promote_token_ids`, so the usual
difference, int32 ids from one tokenizer, is no conflict at all.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from odbclient.shm import SampleMeta

SCHEMA_VOTE_SAMPLES = 16  # samples a node holds aside to choose its schema
SCHEMA_VOTE_WAIT_S = 1.0  # or: this long after the first of them arrived
_MAX_DESCRIPTION_CHARS = 240  # a schema's text in the round offer and in error lines


def winning_schema(hashes: Sequence[int]) -> tuple[int, int]:
    """(the schema most of `hashes` share, how many share it); on a tie, the one of them that
    came first in `hashes` (arrival order)."""
    if not hashes:
        raise ValueError("a schema vote needs at least one sample")
    counts = Counter(hashes)
    best = max(counts.values())
    winner = next(h for h in hashes if counts[h] == best)
    return winner, best


def describe_schema(meta: SampleMeta | None, schema_hash: int) -> str:
    """`input_ids int64[*], labels int64[*]` ('*' is the first dimension, which may differ
    between samples), or the hash alone when the sample's header could not be read."""
    if meta is None:
        return f"schema {schema_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"
    parts = []
    for f in sorted(meta.fields, key=lambda f: f.name):
        dims = ["*", *(str(d) for d in f.shape[1:])] if f.shape else []
        parts.append(f"{f.name} {f.dtype}[{', '.join(dims)}]")
    text = ", ".join(parts)
    if len(text) > _MAX_DESCRIPTION_CHARS:
        text = text[: _MAX_DESCRIPTION_CHARS - 3] + "..."
    return text


def schema_disagreement(schemas: Mapping[int, tuple[int, str]]) -> str | None:
    """Why the job fails when nodes chose different schemas (node -> (hash, description) of
    the nodes that chose one), else None. Every daemon decides it from the same offers."""
    if len({h for h, _ in schemas.values()}) <= 1:
        return None
    named = "; ".join(f"node {node}: {text}" for node, (_, text) in sorted(schemas.items()))
    return (
        f"the nodes' datasets have different sample schemas ({named}), so their samples cannot "
        "share a step; each node chose its schema from its first samples. Make the dataset "
        "uniform on every node (the same keys, dtypes and dimensions after the first), e.g. "
        "cast the odd node's arrays in preprocessing"
    )
