"""Micro-batches by token budget (verl's `use_dynamic_bsz`).

With `use_dynamic_bsz`, verl cuts a data-parallel shard's mini-batch not into micro-batches of a
fixed count of sequences but into the fewest micro-batches whose valid tokens each stay within
`max_token_len` (`ppo_max_token_len_per_gpu`, `log_prob_max_token_len_per_gpu`, ...): it starts
from `ceil(total tokens / max_token_len)` parts, balances their `calculate_workload` cost with
Karmarkar-Karp, and adds a part until every part fits. All shards use the same number of
micro-batches (verl all-reduces the count; here the caller passes every shard's lengths), so the
data-parallel shards step through gradient accumulation together.

In jaxrl a micro-batch whose tokens fit in `max_token_len` fits in one packed row of that length
(`jaxrl.data.packing`), so the jitted step sees one static shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.data.balance import calculate_workload, get_seqlen_balanced_partitions


def _ceildiv(a: int, b: int) -> int:
    return -(a // -b)


def _within(parts: Sequence[Sequence[int]], seqlens: Sequence[int], max_token_len: int) -> bool:
    return all(sum(seqlens[i] for i in p) <= max_token_len for p in parts)


def _balance_order(parts: list[list[int]], workload: Sequence[int]) -> list[list[int]]:
    # Heaviest first, then the light ones moved to both ends (verl's use_dynamic_bsz_balance:
    # fewer pipeline bubbles; harmless without a pipeline).
    parts = sorted(
        parts, key=lambda p: (sum(workload[i] for i in p), p[0] if p else 0), reverse=True
    )
    return parts[::2][::-1] + parts[1::2]


def dynamic_micro_batches(
    seqlens_per_shard: Sequence[Any],
    max_token_len: int,
    *,
    min_num_micro_batches: int | None = None,
    num_batches_divided_by: int | None = None,
    balance_order: bool = True,
) -> list[list[list[int]]]:
    """Index lists of the micro-batches of every data-parallel shard, the same count for all.

    Args:
        seqlens_per_shard: Per shard, int [B_s] valid tokens per sequence (`attention_mask
            .sum(-1)` of that shard's mini-batch). One shard: pass `[seqlens]`.
        max_token_len: The token budget of a micro-batch; at least the longest sequence.
        min_num_micro_batches: At least this many micro-batches.
        num_batches_divided_by: Round the count up to a multiple of this.
        balance_order: Order micro-batches as verl's `use_dynamic_bsz_balance`.

    Returns:
        `parts[s][m]`: indices (into shard s's batch, sorted) of micro-batch m of shard s. Every
        micro-batch is non-empty and holds at most `max_token_len` tokens.
    """
    shards = [np.asarray(s, np.int64).reshape(-1).tolist() for s in seqlens_per_shard]
    longest = max(max(s) for s in shards)
    if longest > max_token_len:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the micro-batch token budget "
            f"{max_token_len}; raise *_max_token_len_per_gpu to at least "
            "max_prompt_length + max_response_length"
        )
    fewest = min(len(s) for s in shards)
    count = max(min(len(s), _ceildiv(sum(s), max_token_len)) for s in shards)
    count = max(count, min_num_micro_batches or 1)
    step = num_batches_divided_by or 1
    count = _ceildiv(count, step) * step
    workloads = [calculate_workload(s).tolist() for s in shards]
    while True:
        if count > fewest:
            raise ValueError(
                f"cannot fit the shards into {count} non-empty micro-batches of {max_token_len} "
                f"tokens: a shard has only {fewest} sequences"
            )
        parts = [get_seqlen_balanced_partitions(w, count, equal_size=False) for w in workloads]
        if all(_within(p, s, max_token_len) for p, s in zip(parts, shards, strict=True)):
            break
        count += step
    if balance_order:
        parts = [_balance_order(p, w) for p, w in zip(parts, workloads, strict=True)]
    return parts


def restore_order(x: Any, parts: Sequence[Sequence[int]]) -> np.ndarray:
    """Results concatenated in micro-batch order (`x`, [B, ...]) back in the batch's order
    (verl's `restore_dynamic_batch`)."""
    order = np.asarray([i for p in parts for i in p], np.int64)
    inv = np.empty_like(order)
    inv[order] = np.arange(len(order))
    return np.asarray(x)[inv]
