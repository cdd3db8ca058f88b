"""verl 0.9.1's advantage estimators in JAX, registered under verl's names.

Every estimator returns `(advantages, returns)`, both [B, R] (B responses, R response length),
and, like verl (which runs them under `torch.no_grad`), carries no gradient. The outcome
estimators reduce a response to its score s_i = sum_t r_{i,t} (over ALL positions, masked or
not, as verl does) and broadcast one scalar over the response's mask.

Groups (the responses to one prompt) are given by `index` [B], an integer array with arbitrary
values (verl uses uid strings). The ids are made dense inside the function (`dense_group_ids`)
and every group statistic is a segment sum, so all estimators are jittable, vmappable, and free
of host syncs and Python loops over groups. Static settings (gamma, lam, epsilon, flags and
`config`) are Python values; `config` is anything with verl's attribute names (an AlgoConfig,
`types.SimpleNamespace`, a dict), read with `cfg_get`.

Group conventions copied from verl: a response alone in its group gets group mean 0 (and std 1
in GRPO / GPG); std is the unbiased (n - 1) one.

Deliberate differences from verl, all because a jitted function cannot raise on array values:

- Whitening (GAE, REINFORCE++, REINFORCE++-baseline, GDPO) over a mask with fewer than two
  tokens: verl raises, here `masked_var` gives 0 and the result is finite.
- Pass@k with a group of one response: verl raises, here that response gets advantage 0.

Where verl asserts on a missing `config` (pass@k, REINFORCE++) or GDPO reward key, this module
raises `ValueError` (those checks are static). The optimal-token-baseline estimators live in
`advantages_token`; importing this module registers all 14.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrl.core_algos.advantages_token import (
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from jaxrl.core_algos.common import (
    cfg_get,
    dense_group_ids,
    group_moments,
    group_sum,
    masked_whiten,
)
from jaxrl.core_algos.registry import AdvantageEstimator, EstimatorInputs, register_adv_est

__all__ = [
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
]

AdvantagesReturns = tuple[Float[Array, "b r"], Float[Array, "b r"]]


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------


def _float_mask(response_mask: Array, like: Array) -> Float[Array, "b r"]:
    # verl's masks are often int64; arithmetic with them promotes to the rewards' dtype.
    return response_mask.astype(like.dtype)


def _group_stats(
    scores: Float[Array, " b"], index: Int[Array, " b"]
) -> tuple[Float[Array, " b"], Float[Array, " b"], Float[Array, " b"]]:
    """Per response: its group's mean, unbiased std and size, with a singleton's (0, 1)."""
    mean, std, n = group_moments(scores, dense_group_ids(index))
    single = n < 2
    return jnp.where(single, 0.0, mean), jnp.where(single, 1.0, std), n


def _grpo_scalars(
    scores: Float[Array, " b"],
    index: Int[Array, " b"],
    epsilon: float,
    norm_adv_by_std_in_grpo: bool,
) -> Float[Array, " b"]:
    mean, std, _ = _group_stats(scores, index)
    centered = scores - mean
    return centered / (std + epsilon) if norm_adv_by_std_in_grpo else centered


def _outcome(scalars: Float[Array, " b"], mask: Float[Array, "b r"]) -> AdvantagesReturns:
    advantages = jax.lax.stop_gradient(scalars[:, None] * mask)
    return advantages, advantages


def _require_config(config: Any, estimator: str) -> None:
    if config is None:
        raise ValueError(f"advantage estimator {estimator!r} needs `config` (an AlgoConfig)")


# ----------------------------------------------------------------------------------------------
# Value-based and token-level estimators
# ----------------------------------------------------------------------------------------------


@register_adv_est(AdvantageEstimator.GAE, inputs=EstimatorInputs(values=True))
def compute_gae_advantage_return(
    token_level_rewards: Float[Array, "b r"],
    values: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    gamma: float | Float[Array, ""],
    lam: float | Float[Array, ""],
) -> AdvantagesReturns:
    """Generalized Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438).

    Backwards over the response, skipping masked positions (observation tokens in multi-turn
    rollouts), so that "next" means the next response token:

        delta_t = r_t + gamma V_{t'} - V_t,    A_t = delta_t + gamma lam A_{t'}

    with t' the next position where M = 1 (V = A = 0 past the end). At a masked position the
    carried (V, A) pass through unchanged, and the A stored there is the carried one. Returns
    are A + V; the advantages are then whitened over the mask.

    Args:
        token_level_rewards: Token rewards [B, R].
        values: Critic values V [B, R].
        response_mask: Response-token mask M [B, R].
        gamma: Discount.
        lam: GAE lambda.

    Returns:
        (whitened advantages [B, R], returns A + V [B, R]).
    """
    mask = _float_mask(response_mask, token_level_rewards)

    def step(carry, xs):
        next_value, next_advantage = carry
        reward, value, m = xs
        delta = reward + gamma * next_value - value
        advantage = delta + gamma * lam * next_advantage
        next_value = value * m + (1 - m) * next_value
        next_advantage = advantage * m + (1 - m) * next_advantage
        return (next_value, next_advantage), next_advantage

    zeros = jnp.zeros(mask.shape[:1], token_level_rewards.dtype)
    _, advantages = jax.lax.scan(
        step, (zeros, zeros), (token_level_rewards.T, values.T, mask.T), reverse=True
    )
    advantages = advantages.T
    returns = advantages + values
    advantages = masked_whiten(advantages, mask)
    return jax.lax.stop_gradient((advantages, returns))


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    config: Any = None,
    **kwargs,
) -> AdvantagesReturns:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns, whitened over the batch.

        G_t = (r_t + gamma G_{t'}) M_t,    A = whiten(G over M) M

    with t' the next response token: masked positions get G = 0 but carry the running return
    through, so rewards reach back across observation spans.

    Args:
        token_level_rewards: Token rewards [B, R].
        response_mask: Response-token mask M [B, R].
        config: Needs `gamma`.
        **kwargs: Ignored (the trainer passes every estimator the same arguments).

    Returns:
        (advantages [B, R], returns G [B, R]).
    """
    _require_config(config, "reinforce_plus_plus")
    gamma = cfg_get(config, "gamma")
    if gamma is None:
        raise ValueError("reinforce_plus_plus needs config.gamma")
    mask = _float_mask(response_mask, token_level_rewards)

    def step(running, xs):
        reward, m = xs
        candidate = reward + gamma * running
        return candidate * m + running * (1 - m), candidate * m

    zeros = jnp.zeros(mask.shape[:1], token_level_rewards.dtype)
    _, returns = jax.lax.scan(step, zeros, (token_level_rewards.T, mask.T), reverse=True)
    returns = returns.T
    advantages = masked_whiten(returns, mask) * mask
    return jax.lax.stop_gradient((advantages, returns))


@register_adv_est(AdvantageEstimator.REMAX, inputs=EstimatorInputs(reward_baselines=True))
def compute_remax_outcome_advantage(
    token_level_rewards: Float[Array, "b r"],
    reward_baselines: Float[Array, " b"],
    response_mask: Float[Array, "b r"],
    config: Any = None,
    **kwargs,
) -> AdvantagesReturns:
    """ReMax (Li et al. 2023, arXiv:2310.10505): the greedy response's reward as baseline.

        G_t = sum_{k >= t} r_k M_k,    A_t = G_t - b M_t

    with b the reward of the greedy-decoded response to the same prompt. Not re-masked: like
    verl, G (and so A) is nonzero at a masked position followed by rewarded tokens.

    Args:
        token_level_rewards: Token rewards [B, R].
        reward_baselines: Reward of the greedy response [B].
        response_mask: Response-token mask M [B, R].
        config: Unused.
        **kwargs: Ignored (the trainer passes every estimator the same arguments).

    Returns:
        (advantages [B, R], returns G [B, R]).
    """
    mask = _float_mask(response_mask, token_level_rewards)
    returns = jax.lax.cumsum(token_level_rewards * mask, axis=1, reverse=True)
    advantages = returns - reward_baselines[:, None] * mask
    return jax.lax.stop_gradient((advantages, returns))


# ----------------------------------------------------------------------------------------------
# Group-relative outcome estimators
# ----------------------------------------------------------------------------------------------


@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_outcome_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    index: Int[Array, " b"],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> AdvantagesReturns:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): group-normalised outcome.

        A_i = (s_i - mean_g(s)) / (std_g(s) + eps)      (norm_adv_by_std_in_grpo)
        A_i = s_i - mean_g(s)                            (Dr. GRPO, arXiv:2503.20783)

    over the group g of response i, broadcast over its mask. A singleton group has mean 0 and
    std 1, so its response keeps (about) its raw score; equal scores give 0.

    Args:
        token_level_rewards: Token rewards [B, R].
        response_mask: Response-token mask [B, R].
        index: Prompt group id of every response [B] (any integers).
        epsilon: Added to the std.
        norm_adv_by_std_in_grpo: Divide by the group std (False: Dr. GRPO).
        config: Unused (verl reads nothing from it here either).

    Returns:
        (advantages [B, R], returns = advantages).
    """
    scores = token_level_rewards.sum(-1)
    scalars = _grpo_scalars(scores, index, epsilon, norm_adv_by_std_in_grpo)
    return _outcome(scalars, _float_mask(response_mask, token_level_rewards))


@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED)
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    index: Int[Array, " b"],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> AdvantagesReturns:
    """GRPO computed with segment sums (verl's loop-free variant); the same numbers as
    `compute_grpo_outcome_advantage`, which is loop-free here as well.

        A_i = (s_i - mean_g(s)) / (std_g(s) + eps)  or  s_i - mean_g(s)

    (Shao et al. 2024, arXiv:2402.03300; without std: Dr. GRPO, arXiv:2503.20783.)

    Args:
        token_level_rewards: Token rewards [B, R].
        response_mask: Response-token mask [B, R].
        index: Prompt group id of every response [B] (any integers).
        epsilon: Added to the std.
        norm_adv_by_std_in_grpo: Divide by the group std (False: Dr. GRPO).
        config: Unused.

    Returns:
        (advantages [B, R], returns = advantages).
    """
    return compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo
    )


@register_adv_est(AdvantageEstimator.GDPO, inputs=EstimatorInputs(reward_components=True))
def compute_gdpo_outcome_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    index: Int[Array, " b"],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    non_tensor_batch: dict[str, Float[Array, " b"]] | None = None,
    batch: dict[str, Array] | None = None,
    **kwargs,
) -> AdvantagesReturns:
    """GDPO, group reward-decoupled normalisation (arXiv:2601.05242).

    Each reward component k is GRPO-normalised in its group on its own, so that one large
    component cannot drown the others; the weighted sum is then whitened over the batch:

        A^k_i = GRPO(s^k)_i,    A = whiten(sum_k w_k A^k M over M) M

    The components are `non_tensor_batch[key]` [B] for the keys in `config.gdpo_reward_keys`,
    with weights `config.gdpo_reward_weights` (default 1). They are used only when `config`,
    `non_tensor_batch` and `batch` are all given (verl's condition); otherwise the single
    component is the summed `token_level_rewards`. verl writes each component score into a row
    of zeros at the response's last position and sums the row again, which is the score
    itself, so `batch` (prompts, attention_mask) is not read.

    Args:
        token_level_rewards: Token rewards [B, R] (the fallback component).
        response_mask: Response-token mask M [B, R].
        index: Prompt group id of every response [B] (any integers).
        epsilon: Added to the per-component std.
        norm_adv_by_std_in_grpo: Divide each component by its group std.
        config: `gdpo_reward_keys` (required with `non_tensor_batch`), `gdpo_reward_weights`.
        non_tensor_batch: Component scores by key, each [B].
        batch: The batch (only its presence matters, see above).
        **kwargs: Ignored (the trainer passes every estimator the same arguments).

    Returns:
        (advantages [B, R], returns = advantages).
    """
    mask = _float_mask(response_mask, token_level_rewards)
    components = [token_level_rewards.sum(-1)]
    weights = None
    if config is not None and non_tensor_batch is not None and batch is not None:
        keys = cfg_get(config, "gdpo_reward_keys")
        if not keys:
            raise ValueError(
                "GDPO needs config.gdpo_reward_keys: the reward component keys returned by "
                "compute_score (e.g. ['format_reward', 'accuracy_reward'])"
            )
        missing = [key for key in keys if key not in non_tensor_batch]
        if missing:
            raise ValueError(
                f"GDPO reward keys {missing} not in non_tensor_batch "
                f"(keys: {sorted(non_tensor_batch)})"
            )
        components = [jnp.asarray(non_tensor_batch[key], jnp.float32) for key in keys]
        if cfg_get(config, "gdpo_reward_weights") is not None:
            weights = list(cfg_get(config, "gdpo_reward_weights"))
    if weights is None:
        weights = [1.0] * len(components)

    total = sum(
        jnp.float32(w) * (_grpo_scalars(s, index, epsilon, norm_adv_by_std_in_grpo)[:, None] * mask)
        for w, s in zip(weights, components, strict=True)
    )
    advantages = jax.lax.stop_gradient(masked_whiten(total, mask) * mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    index: Int[Array, " b"],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs,
) -> AdvantagesReturns:
    """Pass@k training (arXiv:2503.19595): only the group's best response is credited.

        A_{i*} = (s_(1) - s_(2)) / (std_g(s) + eps),    A_i = 0 for i != i*

    with s_(1) >= s_(2) the two largest scores of the group and i* the best response (its
    first, when tied; a tie gives 0 anyway). The std division is controlled by
    `config.norm_adv_by_std_in_grpo` (default True): as in verl, the argument of the same name
    is ignored. A singleton group gives 0 (verl raises).

    Args:
        token_level_rewards: Token rewards [B, R].
        response_mask: Response-token mask [B, R].
        index: Prompt group id of every response [B] (any integers).
        epsilon: Added to the std.
        norm_adv_by_std_in_grpo: Ignored; see `config`.
        config: Required; `norm_adv_by_std_in_grpo`.
        **kwargs: Ignored (the trainer passes every estimator the same arguments).

    Returns:
        (advantages [B, R], returns = advantages).
    """
    _require_config(config, "grpo_passk")
    norm_by_std = cfg_get(config, "norm_adv_by_std_in_grpo", True)
    scores = token_level_rewards.sum(-1)
    b = scores.shape[0]
    groups = dense_group_ids(index)
    rows = jnp.arange(b)

    best = jax.ops.segment_max(scores, groups, num_segments=b)[groups]
    is_best = scores == best
    n_best = group_sum(is_best.astype(scores.dtype), groups)
    runner_up = jax.ops.segment_max(jnp.where(is_best, -jnp.inf, scores), groups, num_segments=b)
    second = jnp.where(n_best > 1, best, runner_up[groups])
    first_best = jax.ops.segment_min(jnp.where(is_best, rows, b), groups, num_segments=b)[groups]

    _, std, n = group_moments(scores, groups)
    gap = best - second
    if norm_by_std:
        gap = gap / (std + epsilon)
    scalars = jnp.where((rows == first_best) & (n > 1), gap, 0.0)
    return _outcome(scalars, _float_mask(response_mask, token_level_rewards))


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    index: Int[Array, " b"],
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs,
) -> AdvantagesReturns:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): group mean baseline, batch whitening.

        A = whiten((s_i - mean_g(s)) M over M) M

    (a singleton group has mean 0, i.e. no baseline).

    Args:
        token_level_rewards: Token rewards [B, R].
        response_mask: Response-token mask M [B, R].
        index: Prompt group id of every response [B] (any integers).
        epsilon: Unused (verl's signature).
        config: Unused.
        **kwargs: Ignored (the trainer passes every estimator the same arguments).

    Returns:
        (advantages [B, R], returns = advantages).
    """
    mask = _float_mask(response_mask, token_level_rewards)
    scores = token_level_rewards.sum(-1)
    mean, _, _ = _group_stats(scores, index)
    centered = (scores - mean)[:, None] * mask
    advantages = jax.lax.stop_gradient(masked_whiten(centered, mask) * mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO)
def compute_rloo_outcome_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    index: Int[Array, " b"],
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs,
) -> AdvantagesReturns:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): leave-one-out group mean as baseline.

        A_i = s_i - 1/(n-1) sum_{j != i} s_j = n/(n-1) (s_i - mean_g(s))

    for a group of n > 1. A singleton group keeps its raw score as advantage (unlike
    `compute_rloo_vectorized_outcome_advantage`, which gives it 0: verl's two differ).

    Args:
        token_level_rewards: Token rewards [B, R].
        response_mask: Response-token mask [B, R].
        index: Prompt group id of every response [B] (any integers).
        epsilon: Unused (verl's signature).
        config: Unused.
        **kwargs: Ignored (the trainer passes every estimator the same arguments).

    Returns:
        (advantages [B, R], returns = advantages).
    """
    scores = token_level_rewards.sum(-1)
    mean, _, n = _group_stats(scores, index)
    scale = jnp.maximum(n - 1, 1)
    leave_one_out = scores * n / scale - mean * n / scale
    scalars = jnp.where(n > 1, leave_one_out, scores)
    return _outcome(scalars, _float_mask(response_mask, token_level_rewards))


@register_adv_est(AdvantageEstimator.RLOO_VECTORIZED)
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    index: Int[Array, " b"],
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs,
) -> AdvantagesReturns:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740) from group sums, 0 for singletons.

        A_i = (n s_i - sum_{j in g} s_j) / (n - 1)  if n > 1,  else 0

    Args:
        token_level_rewards: Token rewards [B, R].
        response_mask: Response-token mask [B, R].
        index: Prompt group id of every response [B] (any integers).
        epsilon: Unused (verl's signature).
        config: Unused.
        **kwargs: Ignored (the trainer passes every estimator the same arguments).

    Returns:
        (advantages [B, R], returns = advantages).
    """
    scores = token_level_rewards.sum(-1)
    groups = dense_group_ids(index)
    n = group_sum(jnp.ones_like(scores), groups)
    total = group_sum(scores, groups)
    scalars = (n * scores - total) / jnp.maximum(n - 1, 1) * (n > 1)
    return _outcome(scalars, _float_mask(response_mask, token_level_rewards))


@register_adv_est(AdvantageEstimator.OPO)
def compute_opo_outcome_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    index: Int[Array, " b"],
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs,
) -> AdvantagesReturns:
    """OPO, on-policy RL with the optimal reward baseline (arXiv:2505.23585).

        A_i = s_i - sum_{j in g} L_j s_j / sum_{j in g} L_j

    with L_j the number of response tokens of j: the length-weighted group mean (0 for a
    singleton group; a group whose responses are all empty gives NaN, as in verl).

    Args:
        token_level_rewards: Token rewards [B, R].
        response_mask: Response-token mask [B, R].
        index: Prompt group id of every response [B] (any integers).
        epsilon: Unused (verl's signature).
        config: Unused.
        **kwargs: Ignored (the trainer passes every estimator the same arguments).

    Returns:
        (advantages [B, R], returns = advantages).
    """
    mask = _float_mask(response_mask, token_level_rewards)
    lengths = mask.sum(-1)
    scores = token_level_rewards.sum(-1)
    groups = dense_group_ids(index)
    n = group_sum(jnp.ones_like(scores), groups)
    baseline = group_sum(lengths * scores, groups) / group_sum(lengths, groups)
    scalars = scores - jnp.where(n > 1, baseline, 0.0)
    return _outcome(scalars, mask)


@register_adv_est(AdvantageEstimator.GPG)
def compute_gpg_outcome_advantage(
    token_level_rewards: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    index: Int[Array, " b"],
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs,
) -> AdvantagesReturns:
    """GPG, Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546).

        A_i = alpha (s_i - mean_g(s)) / f_norm,    alpha = B / max(#{i : s_i != 0}, 1)

    The batch-level alpha rescales the gradient when only M of the B responses carry a
    nonzero reward. As in verl the `alpha` argument is ignored (always recomputed); a
    singleton group has mean 0.

    Args:
        token_level_rewards: Token rewards [B, R].
        response_mask: Response-token mask [B, R].
        index: Prompt group id of every response [B] (any integers).
        epsilon: Unused (verl's signature).
        f_norm: Divides the advantages.
        alpha: Ignored (see above).
        config: Unused.
        **kwargs: Ignored (the trainer passes every estimator the same arguments).

    Returns:
        (advantages [B, R], returns = advantages).
    """
    scores = token_level_rewards.sum(-1)
    batch_alpha = scores.shape[0] / jnp.maximum(jnp.count_nonzero(scores), 1)
    mean, _, _ = _group_stats(scores, index)
    scalars = batch_alpha * (scores - mean) / f_norm
    return _outcome(scalars, _float_mask(response_mask, token_level_rewards))
