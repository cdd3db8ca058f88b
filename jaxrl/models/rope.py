"""Rotary position embeddings with HF's scaling types: default, linear, dynamic, llama3, yarn.

The rotation of head-dim pair (i, i + H/2) at position p is by angle `p * inv_freq[i]`, with

    default:  inv_freq[i] = theta^(-2i/H)
    linear:   inv_freq / factor                                  (position interpolation)
    dynamic:  theta' = theta * (factor * L / L0 - (factor - 1))^(H / (H - 2)) when the longest
              position L in the batch exceeds the trained context L0 (NTK-aware scaling)
    llama3:   low frequencies (wavelength > L0 / low_freq_factor) divided by factor, high ones
              kept, a linear blend in between (Llama 3.1)
    yarn:     per-dimension blend of interpolated and extrapolated frequencies over a ramp set
              by beta_fast / beta_slow, and cos/sin scaled by an attention factor
              (0.1 ln(factor) + 1 by default; Peng et al. 2023)

Differences from transformers: HF's dynamic NTK keeps the largest length it has seen in module
state, so its result depends on earlier calls; here each call uses its own longest position,
which equals HF's fresh-model result.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxrl.models.config import RopeConfig


def _base_inv_freq(theta: float, head_dim: int) -> np.ndarray:
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    return (1.0 / (theta**exponents)).astype(np.float32)


def _llama3(rope: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    dim, base, factor = head_dim, rope.theta, rope.factor
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
            factor, rope.mscale_all_dim
        )
    else:
        attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1
    original = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def inv_freq_and_scale(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Static inverse frequencies [H/2] and cos/sin scale (dynamic NTK: the unscaled ones)."""
    inv_freq = _base_inv_freq(rope.theta, head_dim)
    if rope.type == "linear":
        return inv_freq / np.float32(rope.factor), 1.0
    if rope.type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if rope.type == "yarn":
        return _yarn(rope, head_dim)
    return inv_freq, 1.0


def _dynamic_inv_freq(rope: RopeConfig, head_dim: int, seq_len: Array) -> Array:
    """NTK-aware frequencies for a batch whose longest position is `seq_len - 1`."""
    max_pos = rope.max_position_embeddings
    seq_len = jnp.maximum(seq_len, max_pos).astype(jnp.float32)
    base = rope.theta * ((rope.factor * seq_len / max_pos) - (rope.factor - 1)) ** (
        head_dim / (head_dim - 2)
    )
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return 1.0 / (base**exponents)


def rope_cos_sin(
    rope: RopeConfig, head_dim: int, positions: Int[Array, "b t"]
) -> tuple[Float[Array, "b t h"], Float[Array, "b t h"]]:
    """cos and sin tables [B, T, H] (float32) for the given positions."""
    inv_freq, scale = inv_freq_and_scale(rope, head_dim)
    if rope.type == "dynamic":
        # HF grows the frequencies only past the trained context, from the longest position.
        inv_freq = _dynamic_inv_freq(rope, head_dim, jnp.max(positions) + 1)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(
    x: Float[Array, "b t n h"], cos: Float[Array, "b t h"], sin: Float[Array, "b t h"]
) -> Float[Array, "b t n h"]:
    """Rotate pairs (i, i + H/2) of every head: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
