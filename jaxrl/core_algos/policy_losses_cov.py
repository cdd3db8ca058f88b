"""Clip-Cov and KL-Cov (Cui et al. 2025, arXiv:2505.22617): entropy-preserving PPO variants.

Both act on the few tokens whose centred covariance between advantage and log-probability,

    cov_t = (A_t - mean(A)) (log pi_t - mean(log pi))     (means over the batch's loss tokens)

is largest, since those drive the collapse of the policy's entropy: Clip-Cov drops the
gradient of a random sample of them, KL-Cov adds a |log r| penalty on the top-k.

Deliberate differences from verl, forced by `jit` (no data-dependent shapes or host syncs):

- Clip-Cov draws its random tokens from a jax PRNG key, the keyword argument `rng`
  (default `jax.random.key(0)`: every call then picks the same tokens for the same inputs,
  so a trainer should pass a fresh key per step), where verl uses torch's global RNG
  (`torch.randperm`). The selection is a uniformly random subset of min(k, #eligible)
  eligible tokens in both, k = max(int(clip_cov_ratio * #tokens), 1); only which subset is
  drawn differs. Everything else (eligibility, k, the loss given the subset, the metrics,
  including the selected fraction `actor/pg_clipfrac`) equals verl's.
- KL-Cov's top-k is a fixed-size sort; ties in cov are broken by position (torch's `topk`
  leaves them unspecified). If `kl_cov_ratio > 1`, verl's `topk` fails (k exceeds the
  token count); here all tokens are selected.
- Counts `int(ratio * n)` are evaluated exactly as Python's float64 product (see
  `float64_floor_product`), not in float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrl.core_algos.common import abs_, cfg_get, clamp, masked_mean
from jaxrl.core_algos.policy_losses_common import (
    aggregate,
    clip_range,
    float64_floor_product,
    require_config,
    reweight,
    value_or,
)
from jaxrl.core_algos.registry import register_policy_loss

Metrics = dict[str, Array]


def _policy_loss_config(config: Any, name: str) -> Any:
    require_config(config, name)
    policy_loss = cfg_get(config, "policy_loss")
    if policy_loss is None:
        raise ValueError(f"policy loss {name!r} needs config.policy_loss")
    return policy_loss


def _ranks(keys: Float[Array, "b r"]) -> Int[Array, "b r"]:
    """0-based rank of every entry in ascending order of `keys` (ties: by position)."""
    order = jnp.argsort(keys.ravel(), stable=True)
    ranks = jnp.zeros(order.shape, jnp.int32).at[order].set(jnp.arange(order.size, dtype=jnp.int32))
    return ranks.reshape(keys.shape)


def random_subset(
    eligible: Bool[Array, "b r"], count: Int[Array, ""], rng: Array
) -> Bool[Array, "b r"]:
    """A uniformly random subset of min(count, #eligible) eligible entries."""
    keys = jnp.where(eligible, jax.random.uniform(rng, eligible.shape), 2.0)
    return eligible & (_ranks(keys) < count)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
    *,
    rng: Array | None = None,
) -> tuple[Float[Array, ""], Metrics]:
    """Clip-Cov: PPO with the gradient of a few high-covariance tokens removed.

    With r = exp(log pi - log pi_old) (unclamped, as verl) and cov_t as in the module
    docstring, a token is eligible when it is a loss token, PPO's clip is not active on it,
    and lb < cov_t < ub (`policy_loss.clip_cov_lb` / `clip_cov_ub`). A random subset S of
    min(k, #eligible) eligible tokens, k = max(int(`clip_cov_ratio` * #loss tokens), 1),
    is dropped::

        L = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h)) [t not in S]

    Cui et al. 2025, The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models, arXiv:2505.22617.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights: as `compute_policy_loss_vanilla`.
        rng: PRNG key of the random subset (default `jax.random.key(0)`).

    Returns:
        (loss, metrics): `actor/pg_clipfrac` (the dropped fraction of loss tokens),
        `actor/ppo_kl`.
    """
    policy_loss = _policy_loss_config(config, "clip_cov")
    clip_cov_ratio = value_or(cfg_get(policy_loss, "clip_cov_ratio"), 0.0002)
    clip_cov_lb = value_or(cfg_get(policy_loss, "clip_cov_lb"), 1.0)
    clip_cov_ub = value_or(cfg_get(policy_loss, "clip_cov_ub"), 5.0)
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    clip_low, clip_high = clip_range(config)
    rng = jax.random.key(0) if rng is None else rng

    log_ratio = log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * clamp(ratio, 1 - clip_low, 1 + clip_high)

    valid = response_mask > 0
    log_prob_sg = jax.lax.stop_gradient(log_prob)
    advantages_sg = jax.lax.stop_gradient(advantages)
    cov = (advantages_sg - masked_mean(advantages_sg, response_mask)) * (
        log_prob_sg - masked_mean(log_prob_sg, response_mask)
    )
    eligible = valid & ~(clipped > unclipped) & (cov < clip_cov_ub) & (cov > clip_cov_lb)
    n_tokens = jnp.sum(valid, dtype=jnp.int32)
    k = jnp.maximum(float64_floor_product(clip_cov_ratio, n_tokens, valid.size), 1)
    dropped = jax.lax.stop_gradient(random_subset(eligible, k, rng))
    keep = jnp.where(dropped, 0.0, 1.0).astype(advantages.dtype)

    pg_losses = jnp.maximum(unclipped, clipped) * keep
    loss = aggregate(reweight(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    metrics = {
        "actor/pg_clipfrac": masked_mean((keep == 0).astype(jnp.float32), response_mask),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
    }
    return loss, jax.lax.stop_gradient(metrics)


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> tuple[Float[Array, ""], Metrics]:
    """KL-Cov: the unclipped surrogate, plus a |log r| penalty on the top-k covariance tokens.

    With l = log pi - log pi_old (unclamped, as verl), r = exp(l), beta =
    `policy_loss.ppo_kl_coef` and K the k = max(int(`kl_cov_ratio` * #loss tokens), 1) loss
    tokens of largest cov_t (module docstring)::

        L = -A r + beta |l| [t in K]

    No clipping: the penalty alone keeps the high-covariance tokens near pi_old. Cui et al.
    2025, arXiv:2505.22617.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights: as `compute_policy_loss_vanilla`.

    Returns:
        (loss, metrics): `actor/ppo_kl` = mean |l| over the loss tokens.
    """
    policy_loss = _policy_loss_config(config, "kl_cov")
    kl_cov_ratio = value_or(cfg_get(policy_loss, "kl_cov_ratio"), 0.0002)
    ppo_kl_coef = value_or(cfg_get(policy_loss, "ppo_kl_coef"), 1.0)
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")

    log_ratio = log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    surrogate = -advantages * ratio
    penalised = -advantages * ratio + ppo_kl_coef * abs_(log_ratio)

    valid = response_mask > 0
    n_tokens = jnp.sum(valid, dtype=jnp.int32)
    count = jnp.maximum(n_tokens, 1).astype(log_prob.dtype)
    log_prob_sg = jax.lax.stop_gradient(log_prob)
    advantages_sg = jax.lax.stop_gradient(advantages)
    # Plain means over the loss tokens (verl's `.mean()` of the gathered values: no 1e-8).
    adv_mean = jnp.sum(jnp.where(valid, advantages_sg, 0.0)) / count
    log_prob_mean = jnp.sum(jnp.where(valid, log_prob_sg, 0.0)) / count
    cov = jnp.where(valid, (advantages_sg - adv_mean) * (log_prob_sg - log_prob_mean), -jnp.inf)
    k = jnp.maximum(float64_floor_product(kl_cov_ratio, n_tokens, valid.size), 1)
    top_k = jax.lax.stop_gradient(valid & (_ranks(-cov) < k))

    pg_losses = jnp.where(top_k, penalised, surrogate)
    loss = aggregate(reweight(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    ppo_kl = masked_mean(jnp.abs(log_ratio), response_mask)
    return loss, {"actor/ppo_kl": jax.lax.stop_gradient(ppo_kl)}
