"""Masked reductions, torch-exact clamps, group statistics and duck-typed config access.

Shapes: `[B, R]` for per-token arrays (B responses, R response length), `[B]` per response.
Group statistics work on an integer group-id array `index [B]` with any values: ids are made
dense inside the jitted function (`jnp.unique(..., size=B)`), so no host-side remapping is
needed and any two equal ids are one group.

`clamp` and `abs_` exist to keep gradients bit-for-bit equal to verl's torch code where JAX's
primitives differ in corner cases that real training hits: `jnp.clip` passes half the gradient
at a bound (its `maximum`/`minimum` split ties) and `jnp.abs` has slope 1 at 0, where
`torch.clamp` passes the full gradient on the closed interval [low, high] and `torch.abs` has
slope 0 at 0. An actor that starts equal to its reference (or an on-policy token) has a
log-ratio of exactly 0 on every token, so the kink is hit on the first step of every run.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def masked_sum(values: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """sum(values * mask), with values outside the mask (even NaN) ignored."""
    return jnp.sum(jnp.where(mask.astype(bool), values, 0.0) * mask, axis=axis)


def masked_mean(values: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """masked_sum / (mask count + 1e-8), as verl."""
    return masked_sum(values, mask, axis) / (jnp.sum(mask, axis=axis) + 1e-8)


def masked_var(values: Array, mask: Array, unbiased: bool = True) -> Array:
    """Variance over the mask, with Bessel's correction n / (n - 1) when `unbiased`.

    verl raises for masks with fewer than two elements; under `jit` that cannot be a Python
    error, so here such a mask gives variance 0 (and `masked_whiten` gives 0).
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = jnp.sum(mask)
        variance = jnp.where(n > 1, variance * n / jnp.maximum(n - 1, 1), 0.0)
    return variance


def masked_whiten(values: Array, mask: Array, shift_mean: bool = True) -> Array:
    """(values - mean) / sqrt(var + 1e-8) over the mask (the mean re-added unless shift_mean).

    A mask with fewer than two elements (verl raises) gives zeros rather than differences
    scaled by 1e4 at the unmasked positions.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(var + 1e-8)
    whitened = jnp.where(jnp.sum(mask) > 1, whitened, 0.0)
    return whitened if shift_mean else whitened + mean


def clamp(x: Array, low: float | Array | None = None, high: float | Array | None = None) -> Array:
    """`torch.clamp`: the value of `jnp.clip`, the gradient 1 on [low, high] (bounds included)."""
    clipped = jnp.clip(x, low, high)
    inside = jnp.ones(x.shape, bool)
    if low is not None:
        inside &= x >= low
    if high is not None:
        inside &= x <= high
    return jnp.where(inside, x, jax.lax.stop_gradient(clipped))


def abs_(x: Array) -> Array:
    """`torch.abs`: |x| with slope sign(x), so 0 at x = 0."""
    return x * jax.lax.stop_gradient(jnp.sign(x))


def clip_by_value(x: Array, low: Array, high: Array) -> Array:
    """verl's `clip_by_value`: max(min(x, high), low), array bounds (ties split as torch's)."""
    return jnp.maximum(jnp.minimum(x, high), low)


def dense_group_ids(index: Int[Array, " b"]) -> Int[Array, " b"]:
    """Group ids renumbered to 0..G-1 (G <= B), jittable; equal ids stay equal."""
    _, inverse = jnp.unique(index, size=index.shape[0], return_inverse=True)
    return inverse.reshape(index.shape)


def group_sum(x: Float[Array, " b"], groups: Int[Array, " b"]) -> Float[Array, " b"]:
    """For every element, the sum of `x` over its group (groups from `dense_group_ids`)."""
    totals = jax.ops.segment_sum(x, groups, num_segments=x.shape[0])
    return totals[groups]


def group_count(groups: Int[Array, " b"]) -> Float[Array, " b"]:
    """For every element, the size of its group."""
    return group_sum(jnp.ones(groups.shape, jnp.float32), groups)


def group_moments(
    x: Float[Array, " b"], groups: Int[Array, " b"]
) -> tuple[Float[Array, " b"], Float[Array, " b"], Float[Array, " b"]]:
    """Per element: its group's mean, unbiased std and size (std of a singleton group is 0)."""
    n = group_count(groups)
    mean = group_sum(x, groups) / n
    var = group_sum((x - mean) ** 2, groups) / jnp.maximum(n - 1, 1)
    return mean, jnp.sqrt(jnp.where(n > 1, var, 0.0)), n


def cfg_get(config: Any, name: str, default: Any = None) -> Any:
    """`config.name` for any config object (dataclass, SimpleNamespace, dict, DictConfig)."""
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)
