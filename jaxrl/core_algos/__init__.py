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

Every function of verl's registries is registered on import of this package: estimators in
`advantages` / `advantages_token`, losses in `policy_losses` / `policy_losses_cov`, and bypass
mode's rollout correction in `policy_losses_rollout_corr`.
"""

from jaxrl.core_algos import advantages, policy_losses  # noqa: F401  (registers)
from jaxrl.core_algos.advantages import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
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
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
)
from jaxrl.core_algos.policy_losses_rollout_corr import (
    compute_rollout_correction_and_rejection_mask,
)
from jaxrl.core_algos.registry import (
    ADV_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    AdvantageEstimator,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)
from jaxrl.core_algos.value import compute_entropy_loss, compute_value_loss

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "agg_loss",
    "clip_by_value",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_vanilla",
    "compute_rewards",
    "compute_rollout_correction_and_rejection_mask",
    "compute_value_loss",
    "dense_group_ids",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "global_batch_info",
    "kl_penalty",
    "kl_penalty_forward",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
]
