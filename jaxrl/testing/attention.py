"""A dense attention oracle for the kernel tests, with the masks of `jaxrl.kernels.attention`."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from jaxrl.kernels.blockwise import NEG_INF


def dense_attention(
    q,
    k,
    v,
    *,
    scale,
    causal=True,
    seg_q=None,
    seg_k=None,
    window=None,
    q_offset=0,
    kv_offset=0,
    xp=jnp,
):
    """Dense float32 attention with the same mask semantics: (out [B,T,N,H], lse [B,T,N]).
    `xp=np` evaluates it in numpy (no compile: the forward checks), `jnp` differentiates it."""
    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    f32 = [xp.asarray(x, xp.float32) for x in (q, k, v)]
    kk, vv = (xp.repeat(x, n // kh, axis=2) for x in f32[1:])
    einsum = functools.partial(xp.einsum, precision="highest") if xp is jnp else np.einsum
    scores = einsum("btnh,bsnh->bnts", f32[0], kk) * scale
    pq = xp.arange(t)[:, None] + q_offset
    pk = xp.arange(s)[None, :] + kv_offset
    mask = xp.ones((b, t, s), bool)
    if causal:
        mask &= (pk <= pq)[None]
    if window is not None:
        mask &= (pq - pk < window)[None]
    if seg_q is not None:
        mask &= xp.asarray(seg_q)[:, :, None] == xp.asarray(seg_k)[:, None, :]
    mask = mask[:, None]
    seen = mask.any(-1)
    m = xp.where(seen, xp.max(xp.where(mask, scores, -xp.inf), -1), 0.0)
    e = xp.where(mask, xp.exp(scores - m[..., None]), 0.0)
    l = xp.where(seen, e.sum(-1), 1.0)
    lse = xp.where(seen, m + xp.log(l), NEG_INF)
    out = einsum("bnts,bsnh->btnh", e / l[..., None], vv)
    return out, xp.swapaxes(lse, 1, 2)
