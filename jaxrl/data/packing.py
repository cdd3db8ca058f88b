"""Packing variable-length sequences into rows of a fixed token budget (verl's rmpad, static).

verl removes padding by concatenating every sequence into one flat stream (flash-attention's
varlen). Under `jit` shapes are static, so jaxrl instead places sequences into R rows of L tokens
each; inside a row, sequence j carries segment id j+1 and padding carries 0:

    row 0:  a a a a b b c c c 0 0 0      segment_ids 1 1 1 1 2 2 3 3 3 0 0 0
    row 1:  d d d d d d d e e e e 0                  1 1 1 1 1 1 1 2 2 2 2 0

`jaxrl.models.forward(..., segment_ids=...)` masks attention to a segment and restarts positions
at 0 in each, so a packed pass computes exactly what one pass per sequence computes. Placement is
first-fit decreasing (longest first, into the first row with room), which is deterministic.

`placement` [N, 3] holds `(row, start, length)` per sequence; `unpack` and `unpack_to_padded`
take per-token results (log-probs, values) back to per-sequence or padded [B, T] layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl.data.batch import bucket


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Sequences packed into rows.

    Attributes:
        input_ids: int32 [R, L] token ids (`pad_token_id` on padding).
        segment_ids: int32 [R, L]; 1, 2, ... per sequence within a row, 0 on padding.
        positions: int32 [R, L]; 0, 1, ... within each sequence, 0 on padding.
        placement: int64 [N, 3]: `(row, start, length)` of each input sequence, in input order.
    """

    input_ids: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    placement: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int((self.segment_ids > 0).sum())


def plan_packing(lengths: Sequence[int], row_len: int, num_rows: int | None = None) -> np.ndarray:
    """Place sequences of `lengths` into rows of `row_len` tokens (first-fit decreasing).

    Args:
        lengths: [N] tokens per sequence; each at most `row_len`.
        row_len: L, the token budget of a row.
        num_rows: R, a fixed row count (static shapes); None uses as few as the heuristic needs.

    Returns:
        int64 [N, 3]: `(row, start, length)` per sequence, in input order.

    Raises:
        ValueError: A sequence is longer than `row_len`, or they do not fit in `num_rows` rows.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > row_len:
        raise ValueError(
            f"a sequence of {int(lengths.max())} tokens does not fit in a row of {row_len}; "
            "raise the row length (e.g. ppo_max_token_len_per_gpu)"
        )
    used: list[int] = []  # tokens used per row
    placement = np.zeros((len(lengths), 3), np.int64)
    # Stable sort: equal lengths keep their input order, so the plan is deterministic.
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = int(lengths[i])
        row = next((r for r, u in enumerate(used) if u + n <= row_len), len(used))
        if row == len(used):
            used.append(0)
        placement[i] = (row, used[row], n)
        used[row] += n
    if num_rows is not None and len(used) > num_rows:
        raise ValueError(
            f"{len(lengths)} sequences ({int(lengths.sum())} tokens) need {len(used)} rows of "
            f"{row_len} tokens, more than the {num_rows} given"
        )
    return placement


def row_length(lengths: Sequence[int], max_len: int) -> int:
    """The row length L <= `max_len` that packs sequences of `lengths` into the fewest padded
    tokens R(L) * L (then the fewest rows), among the bucket sizes from the longest sequence
    up and `max_len` itself: a short batch is not padded to `max_len`, and sequences of about
    equal length still share rows when a longer row holds two of them.

    Raises:
        ValueError: A sequence is longer than `max_len`.
    """
    longest = max(lengths, default=1)
    sizes = {max_len}
    size = bucket(longest)
    while size < max_len:
        sizes.add(size)
        size = bucket(size + 1)

    def cost(size: int) -> tuple[int, int]:
        rows = int(plan_packing(lengths, size)[:, 0].max(initial=-1)) + 1
        return rows * size, rows

    return min(sorted(sizes), key=cost)


def pack(
    seqs: Sequence[Sequence[int]],
    row_len: int,
    num_rows: int | None = None,
    pad_token_id: int = 0,
) -> PackedRows:
    """Pack token id sequences into `PackedRows` (see `plan_packing` for the arguments)."""
    placement = plan_packing([len(s) for s in seqs], row_len, num_rows)
    rows = (int(placement[:, 0].max()) + 1 if len(seqs) else 0) if num_rows is None else num_rows
    input_ids = np.full((rows, row_len), pad_token_id, np.int32)
    segment_ids = np.zeros((rows, row_len), np.int32)
    positions = np.zeros((rows, row_len), np.int32)
    # Segment ids number the sequences of a row from the left.
    for i in np.lexsort((placement[:, 1], placement[:, 0])):
        row, start, n = placement[i]
        input_ids[row, start : start + n] = seqs[i]
        segment_ids[row, start : start + n] = (segment_ids[row].max() + 1) if n else 0
        positions[row, start : start + n] = np.arange(n)
    return PackedRows(input_ids, segment_ids, positions, placement)


def pack_padded(
    input_ids_bt: np.ndarray,
    attention_mask_bt: np.ndarray,
    row_len: int,
    num_rows: int | None = None,
    pad_token_id: int = 0,
) -> PackedRows:
    """Pack the unmasked tokens of each padded row (left- and/or right-padded) of a batch."""
    input_ids_bt, mask_bt = np.asarray(input_ids_bt), np.asarray(attention_mask_bt).astype(bool)
    seqs = [ids[m] for ids, m in zip(input_ids_bt, mask_bt, strict=True)]
    return pack(seqs, row_len, num_rows, pad_token_id)


def unpack(x_rl: np.ndarray, placement: np.ndarray) -> list[np.ndarray]:
    """Per-token values [R, L, ...] of packed rows back to one array per sequence."""
    x_rl = np.asarray(x_rl)
    return [x_rl[row, start : start + n] for row, start, n in placement]


def unpack_to_padded(
    x_rl: np.ndarray, placement: np.ndarray, attention_mask_bt: np.ndarray, fill: float = 0
) -> np.ndarray:
    """Per-token values [R, L, ...] of `pack_padded` rows back to the padded [B, T, ...] layout
    (`fill` on padding)."""
    x_rl = np.asarray(x_rl)
    mask_bt = np.asarray(attention_mask_bt).astype(bool)
    out = np.full(mask_bt.shape + x_rl.shape[2:], fill, x_rl.dtype)
    for b, (row, start, n) in enumerate(placement):
        out[b][mask_bt[b]] = x_rl[row, start : start + n]
    return out


def pack_prompt_response(
    arrays: dict[str, np.ndarray], row_len: int, pad_token_id: int = 0
) -> dict[str, np.ndarray]:
    """The sequences of a batch in the RL batch's layout (left-padded `prompts` [N, P],
    right-padded `responses` [N, R], `loss_mask` [N, R]) packed into M rows of `row_len`
    tokens, in the same layout: a packed row is a 1-token "prompt" (its first token) and an
    (L - 1)-token "response" (the rest), with the segment ids of both parts:

        prompts, prompt_mask, prompt_segment_ids          [M, 1]
        responses, response_mask, response_segment_ids    [M, L - 1]
        loss_mask                                         [M, L - 1]

    A forward pass over `concat(prompts, responses)` with `segment_ids = concat(...)` then
    computes every sequence's per-token log-probs as its own padded row does (position t
    predicts token t + 1 within a segment), and a masked sum over the packed loss mask is the
    unpacked one. A sequence's first token is never trained on (nothing in it predicts that
    token; across a segment boundary the previous sequence's last token would). Rows without
    trained tokens (a short batch's filler) are left out.

    Raises:
        ValueError: A sequence is longer than `row_len`.
    """
    prompt_mask = np.asarray(arrays["prompt_mask"]).astype(bool)
    response_mask = np.asarray(arrays["response_mask"]).astype(bool)
    loss_mask = np.asarray(arrays["loss_mask"])
    keep = np.flatnonzero(loss_mask.sum(-1) > 0)
    seqs, masks = [], []
    for i in keep:
        seqs.append(np.concatenate([arrays["prompts"][i][prompt_mask[i]],
                                    arrays["responses"][i][response_mask[i]]]))  # fmt: skip
        mask = np.concatenate([np.zeros(prompt_mask[i].sum(), np.int32),
                               loss_mask[i][response_mask[i]]])  # fmt: skip
        mask[:1] = 0
        masks.append(mask)
    packed = pack(seqs, row_len, pad_token_id=pad_token_id)
    loss = np.zeros(packed.input_ids.shape, np.int32)
    for (row, start, n), mask in zip(packed.placement, masks, strict=True):
        loss[row, start : start + n] = mask
    seg, ids = packed.segment_ids, packed.input_ids
    return {
        "prompts": ids[:, :1],
        "prompt_mask": (seg[:, :1] > 0).astype(np.int32),
        "prompt_segment_ids": seg[:, :1],
        "responses": ids[:, 1:],
        "response_mask": (seg[:, 1:] > 0).astype(np.int32),
        "response_segment_ids": seg[:, 1:],
        "loss_mask": loss[:, 1:],
    }
