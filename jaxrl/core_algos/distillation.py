"""On-policy distillation losses (verl 0.9.1's `distillation.distillation_loss.*`).

The student samples responses; a frozen teacher scores the sampled tokens. With the student's
log-probs s_t = log pi(y_t) and the teacher's t_t = log pi_T(y_t) of each response token, the
per-token loss l_t is a single-sample estimate of the reverse KL(pi || pi_T) (`loss_mode`, the
estimators of `kl_penalty`):

    k1 / kl:        s - t                       abs:  |s - t|
    k2 / mse:       (s - t)^2 / 2               k3 / low_var_kl:  exp(t - s) - (t - s) - 1

Then (`distillation_loss`), with m the trained-token mask:

    l = clamp(l, -loss_max_clamp, loss_max_clamp)         if loss_max_clamp is set
    L = pg_vanilla(old_lp, lp, A = -stop_grad(l), m)      use_policy_gradient (Thinking
                                                           Machines' on-policy distillation)
    L = agg(l, m)                                          otherwise (supervised, GKD,
                                                           arXiv:2306.13649)

and the actor's loss (`combine`) is `L_ppo + coef * L` with task rewards
(`use_task_rewards`), else `L` alone. k1 backpropagated directly has a gradient that does
not depend on the teacher (d(s - t)/d theta = d s / d theta), so it is refused without the
policy gradient, as verl does.

The top-k variant (`forward_kl_topk`: the forward KL over the teacher's top-k tokens) is not
built yet; the config checks refuse it, and k1 without the policy gradient, naming the keys.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxrl.core_algos.aggregation import agg_loss
from jaxrl.core_algos.common import abs_, cfg_get, clamp, masked_mean
from jaxrl.core_algos.kl import kl_penalty_forward
from jaxrl.core_algos.policy_losses import compute_policy_loss_vanilla


def token_losses(
    student_log_probs: Float[Array, "b r"],
    teacher_log_probs: Float[Array, "b r"],
    loss_mode: str,
) -> Float[Array, "b r"]:
    """The per-token distillation loss of the sampled tokens (the estimator `loss_mode`)."""
    return kl_penalty_forward(student_log_probs, teacher_log_probs, loss_mode)


def _masked_extreme(x: Array, mask: Array, fn) -> Array:
    fill = jnp.inf if fn is jnp.min else -jnp.inf
    return jax.lax.stop_gradient(fn(jnp.where(mask > 0, x, fill)))


def distillation_loss(
    losses: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    old_log_prob: Float[Array, "b r"],
    mask: Float[Array, "b r"],
    *,
    loss_cfg: Any,
    loss_agg_mode: str,
    info: dict[str, Any],
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> tuple[Array, dict[str, dict[str, Array]]]:
    """(loss, metrics by how they combine over micro-batches) of per-token distillation
    `losses` (see the module doc): `mean` (token-weighted) `distillation/abs_loss` and, with
    the policy gradient, the vanilla loss's `distillation/{pg_clipfrac, ppo_kl,
    pg_clipfrac_lower}`; `min` / `max`: `distillation/loss_min` / `loss_max` over `mask`,
    before the clamp (+-inf where the mask is empty)."""
    means = {"distillation/abs_loss": jax.lax.stop_gradient(masked_mean(abs_(losses), mask))}
    metrics = {
        "mean": means,
        "min": {"distillation/loss_min": _masked_extreme(losses, mask, jnp.min)},
        "max": {"distillation/loss_max": _masked_extreme(losses, mask, jnp.max)},
    }
    bound = loss_cfg.loss_max_clamp
    if bound is not None:
        losses = clamp(losses, -bound, bound)
    if loss_cfg.use_policy_gradient:
        pg_cfg = {
            "clip_ratio": loss_cfg.clip_ratio,
            "clip_ratio_low": cfg_get(loss_cfg, "clip_ratio_low"),
            "clip_ratio_high": cfg_get(loss_cfg, "clip_ratio_high"),
            "global_batch_info": info,
        }
        loss, pg_metrics = compute_policy_loss_vanilla(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=-jax.lax.stop_gradient(losses),
            response_mask=mask,
            loss_agg_mode=loss_agg_mode,
            config=pg_cfg,
            rollout_is_weights=rollout_is_weights,
        )
        means.update({f"distillation/{k.removeprefix('actor/')}": v for k, v in pg_metrics.items()})
    else:
        loss = agg_loss(losses, mask, loss_agg_mode, **info)
    return loss, metrics


def combine(policy_loss: Array | None, distill: Array, loss_cfg: Any) -> Array:
    """The actor's loss: `policy_loss + coef * distill` with task rewards, else `distill`."""
    if not loss_cfg.use_task_rewards:
        return distill
    return policy_loss + loss_cfg.distillation_loss_coef * distill
