"""Token rewards and advantages of a step (verl's `apply_kl_penalty` and `compute_advantage`).

KL in reward (`algorithm.use_kl_in_reward`), with beta the controller's coefficient:

    kld = kl_penalty(old_log_probs, ref_log_probs) * mask
    token_level_rewards = token_level_scores - beta * kld
    current_kl = mean_b(masked_mean_t(kld))  -> controller.update(current_kl, n_steps=N)

Advantages go through the `core_algos` registry with the arguments verl passes each estimator.
The estimators run with jnp on the host rows of the step's global batch, which every process
holds (`ppo_trainer.gather_processes`), so group statistics and batch-wide whitening see every
sample whichever process generated it.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl.core_algos import (
    AdvantageEstimator,
    get_adv_estimator_fn,
    kl_penalty,
    masked_mean,
)


def apply_kl_penalty(
    batch: dict[str, np.ndarray], kl_ctrl: Any, penalty: str
) -> tuple[np.ndarray, dict[str, float]]:
    """(token_level_rewards [N, R], metrics); updates `kl_ctrl` in place."""
    mask = jnp.asarray(batch["response_mask"], jnp.float32)
    kld = kl_penalty(
        jnp.asarray(batch["old_log_probs"]), jnp.asarray(batch["ref_log_probs"]), penalty
    )
    kld = kld * mask
    beta = kl_ctrl.value
    rewards = jnp.asarray(batch["token_level_scores"]) - beta * kld
    current_kl = float(jnp.mean(masked_mean(kld, mask, axis=-1)))
    kl_ctrl.update(current_kl=current_kl, n_steps=len(mask))
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(beta)}
    return np.asarray(rewards, np.float32), metrics


def compute_advantage(
    batch: dict[str, np.ndarray],
    group_ids: np.ndarray,
    algorithm: Any,
    extra: dict[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns) [N, R] of `algorithm.adv_estimator`, as verl computes them.

    Args:
        batch: Host arrays: token_level_rewards, response_mask, and per estimator values
            (gae), reward_baselines (remax), old_log_probs / sum_pi_squared (optimal token
            baselines), prompts / prompt_mask (gdpo).
        group_ids: int [N], the prompt group of every response (verl's `uid`).
        algorithm: The `algorithm` config (gamma, lam, norm_adv_by_std_in_grpo, ...).
        extra: Per-row non-tensor inputs (gdpo's reward components).
    """
    name = algorithm.adv_estimator
    rewards = jnp.asarray(batch["token_level_rewards"], jnp.float32)
    mask = jnp.asarray(batch["response_mask"], jnp.float32)
    fn = get_adv_estimator_fn(name)
    if name == AdvantageEstimator.GAE:
        adv, ret = fn(
            token_level_rewards=rewards,
            values=jnp.asarray(batch["values"]),
            response_mask=mask,
            gamma=algorithm.gamma,
            lam=algorithm.lam,
        )
    elif name == AdvantageEstimator.GRPO:
        adv, ret = fn(
            token_level_rewards=rewards,
            response_mask=mask,
            index=jnp.asarray(group_ids),
            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
        )
    else:
        kwargs: dict[str, Any] = {
            "token_level_rewards": rewards,
            "response_mask": mask,
            "config": algorithm,
            "index": jnp.asarray(group_ids),
        }
        if "reward_baselines" in batch:
            kwargs["reward_baselines"] = jnp.asarray(batch["reward_baselines"])
        if name == AdvantageEstimator.GDPO:
            attention = np.concatenate([batch["prompt_mask"], batch["response_mask"]], axis=1)
            keys = list(getattr(algorithm, "gdpo_reward_keys", None) or (extra or {}))
            missing = [k for k in keys if k not in (extra or {})]
            if missing:
                raise ValueError(
                    f"gdpo needs the reward components {missing} from the scorer's extra info "
                    f"(it returned {sorted(extra or {})}); return them from compute_score"
                )
            kwargs["non_tensor_batch"] = {
                k: jnp.asarray(np.asarray(extra[k], np.float32)) for k in keys
            }
            kwargs["batch"] = {"attention_mask": jnp.asarray(attention)}
        # (optimal_token_baseline needs the actor's sum_pi_squared, which the trainer does not
        # compute: PPOTrainer refuses that estimator, so it never reaches here.)
        adv, ret = fn(**kwargs)
    return np.asarray(adv, np.float32), np.asarray(ret, np.float32)
