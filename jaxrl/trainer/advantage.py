"""Token rewards and advantages of a step (verl's `apply_kl_penalty` and `compute_advantage`),
jitted on the devices.

KL in reward (`algorithm.use_kl_in_reward`), with beta the controller's coefficient:

    kld = kl_penalty(old_log_probs, ref_log_probs) * mask
    token_level_rewards = token_level_scores - beta * kld
    current_kl = mean_b(masked_mean_t(kld))  -> controller.update(current_kl, n_steps=N)

The controller's update needs `current_kl` on the host: the trainer reads it back with the
step's metrics and updates the controller then (it is used from the next step on, as in verl).

Advantages go through the `core_algos` registry with the arguments verl passes each
estimator (beyond rewards, mask and group ids, the inputs it registered: `EstimatorInputs`),
over the step's global batch (every process holds it), so group statistics and batch-wide
whitening see every sample whichever process generated it. `mask` is the loss mask: the
tokens trained on (verl's `response_mask`, which multi-turn rollouts also cut to the
policy's tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jaxrl.core_algos import (
    AdvantageEstimator,
    estimator_inputs,
    get_adv_estimator_fn,
    kl_penalty,
    masked_mean,
)


def kl_in_reward(
    scores: Float[Array, "n r"],
    old_log_probs: Float[Array, "n r"],
    ref_log_probs: Float[Array, "n r"],
    mask: Float[Array, "n r"],
    beta: Float[Array, ""],
    *,
    penalty: str,
) -> tuple[Float[Array, "n r"], Float[Array, ""]]:
    """(token_level_rewards, current_kl): see the module doc (jit with `penalty` bound)."""
    mask = mask.astype(jnp.float32)
    kld = kl_penalty(old_log_probs, ref_log_probs, penalty) * mask
    rewards = scores - beta * kld
    return rewards.astype(jnp.float32), jnp.mean(masked_mean(kld, mask, axis=-1))


def compute_advantage(
    batch: Mapping[str, Array],
    extra: Mapping[str, Array],
    *,
    algorithm: Any,
) -> tuple[Float[Array, "n r"], Float[Array, "n r"]]:
    """(advantages, returns) [N, R] of `algorithm.adv_estimator`, as verl computes them
    (jittable, with `algorithm` bound).

    Args:
        batch: token_level_rewards, loss_mask, group_ids (int [N], the prompt group of every
            response: verl's `uid`) and the inputs the estimator registered
            (`EstimatorInputs`): values; reward_baselines; old_log_probs, sum_pi_squared and
            rollout_is_weights (when there are); prompt_mask and response_mask.
        extra: The scorer's per-row reward components as float arrays [N] (an estimator
            reading `reward_components`).
        algorithm: The `algorithm` config (gamma, lam, norm_adv_by_std_in_grpo, ...).
    """
    name = algorithm.adv_estimator
    inputs = estimator_inputs(name)
    rewards = batch["token_level_rewards"].astype(jnp.float32)
    mask = batch["loss_mask"].astype(jnp.float32)
    fn = get_adv_estimator_fn(name)
    if name == AdvantageEstimator.GAE:
        adv, ret = fn(
            token_level_rewards=rewards,
            values=batch["values"],
            response_mask=mask,
            gamma=algorithm.gamma,
            lam=algorithm.lam,
        )
    elif name == AdvantageEstimator.GRPO:
        adv, ret = fn(
            token_level_rewards=rewards,
            response_mask=mask,
            index=batch["group_ids"],
            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
        )
    else:
        kwargs: dict[str, Any] = {
            "token_level_rewards": rewards,
            "response_mask": mask,
            "config": algorithm,
            "index": batch["group_ids"],
        }
        if inputs.values:
            kwargs["values"] = batch["values"]
        if inputs.reward_baselines:
            kwargs["reward_baselines"] = batch["reward_baselines"]
        if inputs.reward_components:
            kwargs["non_tensor_batch"] = dict(extra)
            attention = jnp.concatenate([batch["prompt_mask"], batch["response_mask"]], axis=1)
            kwargs["batch"] = {"attention_mask": attention}
        if inputs.sum_pi_squared:  # the old-log-prob pass's
            kwargs["old_log_probs"] = batch["old_log_probs"]
            kwargs["sum_pi_squared"] = batch["sum_pi_squared"]
            kwargs["rollout_is_weights"] = batch.get("rollout_is_weights")
        adv, ret = fn(**kwargs)
    return adv.astype(jnp.float32), ret.astype(jnp.float32)


def gdpo_components(algorithm: Any, extra: Mapping[str, list]) -> dict[str, np.ndarray]:
    """The scorer's reward components gdpo normalises (`gdpo_reward_keys`, default: all it
    returned), as float32 host arrays [N] (the trainer places them with the batch's rows);
    estimators that do not read `reward_components` take none."""
    if not estimator_inputs(algorithm.adv_estimator).reward_components:
        return {}
    keys = list(getattr(algorithm, "gdpo_reward_keys", None) or extra)
    missing = [k for k in keys if k not in extra]
    if missing:
        raise ValueError(
            f"gdpo needs the reward components {missing} from the scorer's extra info (it "
            f"returned {sorted(extra)}); return them from compute_score"
        )
    return {k: np.asarray(extra[k], np.float32) for k in keys}
