"""`agg_loss`: a [B, R] loss matrix to a scalar, normalised by GLOBAL counts.

With L the loss matrix, M the mask, and the mini-batch (global) counts
`batch_num_tokens` = sum M and `global_batch_size` = #{b : sum_t M[b, t] > 0}:

    token-mean               sum(L M) / batch_num_tokens
    token-sum                sum(L M)
    seq-mean-token-sum       sum_b [sum_t L M]_b / global_batch_size
    seq-mean-token-sum-norm  the same / loss_scale_factor (default R, the padded length)
    seq-mean-token-mean      sum_b [sum_t L M / (sum_t M + 1e-8)]_b / global_batch_size

each times `dp_size` (verl's convention for frameworks that average gradients over data-parallel
ranks; jaxrl's SPMD step computes one global loss and passes `dp_size=1`). When the global
counts are given, the loss of a mini-batch is the SUM of the losses of its micro-batches, for
every mode, so gradient accumulation does not depend on how the mini-batch is split. Without
them (and dp_size 1) the local counts are used, as in verl.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxrl.core_algos.common import masked_sum

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
)


def agg_loss(
    loss_mat: Float[Array, "b r"],
    loss_mask: Float[Array, "b r"],
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: float | Array | None = None,
    global_batch_size: float | Array | None = None,
    loss_scale_factor: float | None = None,
) -> Float[Array, ""]:
    """Aggregate `loss_mat` over `loss_mask` into a scalar (modes in the module docstring)."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"invalid loss_agg_mode {loss_agg_mode!r}; use one of {LOSS_AGG_MODES}")
    loss_mask = loss_mask.astype(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = jnp.sum(loss_mask)
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    tokens_per_seq = jnp.sum(loss_mask, axis=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = jnp.sum(loss_mat * loss_mask, axis=-1) / (tokens_per_seq + 1e-8)
    else:
        seq_losses = jnp.sum(loss_mat * loss_mask, axis=-1)
    seq_mask = (tokens_per_seq > 0).astype(loss_mat.dtype)  # fully masked rows do not count
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        global_batch_size = jnp.sum(seq_mask)
    loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def global_batch_info(
    loss_mask: Float[Array, "b r"], loss_scale_factor: float | None = None
) -> dict[str, Array | float | None]:
    """The global counts of a whole mini-batch, for `agg_loss(**info)` on its micro-batches."""
    rows = jnp.sum(jnp.sum(loss_mask, axis=-1) > 0)
    return batch_info(jnp.sum(loss_mask), rows, loss_scale_factor)


def batch_info(
    num_tokens: Array, num_rows: Array, loss_scale_factor: float | None = None
) -> dict[str, Array | float | None]:
    """`global_batch_info` from a mini-batch's counts: its tokens (the loss mask's sum) and
    its rows with at least one of them."""
    return {
        "dp_size": 1,
        "batch_num_tokens": num_tokens,
        "global_batch_size": num_rows,
        "loss_scale_factor": loss_scale_factor,
    }
