"""On-policy distillation losses (verl 0.9.1's `distillation.distillation_loss.*`).

The student samples responses; a frozen teacher scores the sampled tokens. With the student's
log-probs s_t = log pi(y_t) and the teacher's t_t = log pi_T(y_t) of each response token, the
per-token loss l_t is a single-sample estimate of the reverse KL(pi || pi_T) (`loss_mode`, the
estimators of `kl_penalty_forward(s, t, loss_mode)`):

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

The top-k variant (`forward_kl_topk`) is the forward KL over the teacher's k most likely
tokens at each position, with T_k, S_k their teacher and student log-probs (each floored at
`log_prob_min_clamp` when set):

    l_t = max(0, sum_k exp(T_k) (T_k - S_k))

(the top-k masses do not sum to 1, so the sum can go negative; verl clamps it at 0). Its
gradient reaches every one of the k student log-probs, not only the sampled token's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrl.core_algos.aggregation import agg_loss
from jaxrl.core_algos.common import abs_, cfg_get, clamp, masked_mean
from jaxrl.core_algos.policy_losses import compute_policy_loss_vanilla


def estimator_metrics(losses: Float[Array, "b r"], mask: Float[Array, "b r"]) -> dict:
    """The estimators' own metric (verl logs the mean |loss|: k1 can be negative)."""
    return {
        "mean": {"distillation/abs_loss": jax.lax.stop_gradient(masked_mean(abs_(losses), mask))}
    }


def forward_kl_topk(
    student_topk: Float[Array, "b r k"],
    teacher_topk: Float[Array, "b r k"],
    student_ids: Int[Array, "b r k"],
    teacher_ids: Int[Array, "b r k"],
    mask: Float[Array, "b r"],
    *,
    log_prob_min_clamp: float | None,
) -> tuple[Float[Array, "b r"], dict[str, dict[str, Array]]]:
    """(per-token losses, metrics) of the top-k forward KL (module doc). `student_topk`: the
    student's log-probs at the teacher's top-k ids; `student_ids`: the student's own top-k
    (for the overlap metrics only). Metrics, over `mask` (verl's): the top-k probability mass
    of each model (`distillation/{student,teacher}_mass` and their `_min` / `_max`), the
    fraction of the teacher's top-k the student's top-k holds (`overlap_ratio`), and the mean
    -exp(T_k) (T_k - S_k) over the overlapping tokens of positions that have some
    (`overlap_token_advantage`)."""
    stop = jax.lax.stop_gradient
    student_mass = stop(jnp.sum(jnp.exp(student_topk), axis=-1))
    teacher_mass = jnp.sum(jnp.exp(teacher_topk), axis=-1)
    if log_prob_min_clamp is not None:
        student_topk = jnp.maximum(student_topk, log_prob_min_clamp)
        teacher_topk = jnp.maximum(teacher_topk, log_prob_min_clamp)
    token_kl = jnp.exp(teacher_topk) * (teacher_topk - student_topk)
    losses = jnp.maximum(jnp.sum(token_kl, axis=-1), 0.0)
    overlap = jnp.any(teacher_ids[..., :, None] == student_ids[..., None, :], axis=-1)
    count = jnp.sum(overlap, axis=-1).astype(jnp.float32)
    advantage = jnp.sum(-stop(token_kl) * overlap, axis=-1) / jnp.maximum(count, 1.0)
    overlapping = mask * (count > 0)
    k = teacher_ids.shape[-1]
    metrics = {
        "mean": {
            "distillation/student_mass": masked_mean(student_mass, mask),
            "distillation/teacher_mass": masked_mean(teacher_mass, mask),
            "distillation/overlap_ratio": masked_mean(count, mask) / k,
            "distillation/overlap_token_advantage": jnp.where(
                jnp.sum(overlapping) > 0, masked_mean(advantage, overlapping), 0.0
            ),
        },
        "min": {f"distillation/{n}_mass_min": _masked_extreme(m, mask, jnp.min)
                for n, m in (("student", student_mass), ("teacher", teacher_mass))},
        "max": {f"distillation/{n}_mass_max": _masked_extreme(m, mask, jnp.max)
                for n, m in (("student", student_mass), ("teacher", teacher_mass))},
    }  # fmt: skip
    return losses, jax.tree.map(stop, metrics)


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
    `losses` (see the module doc): `mean` (token-weighted), with the policy gradient, the
    vanilla loss's `distillation/{pg_clipfrac, ppo_kl, pg_clipfrac_lower}`; `min` / `max`:
    `distillation/loss_min` / `loss_max` over `mask`, before the clamp (+-inf where the mask
    is empty)."""
    means = {}
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
