"""The PPO value loss and the entropy loss.

Clipped value loss (as in verl / TRL), with v the new predictions, v_old the rollout values,
G the returns and eps = cliprange_value:

    L_V = 1/2 agg( max((v - G)^2, (clip(v, v_old - eps, v_old + eps) - G)^2) )
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxrl.core_algos.aggregation import agg_loss
from jaxrl.core_algos.common import clip_by_value, masked_mean


def compute_value_loss(
    vpreds: Float[Array, "b r"],
    returns: Float[Array, "b r"],
    values: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: float | Array | None = None,
    global_batch_size: float | Array | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(value loss, fraction of tokens where the clipped term was larger)."""
    vpred_clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    losses1 = (vpreds - returns) ** 2
    losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        loss_mat=jnp.maximum(losses1, losses2),
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean((losses2 > losses1).astype(jnp.float32), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: Float[Array, "b r v"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "token-mean",
) -> Float[Array, ""]:
    """The aggregated entropy H = logsumexp(z) - sum softmax(z) z of the response tokens
    (in float32, as verl's `entropy_from_logits`; core_algos is a leaf, so it does not import
    the models' copy)."""
    z = logits.astype(jnp.float32)
    entropy = jax.nn.logsumexp(z, axis=-1) - jnp.sum(jax.nn.softmax(z) * z, axis=-1)
    return agg_loss(entropy, response_mask, loss_agg_mode)
