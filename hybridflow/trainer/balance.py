"""Data-parallel load balancing: reorder a batch so every rank's contiguous chunk holds a similar number of tokens."""

from __future__ import annotations

import heapq

import torch

from hybridflow.protocol import DataProto


def balanced_partitions(lengths: list[int], num_parts: int) -> list[list[int]]:
    """Greedy longest-first assignment into `num_parts` equal-count parts, each part's token sum as even as possible."""
    n = len(lengths)
    if n % num_parts:
        raise ValueError(f"cannot balance {n} rows over {num_parts} ranks: the count must divide evenly")
    per_part = n // num_parts
    heap = [(0, p) for p in range(num_parts)]  # (tokens so far, part)
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        full = []
        while True:
            tokens, p = heapq.heappop(heap)
            if len(parts[p]) < per_part:
                break
            full.append((tokens, p))
        parts[p].append(i)
        heapq.heappush(heap, (tokens + lengths[i], p))
        for item in full:
            heapq.heappush(heap, item)
    return [sorted(p) for p in parts]


def balance_batch(batch: DataProto, world_size: int) -> dict[str, float]:
    """Reorder `batch` in place (rows keep their data; only their order changes); returns imbalance metrics."""
    if world_size <= 1 or len(batch) % world_size:
        return {}
    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    parts = balanced_partitions([int(x) for x in lengths], world_size)
    batch.reorder(torch.tensor([i for p in parts for i in p]))
    sums = [sum(lengths[i] for i in p) for p in parts]
    return {"balance/max_over_mean_tokens": max(sums) / max(1e-9, sum(sums) / len(sums))}
