"""Blockwise (flash-style) attention in plain `jax.numpy`: O(T) memory forward and backward.

Queries are processed in blocks of `block_q` rows; for each, keys stream by in blocks of
`block_k` with an online softmax. With row maximum m, normaliser l and accumulator a:

    s_j   = scale · q k_jᵀ  (capped: c · tanh(s_j / c); then masked entries -> -inf)
    m'    = max(m, rowmax s_j)
    l'    = l · e^(m - m') + rowsum e^(s_j - m')
    a'    = a · e^(m - m') + e^(s_j - m') v_j
    out   = a / l,   lse = m + log l

Only key blocks that can hold an admissible key are visited (causal and sliding-window block
skipping, bounds computed from the offsets at run time, so offsets may be traced).

The backward pass recomputes p = exp(s - lse) block by block (flash-attention 2), with
D = rowsum(dout ⊙ out):

    dv = pᵀ dout,   dp = dout vᵀ,   ds = p ⊙ (dp - D + dlse),
    dq = scale · ds k,   dk = scale · dsᵀ q

With Gemma 2's logit soft-cap c (`logit_softcap`), the scores are s = c · tanh(scale · q kᵀ / c)
and ds above is the gradient in the capped scores; through the tanh it becomes
ds ⊙ (1 - (s / c)²) before the products with k and q.

The `+ dlse` term is the cotangent of the returned log-sum-exp (∂lse/∂s = p); ring attention
calls the backward with the global (out, lse) of the whole ring. Grouped-query heads are
computed as [K, G] without repeating k and v. A row with no admissible key yields out = 0 and
lse = NEG_INF.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

# The log-sum-exp of a row with no admissible key (finite, so merging never makes NaN).
NEG_INF = -1e30
# A sliding window that never binds.
NO_WINDOW = 2**30


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Static parts of an attention problem (hashable, a `custom_vjp` nondiff argument)."""

    causal: bool
    scale: float
    block_q: int
    block_k: int
    softcap: float | None = None


def check_softcap(logit_softcap) -> float | None:
    """`logit_softcap` as a python float (None: no cap); refuses a traced or non-positive one."""
    if logit_softcap is None:
        return None
    if isinstance(logit_softcap, bool) or not isinstance(
        logit_softcap, int | float | np.integer | np.floating
    ):
        raise ValueError(
            f"logit_softcap must be a python float (static) or None, got {logit_softcap!r}"
        )
    if not logit_softcap > 0:
        raise ValueError(f"logit_softcap={logit_softcap} must be > 0 (None: no cap)")
    return float(logit_softcap)


def softcap(s: Array, cap: float) -> Array:
    """Gemma 2's logit soft-cap, cap · tanh(s / cap): scores squashed into (-cap, cap)."""
    return cap * jnp.tanh(s / cap)


def softcap_grad(s_capped: Array, cap: float) -> Array:
    """∂softcap/∂s from the capped score: tanh' = 1 - (s_capped / cap)², clamped at 0 (masked
    NEG_INF scores give 0 rather than -inf, so p = 0 there keeps ds = 0)."""
    t = s_capped / cap
    return jnp.maximum(1.0 - t * t, 0.0)


def _masks(spec: MaskSpec, aux: dict, qi, kj) -> Array:
    """Admissible pairs [B, bq, bk] of query block `qi` and key block `kj`."""
    bq, bk = spec.block_q, spec.block_k
    pq = qi * bq + jnp.arange(bq) + aux["q_offset"]
    pk = kj * bk + jnp.arange(bk) + aux["kv_offset"]
    ok = (pk[None, :] < aux["kv_end"]) & (pq[:, None] - pk[None, :] < aux["window"])
    if spec.causal:
        ok &= pk[None, :] <= pq[:, None]
    seg_q = jax.lax.dynamic_slice_in_dim(aux["seg_q"], qi * bq, bq, axis=1)
    seg_k = jax.lax.dynamic_slice_in_dim(aux["seg_kv"], kj * bk, bk, axis=1)
    return ok[None] & (seg_q[:, :, None] == seg_k[:, None, :])


def _kv_range(spec: MaskSpec, aux: dict, qi, n_kv: int):
    """[lo, hi) of the key blocks query block `qi` can see."""
    bq, bk = spec.block_q, spec.block_k
    first = qi * bq + aux["q_offset"] - aux["kv_offset"]  # first query, in key indices
    last = first + bq - 1
    lo = jnp.clip((first - aux["window"] + 1) // bk, 0, n_kv)
    hi = jnp.clip(last // bk + 1, 0, n_kv) if spec.causal else n_kv
    return lo, jnp.maximum(lo, hi)


def _q_range(spec: MaskSpec, aux: dict, kj, n_q: int):
    """[lo, hi) of the query blocks that can see key block `kj`."""
    bq, bk = spec.block_q, spec.block_k
    first = kj * bk + aux["kv_offset"] - aux["q_offset"]  # first key, in query indices
    last = first + bk - 1
    lo = jnp.clip(first // bq, 0, n_q) if spec.causal else 0
    hi = jnp.clip((last + aux["window"] - 1) // bq + 1, 0, n_q)
    return lo, jnp.maximum(lo, hi)


def _block(x, i, size):
    return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=1)


def _scores(spec, q_blk, k_blk, mask):
    """Masked (and capped, with `spec.softcap`) scores [B, K, G, bq, bk] in float32."""
    s = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32)
    s = s * spec.scale
    if spec.softcap is not None:
        s = softcap(s, spec.softcap)
    return jnp.where(mask[:, None, None], s, NEG_INF)


def _forward(spec: MaskSpec, q, k, v, aux):
    """Padded inputs: q [B, Tp, K, G, H], k/v [B, Sp, K, H] -> out like q, lse [B, Tp, K, G]."""
    b, t, kh, g, h = q.shape
    n_q, n_kv = t // spec.block_q, k.shape[1] // spec.block_k

    def q_block(qi):
        q_blk = _block(q, qi, spec.block_q)

        def kv_step(kj, carry):
            m, l, acc = carry
            mask = _masks(spec, aux, qi, kj)
            s = _scores(spec, q_blk, _block(k, kj, spec.block_k), mask)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            v_blk = _block(v, kj, spec.block_k)
            pv = jnp.einsum(
                "bkgqs,bskh->bkgqh", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32
            )
            return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

        init = (
            jnp.full((b, kh, g, spec.block_q), NEG_INF, jnp.float32),
            jnp.zeros((b, kh, g, spec.block_q), jnp.float32),
            jnp.zeros((b, kh, g, spec.block_q, h), jnp.float32),
        )
        lo, hi = _kv_range(spec, aux, qi, n_kv)
        m, l, acc = jax.lax.fori_loop(lo, hi, kv_step, init)
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
        return out.transpose(0, 3, 1, 2, 4), lse.transpose(0, 3, 1, 2)

    out, lse = jax.lax.map(q_block, jnp.arange(n_q))  # [nq, B, bq, K, G, (H)]
    out = jnp.moveaxis(out, 0, 1).reshape(b, t, kh, g, h).astype(q.dtype)
    return out, jnp.moveaxis(lse, 0, 1).reshape(b, t, kh, g)


def _backward(spec: MaskSpec, q, k, v, out, lse, dout, dlse, aux):
    """Padded inputs as `_forward`; returns dq (float32), dk, dv (float32)."""
    b, t, kh, _, h = q.shape
    n_q, n_kv = t // spec.block_q, k.shape[1] // spec.block_k
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)  # [B, Tp, K, G]
    if dlse is not None:
        delta = delta - dlse

    def kv_block(dq, kj):
        k_blk, v_blk = _block(k, kj, spec.block_k), _block(v, kj, spec.block_k)

        def q_step(qi, carry):
            dq, dk, dv = carry
            mask = _masks(spec, aux, qi, kj)
            q_blk, do_blk = _block(q, qi, spec.block_q), _block(dout, qi, spec.block_q)
            lse_blk = _block(lse, qi, spec.block_q).transpose(0, 2, 3, 1)  # [B, K, G, bq]
            s = _scores(spec, q_blk, k_blk, mask)
            p = jnp.where(mask[:, None, None], jnp.exp(s - lse_blk[..., None]), 0.0)
            dv = dv + jnp.einsum(
                "bkgqs,bqkgh->bskh",
                p.astype(dout.dtype),
                do_blk,
                preferred_element_type=jnp.float32,
            )
            dp = jnp.einsum("bqkgh,bskh->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
            d_blk = _block(delta, qi, spec.block_q).transpose(0, 2, 3, 1)
            ds = p * (dp - d_blk[..., None])
            if spec.softcap is not None:
                ds = ds * softcap_grad(s, spec.softcap)  # through the cap's tanh
            ds = (ds * spec.scale).astype(q.dtype)
            dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, q_blk, preferred_element_type=jnp.float32)
            dq_blk = jnp.einsum("bkgqs,bskh->bqkgh", ds, k_blk, preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_slice_in_dim(
                dq, _block(dq, qi, spec.block_q) + dq_blk, qi * spec.block_q, axis=1
            )
            return dq, dk, dv

        zeros = jnp.zeros((b, spec.block_k, kh, h), jnp.float32)
        lo, hi = _q_range(spec, aux, kj, n_q)
        dq, dk, dv = jax.lax.fori_loop(lo, hi, q_step, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(kv_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(n_kv))
    dk = jnp.moveaxis(dk, 0, 1).reshape(k.shape)
    dv = jnp.moveaxis(dv, 0, 1).reshape(v.shape)
    return dq, dk, dv


# ----------------------------------------------------------------- padding and the public API


def _prepare(q, k, v, segment_ids_q, segment_ids_kv, sliding_window, q_offset, kv_offset, bq, bk):
    """Pads to whole blocks and splits query heads into [K, G]; returns (q, k, v, aux)."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    q5 = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0))).reshape(b, tp, kh, n // kh, h)
    pad_kv = ((0, 0), (0, sp - s), (0, 0), (0, 0))
    seg_q = jnp.zeros((b, t), jnp.int32) if segment_ids_q is None else segment_ids_q
    seg_kv = jnp.zeros((b, s), jnp.int32) if segment_ids_kv is None else segment_ids_kv
    aux = {
        "seg_q": jnp.pad(seg_q.astype(jnp.int32), ((0, 0), (0, tp - t))),
        "seg_kv": jnp.pad(seg_kv.astype(jnp.int32), ((0, 0), (0, sp - s))),
        "window": jnp.asarray(NO_WINDOW if sliding_window is None else sliding_window, jnp.int32),
        "q_offset": jnp.asarray(q_offset, jnp.int32),
        "kv_offset": jnp.asarray(kv_offset, jnp.int32),
    }
    aux["kv_end"] = aux["kv_offset"] + s  # keys past the real ones are padding
    return q5, jnp.pad(k, pad_kv), jnp.pad(v, pad_kv), aux


def _check(q, k, v, segment_ids_q, segment_ids_kv, block_q, block_k, q_offset, kv_offset):
    b, t, n, h = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != h:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B, S, K, H] matching q {q.shape}")
    if n % k.shape[2]:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({k.shape[2]})")
    if (segment_ids_q is None) != (segment_ids_kv is None):
        raise ValueError("give segment ids for both queries and keys, or for neither")
    if segment_ids_q is not None and (
        segment_ids_q.shape != (b, t) or segment_ids_kv.shape != (b, k.shape[1])
    ):
        raise ValueError(
            f"segment ids must be [B, T]={(b, t)} for queries and [B, S]={(b, k.shape[1])} for "
            f"keys, got {segment_ids_q.shape} and {segment_ids_kv.shape}"
        )
    for name, offset in (("q_offset", q_offset), ("kv_offset", kv_offset)):
        if jnp.ndim(offset) != 0:
            raise ValueError(
                f"{name} must be one integer for the batch, got shape {jnp.shape(offset)}"
            )
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size < 1:
            raise ValueError(f"{name} must be a positive number of rows, got {size}")


def _unpad(q, out5, lse5):
    b, t, n, h = q.shape
    return out5.reshape(b, -1, n, h)[:, :t], lse5.reshape(b, -1, n)[:, :t]


def blockwise_forward(
    q: Float[Array, "b t n h"],
    k: Float[Array, "b s k h"],
    v: Float[Array, "b s k h"],
    *,
    causal: bool = True,
    segment_ids_q: Int[Array, "b t"] | None = None,
    segment_ids_kv: Int[Array, "b s"] | None = None,
    sliding_window: int | Int[Array, ""] | None = None,
    scale: float,
    q_offset: int | Int[Array, ""] = 0,
    kv_offset: int | Int[Array, ""] = 0,
    block_q: int = 512,
    block_k: int = 512,
    logit_softcap: float | None = None,
) -> tuple[Float[Array, "b t n h"], Float[Array, "b t n"]]:
    """(out [B, T, N, H] in q's dtype, lse [B, T, N] float32), no gradient rule.

    Query row t sits at position `t + q_offset`, key row s at `s + kv_offset`; key s is
    admissible for query t when (not causal or pos_k <= pos_q), pos_q - pos_k <
    sliding_window, and the segment ids are equal. With `logit_softcap` c (a python float > 0)
    the scores scale · q·k are capped to c · tanh(scale · q·k / c) before the mask.
    """
    _check(q, k, v, segment_ids_q, segment_ids_kv, block_q, block_k, q_offset, kv_offset)
    bq, bk = min(block_q, q.shape[1]), min(block_k, k.shape[1])
    spec = MaskSpec(causal, float(scale), bq, bk, check_softcap(logit_softcap))
    q5, kp, vp, aux = _prepare(
        q, k, v, segment_ids_q, segment_ids_kv, sliding_window, q_offset, kv_offset, bq, bk
    )
    return _unpad(q, *_forward(spec, q5, kp, vp, aux))


def blockwise_backward(
    q,
    k,
    v,
    out,
    lse,
    dout,
    dlse=None,
    *,
    causal=True,
    segment_ids_q=None,
    segment_ids_kv=None,
    sliding_window=None,
    scale: float,
    q_offset=0,
    kv_offset=0,
    block_q: int = 512,
    block_k: int = 512,
    logit_softcap: float | None = None,
):
    """(dq, dk, dv) in the inputs' dtypes, given the attention's (out, lse) [B, T, N(, H)], the
    cotangent `dout` and optionally `dlse`; arguments as `blockwise_forward`."""
    _check(q, k, v, segment_ids_q, segment_ids_kv, block_q, block_k, q_offset, kv_offset)
    b, t, n, h = q.shape
    bq, bk = min(block_q, t), min(block_k, k.shape[1])
    spec = MaskSpec(causal, float(scale), bq, bk, check_softcap(logit_softcap))
    q5, kp, vp, aux = _prepare(
        q, k, v, segment_ids_q, segment_ids_kv, sliding_window, q_offset, kv_offset, bq, bk
    )
    tp, kh = q5.shape[1], k.shape[2]

    def to5(x, dtype=None):
        x = jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(b, tp, kh, n // kh, *x.shape[3:])

    dlse5 = None if dlse is None else to5(dlse.astype(jnp.float32))
    dq, dk, dv = _backward(
        spec, q5, kp, vp, to5(out), to5(lse), to5(dout.astype(q.dtype)), dlse5, aux
    )
    s = k.shape[1]
    return (
        dq.reshape(b, tp, n, h)[:, :t].astype(q.dtype),
        dk[:, :s].astype(k.dtype),
        dv[:, :s].astype(v.dtype),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, aux, static):
    return blockwise_forward(q, k, v, **aux, **_static_kwargs(static))


def _static_kwargs(static: tuple) -> dict:
    names = ("causal", "scale", "block_q", "block_k", "logit_softcap")
    return dict(zip(names, static, strict=True))


def _attention_fwd(q, k, v, aux, static):
    out, lse = blockwise_forward(q, k, v, **aux, **_static_kwargs(static))
    return (out, lse), (q, k, v, out, lse, aux)


def _attention_bwd(static, residuals, cotangents):
    q, k, v, out, lse, aux = residuals
    dout, dlse = cotangents
    grads = blockwise_backward(q, k, v, out, lse, dout, dlse, **aux, **_static_kwargs(static))
    return (*grads, jax.tree.map(lambda _: None, aux))


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(
    q: Float[Array, "b t n h"],
    k: Float[Array, "b s k h"],
    v: Float[Array, "b s k h"],
    *,
    causal: bool = True,
    segment_ids_q: Int[Array, "b t"] | None = None,
    segment_ids_kv: Int[Array, "b s"] | None = None,
    sliding_window: int | Int[Array, ""] | None = None,
    scale: float,
    q_offset: int | Int[Array, ""] = 0,
    kv_offset: int | Int[Array, ""] = 0,
    block_q: int = 512,
    block_k: int = 512,
    logit_softcap: float | None = None,
) -> tuple[Float[Array, "b t n h"], Float[Array, "b t n"]]:
    """`blockwise_forward` with a recomputing backward (a `custom_vjp`): (out, lse).

    Memory is O(T) in both passes: only one [bq, bk] score block per head exists at a time.
    """
    aux = {
        "segment_ids_q": segment_ids_q,
        "segment_ids_kv": segment_ids_kv,
        "sliding_window": None if sliding_window is None else jnp.asarray(sliding_window),
        "q_offset": jnp.asarray(q_offset, jnp.int32),
        "kv_offset": jnp.asarray(kv_offset, jnp.int32),
    }
    static = (causal, float(scale), block_q, block_k, check_softcap(logit_softcap))
    return _attention(q, k, v, aux, static)
