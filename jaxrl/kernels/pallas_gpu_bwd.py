"""Backward flash-attention kernels for `pallas_gpu` (flash-attention 2): one kernel for dq
(grid over query blocks, keys streamed), one for dk and dv (grid over key blocks and kv heads;
the G query heads of the group and the query blocks streamed, so grouped-query gradients are
summed in float32 inside the kernel, without repeating k and v).

With p = exp(s - lse) recomputed from q, k and the saved lse, and D = rowsum(dout ⊙ out):

    dv = pᵀ dout,   dp = dout vᵀ,   ds = p ⊙ (dp - D + dlse),
    dq = scale · ds k,   dk = scale · dsᵀ q

(the `+ dlse` term is the cotangent of the returned log-sum-exp: ∂lse/∂s = p). `D - dlse` is
formed once outside the kernels, so they see a single per-row vector. With a logit soft-cap c,
s = c · tanh(scale · q kᵀ / c) and ds goes through the tanh: ds ⊙ (1 - (s / c)²).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl.kernels.blockwise import softcap_grad
from jaxrl.kernels.pallas_gpu_fwd import (
    LOG2_E,
    KernelConfig,
    admissible,
    cdiv0,
    dot,
    dot_t,
    fdiv0,
    key_block_ranges,
    q_block_index,
    scores2,
)


def query_block_ranges(cfg: KernelConfig, params_ref, k_start, num_q_blocks: int):
    """Query blocks a key block [k_start, k_start + block_k) must visit: [lo, hi), and the
    mask-free sub-range [a, b). Mirror image of `key_block_ranges` (d = q_offset - kv_offset:
    query row t sees key row s iff (causal) t >= s - d and (window) t < s - d + W)."""
    bq, bk = cfg.block_q, cfg.block_k
    d = params_ref[0] - params_ref[1]
    nq = jnp.int32(num_q_blocks)
    if cfg.causal:
        lo = fdiv0(k_start - d, bq)  # first query row that sees the block's first key
        a = cdiv0(k_start + bk - 1 - d, bq)  # blocks whose first query sees the last key
    else:
        lo, a = jnp.int32(0), jnp.int32(0)
    if cfg.has_window:
        w = params_ref[2]
        hi = jnp.minimum(fdiv0(k_start + bk - 2 - d + w + bq, bq), nq)
        b = fdiv0(w + k_start - d, bq)  # blocks whose last query still sees the first key
    else:
        hi, b = nq, nq
    lo = jnp.minimum(lo, hi)
    if cfg.s % bk:  # a key block holding padding needs the mask everywhere
        b = jnp.where(k_start + bk <= cfg.s, b, 0)
    if cfg.has_segments:
        a = b = hi
    a = jnp.clip(a, lo, hi)
    b = jnp.clip(b, a, hi)
    return lo, a, b, hi


def _dq_kernel(
    params_ref,
    q_ref,
    k_ref,
    v_ref,
    segq_ref,
    segk_ref,
    do_ref,
    lse_ref,
    dd_ref,
    dq_ref,
    *,
    cfg,
    nq,
    nk,
):
    bq, bk = cfg.block_q, cfg.block_k
    q_start = q_block_index(cfg, pl.program_id(0), nq) * bq
    q, do = q_ref[...], do_ref[...]
    lse2 = lse_ref[...] * LOG2_E
    dd = dd_ref[...]
    q_row = q_start + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    seg_q = segq_ref[...][:, None] if cfg.has_segments else None

    def body(j, dq, masked: bool):
        k_start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k_start, bk), :]
        v = v_ref[pl.ds(k_start, bk), :]
        s2, s = scores2(cfg, q, k)
        p = jnp.exp2(s2 - lse2[:, None])  # [bq, bk]
        if masked:
            k_row = k_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            seg_k = segk_ref[pl.ds(k_start, bk)][None, :] if cfg.has_segments else None
            mask = admissible(cfg, params_ref, q_row, k_row, seg_q, seg_k)
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
        ds = p * (dot_t(do, v) - dd[:, None])
        if s is not None:  # through the soft-cap's tanh
            ds = ds * softcap_grad(s, cfg.softcap)
        return dq + dot(ds.astype(k.dtype), k)

    lo, a, b, hi = key_block_ranges(cfg, params_ref, q_start, nk)
    dq = jnp.zeros(q.shape, jnp.float32)
    dq = lax.fori_loop(lo, a, functools.partial(body, masked=True), dq)
    dq = lax.fori_loop(a, b, functools.partial(body, masked=False), dq)
    dq = lax.fori_loop(b, hi, functools.partial(body, masked=True), dq)
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(
    params_ref,
    q_ref,
    k_ref,
    v_ref,
    segq_ref,
    segk_ref,
    do_ref,
    lse_ref,
    dd_ref,
    dk_ref,
    dv_ref,
    *,
    cfg,
    nq,
):
    # Transposed orientation ([bk, bq] tiles) so no tile needs a transpose before its matmul.
    bq, bk = cfg.block_q, cfg.block_k
    k_start = pl.program_id(0) * bk
    k, v = k_ref[...], v_ref[...]
    k_row = k_start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
    seg_k = segk_ref[...][:, None] if cfg.has_segments else None
    lo, a, b, hi = query_block_ranges(cfg, params_ref, k_start, nq)

    def head(g, carry):
        def body(i, carry, masked: bool):
            dk, dv = carry
            q_start = pl.multiple_of(i * bq, bq)
            rows = pl.ds(q_start, bq)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            st2, st = scores2(cfg, k, q)  # [bk, bq]
            pt = jnp.exp2(st2 - (lse_ref[g, rows] * LOG2_E)[None, :])
            if masked:
                q_row = q_start + lax.broadcasted_iota(jnp.int32, (1, bq), 1)
                seg_q = segq_ref[rows][None, :] if cfg.has_segments else None
                mask = admissible(cfg, params_ref, q_row, k_row, seg_q, seg_k)
                if mask is not None:
                    pt = jnp.where(mask, pt, 0.0)
            dv = dv + dot(pt.astype(do.dtype), do)
            dst = pt * (dot_t(v, do) - dd_ref[g, rows][None, :])
            if st is not None:  # through the soft-cap's tanh
                dst = dst * softcap_grad(st, cfg.softcap)
            dk = dk + dot(dst.astype(q.dtype), q)
            return dk, dv

        carry = lax.fori_loop(lo, a, functools.partial(body, masked=True), carry)
        carry = lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
        return lax.fori_loop(b, hi, functools.partial(body, masked=True), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, cfg.g, head, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def flash_bwd(cfg: KernelConfig, params, q, k, v, seg_q, seg_k, out, lse, dout, dlse):
    """Padded backward. q/out/dout [B, Tp, N, Hp], k/v [B, Sp, K, Hp], lse/dlse [B, N, Tp]
    float32 (dlse may be None) -> dq, dk, dv shaped and typed like q, k, v."""
    b, tp, n, hp = q.shape
    sp, kh = k.shape[1], k.shape[2]
    bq, bk, g = cfg.block_q, cfg.block_k, cfg.g
    nq, nk = tp // bq, sp // bk
    delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)

    def qi(i):
        return q_block_index(cfg, i, nq)

    params_spec = pl.BlockSpec((4,), lambda *_: (0,))
    q_block = pl.BlockSpec((None, bq, None, hp), lambda i, bi, h: (bi, qi(i), h, 0))
    kv_full = pl.BlockSpec((None, sp, None, hp), lambda i, bi, h: (bi, 0, lax.div(h, g), 0))
    row_block = pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, qi(i)))
    seg_specs = [None, None]
    if cfg.has_segments:
        seg_specs = [
            pl.BlockSpec((None, bq), lambda i, bi, h: (bi, qi(i))),
            pl.BlockSpec((None, sp), lambda i, bi, h: (bi, 0)),
        ]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, nq=nq, nk=nk),
        grid=(nq, b, n),
        in_specs=[
            params_spec,
            q_block,
            kv_full,
            kv_full,
            *seg_specs,
            q_block,
            row_block,
            row_block,
        ],
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=cfg.compiler_params(backward=True),
        interpret=cfg.interpret,
        name="pallas_gpu_attention_dq",
    )(params, q, k, v, seg_q, seg_k, dout, lse, delta)

    # dk/dv: grid (key block, batch, kv head); the group's G query heads are one block.
    q_group = pl.BlockSpec((None, tp, g, hp), lambda j, bi, h: (bi, 0, h, 0))
    kv_block = pl.BlockSpec((None, bk, None, hp), lambda j, bi, h: (bi, j, h, 0))
    rows_group = pl.BlockSpec((None, g, tp), lambda j, bi, h: (bi, h, 0))
    seg_specs = [None, None]
    if cfg.has_segments:
        seg_specs = [
            pl.BlockSpec((None, tp), lambda j, bi, h: (bi, 0)),
            pl.BlockSpec((None, bk), lambda j, bi, h: (bi, j)),
        ]
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg, nq=nq),
        grid=(nk, b, kh),
        in_specs=[
            params_spec,
            q_group,
            kv_block,
            kv_block,
            *seg_specs,
            q_group,
            rows_group,
            rows_group,
        ],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=cfg.compiler_params(backward=True),
        interpret=cfg.interpret,
        name="pallas_gpu_attention_dkdv",
    )(params, q, k, v, seg_q, seg_k, dout, lse, delta)
    return dq, dk, dv
