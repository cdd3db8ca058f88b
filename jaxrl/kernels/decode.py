"""Decode attention: one new query per row against one layer's KV cache, over the live prefix.

    out_b1nh = decode_attention(q_b1nh, k_bkhc, v_bkch, kv_valid_bc, query_index_b,
                                live=live, block=128)
    out_b1nh = decode_attention(q_b1nh, k_lbkhc, v_lbkch, ..., layer=i)   # stacked caches
    out_btnh = extend_attention(q_btnh, k_bkhc, v_bkch, kv_valid_bc, query_index_bt)

With `layer`, the caches are every layer's, stacked [L, ...] as the decode step's scan
carries them, and only the layer's live blocks are sliced out. Each row b attends to the cache
entries s with `kv_valid[b, s]`, `s <= query_index[b]` and
(with a sliding window W) `query_index[b] - s < W`. Rows advance independently (continuous
batching): `query_index` is per row. Keys come transposed, [B, K, H, C], and values as
[B, K, C, H], so both matmuls (scores q·k over H, output p·v over C) take the buffers as they
are. With `block` equal to the cache length C the whole cache is read in one pass (no loop, no
copy: the cheapest on a CPU for short caches); otherwise keys are read in blocks of `block`
entries and only the blocks below `live` (a traced bound on every row's `query_index + 1`) are
read at all, so a step early in generation costs attention over the prompt, not over the whole
preallocated cache. The queries are scaled before the dot, so a block's scores are
x = (scale · q)·k; with a logit soft-cap c (Gemma 2) they are capped to c · tanh(x / c) after the
dot, before the mask. Blocks are combined with the online softmax of flash attention: a block's
scores x give its max m_j, normaliser l_j = sum_s e^{x_s - m_j} and output
o_j = sum_s e^{x_s - m_j} v_s, and with m = max(m_1, m_2)

    l = l_1 e^{m_1 - m} + l_2 e^{m_2 - m},   o = o_1 e^{m_1 - m} + o_2 e^{m_2 - m},   out = o / l.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrl.kernels.blockwise import check_softcap, softcap

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)

_Partial = tuple[Float[Array, "b k g"], Float[Array, "b k g"], Float[Array, "b k g h"]]


def _attend_block(
    q_bkgh: Array,
    k_bkhs: Array,
    v_bksh: Array,
    ok_bs: Bool[Array, "b s"],
    cap: float | None = None,
) -> _Partial:
    """(m, l, o) of one block of keys (see the module doc), in float32; `q_bkgh` is scaled
    already, `cap` the logit soft-cap (None: off)."""
    x = jnp.einsum("bkgh,bkhs->bkgs", q_bkgh, k_bkhs, preferred_element_type=jnp.float32)
    if cap is not None:
        x = softcap(x, cap)
    ok = ok_bs[:, None, None]
    x = jnp.where(ok, x, _MASKED)
    m = x.max(axis=-1)
    p = jnp.where(ok, jnp.exp(x - m[..., None]), 0.0)
    o = jnp.einsum(
        "bkgs,bksh->bkgh", p.astype(v_bksh.dtype), v_bksh, preferred_element_type=jnp.float32
    )
    return m, p.sum(axis=-1), o


def _merge(a: _Partial, b: _Partial) -> _Partial:
    """The (m, l, o) of two blocks together (the module doc's combination)."""
    m = jnp.maximum(a[0], b[0])
    ca, cb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    return m, a[1] * ca + b[1] * cb, a[2] * ca[..., None] + b[2] * cb[..., None]


def decode_attention(
    q: Float[Array, "b 1 n h"],
    k_cache: Float[Array, "b k h c"],
    v_cache: Float[Array, "b k c h"],
    kv_valid: Bool[Array, "b c"],
    query_index: Int[Array, " b"],
    *,
    live: Int[Array, ""] | int,
    sliding_window: Int[Array, ""] | int | None = None,
    softmax_scale: float | None = None,
    block: int = 128,
    layer: Int[Array, ""] | int | None = None,
    logit_softcap: float | None = None,
) -> Float[Array, "b 1 n h"]:
    """Attention of one query per row over the cache's live blocks (see the module doc).

    Args:
        q: Queries [B, 1, N, H].
        k_cache: One layer's keys, transposed: [B, K, H, C], C a multiple of `block`; with
            `layer`, every layer's, stacked: [L, B, K, H, C].
        v_cache: Its values [B, K, C, H] ([L, B, K, C, H] with `layer`).
        kv_valid: [B, C] True where a real token's key is stored.
        query_index: [B] cache index of each row's query token.
        live: Read blocks up to this cache index (exclusive); >= max(query_index) + 1.
        sliding_window: Keys further back than this many positions are masked (None: off).
        softmax_scale: Score scale; default 1/sqrt(H).
        block: Keys per block; C: the whole cache in one pass.
        layer: Which layer of stacked caches to read (only its live blocks are sliced out).
        logit_softcap: Cap c of the scaled scores x, c · tanh(x / c) (a python float > 0; None:
            off).

    Returns:
        [B, 1, N, H] in the dtype of `q`.
    """
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    b, t, n, h = q.shape
    _, _, kv_heads, _, c = k_cache.shape
    if t != 1:
        raise ValueError(f"decode_attention takes one query per row, got {t}")
    if c % block:
        raise ValueError(f"cache length {c} must be a multiple of block={block}")
    scale = h**-0.5 if softmax_scale is None else softmax_scale
    cap = check_softcap(logit_softcap)
    q_bkgh = (q.reshape(b, kv_heads, n // kv_heads, h) * scale).astype(k_cache.dtype)

    def allowed(start: Array | int, size: int) -> Bool[Array, "b s"]:
        idx = start + jnp.arange(size)
        ok = jax.lax.dynamic_slice_in_dim(kv_valid, start, size, axis=1)
        ok &= idx[None] <= query_index[:, None]
        if sliding_window is not None:
            ok &= query_index[:, None] - idx[None] < sliding_window
        return ok

    def keys(start: Array | int, size: int) -> tuple[Array, Array]:
        """Keys [B, K, H, size] and values [B, K, size, H] of `layer` from cache index `start`."""
        k = jax.lax.dynamic_slice(k_cache, (layer, 0, 0, 0, start), (1, b, kv_heads, h, size))
        v = jax.lax.dynamic_slice(v_cache, (layer, 0, 0, start, 0), (1, b, kv_heads, size, h))
        return k[0], v[0]

    if block == c:
        _, l, o = _attend_block(q_bkgh, *keys(0, c), allowed(0, c), cap)
    else:

        def body(i, carry):
            start = i * block
            block_mlo = _attend_block(q_bkgh, *keys(start, block), allowed(start, block), cap)
            return _merge(carry, block_mlo)

        g = n // kv_heads
        init = (
            jnp.full((b, kv_heads, g), _MASKED, jnp.float32),
            jnp.zeros((b, kv_heads, g), jnp.float32),
            jnp.zeros((b, kv_heads, g, h), jnp.float32),
        )
        num_blocks = jnp.minimum((live + block - 1) // block, c // block)
        _, l, o = jax.lax.fori_loop(0, num_blocks, body, init)
    out = o / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(b, 1, n, h).astype(q.dtype)


def extend_attention(
    q: Float[Array, "b t n h"],
    k_cache: Float[Array, "b k h c"],
    v_cache: Float[Array, "b k c h"],
    kv_valid: Bool[Array, "b c"],
    query_index: Int[Array, "b t"],
    *,
    sliding_window: Int[Array, ""] | int | None = None,
    softmax_scale: float | None = None,
    logit_softcap: float | None = None,
) -> Float[Array, "b t n h"]:
    """Attention of T new queries per row over the whole cache (the tokens appended to a
    conversation: their keys are in the cache already). Query t of row b, at cache index
    `query_index[b, t]`, attends to the entries s with `kv_valid[b, s]`, `s <= query_index[b, t]`
    and (with a window W) `query_index[b, t] - s < W`; scores (capped to c · tanh(x / c) with
    `logit_softcap` c, as `decode_attention`) and softmax in float32.

    Returns:
        [B, T, N, H] in the dtype of `q`.
    """
    b, t, n, h = q.shape
    kv_heads, c = k_cache.shape[1], k_cache.shape[3]
    scale = h**-0.5 if softmax_scale is None else softmax_scale
    cap = check_softcap(logit_softcap)
    q_btkgh = (q.reshape(b, t, kv_heads, n // kv_heads, h) * scale).astype(k_cache.dtype)
    x = jnp.einsum("btkgh,bkhs->btkgs", q_btkgh, k_cache, preferred_element_type=jnp.float32)
    if cap is not None:
        x = softcap(x, cap)
    s = jnp.arange(c)
    ok = kv_valid[:, None, :] & (s[None, None] <= query_index[..., None])
    if sliding_window is not None:
        ok &= query_index[..., None] - s[None, None] < sliding_window
    x = jnp.where(ok[:, :, None, None], x, _MASKED)
    p = jax.nn.softmax(x, axis=-1)
    o = jnp.einsum(
        "btkgs,bksh->btkgh", p.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32
    )
    return o.reshape(b, t, n, h).astype(q.dtype)
