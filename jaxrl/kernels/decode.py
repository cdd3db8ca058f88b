"""Decode attention: one new query per row against a KV cache, over the live prefix only.

    out_b1nh = decode_attention(q_b1nh, k_lbskh, v_lbskh, layer, kv_valid_bs, query_index_b,
                                live=live, block=128)

Each row b attends to the cache entries s with `kv_valid[b, s]`, `s <= query_index[b]` and
(with a sliding window W) `query_index[b] - s < W`. Rows advance independently (continuous
batching): `query_index` is per row. Keys are read in blocks of `block` entries, and only the
blocks below `live` (a traced bound on every row's `query_index + 1`) are read at all, so a
step early in generation costs attention over the prompt, not over the whole preallocated
cache. Blocks are combined with the online softmax of flash attention: with running max m,
normaliser l and accumulator o,

    m' = max(m, max_s x_s),  l' = l e^{m - m'} + sum_s e^{x_s - m'},
    o' = o e^{m - m'} + sum_s e^{x_s - m'} v_s,     out = o / l.

The cache is the whole stack [L, B, S, K, H] plus a layer index, so a block is sliced straight
out of it (no copy of the layer's cache per step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def decode_attention(
    q: Float[Array, "b 1 n h"],
    k_cache: Float[Array, "l b s k h"],
    v_cache: Float[Array, "l b s k h"],
    layer: Int[Array, ""] | int,
    kv_valid: Bool[Array, "b s"],
    query_index: Int[Array, " b"],
    *,
    live: Int[Array, ""] | int,
    sliding_window: Int[Array, ""] | int | None = None,
    softmax_scale: float | None = None,
    block: int = 128,
) -> Float[Array, "b 1 n h"]:
    """Attention of one query per row over the cache's live blocks (see the module doc).

    Args:
        q: Queries [B, 1, N, H].
        k_cache: Keys of every layer [L, B, S, K, H], S a multiple of `block`.
        v_cache: Values, like `k_cache`.
        layer: Which layer's keys to read.
        kv_valid: [B, S] True where a real token's key is stored.
        query_index: [B] cache index of each row's query token.
        live: Read blocks up to this cache index (exclusive); >= max(query_index) + 1.
        sliding_window: Keys further back than this many positions are masked (None: off).
        softmax_scale: Score scale; default 1/sqrt(H).
        block: Keys per block.

    Returns:
        [B, 1, N, H] in the dtype of `q`.
    """
    b, t, n, h = q.shape
    _, _, s, kv_heads, _ = k_cache.shape
    if t != 1:
        raise ValueError(f"decode_attention takes one query per row, got {t}")
    if s % block:
        raise ValueError(f"cache length {s} must be a multiple of block={block}")
    scale = h**-0.5 if softmax_scale is None else softmax_scale
    q_bkgh = (q.reshape(b, kv_heads, n // kv_heads, h) * scale).astype(k_cache.dtype)
    num_blocks = jnp.minimum((live + block - 1) // block, s // block)

    def body(i, carry):
        m, l, o = carry
        start = i * block
        at = (layer, 0, start, 0, 0)
        size = (1, b, block, kv_heads, h)
        k = jax.lax.dynamic_slice(k_cache, at, size)[0]
        v = jax.lax.dynamic_slice(v_cache, at, size)[0]
        idx = start + jnp.arange(block)
        ok = jax.lax.dynamic_slice_in_dim(kv_valid, start, block, axis=1)
        ok &= idx[None] <= query_index[:, None]
        if sliding_window is not None:
            ok &= query_index[:, None] - idx[None] < sliding_window
        x = jnp.einsum("bkgh,bskh->bkgs", q_bkgh, k, preferred_element_type=jnp.float32)
        x = jnp.where(ok[:, None, None], x, _MASKED)
        m_new = jnp.maximum(m, x.max(axis=-1))
        p = jnp.where(ok[:, None, None], jnp.exp(x - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        pv = jnp.einsum("bkgs,bskh->bkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l, o * correction[..., None] + pv

    g = n // kv_heads
    init = (
        jnp.full((b, kv_heads, g), _MASKED, jnp.float32),
        jnp.zeros((b, kv_heads, g), jnp.float32),
        jnp.zeros((b, kv_heads, g, h), jnp.float32),
    )
    _, l, o = jax.lax.fori_loop(0, num_blocks, body, init)
    out = o / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(b, 1, n, h).astype(q.dtype)
