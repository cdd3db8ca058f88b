"""Micro-batches of an RL batch: which rows go together, trimmed of their common padding.

A batch holds `prompts` [N, P] (left-padded) and `responses` [N, R] (right-padded) plus
per-token arrays [N, R]. A micro-batch is a list of rows and the widths (p, r) it is cut to:
the last p prompt columns and the first r response columns, each the bucketed maximum of its
rows' real lengths, so short responses do not pay for the longest one (verl's
`use_remove_padding`, done as trimming). The row count is padded to a multiple of the
batch-shard count with all-padding rows (row index -1), which carry no loss.

Two ways to form them (verl's keys):

- `micro_rows` (`*_micro_batch_size_per_gpu`): a fixed count of rows per shard;
- `token_budget` (`use_dynamic_bsz`, `*_max_token_len_per_gpu`): each shard's block is cut by
  `jaxrl.data.dynamic_micro_batches` (verl's `rearrange_micro_batches`: the same number of
  micro-batches on every shard, each within the budget of valid tokens), and micro-batch k
  gathers every shard's k-th part, padded to the longest part.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.data.balance import calculate_workload, get_seqlen_balanced_partitions
from jaxrl.data.batch import bucket
from jaxrl.data.dynamic import dynamic_micro_batches


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Rows of a batch (`row_ids`, indices; -1: an all-padding row) and the widths they are
    trimmed to."""

    row_ids: np.ndarray
    prompt_len: int
    response_len: int


def _width(lengths: np.ndarray, full: int) -> int:
    return min(bucket(int(lengths.max(initial=1)), minimum=8), full)


def _pad_rows(rows: np.ndarray, multiple: int) -> np.ndarray:
    return pad_to(rows, len(rows) + (-len(rows) % multiple))


def pad_to(rows: np.ndarray, n: int) -> np.ndarray:
    """`rows` (int64) followed by -1 (all-padding rows) up to length n."""
    return np.concatenate([rows.astype(np.int64), np.full(n - len(rows), -1, np.int64)])


def plan_micro_batches(
    rows: np.ndarray,
    prompt_lengths: np.ndarray,
    response_lengths: np.ndarray,
    prompt_width: int,
    response_width: int,
    *,
    micro_rows: int | None = None,
    token_budget: int | None = None,
    shards: int = 1,
    balance: bool = False,
) -> list[MicroBatch]:
    """Split `rows` (indices into the batch) into micro-batches.

    The rows are first dealt to the `shards` batch-shard devices as contiguous blocks (with
    `balance`, as blocks of equal token work: verl's `trainer.balance_batch`, Karmarkar-Karp
    over prompt + response lengths); micro-batch k holds every shard's k-th part, so each
    device works through its own block.

    Args:
        rows: Row indices of the (mini-)batch to split.
        prompt_lengths: Real prompt tokens of every row of the batch [N].
        response_lengths: Real response tokens of every row of the batch [N].
        prompt_width: P, the batch's prompt columns.
        response_width: R, the batch's response columns.
        micro_rows: Rows per shard per micro-batch (fixed count); None with no budget: all
            rows at once.
        token_budget: Valid tokens per shard per micro-batch (dynamic batch size); overrides
            `micro_rows`.
        shards: Devices the batch axis is split over; every micro-batch's row count is a
            multiple of it.
        balance: Deal rows to shards by equal work instead of in order.
    """
    rows = _pad_rows(np.asarray(rows), shards)
    lengths = np.where(rows >= 0, (prompt_lengths + response_lengths)[rows], 0)
    if balance and shards > 1:
        parts = get_seqlen_balanced_partitions(
            calculate_workload(lengths).tolist(), shards, equal_size=True
        )
        blocks = [rows[np.sort(np.asarray(p, np.int64))] for p in parts]
    else:
        blocks = np.split(rows, shards)
    if token_budget is not None:
        groups = _by_budget(blocks, prompt_lengths + response_lengths, token_budget)
    else:
        size = len(blocks[0]) if micro_rows is None else micro_rows
        groups = [
            np.concatenate([b[k : k + size] for b in blocks])
            for k in range(0, len(blocks[0]), max(size, 1))
        ]
    out = []
    for group in groups:
        real = group[group >= 0]
        p = _width(prompt_lengths[real], prompt_width)
        r = _width(response_lengths[real], response_width)
        out.append(MicroBatch(group, p, r))
    return out


def _by_budget(blocks, seq_lengths, budget) -> list[np.ndarray]:
    blocks = [b[b >= 0] for b in blocks]
    filled = [b for b in blocks if len(b)]
    parts = iter(dynamic_micro_batches([seq_lengths[b] for b in filled], budget))
    per_shard = [next(parts) if len(b) else [] for b in blocks]
    count = max(len(p) for p in per_shard)
    groups = []
    for k in range(count):
        pieces = [
            b[p[k]] if p else np.zeros(0, np.int64) for b, p in zip(blocks, per_shard, strict=True)
        ]
        width = max(len(x) for x in pieces)
        groups.append(np.concatenate([pad_to(x, width) for x in pieces]))
    return groups
