"""Optimal Token Baseline (OTB) advantage estimators: a separate baseline for every token.

Li, Xu, Li et al., "The Optimal Token Baseline: Variance Reduction for Long-Horizon LLM-RL"
(PMLR vol. 306, 2026). With G_t the reward-to-go of a response and the logit-gradient proxy of
the squared score norm at token j,

    w_j = (1 - 2 pi_j + sum_v pi_v^2) * rho_j^2,    W_t = sum_{j <= t} w_j

(pi_j the old policy's probability of the sampled token, rho_j an optional truncated rollout
importance weight), the baseline of step t in a prompt group is the W-weighted mean of the
group's returns at step t,

    B_t = sum_i G_{i,t} W_{i,t} / (sum_i W_{i,t} + eps),    A_{i,t} = G_{i,t} - B_t,

so paths that have accumulated more gradient energy weigh more. A response alone in its group
gets no baseline (A = G).

`handle_zero_tail`: past the end of the second-longest response of a group only the longest one
(when it is the unique longest) has tokens, and its baseline there would be its own return
(advantage 0); instead its baseline is set to 0 from the second-longest length on.

`response_mask` must be 0/1. Groups come from `index` with `dense_group_ids`, so all per-group
sums are segment sums over [B, R] rows (verl loops over groups in Python).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrl.core_algos.common import dense_group_ids, group_sum
from jaxrl.core_algos.registry import AdvantageEstimator, EstimatorInputs, register_adv_est


def _reward_to_go(token_level_rewards: Float[Array, "b r"], mask: Float[Array, "b r"]):
    return jax.lax.cumsum(token_level_rewards * mask, axis=1, reverse=True)


def _cumulative_path_weight(
    mask: Float[Array, "b r"],
    old_log_probs: Float[Array, "b r"],
    sum_pi_squared: Float[Array, "b r"],
    rollout_is_weights: Float[Array, "b r"] | None,
) -> Float[Array, "b r"]:
    """W_t = sum_{j <= t} (1 - 2 pi_j + sum pi^2) rho_j^2 over the response tokens."""
    w = 1 - 2 * jnp.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights**2
    return jnp.cumsum(w * mask, axis=-1)


def _zero_tail(
    lengths: Float[Array, " b"],
    groups: Int[Array, " b"],
    group_size: Float[Array, " b"],
    width: int,
) -> Bool[Array, "b r"]:
    """Where the unique longest response of a group (of 2 or more) outruns the second longest.

    The second-longest length counts ties: if the maximum is shared nothing is zeroed.
    """
    b = lengths.shape[0]
    longest = jax.ops.segment_max(lengths, groups, num_segments=b)[groups]
    is_longest = lengths == longest
    n_longest = group_sum(is_longest.astype(jnp.float32), groups)
    runner_up = jax.ops.segment_max(
        jnp.where(is_longest, -jnp.inf, lengths), groups, num_segments=b
    )[groups]
    unique_longest = is_longest & (n_longest == 1) & (group_size > 1)
    return unique_longest[:, None] & (jnp.arange(width)[None, :] >= runner_up[:, None])


@register_adv_est(
    AdvantageEstimator.OPTIMAL_TOKEN_BASELINE, inputs=EstimatorInputs(sum_pi_squared=True)
)
def compute_optimal_token_baseline_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    index: Int[Array, " b"],
    old_log_probs: Float[Array, "b r"],
    sum_pi_squared: Float[Array, "b r"],
    rollout_is_weights: Float[Array, "b r"] | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[Float[Array, "b r"], Float[Array, "b r"]]:
    """Optimal Token Baseline with the step index t as the response position.

    B_t = sum_i G_{i,t} W_{i,t} M_{i,t} / (sum_i W_{i,t} M_{i,t} + eps) over the prompt group,
    A_{i,t} = (G_{i,t} - B_t) M_{i,t} (Li et al. 2026, see the module docstring). Positions are
    padded columns, so with observation tokens inside the responses use
    `compute_multi_turn_optimal_token_baseline_advantage`.

    Args:
        token_level_rewards: Token rewards [B, R].
        response_mask: 0/1 mask of the response tokens [B, R].
        index: Prompt group id of every response [B] (any integers).
        old_log_probs: Log-probs of the sampled tokens under the rollout-time policy [B, R].
        sum_pi_squared: sum_v pi_v^2 of the same distributions [B, R].
        rollout_is_weights: Truncated rollout importance weights rho [B, R], or None.
        handle_zero_tail: Zero the baseline of a group's unique longest response past the
            second-longest length.
        epsilon: Added to the baseline's denominator.
        **kwargs: Ignored (the trainer passes every estimator the same arguments).

    Returns:
        (advantages [B, R], returns G [B, R]).
    """
    mask = response_mask.astype(token_level_rewards.dtype)
    returns = _reward_to_go(token_level_rewards, mask)
    w_cum = _cumulative_path_weight(mask, old_log_probs, sum_pi_squared, rollout_is_weights)

    groups = dense_group_ids(index)
    group_size = group_sum(jnp.ones(groups.shape, jnp.float32), groups)
    numerator = group_sum(returns * w_cum * mask, groups)
    denominator = group_sum(w_cum * mask, groups) + epsilon
    baseline = jnp.where(group_size[:, None] > 1, numerator / denominator, 0.0)
    if handle_zero_tail:
        tail = _zero_tail(mask.sum(-1), groups, group_size, mask.shape[-1])
        baseline = jnp.where(tail, 0.0, baseline)

    advantages = (returns - baseline) * mask
    return jax.lax.stop_gradient((advantages, returns))


@register_adv_est(
    AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE, inputs=EstimatorInputs(sum_pi_squared=True)
)
def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    index: Int[Array, " b"],
    old_log_probs: Float[Array, "b r"],
    sum_pi_squared: Float[Array, "b r"],
    rollout_is_weights: Float[Array, "b r"] | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[Float[Array, "b r"], Float[Array, "b r"]]:
    """Optimal Token Baseline for multi-turn / tool-integrated responses.

    As `compute_optimal_token_baseline_advantage`, but the step index t counts response tokens
    only: each row's masked tokens (model turns) are first packed to the left, dropping the
    observation tokens between turns, so that step t of every response in a group is its t-th
    generated token. On the packed rows, B_t = sum_i G_{i,t} W_{i,t} / (sum_i W_{i,t} + eps)
    (rows are zero past their length); the advantages are scattered back to the token
    positions. Responses without tokens are left out of their group.

    Args:
        token_level_rewards: Token rewards [B, R].
        response_mask: 0/1 mask of the model's tokens [B, R], with holes between turns.
        index: Prompt group id of every response [B] (any integers).
        old_log_probs: Log-probs of the sampled tokens under the rollout-time policy [B, R].
        sum_pi_squared: sum_v pi_v^2 of the same distributions [B, R].
        rollout_is_weights: Truncated rollout importance weights rho [B, R], or None.
        handle_zero_tail: Zero the baseline of a group's unique longest response past the
            second-longest length (in packed positions).
        epsilon: Added to the baseline's denominator.
        **kwargs: Ignored (the trainer passes every estimator the same arguments).

    Returns:
        (advantages [B, R], returns G [B, R]), G per (unpacked) position.
    """
    mask = response_mask.astype(token_level_rewards.dtype)
    returns = _reward_to_go(token_level_rewards, mask)
    w_cum = _cumulative_path_weight(mask, old_log_probs, sum_pi_squared, rollout_is_weights)

    b, r = mask.shape
    is_token = mask != 0
    lengths = jnp.sum(is_token, axis=-1)
    packed_pos = jnp.cumsum(is_token, axis=-1) - 1
    rows = jnp.arange(b)[:, None]
    # Non-tokens are sent to column r, which `mode="drop"` discards.
    target = jnp.where(is_token, packed_pos, r)

    def pack(x):
        return jnp.zeros_like(x).at[rows, target].set(x, mode="drop")

    packed_w, packed_returns = pack(w_cum), pack(returns)

    groups = dense_group_ids(index)
    group_size = group_sum((lengths > 0).astype(jnp.float32), groups)
    b_star = group_sum(packed_returns * packed_w, groups) / (group_sum(packed_w, groups) + epsilon)
    baseline = jnp.where(group_size[:, None] > 1, b_star, 0.0)
    if handle_zero_tail:
        tail = _zero_tail(lengths.astype(jnp.float32), groups, group_size, r)
        baseline = jnp.where(tail, 0.0, baseline)

    packed_advantages = packed_returns - baseline
    unpacked = jnp.take_along_axis(packed_advantages, jnp.clip(packed_pos, 0, r - 1), axis=-1)
    advantages = jnp.where(is_token, unpacked, 0.0) * mask
    return jax.lax.stop_gradient((advantages, returns))
