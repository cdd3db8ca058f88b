"""verl 0.9.1's registered policy losses in JAX, numerically equal to verl's torch code.

Every loss has verl's name, signature and semantics::

    loss, metrics = fn(old_log_prob, log_prob, advantages, response_mask,
                       loss_agg_mode, config, rollout_is_weights)

with `[B, R]` float arrays, `config` any object with verl's actor attribute names (read by
attribute only: a dataclass, `types.SimpleNamespace`, dict or DictConfig), and
`rollout_is_weights` optional per-token weights multiplying the per-token loss. Losses are
aggregated with `agg_loss(..., **config.global_batch_info)` wherever verl does so, and
metrics carry verl's keys. All are jittable (config closed over: it is static) and
differentiable in `log_prob`; where verl detaches a tensor, `jax.lax.stop_gradient` does the
same, and clamps and absolute values have torch's gradients at their kinks (`common.clamp`,
`common.abs_`), so `jax.grad` equals torch autograd.

Registered names: vanilla, dppo_tv, dppo_kl, gspo, sapo, gpg, geo_mean, dro, cispo and
bypass_mode here; clip_cov and kl_cov in `policy_losses_cov` (imported below, so importing
this module registers all twelve); bypass mode's rollout correction in
`policy_losses_rollout_corr`.

Deliberate differences from verl:

- Metrics are jax scalars, not Python floats (`.item()` is a host sync under `jit`).
- Invalid config values raise `ValueError` where verl uses `assert` (`clip_ratio_c <= 1`,
  a missing config). verl's `isinstance(config, ActorConfig)` checks (gspo, sapo, cispo) are
  not made: any config object with the attributes works.
- `clip_cov` selects its tokens with a jax PRNG key (`rng=`) instead of torch's global RNG;
  see `policy_losses_cov`.
- `compute_policy_loss` (verl's deprecated pre-registry form of `vanilla`) warns with a
  `FutureWarning` as verl's does, and raises `ValueError` without a clip range.
- `bypass_mode` cannot check that the mask has a valid token (verl raises); see
  `policy_losses_rollout_corr`.
"""

from __future__ import annotations

import types
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxrl.core_algos.common import cfg_get, clamp, masked_mean
from jaxrl.core_algos.policy_losses_common import (
    aggregate,
    clamped_log_ratio,
    clip_range,
    require_config,
    reweight,
    zero_metric,
)
from jaxrl.core_algos.policy_losses_cov import (
    compute_policy_loss_clip_cov,
    compute_policy_loss_kl_cov,
)
from jaxrl.core_algos.policy_losses_rollout_corr import (
    compute_rollout_correction_and_rejection_mask,
)
from jaxrl.core_algos.registry import register_policy_loss

__all__ = [
    "compute_policy_loss",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
]

Metrics = dict[str, Array]
PolicyLossOutput = tuple[Float[Array, ""], Metrics]


def _ppo_metrics(clipfrac: Array, ppo_kl: Array, clipfrac_lower: Array) -> Metrics:
    return jax.lax.stop_gradient(
        {
            "actor/pg_clipfrac": clipfrac,
            "actor/ppo_kl": ppo_kl,
            "actor/pg_clipfrac_lower": clipfrac_lower,
        }
    )


def _fraction(condition: Array, response_mask: Array) -> Array:
    return masked_mean(condition.astype(jnp.float32), response_mask)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> PolicyLossOutput:
    """Clipped PPO surrogate with dual clipping for negative advantages.

    With r = exp(clamp(log pi - log pi_old, -20, 20)), A the advantage, eps_l / eps_h the
    clip ranges (`clip_ratio_low` / `clip_ratio_high`, default `clip_ratio`) and c > 1
    (`clip_ratio_c`)::

        L_clip = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h))        (Schulman et al. 2017)
        L      = min(L_clip, -c A)  if A < 0  else  L_clip            (Ye et al. 2019)

    PPO: arXiv:1707.06347. Dual-clip PPO: arXiv:1912.09729 (bounds the loss of a negative
    advantage when r is very large).

    Args:
        old_log_prob: log pi_old of the sampled tokens.
        log_prob: log pi of the same tokens (the differentiated input).
        advantages: Per-token advantages.
        response_mask: 1 for loss tokens, 0 for padding and tool/observation tokens.
        loss_agg_mode: `agg_loss` mode.
        config: Actor config (`clip_ratio*`, `clip_ratio_c`, `global_batch_info`).
        rollout_is_weights: Optional per-token weights multiplying the loss.

    Returns:
        (loss, metrics): `actor/pg_clipfrac` (tokens where clipping is active),
        `actor/ppo_kl` (mean -log r), `actor/pg_clipfrac_lower` (tokens capped by dual clip).
    """
    require_config(config, "vanilla")
    clip_low, clip_high = clip_range(config)
    clip_ratio_c = cfg_get(config, "clip_ratio_c", 3.0)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"dual-clip PPO needs clip_ratio_c > 1.0, got {clip_ratio_c}")

    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * clamp(ratio, 1 - clip_low, 1 + clip_high)
    ppo_losses = jnp.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = jnp.where(negative, jnp.minimum(dual_bound, ppo_losses), ppo_losses)

    loss = aggregate(reweight(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    return loss, _ppo_metrics(
        _fraction(clipped > unclipped, response_mask),
        masked_mean(-log_ratio, response_mask),
        _fraction((ppo_losses > dual_bound) & negative, response_mask),
    )


def compute_policy_loss(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Float[Array, ""], Array, Array, Array]:
    """verl's deprecated `compute_policy_loss`: `compute_policy_loss_vanilla` with the clip
    ranges as arguments and the local token counts (no `global_batch_info`).

    Returns:
        (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), the loss and vanilla's metrics.
    """
    warnings.warn(
        "Function 'jaxrl.core_algos.compute_policy_loss' is deprecated. Please use "
        "'jaxrl.core_algos.compute_policy_loss_vanilla' instead.",
        FutureWarning,
        stacklevel=2,
    )
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError("compute_policy_loss needs cliprange (or cliprange_low and _high)")
    config = types.SimpleNamespace(
        clip_ratio=cliprange, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_ratio_c
    )
    loss, metrics = compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config
    )
    return (
        loss,
        metrics["actor/pg_clipfrac"],
        metrics["actor/ppo_kl"],
        metrics["actor/pg_clipfrac_lower"],
    )


def _dppo_loss(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: Array | None,
    divergence: str,
) -> PolicyLossOutput:
    """DPPO-Binary with a total-variation (`tv`) or binary-KL (`kl`) trust region."""
    require_config(config, f"dppo_{divergence}")
    limit_low, limit_high = clip_range(config)  # divergence limits, not ratio ranges
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    ratio = jnp.exp(log_ratio)
    # A truncated IS weight replaces dual clipping; verl's fallback of 20 applies only to a
    # config without `clip_ratio_c` (actor configs hold 3.0).
    clip_ratio_c = cfg_get(config, "clip_ratio_c", 20.0)
    truncated_ratio = jax.lax.stop_gradient(jnp.minimum(ratio, clip_ratio_c))

    prob, old_prob = jnp.exp(log_prob), jnp.exp(old_log_prob)
    if divergence == "tv":
        may_rise = (prob - old_prob) <= limit_high
        may_fall = (prob - old_prob) >= -limit_low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * jnp.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        may_rise = (binary_kl <= limit_high) | (prob <= old_prob)
        may_fall = (binary_kl <= limit_low) | (prob >= old_prob)
    in_region = jnp.where(advantages > 0, may_rise, may_fall).astype(jnp.float32)
    in_region = jax.lax.stop_gradient(in_region)

    pg_losses = -advantages * truncated_ratio * log_prob * in_region
    loss = aggregate(reweight(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    return loss, _ppo_metrics(
        masked_mean(1.0 - in_region, response_mask),
        masked_mean(-log_ratio, response_mask),
        masked_mean((ratio > clip_ratio_c).astype(jnp.float32) * in_region, response_mask),
    )


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-TV: a policy gradient masked outside a total-variation trust region.

    With p = pi(y_t), p_old = pi_old(y_t), r = p / p_old (log clamped to +-20), c =
    `clip_ratio_c` and delta_l / delta_h the limits `clip_ratio_low` / `clip_ratio_high`
    (default `clip_ratio`; here bounds on the probability change, not ratio ranges)::

        M = [p - p_old <= delta_h]  if A > 0  else  [p - p_old >= -delta_l]
        L = -A sg(min(r, c)) sg(M) log p

    Tokens whose update would leave the trust region get no gradient; the truncated,
    stop-gradient IS weight min(r, c) replaces PPO's clipping. DPPO: arXiv:2602.04879.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights: as `compute_policy_loss_vanilla`.

    Returns:
        (loss, metrics): `actor/pg_clipfrac` (tokens outside the region), `actor/ppo_kl`,
        `actor/pg_clipfrac_lower` (tokens inside the region with r > c).
    """
    return _dppo_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        "tv",
    )


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-KL: a policy gradient masked outside a binary-KL trust region.

    With p, p_old, r, c, delta_l / delta_h as in `compute_policy_loss_dppo_tv`, and the KL
    between the Bernoulli distributions (p_old, 1 - p_old) and (p, 1 - p)::

        D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        M = [D <= delta_h or p <= p_old]  if A > 0  else  [D <= delta_l or p >= p_old]
        L = -A sg(min(r, c)) sg(M) log p

    Only moves away from p_old in the direction A pushes are limited. DPPO:
    arXiv:2602.04879.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights: as `compute_policy_loss_vanilla`.

    Returns:
        (loss, metrics): `actor/pg_clipfrac` (tokens outside the region), `actor/ppo_kl`,
        `actor/pg_clipfrac_lower` (tokens inside the region with r > c).
    """
    return _dppo_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        "kl",
    )


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> PolicyLossOutput:
    """GSPO: PPO clipping on the length-normalised sequence ratio.

    With s_i = exp(mean_t log(pi / pi_old)) over the response's tokens (no +-20 clamp, as
    verl) and the token-level form that carries each token's own gradient::

        log s_it = min(sg(log s_i) + log pi_t - sg(log pi_t), 10)
        L        = max(-A s_it, -A clip(s_it, 1 - eps_l, 1 + eps_h))

    Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071. The paper
    aggregates per sequence (`seq-mean-token-mean`, the default); other modes are allowed.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights: as `compute_policy_loss_vanilla`.

    Returns:
        (loss, metrics): `actor/pg_clipfrac`, `actor/ppo_kl` (token mean of -log r),
        `actor/pg_clipfrac_lower` (always 0).
    """
    require_config(config, "gspo")
    clip_low, clip_high = clip_range(config)
    log_ratio = log_prob - old_log_prob
    lengths = jnp.maximum(jnp.sum(response_mask, axis=-1), 1)
    seq_log_ratio = jnp.sum(log_ratio * response_mask, axis=-1) / lengths
    log_seq_ratio = (
        log_prob - jax.lax.stop_gradient(log_prob) + jax.lax.stop_gradient(seq_log_ratio)[..., None]
    )
    seq_ratio = jnp.exp(clamp(log_seq_ratio, high=10.0))
    unclipped = -advantages * seq_ratio
    clipped = -advantages * clamp(seq_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = jnp.maximum(unclipped, clipped)

    loss = aggregate(reweight(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    return loss, _ppo_metrics(
        _fraction(clipped > unclipped, response_mask),
        masked_mean(-log_ratio, response_mask),
        zero_metric(loss),
    )


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> PolicyLossOutput:
    """SAPO: a smooth sigmoid gate on the ratio in place of hard clipping.

    With r = exp(clamp(log pi - log pi_old, -20, 20)) and tau = `tau_pos` if A > 0 else
    `tau_neg`::

        f(r) = (4 / tau) sigmoid(tau (r - 1))        (slope 1 at r = 1, flat far from it)
        L    = -f(r) A

    Soft Adaptive Policy Optimization, arXiv:2511.20347. The loss is always aggregated with
    `seq-mean-token-mean` (with the config's global batch counts); `loss_agg_mode` is
    ignored, as in verl.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights: as `compute_policy_loss_vanilla`.

    Returns:
        (loss, metrics): `actor/ppo_kl`; `actor/pg_clipfrac` and `actor/pg_clipfrac_lower`
        are always 0.
    """
    require_config(config, "sapo")
    tau_pos = jnp.asarray(cfg_get(config, "tau_pos"), advantages.dtype)
    tau_neg = jnp.asarray(cfg_get(config, "tau_neg"), advantages.dtype)
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    ratio = jnp.exp(log_ratio)
    tau = jnp.where(advantages > 0, tau_pos, tau_neg)
    gates = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gates * advantages

    pg_losses = reweight(pg_losses, rollout_is_weights)
    loss = aggregate(pg_losses, response_mask, "seq-mean-token-mean", config)
    return loss, _ppo_metrics(
        zero_metric(loss), masked_mean(-log_ratio, response_mask), zero_metric(loss)
    )


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> PolicyLossOutput:
    """GPG: the plain policy gradient, no ratio and no clipping.

    ::

        L = -A log pi

    Chu et al. 2025, GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning (github.com/AMAP-ML/GPG). `old_log_prob` is unused.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights: as `compute_policy_loss_vanilla`.

    Returns:
        (loss, {}): no metrics.
    """
    require_config(config, "gpg")
    pg_losses = reweight(-log_prob * advantages, rollout_is_weights)
    return aggregate(pg_losses, response_mask, loss_agg_mode, config), {}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> PolicyLossOutput:
    """GMPO: the geometric mean of clipped token ratios, one term per sequence.

    With l_t = log pi - log pi_old (unclamped), sgn = sign(A), |y| the number of loss tokens::

        l'_t = sgn min(sgn l_t, sgn clip(l_t, -eps_l, eps_h))     (pessimistic clip per token)
        R    = exp(sum_t l'_t / (|y| + 1e-8)),   A_seq = sum_t A_t / (|y| + 1e-8)
        L    = mean_i [-A_seq R w_i]

    with w_i the geometric mean of `rollout_is_weights` over the sequence (1 without). Zhao
    et al. 2025, Geometric-Mean Policy Optimization, arXiv:2507.20673.

    As in verl, `loss_agg_mode` and `global_batch_info` are ignored: the loss is the plain
    mean over the local batch's rows (fully masked rows included, contributing 0).

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights: as `compute_policy_loss_vanilla`.

    Returns:
        (loss, metrics): `actor/pg_clipfrac` / `actor/pg_clipfrac_lower` (clipped tokens with
        A > 0 / A < 0), `actor/ppo_kl`.
    """
    require_config(config, "geo_mean")
    clip_low, clip_high = clip_range(config)
    log_ratio = log_prob - old_log_prob
    sign = jnp.sign(advantages)
    log_ratio_clipped = clamp(log_ratio, -clip_low, clip_high)
    pessimistic = sign * jnp.minimum(sign * log_ratio, sign * log_ratio_clipped)
    lengths = jnp.sum(response_mask, axis=-1) + 1e-8
    seq_ratio = jnp.exp(jnp.sum(pessimistic * response_mask, axis=-1) / lengths)
    seq_advantage = jnp.sum(advantages * response_mask, axis=-1) / lengths
    pg_losses = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:
        log_weights = jnp.log(rollout_is_weights + 1e-10) * response_mask
        pg_losses = pg_losses * jnp.exp(jnp.sum(log_weights, axis=-1) / lengths)
    loss = jnp.mean(pg_losses)

    was_clipped = log_ratio != log_ratio_clipped
    return loss, _ppo_metrics(
        _fraction(was_clipped & (advantages > 0), response_mask),
        masked_mean(-log_ratio, response_mask),
        _fraction(was_clipped & (advantages < 0), response_mask),
    )


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> PolicyLossOutput:
    """DRO-style policy gradient with a quadratic log-ratio penalty.

    With beta = `policy_loss.dro_beta` (> 0, required) and l = log pi - log pi_old::

        L = -(A log pi - beta l^2 / 2)

    The penalty keeps pi near pi_old with a pull proportional to the log-ratio. verl gives
    no reference; the name follows Direct Reward Optimization (Richemond et al. 2024,
    arXiv:2405.19107), whose objective is also a squared log-ratio regression.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights: as `compute_policy_loss_vanilla`.

    Returns:
        (loss, metrics): `actor/ppo_kl`.
    """
    require_config(config, "dro")
    policy_loss = cfg_get(config, "policy_loss")
    if policy_loss is None:
        raise ValueError("policy loss 'dro' needs config.policy_loss")
    beta = cfg_get(policy_loss, "dro_beta")
    if beta is None or beta <= 0:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * jnp.square(log_ratio))
    loss = aggregate(reweight(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    return loss, {"actor/ppo_kl": jax.lax.stop_gradient(masked_mean(-log_ratio, response_mask))}


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> PolicyLossOutput:
    """CISPO: REINFORCE weighted by the clipped, stop-gradient IS ratio.

    With r = exp(clamp(log pi - log pi_old, -20, 20))::

        L = -sg(clip(r, 1 - eps_l, 1 + eps_h)) A log pi

    Unlike PPO, clipped tokens keep a gradient (through log pi); only its weight is capped.
    MiniMax 2025, MiniMax-M1, arXiv:2506.13585.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights: as `compute_policy_loss_vanilla`.

    Returns:
        (loss, metrics): `actor/pg_clipfrac` (tokens whose weight was clipped),
        `actor/ppo_kl`, `actor/pg_clipfrac_lower` (always 0).
    """
    require_config(config, "cispo")
    clip_low, clip_high = clip_range(config)
    log_ratio = clamped_log_ratio(log_prob, old_log_prob)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = -jax.lax.stop_gradient(clipped_ratio) * advantages * log_prob

    loss = aggregate(reweight(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    return loss, _ppo_metrics(
        _fraction(ratio != clipped_ratio, response_mask),
        masked_mean(-log_ratio, response_mask),
        zero_metric(loss),
    )


def compute_policy_loss_reinforce(
    rollout_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "seq-mean-token-sum",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> PolicyLossOutput:
    """REINFORCE, optionally importance-weighted (bypass mode's `reinforce` loss type).

    ::

        L = -w A log pi        (w = rollout_is_weights, 1 without)

    Williams 1992. Not registered (verl does not register it either); `bypass_mode` calls
    it. The weights are used as given: pass them stop-gradient (bypass mode does).

    Args:
        rollout_log_prob: The rollout policy's log-probabilities (for the KL metric only).
        log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights: as
            `compute_policy_loss_vanilla`.

    Returns:
        (loss, metrics): `actor/ppo_kl` = mean over the mask of log pi_rollout - log pi.
    """
    require_config(config, "reinforce")
    pg_losses = -advantages * log_prob
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = aggregate(pg_losses, response_mask, loss_agg_mode, config)
    kl = masked_mean(-(log_prob - rollout_log_prob), response_mask)
    return loss, {"actor/ppo_kl": jax.lax.stop_gradient(kl)}


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(
    old_log_prob: Float[Array, "b r"],
    log_prob: Float[Array, "b r"],
    advantages: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Float[Array, "b r"] | None = None,
) -> PolicyLossOutput:
    """Bypass mode: old_log_prob is the rollout policy's; correct for it, then PPO or REINFORCE.

    With `config.policy_loss.rollout_correction` (`loss_type`, `rollout_is`,
    `rollout_is_threshold`, `rollout_is_batch_normalize`, `rollout_rs`,
    `rollout_rs_threshold`), IS weights w = pi / pi_rollout (truncated or band-limited) and a
    rejection mask M are computed without gradient (`policy_losses_rollout_corr`); then::

        reinforce:  L = -w A log pi                                   on the mask M
        ppo_clip:   L = compute_policy_loss_vanilla with pi_old = pi_rollout, on M, no w

    (PPO's ratio already is the IS ratio, so applying w too would count it twice.) The
    `rollout_is_weights` argument is ignored. Rollout-policy mismatch and its corrections:
    Liu et al. 2025, "When Speed Kills Stability" (richardli.xyz/rl-collapse); truncated IS:
    Yao et al. 2025 (fengyao.notion.site/off-policy-rl).

    Args:
        old_log_prob: The rollout policy's log-probabilities.
        log_prob, advantages, response_mask, loss_agg_mode, config: as
            `compute_policy_loss_vanilla`.
        rollout_is_weights: Ignored (computed here).

    Returns:
        (loss, metrics): the metrics of the chosen loss and the `rollout_corr/*` metrics.
    """
    require_config(config, "bypass_mode")
    correction = cfg_get(cfg_get(config, "policy_loss"), "rollout_correction")
    if correction is None:
        raise ValueError(
            "loss_mode 'bypass_mode' needs config.policy_loss.rollout_correction to be set"
        )
    loss_type = cfg_get(correction, "loss_type", "ppo_clip")
    if loss_type not in ("reinforce", "ppo_clip"):
        raise ValueError(f"invalid loss_type {loss_type!r}; use 'reinforce' or 'ppo_clip'")

    weights, effective_mask, correction_metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=jax.lax.stop_gradient(log_prob),
        rollout_log_prob=jax.lax.stop_gradient(old_log_prob),
        response_mask=response_mask,
        rollout_is=cfg_get(correction, "rollout_is", None),
        rollout_is_threshold=cfg_get(correction, "rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=cfg_get(correction, "rollout_is_batch_normalize", False),
        rollout_rs=cfg_get(correction, "rollout_rs", None),
        rollout_rs_threshold=cfg_get(correction, "rollout_rs_threshold", None),
    )
    if loss_type == "reinforce":
        loss, metrics = compute_policy_loss_reinforce(
            old_log_prob, log_prob, advantages, effective_mask, loss_agg_mode, config, weights
        )
    else:
        loss, metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, effective_mask, loss_agg_mode, config, None
        )
    return loss, {**metrics, **correction_metrics}
