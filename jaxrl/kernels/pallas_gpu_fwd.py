"""Forward flash-attention kernel for `pallas_gpu` (Pallas, Triton lowering), and the pieces the
backward kernels share: the static kernel configuration, the admissibility mask and the block
ranges that implement causal / sliding-window block skipping.

Arrays reach the kernels already padded (see `jaxrl.kernels.pallas_gpu`): T and S to multiples
of the block sizes, H to a power of two >= 16. Positions, the window and the true lengths are
data (`params`, int32 [4] = [q_offset, kv_offset, window, 0]) so they may be traced.

Scores are kept in base 2 (`s2 = log2(e) · scale · q kᵀ`, `exp2` instead of `exp`): the
log-sum-exp returned is converted back to the natural log. With a logit soft-cap c (Gemma 2) the
natural-unit score s = scale · q kᵀ is capped first: `s2 = log2(e) · c · tanh(s / c)`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl.kernels.blockwise import NEG_INF, softcap

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Everything static about one attention call (hashable: a `custom_vjp` nondiff arg).

    `t` and `s` are the true (unpadded) lengths; `g` the query heads per kv head; `softcap`
    the logit soft-cap (None: uncapped).
    """

    causal: bool
    has_window: bool
    has_segments: bool
    scale: float
    block_q: int
    block_k: int
    t: int
    s: int
    g: int
    interpret: bool
    num_warps: int
    num_stages_fwd: int
    num_stages_bwd: int
    softcap: float | None = None

    def compiler_params(self, backward: bool = False):
        stages = self.num_stages_bwd if backward else self.num_stages_fwd
        return pltriton.CompilerParams(num_warps=self.num_warps, num_stages=stages)


def fdiv0(x, d: int):
    """floor(max(x, 0) / d) for an int32 scalar x (no floor division of negatives on Triton)."""
    return lax.div(jnp.maximum(x, 0), jnp.int32(d))


def cdiv0(x, d: int):
    """ceil(max(x, 0) / d) for an int32 scalar x."""
    return lax.div(jnp.maximum(x, 0) + (d - 1), jnp.int32(d))


def admissible(cfg: KernelConfig, params_ref, q_row, k_row, seg_q=None, seg_k=None):
    """Boolean mask of admissible (query, key) pairs, or None when nothing is masked.

    `q_row`/`k_row` are padded-array row indices already broadcast against each other
    ([bq, 1] and [1, bk], or transposed), `seg_q`/`seg_k` segment ids shaped the same way.
    """
    pq = q_row + params_ref[0]
    pk = k_row + params_ref[1]
    mask = None

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if cfg.causal:
        mask = both(mask, pk <= pq)
    if cfg.has_window:
        mask = both(mask, pq - pk < params_ref[2])
    if cfg.has_segments:
        mask = both(mask, seg_q == seg_k)
    if cfg.s % cfg.block_k:  # padded keys are never admissible
        mask = both(mask, k_row < cfg.s)
    return mask  # None: every pair admissible


def key_block_ranges(cfg: KernelConfig, params_ref, q_start, num_k_blocks: int):
    """Key blocks a query block [q_start, q_start + block_q) must visit: [lo, hi), and the
    sub-range [a, b) of blocks that need no mask (every pair admissible).

    With d = q_offset - kv_offset, key row s is admissible for query row t iff
    (causal) s <= t + d and (window) s > t + d - W.
    """
    bq, bk = cfg.block_q, cfg.block_k
    d = params_ref[0] - params_ref[1]
    nk = jnp.int32(num_k_blocks)
    if cfg.causal:  # last admissible key row: q_start + bq - 1 + d
        hi = jnp.minimum(fdiv0(q_start + bq - 1 + d + bk, bk), nk)
        b = fdiv0(q_start + d + 1, bk)  # blocks whose last key <= first query position
    else:
        hi, b = nk, nk
    if cfg.has_window:  # first admissible key row: q_start + d - W + 1
        w = params_ref[2]
        lo = jnp.minimum(fdiv0(q_start + d - w + 1, bk), hi)
        a = cdiv0(q_start + bq + d - w, bk)  # blocks whose first key >= last query - W + 1
    else:
        lo, a = jnp.int32(0), jnp.int32(0)
    b = jnp.minimum(b, cfg.s // bk)  # blocks holding padding need the mask
    if cfg.has_segments:
        a = b = hi
    a = jnp.clip(a, lo, hi)
    b = jnp.clip(b, a, hi)
    return lo, a, b, hi


def dot_t(x, y):
    """x yᵀ in float32 accumulation: [m, h] x [n, h] -> [m, n]."""
    return lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot(x, y):
    """x y in float32 accumulation: [m, h] x [h, n] -> [m, n]."""
    return lax.dot_general(x, y, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def scores2(cfg: KernelConfig, x, y):
    """Base-2 scores of a tile, log2(e) · s with s = scale · x yᵀ ([m, h] x [n, h] -> [m, n]),
    capped to c · tanh(s / c) with `cfg.softcap`; and the capped s (None without a cap), from
    which the backward's tanh' = 1 - (s / c)² follows."""
    if cfg.softcap is None:
        return dot_t(x, y) * (cfg.scale * LOG2_E), None
    s = softcap(dot_t(x, y) * cfg.scale, cfg.softcap)
    return s * LOG2_E, s


def q_block_index(cfg: KernelConfig, i, num_q_blocks: int):
    """Causal grids run the longest query blocks (the last ones) first: better tail balance."""
    return num_q_blocks - 1 - i if cfg.causal else i


def _fwd_kernel(
    params_ref, q_ref, k_ref, v_ref, segq_ref, segk_ref, o_ref, lse_ref, *, cfg, nq, nk
):
    bq, bk = cfg.block_q, cfg.block_k
    q_start = q_block_index(cfg, pl.program_id(0), nq) * bq
    q = q_ref[...]
    q_row = q_start + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    seg_q = segq_ref[...][:, None] if cfg.has_segments else None

    def body(j, carry, masked: bool):
        acc, m, l = carry
        mask = None
        k_start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k_start, bk), :]
        v = v_ref[pl.ds(k_start, bk), :]
        s2, _ = scores2(cfg, q, k)  # [bq, bk]
        if masked:
            k_row = k_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            seg_k = segk_ref[pl.ds(k_start, bk)][None, :] if cfg.has_segments else None
            mask = admissible(cfg, params_ref, q_row, k_row, seg_q, seg_k)
            if mask is not None:
                s2 = jnp.where(mask, s2, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s2, axis=1))
        p = jnp.exp2(s2 - m_new[:, None])
        if masked and mask is not None:
            # A row with nothing admissible yet has m_new = NEG_INF, where exp2(0) would be 1.
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp2(m - m_new)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
        return acc, m_new, l

    lo, a, b, hi = key_block_ranges(cfg, params_ref, q_start, nk)
    carry = (
        jnp.zeros((bq, q.shape[-1]), jnp.float32),
        jnp.full((bq,), NEG_INF, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    carry = lax.fori_loop(lo, a, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
    acc, m, l = lax.fori_loop(b, hi, functools.partial(body, masked=True), carry)
    empty = l == 0.0
    safe_l = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, NEG_INF, (m + jnp.log2(safe_l)) * LN_2)


def flash_fwd(cfg: KernelConfig, params, q, k, v, seg_q, seg_k):
    """Padded forward: q [B, Tp, N, Hp], k/v [B, Sp, K, Hp] -> out [B, Tp, N, Hp],
    lse [B, N, Tp] float32."""
    b, tp, n, hp = q.shape
    sp = k.shape[1]
    bq, bk, g = cfg.block_q, cfg.block_k, cfg.g
    nq, nk = tp // bq, sp // bk

    def qi(i):
        return q_block_index(cfg, i, nq)

    in_specs = [
        pl.BlockSpec((4,), lambda i, bi, h: (0,)),
        pl.BlockSpec((None, bq, None, hp), lambda i, bi, h: (bi, qi(i), h, 0)),
        pl.BlockSpec((None, sp, None, hp), lambda i, bi, h: (bi, 0, lax.div(h, g), 0)),
        pl.BlockSpec((None, sp, None, hp), lambda i, bi, h: (bi, 0, lax.div(h, g), 0)),
    ]
    if cfg.has_segments:
        in_specs += [
            pl.BlockSpec((None, bq), lambda i, bi, h: (bi, qi(i))),
            pl.BlockSpec((None, sp), lambda i, bi, h: (bi, 0)),
        ]
    else:
        in_specs += [None, None]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, nq=nq, nk=nk),
        grid=(nq, b, n),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, hp), lambda i, bi, h: (bi, qi(i), h, 0)),
            pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, qi(i))),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, n, tp), jnp.float32),
        ],
        compiler_params=cfg.compiler_params(),
        interpret=cfg.interpret,
        name="pallas_gpu_attention_fwd",
    )(params, q, k, v, seg_q, seg_k)
