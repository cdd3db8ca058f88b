"""Name -> function registries of advantage estimators and policy losses, with verl's names.

An estimator registers what it reads beyond the rewards, the mask and the group ids
(`EstimatorInputs`): the trainer's step plan runs the passes that make those inputs and the
advantage call passes them; an estimator registered without a declaration reads none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import Enum, StrEnum
from typing import Any

from jaxtyping import Array

# verl's `PolicyLossFn`: (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
# config, rollout_is_weights) -> (loss, metrics), on jax arrays.
PolicyLossFn = Callable[
    [Array, Array, Array, Array, str, Any, Array | None], tuple[Array, dict[str, Any]]
]


class AdvantageEstimator(StrEnum):
    """verl 0.9.1's advantage estimator names."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    GDPO = "gdpo"


@dataclasses.dataclass(frozen=True)
class EstimatorInputs:
    """What an advantage estimator reads beyond `token_level_rewards`, `response_mask` and
    `index` (the group ids).

    Attributes:
        values: A critic's values [N, R] (the critic's pass; verl enables a critic by
            default for gae only: another estimator reading values needs `critic.enable`).
        reward_baselines: The reward of a greedy response to the same prompt [N] (a second,
            greedy generation: ReMax).
        sum_pi_squared: The actor's sum_v pi_v^2 [N, R] with its old log-probs (the
            old-log-prob pass returns it: the optimal token baselines).
        reward_components: The scorer's per-row reward components and the prompt/response
            masks (gdpo).
    """

    values: bool = False
    reward_baselines: bool = False
    sum_pi_squared: bool = False
    reward_components: bool = False


ADV_ESTIMATOR_REGISTRY: dict[str, Callable[..., Any]] = {}
ESTIMATOR_INPUTS: dict[str, EstimatorInputs] = {}
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def _name(name_or_enum: str | Enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(
    name_or_enum: str | AdvantageEstimator, *, inputs: EstimatorInputs = EstimatorInputs()
) -> Callable:
    """Decorator registering an advantage estimator under a name, with the inputs it reads
    (a second, different function under the same name is an error)."""

    def decorator(fn: Callable) -> Callable:
        name = _name(name_or_enum)
        if ADV_ESTIMATOR_REGISTRY.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        ESTIMATOR_INPUTS[name] = inputs
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> Callable:
    """The advantage estimator registered under a name."""
    name = _name(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"unknown advantage estimator {name!r}; registered: {sorted(ADV_ESTIMATOR_REGISTRY)}"
        )
    return ADV_ESTIMATOR_REGISTRY[name]


def estimator_inputs(name_or_enum: str | AdvantageEstimator) -> EstimatorInputs:
    """The inputs the estimator registered under a name reads (`EstimatorInputs`)."""
    get_adv_estimator_fn(name_or_enum)  # an unknown name: the registry's error
    return ESTIMATOR_INPUTS[_name(name_or_enum)]


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under a name."""

    def decorator(fn: Callable) -> Callable:
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under a name."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"unsupported loss mode {name!r}; registered: {sorted(POLICY_LOSS_REGISTRY)}"
        )
    return POLICY_LOSS_REGISTRY[name]
