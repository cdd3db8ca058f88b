"""Balanced partitions of sequences: data-parallel shards (`balance_batch`) and the partition
algorithms under them, with verl 0.9.1's names and results.

verl estimates the cost of a sequence of s tokens as `24576 s + s^2` (`calculate_workload`: the
dense matmuls of a 7B model plus attention) and splits a batch into k parts of near-equal total
cost with the Karmarkar-Karp largest differencing method: every item starts as a k-way
"partial partition"; the two partial partitions with the largest spread are merged, largest part
with smallest part, until one remains. `karmarkar_karp` here gives the same parts as verl's on
the same input (ties are broken the same way); `greedy_partition` is verl's simpler fallback.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np


def _scalar(v: Any) -> Any:
    """A Python number (numpy and torch scalars compare and sum exactly as verl's lists)."""
    return v.item() if hasattr(v, "item") else v


def calculate_workload(seqlens: Any) -> np.ndarray:
    """int64 relative cost of sequences of `seqlens` tokens: `24576 * s + s**2` (verl's)."""
    s = np.asarray(seqlens, np.int64)
    return 24576 * s + s * s


class _Part:
    """One part of a partial partition: item (index, value) pairs and their sum."""

    __slots__ = ("items", "total")

    def __init__(self) -> None:
        self.items: list[tuple[int, int]] = []
        self.total = 0

    def key(self) -> tuple:
        # verl's order: by sum, then item count, then the item lists themselves.
        return (self.total, len(self.items), self.items)

    def __lt__(self, other: _Part) -> bool:
        return self.key() < other.key()


class _Partial:
    """A k-way partial partition, parts in decreasing order. On the min-heap the one with the
    largest spread (then the largest biggest part) comes out first."""

    __slots__ = ("parts",)

    def __init__(self, items: Sequence[tuple[int, int]], k: int) -> None:
        self.parts = [_Part() for _ in range(k)]
        for part, (idx, value) in zip(self.parts, items, strict=False):
            part.items.append((idx, value))
            part.total += value
        self._sort()

    def _sort(self) -> None:
        self.parts.sort(key=_Part.key, reverse=True)

    @property
    def spread(self) -> int:
        return self.parts[0].total - self.parts[-1].total

    def merge(self, other: _Partial) -> None:
        """Join part i with the other's part k-1-i (big with small), then re-sort."""
        for mine, theirs in zip(self.parts, reversed(other.parts), strict=True):
            mine.items.extend(theirs.items)
            mine.total += theirs.total
        self._sort()

    def __lt__(self, other: _Partial) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return other.parts[0] < self.parts[0]


def karmarkar_karp(
    seqlen_list: Sequence[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """Split item indices into `k_partitions` parts of near-equal value sums (largest
    differencing). With `equal_size`, every part gets `len(seqlen_list) / k` items: the items,
    sorted, enter k at a time, one per part. Parts are in verl's order, indices unsorted."""
    k = k_partitions
    order = sorted((_scalar(v), i) for i, v in enumerate(seqlen_list))
    if equal_size:
        if len(order) % k:
            raise ValueError(f"{len(order)} items cannot be split into {k} equal-size parts")
        groups = [order[o : o + k] for o in range(0, len(order), k)]
    else:
        groups = [[item] for item in order]
    heap: list[_Partial] = []
    for group in groups:
        heapq.heappush(heap, _Partial([(i, v) for v, i in group], k))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.merge(second)
        heapq.heappush(heap, first)
    return [[i for i, _ in part.items] for part in heap[0].parts]


def greedy_partition(
    seqlen_list: Sequence[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """Each item, in input order, to the part with the smallest sum (verl's `greedy_partition`;
    with `equal_size` a large bias per item equalises the item counts first)."""
    bias = sum(seqlen_list) + 1 if equal_size else 0
    parts: list[list[int]] = [[] for _ in range(k_partitions)]
    sums = [0] * k_partitions
    for i, v in enumerate(seqlen_list):
        j = min(range(k_partitions), key=lambda j: (sums[j], j))
        parts[j].append(i)
        sums[j] += _scalar(v) + bias
    return parts


def get_seqlen_balanced_partitions(
    seqlen_list: Sequence[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """`karmarkar_karp` parts with each part's indices sorted; checks that every part is
    non-empty and every index is used once (verl's function of the same name)."""
    if len(seqlen_list) < k_partitions:
        raise ValueError(f"{len(seqlen_list)} items cannot fill {k_partitions} partitions")
    parts = karmarkar_karp(seqlen_list, k_partitions, equal_size)
    if any(not p for p in parts) or sorted(i for p in parts for i in p) != list(
        range(len(seqlen_list))
    ):
        raise AssertionError("karmarkar_karp returned an empty part or lost an index")
    return [sorted(p) for p in parts]


def seqlen_balance_metrics(
    seqlen_list: Sequence[int], partitions: Sequence[Sequence[int]], prefix: str = "global_seqlen"
) -> dict[str, float]:
    """verl's `log_seqlen_unbalance`: token sums per shard before (contiguous split of the input
    order) and after balancing: `{prefix}/min, max, minmax_diff, balanced_min, balanced_max,
    mean`."""
    k = len(partitions)
    seqlens = [int(s) for s in seqlen_list]
    size = len(seqlens) // k
    before = [sum(seqlens[o : o + size]) for o in range(0, len(seqlens), size)]
    after = [sum(seqlens[i] for i in p) for p in partitions]
    return {
        f"{prefix}/min": min(before),
        f"{prefix}/max": max(before),
        f"{prefix}/minmax_diff": max(before) - min(before),
        f"{prefix}/balanced_min": min(after),
        f"{prefix}/balanced_max": max(after),
        f"{prefix}/mean": sum(before) / k,
    }


def balance_batch(
    seqlens: Any,
    dp_size: int,
    *,
    minibatch_size: int | None = None,
    prefix: str = "global_seqlen",
) -> tuple[np.ndarray, dict[str, float]]:
    """Reorder a batch so that its `dp_size` contiguous shards cost about the same (verl's
    `trainer.balance_batch`, `RayPPOTrainer._balance_batch`).

    Args:
        seqlens: int [B] valid tokens per sequence (prompt + response), e.g.
            `attention_mask.sum(-1)`.
        dp_size: Data-parallel shards; each gets `B / dp_size` sequences.
        minibatch_size: If set, balance each mini-batch of this many sequences on its own, so
            mini-batch boundaries stay where they were (verl's `keep_minibatch`).
        prefix: Metric-name prefix.

    Returns:
        `order` int64 [B] (`batch[order]`, cut into `dp_size` equal contiguous chunks, gives the
        shards; within a shard, sequences are ordered light-heavy-light as verl does) and verl's
        balance metrics (`seqlen_balance_metrics`).
    """
    seqlens = np.asarray(seqlens, np.int64).reshape(-1)
    workload = calculate_workload(seqlens).tolist()
    if minibatch_size:
        parts: list[list[int]] = [[] for _ in range(dp_size)]
        for m in range(len(workload) // minibatch_size):
            offset = m * minibatch_size
            chunk = workload[offset : offset + minibatch_size]
            for j, p in enumerate(get_seqlen_balanced_partitions(chunk, dp_size, True)):
                parts[j].extend(i + offset for i in p)
    else:
        parts = get_seqlen_balanced_partitions(workload, dp_size, equal_size=True)
    ordered = []
    for p in parts:
        p = sorted(p, key=lambda i: (workload[i], i))
        ordered.append(p[::2] + p[1::2][::-1])  # light at both ends of the shard
    order = np.asarray([i for p in ordered for i in p], np.int64)
    return order, seqlen_balance_metrics(seqlens.tolist(), ordered, prefix)


def inverse_permutation(order: Any) -> np.ndarray:
    """int64 `inv` with `inv[order[i]] = i`: `x[order][inv]` is `x`."""
    order = np.asarray(order, np.int64)
    inv = np.empty_like(order)
    inv[order] = np.arange(len(order))
    return inv
