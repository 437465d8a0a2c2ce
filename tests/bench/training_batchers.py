"""The batchers users pick instead of odbd, as per-rank batch plans for one epoch (pure).

Each planner takes the dataset's token lengths and returns `Plan`: for every rank, its batches
(lists of sample ids) in step order. Every sample is in exactly one batch; ranks may end up with
different step counts (the trainer then runs DDP's `Join`, as the paper's loader does), since
dropping or repeating samples would change what is trained. Written for the benchmark from the
published algorithms (none of their code is copied):

- `fixed`: a shuffled sampler, batch B. Batches are dealt to ranks round-robin (batch i to rank
  i mod W), which is how Accelerate shards the Hugging Face Trainer's DataLoader
  (`BatchSamplerShard`, `split_batches=False`).
- `length_grouped`: HF `TrainingArguments(group_by_length=True)`: transformers'
  `get_length_grouped_indices` (random permutation, mega-batches of 50 x B sorted by length
  descending, the longest batch first), dealt to ranks as above. Used with padding.
- `bucketed`: the NeMo/Lhotse token-budget kind (`DynamicBucketingSampler` with
  `max_tokens`-style budget and `sync_buckets=True`): bucket boundaries at length quantiles
  that split the total tokens evenly, each bucket shuffled and cut greedily into batches whose
  padded size (batch x longest) stays within the budget; at each step every rank takes a batch
  from the same randomly drawn bucket, so the ranks of a step have similar lengths.
- `load_balanced`: cosmos-rl's load-balanced dynamic batching (`enable_dp_load_balancing`):
  each rank shuffles its own shard (sample i of the permutation to rank i mod W) and keeps a
  pool of P samples; a padded batch grows from the pool's first sample by adding the pool
  sample whose length is closest to the batch's longest (`prefer_closest`) while batch x
  longest stays within the budget; a packed batch adds pool samples in order while the sum of
  lengths stays within it. The pool refills from the shard after each batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

Plan = list[list[list[int]]]  # rank -> batches in step order -> sample ids


def _deal(batches: Sequence[list[int]], world: int) -> Plan:
    return [list(batches[rank::world]) for rank in range(world)]


def _chunks(order: Sequence[int], size: int) -> list[list[int]]:
    return [list(order[i : i + size]) for i in range(0, len(order), size)]


def _permutation(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def fixed(lengths: np.ndarray, *, batch: int, world: int, seed: int) -> Plan:
    return _deal(_chunks(_permutation(len(lengths), seed), batch), world)


def length_grouped(lengths: np.ndarray, *, batch: int, world: int, seed: int) -> Plan:
    from transformers.trainer_pt_utils import get_length_grouped_indices

    generator = torch.Generator().manual_seed(seed)
    order = get_length_grouped_indices(lengths.tolist(), batch, generator=generator)
    return _deal(_chunks(order, batch), world)


def bucket_edges(lengths: np.ndarray, buckets: int) -> np.ndarray:
    """Upper length bounds of `buckets` buckets holding about equal total tokens."""
    ordered = np.sort(lengths)
    mass = np.cumsum(ordered) / ordered.sum()
    edges = [int(ordered[np.searchsorted(mass, q)]) for q in np.arange(1, buckets) / buckets]
    return np.unique(np.asarray([*edges, int(ordered[-1])], dtype=np.int64))


def _fill_padded(ids: list[int], lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Greedy cut of `ids` in order into batches with count x longest <= budget."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in ids:
        grown = max(longest, int(lengths[i]))
        if current and grown * (len(current) + 1) > budget:
            batches.append(current)
            current, grown = [], int(lengths[i])
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
    return batches


def bucketed(lengths: np.ndarray, *, budget: int, buckets: int, world: int, seed: int) -> Plan:
    rng = np.random.default_rng(seed)
    edges = bucket_edges(lengths, buckets)
    which = np.searchsorted(edges, lengths)
    queues: list[list[list[int]]] = []
    for b in range(len(edges)):
        members = np.flatnonzero(which == b)
        rng.shuffle(members)
        queues.append(_fill_padded(members.tolist(), lengths, budget))
    plan: Plan = [[] for _ in range(world)]
    while any(queues):
        left = np.asarray([len(q) for q in queues], dtype=np.float64)
        bucket = int(rng.choice(len(queues), p=left / left.sum()))  # the same draw on every rank
        for rank in range(world):
            if not queues[bucket]:  # the bucket ran dry mid-step: the fullest one finishes it
                bucket = int(np.argmax([len(q) for q in queues]))
                if not queues[bucket]:
                    break
            plan[rank].append(queues[bucket].pop())
    return plan


def _pool_batch(pool: list[int], lengths: np.ndarray, budget: int, packed: bool) -> list[int]:
    batch = [pool.pop(0)]
    if packed:
        total = int(lengths[batch[0]])
        for i in list(pool):
            if total + int(lengths[i]) <= budget:
                batch.append(i)
                pool.remove(i)
                total += int(lengths[i])
        return batch
    longest = int(lengths[batch[0]])
    while pool:
        fits = [i for i in pool if max(longest, int(lengths[i])) * (len(batch) + 1) <= budget]
        if not fits:
            break
        best = min(fits, key=lambda i: abs(int(lengths[i]) - longest))  # prefer_closest
        batch.append(best)
        pool.remove(best)
        longest = max(longest, int(lengths[best]))
    return batch


def load_balanced(
    lengths: np.ndarray, *, budget: int, pool: int, world: int, seed: int, packed: bool = False
) -> Plan:
    order = _permutation(len(lengths), seed)
    plan: Plan = []
    for rank in range(world):
        shard = order[rank::world]
        waiting: list[int] = []
        batches: list[list[int]] = []
        while shard or waiting:
            while shard and len(waiting) < pool:
                waiting.append(shard.pop(0))
            batches.append(_pool_batch(waiting, lengths, budget, packed))
        plan.append(batches)
    return plan


def steps(plan: Plan) -> int:
    return max(len(batches) for batches in plan)
