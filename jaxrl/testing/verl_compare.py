"""Helpers for comparing `jaxrl.core_algos` with verl 0.9.1's torch `core_algos`.

Tolerance policy (DESIGN §6, float32 simple ops): elementwise |ours - ref| <= ATOL + RTOL |ref|
with ATOL = RTOL = 1e-5, for outputs, metrics and the gradients with respect to `log_prob`
(`jax.grad` against torch autograd). Why that suffices and is stable: the tests' inputs are
unit-scale by construction (standard normals, log-probs of probabilities in [0.05, 1] and
+-30 offsets, weights in [0.5, 1.5]), and each compared value is a few float32 operations and
masked sums of at most 192 such terms away from them. Two float32 evaluations in another order
(torch against XLA, another CPU or XLA code path) then differ by rounding of ~1e-7 of the
magnitudes involved: relative to the value (RTOL: ratios up to exp(20) = 5e8 and metrics
up to 1e17 included) and, where terms cancel to a value near 0, absolute at the inputs' unit
scale (ATOL = ~100 float32 ulps of 1). Measured over every call under both XLA CPU
configurations (docs/testing.md): at most 0.04 of the tolerance, i.e. a 25x margin.
Exact quantities (masks, counts) are compared exactly, not here.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

# float32 simple ops on unit-scale inputs: ~1e-7 rounding, a 25x margin measured (see above).
ATOL = RTOL = 1e-5


def verl_core_algos():
    """verl's `core_algos` module (skips, or fails under JAXRL_REQUIRE_REFERENCE=1)."""
    from jaxrl.testing.reference import import_reference

    return import_reference("verl.trainer.ppo.core_algos")


def to_torch(x: Any, requires_grad: bool = False):
    import torch

    t = torch.tensor(np.asarray(x))
    if requires_grad:
        t.requires_grad_(True)
    return t


def assert_close(ours: Any, ref: Any, atol: float = ATOL, rtol: float = RTOL, what: str = ""):
    """Compare a jax/numpy value with a torch/numpy/float reference elementwise."""
    if hasattr(ref, "detach"):
        ref = ref.detach().numpy()
    np.testing.assert_allclose(
        np.asarray(ours, np.float64),
        np.asarray(ref, np.float64),
        atol=atol,
        rtol=rtol,
        err_msg=what,
    )


def assert_metrics_close(ours: dict, ref: dict, atol: float = ATOL, rtol: float = RTOL):
    """Same metric names, values within tolerance."""
    assert set(ours) == set(ref), (sorted(ours), sorted(ref))
    for key in ref:
        value = ref[key]
        value = value.detach().numpy() if hasattr(value, "detach") else value
        assert_close(ours[key], value, atol, rtol, what=key)


def actor_configs(**overrides: Any) -> tuple[Any, Any]:
    """(verl config, jaxrl config) for policy losses, with verl 0.9.1's actor defaults.

    verl's side is an OmegaConf DictConfig (verl calls `config.get(...)`); jaxrl's is a plain
    `types.SimpleNamespace`, proving that jaxrl needs attribute access only.
    """
    from omegaconf import OmegaConf

    policy_loss = dict(
        loss_mode="vanilla",
        clip_cov_ratio=0.0002,
        clip_cov_lb=1.0,
        clip_cov_ub=5.0,
        kl_cov_ratio=0.0002,
        ppo_kl_coef=0.1,
        dro_beta=None,
    )
    policy_loss.update(overrides.pop("policy_loss", {}))
    values = dict(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        clip_ratio_c=3.0,
        tau_pos=1.0,
        tau_neg=1.05,
        loss_agg_mode="token-mean",
        loss_scale_factor=None,
        global_batch_info={},
        policy_loss=policy_loss,
    )
    values.update(overrides)
    verl_cfg = OmegaConf.create(values)
    ours = types.SimpleNamespace(**{**values, "policy_loss": types.SimpleNamespace(**policy_loss)})
    return verl_cfg, ours
