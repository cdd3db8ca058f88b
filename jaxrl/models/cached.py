"""The decoder with a KV cache: prefill a prompt, then extend it a token at a time.

    cache = init_cache(config, batch=B, length=S)
    h_btd, cache = forward_cached(config, params, ids_bt, positions_bt, segments_bt, cache, 0)
    h_b1d, cache = forward_cached(config, params, next_b1, pos_b1, ones_b1, cache, T)
    h_bd, cache = decode_step(config, params, tokens_b, positions_b, cache, write_index_b, live)

The cache is an explicit value (passed in, returned, donated by the caller's `jit`), laid out
[L, B, S, K, H] for keys and values plus [B, S] segment ids (1: a real key, 0: padding or not
yet written). `forward_cached` writes new keys at cache positions [index, index + T) for every
row (rows in lockstep; prompts are left-padded to a common length) and attends causally to
everything written so far, with the model's sliding windows. `decode_step` advances each row by
one token at its own cache index (rows at different points: continuous batching) and reads
only the cache's live blocks (`jaxrl.kernels.decode_attention`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrl.kernels import attention
from jaxrl.kernels.decode import decode_attention
from jaxrl.models.config import DecoderConfig
from jaxrl.models.params import Params
from jaxrl.models.rope import rope_cos_sin
from jaxrl.models.transformer import _block, rms_norm
from jaxrl.sharding.layouts import KV_CACHE_AXES, shard


@flax.struct.dataclass
class KVCache:
    """Keys, values and key segment ids of every layer.

    Attributes:
        k: Keys [L, B, S, K, H].
        v: Values [L, B, S, K, H].
        segments: [B, S]: 1 where a real token's key is stored, else 0.
    """

    k: Float[Array, "l b s k h"]
    v: Float[Array, "l b s k h"]
    segments: Int[Array, "b s"]

    @property
    def length(self) -> int:
        return self.k.shape[2]


def _embed(config: DecoderConfig, params: Params, ids: Array) -> Array:
    return params["embed"]["tokens_vd"][ids].astype(config.compute_dtype)


def init_cache(config: DecoderConfig, batch: int, length: int, dtype=None) -> KVCache:
    """An empty cache for `batch` rows of up to `length` tokens (in the compute dtype)."""
    dtype = config.compute_dtype if dtype is None else dtype
    shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        segments=jnp.zeros((batch, length), jnp.int32),
    )


def _scan_layers(
    config: DecoderConfig,
    params: Params,
    cos: Array,
    sin: Array,
    x: Array,
    cache: KVCache,
    segments: Int[Array, "b s"],
    attend_with_cache,
) -> tuple[Array, KVCache]:
    """Run every layer over `x`, each attending through `attend_with_cache(k_all, v_all, layer,
    q, k, v, window) -> (out, k_all, v_all)`, which writes the layer's new keys into the cache
    stack; returns the final-normed hidden states and the updated cache."""

    def body(carry, layer):
        x_btd, k_all, v_all = carry
        p, window, layer_idx = layer
        written = {}

        def attend(q, k, v, window):
            out, written["k"], written["v"] = attend_with_cache(
                k_all, v_all, layer_idx, q, k, v, window
            )
            return out

        x_btd = _block(config, cos, sin, attend, x_btd, p, window)
        return (x_btd, written["k"], written["v"]), None

    windows = jnp.asarray(config.window_per_layer, jnp.int32)
    layer_ids = jnp.arange(config.num_layers)
    (x, k_all, v_all), _ = jax.lax.scan(
        body, (x, cache.k, cache.v), (params["layers"], windows, layer_ids)
    )
    k_all = shard(k_all, KV_CACHE_AXES)
    v_all = shard(v_all, KV_CACHE_AXES)
    h = rms_norm(x, params["final_norm_d"], config.rms_norm_eps)
    return h, KVCache(k=k_all, v=v_all, segments=segments)


def forward_cached(
    config: DecoderConfig,
    params: Params,
    input_ids: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    segments: Int[Array, "b t"],
    cache: KVCache,
    index: int | Int[Array, ""],
) -> tuple[Float[Array, "b t d"], KVCache]:
    """Final-normed hidden states of `input_ids`, written into the cache at `index`.

    Args:
        config: The model.
        params: Its parameters.
        input_ids: [B, T] new tokens (a left-padded prompt, or one token per row).
        positions: [B, T] their positions (verl's: count of real tokens before them).
        segments: [B, T] 1 for real tokens, 0 for padding.
        cache: The cache; keys [0, index) are already written.
        index: Cache position of the first new token (a traced scalar in the decode loop).

    Returns:
        (hidden states [B, T, D], the updated cache).
    """
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions)
    kv_segments = jax.lax.dynamic_update_slice(
        cache.segments, segments.astype(jnp.int32), (0, index)
    )
    x = _embed(config, params, input_ids)
    dtype = cache.k.dtype

    def attend(k_all, v_all, layer_idx, q, k, v, window):
        # Write only the new tokens in place; read the layer's keys back for attention.
        at = (layer_idx, 0, index, 0, 0)
        k_all = jax.lax.dynamic_update_slice(k_all, k.astype(dtype)[None], at)
        v_all = jax.lax.dynamic_update_slice(v_all, v.astype(dtype)[None], at)
        out = attention(
            q,
            k_all[layer_idx].astype(q.dtype),
            v_all[layer_idx].astype(q.dtype),
            causal=True,
            segment_ids=(segments, kv_segments),
            sliding_window=window,
            q_offset=index,
            implementation=config.attention_impl,
        )
        return out, k_all, v_all

    return _scan_layers(config, params, cos, sin, x, cache, kv_segments, attend)


def decode_step(
    config: DecoderConfig,
    params: Params,
    tokens: Int[Array, " b"],
    positions: Int[Array, " b"],
    cache: KVCache,
    write_index: Int[Array, " b"],
    live: Int[Array, ""],
    block: int,
) -> tuple[Float[Array, "b d"], KVCache]:
    """One token per row, each written at its own cache index, attending to the live prefix.

    Args:
        config: The model.
        params: Its parameters.
        tokens: [B] the rows' newest tokens.
        positions: [B] their positions.
        cache: The cache; row b holds its keys below `write_index[b]` (`segments` marks them).
        write_index: [B] cache index for each row's token.
        live: Bound on `write_index + 1` over all rows: cache blocks at or past it are not read.
        block: Key block of the attention (the cache length is a multiple of it).

    Returns:
        (final-normed hidden states [B, D], the updated cache).
    """
    rows = jnp.arange(tokens.shape[0])
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions[:, None])
    segments = cache.segments.at[rows, write_index].set(1)
    kv_valid = segments > 0
    x = _embed(config, params, tokens[:, None])
    dtype = cache.k.dtype

    def attend(k_all, v_all, layer_idx, q, k, v, window):
        k_all = k_all.at[layer_idx, rows, write_index].set(k[:, 0].astype(dtype))
        v_all = v_all.at[layer_idx, rows, write_index].set(v[:, 0].astype(dtype))
        out = decode_attention(
            q,
            k_all,
            v_all,
            layer_idx,
            kv_valid,
            write_index,
            live=live,
            sliding_window=window,
            block=block,
        )
        return out, k_all, v_all

    h, cache = _scan_layers(config, params, cos, sin, x, cache, segments, attend)
    return h[:, 0], cache
