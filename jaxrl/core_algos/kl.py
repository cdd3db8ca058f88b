"""KL estimators, KL-penalised rewards and the KL coefficient controllers.

With d = log pi(y) - log pi_ref(y) per token (Schulman, "Approximating KL divergence", 2020):

    kl / k1      d
    abs          |d|
    mse / k2     d^2 / 2
    low_var_kl / k3   exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10]

A `+` suffix (`k1+`, `low_var_kl+`, ...) keeps the value of the estimator but takes the gradient
of k2 (a straight-through estimator): k1 and k3 are unbiased for the KL value but not for its
gradient, k2 is unbiased for the gradient.

Gradients equal verl's (torch autograd) everywhere, kinks included: `abs` has slope 0 at a tie
(d = 0 exactly, as on every token of a run's first step when the actor starts as its
reference), and the k3 clamps pass the full gradient on their closed intervals. Both come from
`common.abs_` / `common.clamp`; `jnp.abs` (slope 1 at 0) and `jnp.clip` (half at a bound)
would not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jaxrl.core_algos.common import abs_, cfg_get, clamp

KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty_forward(
    logprob: Float[Array, "b r"], ref_logprob: Float[Array, "b r"], kl_penalty: str
) -> Float[Array, "b r"]:
    """The per-token KL estimate of the named estimator (no `+`)."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return abs_(logprob - ref_logprob)
    if kl_penalty in ("mse", "k2"):
        return 0.5 * jnp.square(logprob - ref_logprob)
    if kl_penalty in ("low_var_kl", "k3"):
        kl = clamp(ref_logprob - logprob, -20.0, 20.0)
        return clamp(jnp.exp(kl) - kl - 1, -10.0, 10.0)
    raise NotImplementedError(f"kl_penalty {kl_penalty!r}; use one of {KL_PENALTIES} (+ suffix)")


def kl_penalty(
    logprob: Float[Array, "b r"], ref_logprob: Float[Array, "b r"], kl_penalty: str
) -> Float[Array, "b r"]:
    """KL estimate; with a `+` suffix, its value with k2's gradient (straight-through)."""
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    forward = kl_penalty_forward(logprob, ref_logprob, base)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward
    backward = 0.5 * jnp.square(logprob - ref_logprob)
    return backward - jax.lax.stop_gradient(backward) + jax.lax.stop_gradient(forward)


def compute_rewards(
    token_level_scores: Float[Array, "b r"],
    old_log_prob: Float[Array, "b r"],
    ref_log_prob: Float[Array, "b r"],
    kl_ratio: float | Array,
) -> Float[Array, "b r"]:
    """Token rewards with a k1 KL penalty: scores - kl_ratio * (log pi_old - log pi_ref)."""
    return token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio


class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593).

    After each step: value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon.
    Host-side state (a float), checkpointed by the trainer.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = np.clip(float(current_kl) / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""


def get_kl_controller(kl_ctrl) -> FixedKLController | AdaptiveKLController:
    """The controller described by `kl_ctrl` (`type`, `kl_coef`, `horizon`, `target_kl`)."""
    kind = cfg_get(kl_ctrl, "type")
    if kind == "fixed":
        return FixedKLController(kl_coef=cfg_get(kl_ctrl, "kl_coef"))
    if kind == "adaptive":
        horizon = cfg_get(kl_ctrl, "horizon")
        if not horizon > 0:
            raise ValueError(f"adaptive KL controller: horizon must be > 0, got {horizon}")
        return AdaptiveKLController(
            init_kl_coef=cfg_get(kl_ctrl, "kl_coef"),
            target_kl=cfg_get(kl_ctrl, "target_kl"),
            horizon=horizon,
        )
    raise NotImplementedError(f"kl_ctrl.type {kind!r}; use fixed or adaptive")
