"""Micro-batches of an RL batch: which rows go together, trimmed of their common padding.

A batch holds `prompts` [N, P] (left-padded) and `responses` [N, R] (right-padded) plus
per-token arrays [N, R]. A micro-batch is a list of rows and the widths (p, r) it is cut to:
the last p prompt columns and the first r response columns, each the bucketed maximum of its
rows' real lengths, so short responses do not pay for the longest one (verl's
`use_remove_padding`, done as trimming). The row count is padded to a multiple of the
batch-shard count with all-padding rows (row index -1), which carry no loss.

Two ways to form them (verl's keys):

- `micro_rows` (`*_micro_batch_size_per_gpu` x batch shards): consecutive rows, a fixed count;
- `token_budget` (`use_dynamic_bsz`, `*_max_token_len_per_gpu` x batch shards): rows sorted by
  length, longest first, filled while rows x (p + r) stays within the budget.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.rollout.engine import bucket


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Rows of a batch (-1: an all-padding row) and the widths they are trimmed to."""

    rows: np.ndarray
    prompt_len: int
    response_len: int

    @property
    def tokens(self) -> int:
        return len(self.rows) * (self.prompt_len + self.response_len)


def _width(lengths: np.ndarray, full: int) -> int:
    return min(bucket(int(lengths.max(initial=1)), minimum=8), full)


def _pad_rows(rows: np.ndarray, multiple: int) -> np.ndarray:
    extra = -len(rows) % multiple
    return np.concatenate([rows, np.full(extra, -1, rows.dtype)]) if extra else rows


def plan_micro_batches(
    rows: np.ndarray,
    prompt_lengths: np.ndarray,
    response_lengths: np.ndarray,
    prompt_width: int,
    response_width: int,
    *,
    micro_rows: int | None = None,
    token_budget: int | None = None,
    row_multiple: int = 1,
) -> list[MicroBatch]:
    """Split `rows` (indices into the batch) into micro-batches.

    Args:
        rows: Row indices of the (mini-)batch to split.
        prompt_lengths: Real prompt tokens of every row of the batch [N].
        response_lengths: Real response tokens of every row of the batch [N].
        prompt_width: P, the batch's prompt columns.
        response_width: R, the batch's response columns.
        micro_rows: Rows per micro-batch (fixed count); None with no budget: all rows at once.
        token_budget: Padded tokens per micro-batch (dynamic batch size); overrides micro_rows.
        row_multiple: Every micro-batch's row count is padded to a multiple of this.

    Raises:
        ValueError: if one row alone exceeds the token budget (naming the budget needed).
    """
    rows = np.asarray(rows)
    if token_budget is not None:
        groups = _by_budget(rows, prompt_lengths, response_lengths, token_budget, row_multiple)
    else:
        size = len(rows) if micro_rows is None else micro_rows
        groups = [rows[i : i + size] for i in range(0, len(rows), max(size, 1))]
    out = []
    for group in groups:
        p = _width(prompt_lengths[group], prompt_width)
        r = _width(response_lengths[group], response_width)
        out.append(MicroBatch(_pad_rows(group, row_multiple), p, r))
    return out


def _by_budget(rows, prompt_lengths, response_lengths, budget, row_multiple) -> list[np.ndarray]:
    total = prompt_lengths[rows] + response_lengths[rows]
    order = rows[np.argsort(-total, kind="stable")]
    groups, current = [], []
    for row in order:
        candidate = [*current, row]
        p = _width(prompt_lengths[candidate], 1 << 30)
        r = _width(response_lengths[candidate], 1 << 30)
        padded_rows = -(-len(candidate) // row_multiple) * row_multiple
        if padded_rows * (p + r) <= budget:
            current = candidate
            continue
        if not current:
            raise ValueError(
                f"a sequence of {p + r} padded tokens ({row_multiple} rows per shard step) does "
                f"not fit the token budget {budget}; raise ppo_max_token_len_per_gpu to at "
                f"least {-(-padded_rows * (p + r) // row_multiple)}"
            )
        groups.append(np.asarray(current))
        current = [row]
    if current:
        groups.append(np.asarray(current))
    return groups


def take(batch: dict[str, np.ndarray], mb: MicroBatch) -> dict[str, np.ndarray]:
    """The micro-batch's rows of every array, prompts cut to their last `prompt_len` columns
    and [N, R] arrays to their first `response_len`; rows -1 are zeros."""
    valid = mb.rows >= 0
    idx = np.where(valid, mb.rows, 0)
    out = {}
    for name, x in batch.items():
        x = x[idx]
        if name in ("prompts", "prompt_mask"):
            x = x[:, x.shape[1] - mb.prompt_len :]
        elif x.ndim == 2:
            x = x[:, : mb.response_len]
        out[name] = np.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, np.zeros_like(x))
    return out
