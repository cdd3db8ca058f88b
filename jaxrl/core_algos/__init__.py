"""verl 0.9.1's `core_algos` in JAX: advantage estimators, policy losses, KL, value loss.

Same names, argument names and semantics as `verl.trainer.ppo.core_algos`, on jax arrays,
jittable (no host syncs; metrics are arrays) and differentiable. `index` is an integer group-id
array (verl uses uid strings); `config` arguments are any object with verl's attribute names
(a dataclass, `types.SimpleNamespace` or dict).

Deliberate differences from verl (all forced by running under `jit`):

- Metrics are returned as jax scalars, not Python floats (`.item()` is a host sync).
- `masked_var` (and so GAE's whitening) gives variance 0 for a mask with fewer than two
  elements, where verl raises.
- `agg_loss` takes the global counts as arrays as well as numbers.
- `masked_whiten` gives zeros (not NaN) for a mask with fewer than two elements.
- `compute_grpo_passk_outcome_advantage` gives 0 advantage to a singleton group (verl raises).
- `clip_cov` draws its token subset from a jax PRNG key (`rng=`), not torch's global RNG;
  `kl_cov` breaks ties in its top-k by position (torch's `topk` order is unspecified).
- Invalid config values raise `ValueError` where verl uses `assert`.
- `as_torch_index` (verl's name, kept for ported code) returns a jax array and refuses float
  labels that are not integers (verl truncates those of a numpy array or list and numbers a
  torch tensor's by their text); it and `group_mean_std` (per-group arrays whose length
  depends on the data) run eagerly only.
- `compute_policy_loss` (deprecated in verl) returns its three metrics without gradient.

Every verl 0.9.1 name of `verl.trainer.ppo.core_algos` that jaxrl implements is exported here
under that name with verl's argument names (`tests/core_algos/test_verl_contract.py` walks
verl's module to keep it so); the few it does not implement are `VERL_NAMES_NOT_PROVIDED`,
each with its reason, and reading one of them from this package raises an AttributeError
that gives the reason. Every function of verl's registries is registered on import of this
package: estimators in `advantages` / `advantages_token`, losses in `policy_losses` /
`policy_losses_cov`, and bypass mode's rollout correction in `policy_losses_rollout_corr`.
"""

from jaxrl.core_algos.advantages import (
    compute_gae_advantage_return,
    compute_gdpo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_opo_outcome_advantage,
    compute_optimal_token_baseline_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
)
from jaxrl.core_algos.aggregation import LOSS_AGG_MODES, agg_loss, global_batch_info
from jaxrl.core_algos.common import (
    clip_by_value,
    dense_group_ids,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from jaxrl.core_algos.groupwise import as_torch_index, group_mean_std
from jaxrl.core_algos.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
)
from jaxrl.core_algos.policy_losses import (
    compute_policy_loss,
    compute_policy_loss_bypass_mode,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_reinforce,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
)
from jaxrl.core_algos.policy_losses_rollout_corr import (
    compute_rollout_correction_and_rejection_mask,
)
from jaxrl.core_algos.registry import (
    ADV_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    AdvantageEstimator,
    EstimatorInputs,
    PolicyLossFn,
    estimator_inputs,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)
from jaxrl.core_algos.reweight import pf_ppo_indices, pf_ppo_weights
from jaxrl.core_algos.value import compute_entropy_loss, compute_value_loss

# verl 0.9.1 names of `verl.trainer.ppo.core_algos` that jaxrl deliberately does not provide.
# (The module's re-imports from the standard library and omegaconf are not verl's names.)
VERL_NAMES_NOT_PROVIDED: dict[str, str] = {
    "compute_pf_ppo_reweight_data": (
        "PF-PPO resamples a verl DataProto (batch, non_tensor_batch, meta_info) with torch's "
        "global RNG; jaxrl has no DataProto: pf_ppo_weights and pf_ppo_indices (a jax key) "
        "give the weights and the drawn rows, and the trainer gathers its batch by them"
    ),
    "ActorConfig": (
        "verl's actor config class, imported by core_algos for type checks; jaxrl's functions "
        "take any object with verl's attribute names (verl's ActorConfig itself included); "
        "jaxrl's typed config is jaxrl.config"
    ),
    "AlgoConfig": (
        "verl's algorithm config class, imported by core_algos for type checks; the estimators "
        "take any object with its attribute names (verl's AlgoConfig itself included)"
    ),
    "deprecated": "verl's decorator utility (verl.utils.import_utils), not an algorithm",
}


def __getattr__(name: str):
    if name in VERL_NAMES_NOT_PROVIDED:
        raise AttributeError(
            f"jaxrl.core_algos does not provide verl's {name!r}: {VERL_NAMES_NOT_PROVIDED[name]}"
        )
    raise AttributeError(f"module 'jaxrl.core_algos' has no attribute {name!r}")


__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "VERL_NAMES_NOT_PROVIDED",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "EstimatorInputs",
    "FixedKLController",
    "PolicyLossFn",
    "agg_loss",
    "as_torch_index",
    "clip_by_value",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
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
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_rollout_correction_and_rejection_mask",
    "compute_value_loss",
    "dense_group_ids",
    "estimator_inputs",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "global_batch_info",
    "group_mean_std",
    "kl_penalty",
    "kl_penalty_forward",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pf_ppo_indices",
    "pf_ppo_weights",
    "register_adv_est",
    "register_policy_loss",
]
