"""Pieces shared by the policy losses: config reads, the clamped log-ratio, aggregation, counts.

The torch-exact `clamp` and `abs_` live in `common` (the KL estimators use them too).
`float64_floor_product` keeps integer counts equal to verl's: verl sizes its token selections
with `int(ratio * count)` in Python float64, and a float32 product rounds across integers
differently (0.29 * 100 is 29 in float32 and 28.999999999999996 in float64).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxrl.core_algos.aggregation import agg_loss
from jaxrl.core_algos.common import cfg_get, clamp

LOG_RATIO_BOUND = 20.0  # exp(20) ~ 4.9e8: far from float32 overflow, still "very off-policy"


def clamped_log_ratio(log_prob: Array, old_log_prob: Array) -> Array:
    """log(pi / pi_old) clamped to [-20, 20], so the ratio stays finite far off-policy."""
    return clamp(log_prob - old_log_prob, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def require_config(config: Any, name: str) -> None:
    if config is None:
        raise ValueError(f"policy loss {name!r} needs the actor config")


def clip_range(config: Any) -> tuple[float, float]:
    """(low, high) clip ranges: `clip_ratio_low` / `clip_ratio_high`, else `clip_ratio`."""
    clip_ratio = cfg_get(config, "clip_ratio")
    low = cfg_get(config, "clip_ratio_low")
    high = cfg_get(config, "clip_ratio_high")
    return (clip_ratio if low is None else low), (clip_ratio if high is None else high)


def value_or(value: Any, default: Any) -> Any:
    return default if value is None else value


def aggregate(
    pg_losses: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    loss_agg_mode: str,
    config: Any,
) -> Float[Array, ""]:
    """`agg_loss` with the config's global batch counts (empty: the local counts)."""
    info = cfg_get(config, "global_batch_info", {}) or {}
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **dict(info))


def reweight(
    pg_losses: Float[Array, "b r"], rollout_is_weights: Float[Array, "b r"] | None
) -> Float[Array, "b r"]:
    """Per-token losses times the rollout-correction weights, when given."""
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def zero_metric(like: Array) -> Float[Array, ""]:
    """A metric verl reports as a constant 0 for interface compatibility."""
    return jnp.zeros((), like.dtype)


def float64_floor_product(factor: float, count: Int[Array, ""], max_count: int) -> Int[Array, ""]:
    """`int(factor * count)` as Python computes it (float64), for an integer count <= max_count.

    `factor` is static, so the step function n -> floor(factor * n) is tabulated on the host at
    trace time as its jump points (the first n of each step), and looked up with a binary
    search: exact, jittable, and small (one entry per step). Values above `max_count` are
    capped there, since no selection can exceed the token count.
    """
    counts = np.arange(max_count + 1, dtype=np.float64)
    steps = np.minimum(np.floor(factor * counts), max_count)
    jumps = np.searchsorted(steps, np.arange(1, int(steps[-1]) + 1), side="left")
    if jumps.size == 0:
        return jnp.zeros(jnp.shape(count), jnp.int32)
    return jnp.searchsorted(jnp.asarray(jumps, jnp.int32), count, side="right").astype(jnp.int32)
