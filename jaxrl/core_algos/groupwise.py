"""verl's group-label helpers (`verl.utils.groupwise`), which verl's `core_algos` re-exports.

`as_torch_index(index)` turns any group labels into an integer array, and
`group_mean_std(scores, gidx)` gives per-GROUP statistics, with G = max(gidx) + 1 groups:

    mean_g  = sum_{i in g} s_i / n_g
    std_g   = sqrt(max(sum_{i in g} (s_i - mean_g)^2 / max(n_g - 1, 1), eps))
    count_g = n_g

and (mean, std) = (0, 1) for a group of at most one score. Both have data-dependent shapes or
host-side label handling, so they run eagerly; the estimators themselves use the jittable
per-response statistics of `common` (`dense_group_ids`, `group_moments`) instead.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

# verl truncates these in a numpy array or list (astype(int64) puts 1.2 and 1.7 in one group)
# and numbers a torch tensor's by their text: refused here rather than guessed.
_FLOAT_LABELS = (
    "as_torch_index: float group labels that are not integers; pass integer ids or strings"
)


def _device(device: Any) -> jax.Device | None:
    """A jax device for verl's `device` argument: None, a jax Device, or 'cpu' / 'cuda:1' /
    a torch.device (by its text)."""
    if device is None or isinstance(device, jax.Device):
        return device
    platform, _, number = str(device).partition(":")
    platform = {"cuda": "gpu"}.get(platform, platform)
    return jax.devices(platform)[int(number or 0)]


def _labels_1d(index: Any) -> np.ndarray:
    """Any labels (jax/numpy/torch array, list, tuple) as a 1-D numpy array (object if mixed)."""
    try:
        labels = np.asarray(index)
    except (TypeError, ValueError):
        labels = np.array(list(index), dtype=object)
    return labels.reshape(-1)


def _as_int_ids(labels: np.ndarray) -> np.ndarray | None:
    """The labels as int64 ids when they are integers, near-integer floats or numeric strings."""
    if labels.dtype != object and (
        np.issubdtype(labels.dtype, np.integer) or labels.dtype == np.bool_
    ):
        return labels.astype(np.int64)
    if labels.dtype != object and np.issubdtype(labels.dtype, np.floating):
        as_float = labels.astype(np.float64)
        rounded = np.rint(as_float)
        if not np.allclose(as_float, rounded, rtol=0.0, atol=1e-6):
            raise ValueError(_FLOAT_LABELS)
        return rounded.astype(np.int64)
    try:
        ids = labels.astype(np.int64)
    except (TypeError, ValueError, OverflowError):
        return None
    if any(isinstance(x, float | np.floating) and not float(x).is_integer() for x in labels):
        raise ValueError(_FLOAT_LABELS)  # an object array of floats: astype truncates too
    return ids


def _factorize(labels: np.ndarray) -> np.ndarray:
    """0..G-1 in the sorted order of the labels (of their text when they do not compare)."""
    labels = labels.astype(object)
    try:
        _, inverse = np.unique(labels, return_inverse=True)
    except TypeError:
        texts = np.array([str(x) for x in labels], dtype=object)
        _, inverse = np.unique(texts, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64)


def as_torch_index(index: Any, device: jax.Device | None = None) -> Int[Array, " n"]:
    """verl's `as_torch_index` on jax: group labels as a 1-D integer array (jax's default int).

    Integers (and bools) pass through unchanged, floats within 1e-6 of integers are rounded,
    numeric strings are parsed, and anything else (uid strings, mixed objects) is factorized to
    0..G-1 in sorted label order. The name is verl's, kept so that ported code runs unchanged;
    the result is a jax array, placed on `device` when given (a jax Device, or verl's
    'cpu' / 'cuda:N' text).

    Raises:
        ValueError: float labels that are not integers (verl truncates a numpy array or
            list of them, putting 1.2 and 1.7 in one group, and numbers a torch tensor's by
            their text), or a traced `index` (under `jit`).
        ValueError: integer labels that do not fit the default integer dtype (int32 unless
            `jax_enable_x64`), which would otherwise wrap silently.
    """
    if isinstance(index, jax.core.Tracer):
        raise ValueError(
            "as_torch_index runs on the host (labels may be strings); under jit pass integer "
            "ids and use dense_group_ids"
        )
    labels = _labels_1d(index)
    ids = _as_int_ids(labels)
    if ids is None:
        ids = _factorize(labels)
    dtype = jax.dtypes.canonicalize_dtype(np.int64)  # int32 unless jax_enable_x64
    info = np.iinfo(dtype)
    if ids.size and (ids.min() < info.min or ids.max() > info.max):
        raise ValueError(
            f"as_torch_index: integer group labels in [{ids.min()}, {ids.max()}] do not fit "
            f"{dtype}; pass them as strings (they are then numbered 0..G-1) or enable "
            "jax_enable_x64"
        )
    out = jnp.asarray(ids.astype(dtype))
    return out if device is None else jax.device_put(out, _device(device))


def group_mean_std(
    scores: Float[Array, " n"],
    gidx: Int[Array, " n"],
    eps: float = 1e-6,
    device: jax.Device | None = None,
) -> tuple[Float[Array, " g"], Float[Array, " g"], Float[Array, " g"]]:
    """verl's per-group (mean, std, count), each [G] float32 with G = max(gidx) + 1.

    `gidx` holds group numbers 0..G-1 (from `as_torch_index`); a number with no member gives
    count 0, mean 0 and std 1. Eager only: G sets the output shape.

    Raises:
        ValueError: `scores` and `gidx` of different sizes, negative group numbers (verl
            raises an IndexError), or a traced `gidx` (under `jit`; use `dense_group_ids` with
            per-response statistics there).
    """
    scores = jnp.asarray(scores, jnp.float32).reshape(-1)
    gidx = jnp.asarray(gidx).reshape(-1)
    if scores.size != gidx.size:
        raise ValueError(f"scores and gidx length mismatch: {scores.size} vs {gidx.size}")
    try:
        num_groups = int(jnp.max(gidx)) + 1 if gidx.size else 0
    except jax.errors.ConcretizationTypeError as err:
        raise ValueError(
            "group_mean_std needs a concrete gidx (the group count sets the output shape); "
            "under jit use dense_group_ids and per-response statistics"
        ) from err
    if gidx.size and int(jnp.min(gidx)) < 0:
        raise ValueError("group_mean_std: gidx holds negative group numbers; use as_torch_index")
    count = jax.ops.segment_sum(jnp.ones_like(scores), gidx, num_segments=num_groups)
    mean = jax.ops.segment_sum(scores, gidx, num_segments=num_groups) / jnp.maximum(count, 1.0)
    squares = jax.ops.segment_sum(jnp.square(scores - mean[gidx]), gidx, num_segments=num_groups)
    std = jnp.sqrt(jnp.maximum(squares / jnp.maximum(count - 1.0, 1.0), eps))
    single = count <= 1.0
    out = (jnp.where(single, 0.0, mean), jnp.where(single, 1.0, std), count)
    return out if device is None else jax.device_put(out, _device(device))
