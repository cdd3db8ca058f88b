"""Flash attention as Pallas kernels with the Triton (GPU) lowering, forward and backward.

    out_btnh, lse_btn = pallas_attention(q_btnh, k_bskh, v_bskh, causal=True, scale=h**-0.5)

Letters: B batch, T query length, S key length, N query heads, K kv heads (N = K·G), H head
dim. Query row t sits at absolute position `t + q_offset`, key row s at `s + kv_offset`; key s
is admissible for query t iff

- causal: `s + kv_offset <= t + q_offset`;
- sliding window: `(t + q_offset) - (s + kv_offset) < sliding_window`;
- segments: `segment_ids_q[t] == segment_ids_kv[s]`.

Over the admissible keys, with s_ts = scale · q_t·k_s in float32 (with a logit soft-cap c,
Gemma 2's: s_ts = c · tanh(scale · q_t·k_s / c)):

    lse_t = log Σ_s exp(s_ts),   out_t = Σ_s exp(s_ts - lse_t) v_s

A row with no admissible key gets out = 0 and lse = NEG_INF (finite, so merging partial
results, as ring attention does, never makes NaN).

Forward (one program per query block and query head): keys stream through an online softmax.
Backward (flash-attention 2, see `pallas_gpu_bwd`): p is recomputed from q, k and the saved
lse; with D = rowsum(dout ⊙ out),

    dv = pᵀ dout,   dp = dout vᵀ,   ds = p ⊙ (dp - D + dlse),   dq = scale·ds k,   dk = scale·dsᵀ q

The `+ dlse` term: ∂lse_t/∂s_ts = p_ts, so the lse cotangent adds p ⊙ dlse to ds. With the
cap, ds is then taken through the tanh: ds ⊙ (1 - (s / c)²) before the products with k and q.

Grouped-query heads index the kv head in the BlockSpec (k and v are never repeated); blocks
that the causal mask or the window rule out entirely are never visited (loop bounds computed
in the kernel from the offsets, which may be traced), and blocks where every pair is
admissible skip the mask. T, S are padded to the block sizes and H to a power of two >= 16
here, never read out of bounds (interpret mode would clamp such reads silently).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxrl.kernels.blockwise import check_softcap
from jaxrl.kernels.pallas_gpu_bwd import flash_bwd
from jaxrl.kernels.pallas_gpu_fwd import NEG_INF, KernelConfig, flash_fwd

__all__ = ["MAX_HEAD_DIM", "NEG_INF", "pallas_attention", "pallas_attention_bwd"]

MAX_HEAD_DIM = 256

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Windows beyond this never bind (|position difference| < 2**30) and keep int32 math exact.
_WINDOW_CAP = 2**30


def pallas_attention(
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
    block_q: int = 64,
    block_k: int = 64,
    interpret: bool = False,
    logit_softcap: float | None = None,
) -> tuple[Float[Array, "b t n h"], Float[Array, "b t n"]]:
    """Flash attention; differentiable in q, k, v (the lse output too).

    Args:
        q: Queries [B, T, N, H]; float32, bfloat16 or float16 (accumulation in float32).
        k: Keys [B, S, K, H], N a multiple of K; query head n reads kv head n // (N // K).
        v: Values [B, S, K, H].
        causal: Mask keys at later absolute positions than the query.
        segment_ids_q: int [B, T] (with `segment_ids_kv`) for packed rows.
        segment_ids_kv: int [B, S].
        sliding_window: Admit only keys with `pq - pk < sliding_window`; python int >= 1 or a
            traced int32 scalar (None: off).
        scale: Softmax scale (a python float).
        q_offset: Absolute position of query row 0 (python int or traced int32 scalar).
        kv_offset: Absolute position of key row 0.
        block_q: Query rows per program (power of two >= 16; shrunk for short T).
        block_k: Key rows per inner step (power of two >= 16; shrunk for short S).
        interpret: Run the kernels in the Pallas interpreter (any backend, e.g. CPU tests).
        logit_softcap: Cap c of the scores, c · tanh(s / c) (a python float > 0; None: off).

    Returns:
        out [B, T, N, H] in q's dtype and lse [B, T, N] float32 (NEG_INF for empty rows).
    """
    cfg, params = _prepare(
        q,
        k,
        v,
        causal,
        segment_ids_q,
        segment_ids_kv,
        sliding_window,
        scale,
        q_offset,
        kv_offset,
        block_q,
        block_k,
        interpret,
        logit_softcap,
    )
    t, h = q.shape[1], q.shape[3]
    out, lse = _flash(cfg, params, *_pad_inputs(cfg, q, k, v, segment_ids_q, segment_ids_kv))
    return out[:, :t, :, :h], jnp.swapaxes(lse[:, :, :t], 1, 2)


def pallas_attention_bwd(
    q: Float[Array, "b t n h"],
    k: Float[Array, "b s k h"],
    v: Float[Array, "b s k h"],
    out: Float[Array, "b t n h"],
    lse: Float[Array, "b t n"],
    dout: Float[Array, "b t n h"],
    dlse: Float[Array, "b t n"] | None = None,
    **kwargs,
) -> tuple[Float[Array, "b t n h"], Float[Array, "b s k h"], Float[Array, "b s k h"]]:
    """The backward kernels on an externally supplied (out, lse), e.g. ring attention's global
    ones: p = exp(s - lse) over this call's admissible keys (s the module doc's scores, capped
    with `logit_softcap`). Same keyword arguments as `pallas_attention`; returns (dq, dk, dv)
    typed like (q, k, v)."""
    unknown = set(kwargs) - set(_KWARGS)
    if unknown:
        raise ValueError(
            f"pallas_attention_bwd got unknown keyword(s) {sorted(unknown)}; "
            f"use those of pallas_attention: {', '.join(_KWARGS)}"
        )
    if "scale" not in kwargs:
        raise ValueError("pallas_attention_bwd needs scale= (the softmax scale of the forward)")
    opts = {**_KWARGS, **kwargs}
    cfg, params = _prepare(q, k, v, *(opts[name] for name in _KWARGS))
    b, t, n, h = q.shape
    for name, x, shape in (
        ("out", out, q.shape),
        ("dout", dout, q.shape),
        ("lse", lse, (b, t, n)),
        ("dlse", dlse, (b, t, n)),
    ):
        if x is not None and tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; it must be {tuple(shape)}")
    qp, kp, vp, seg_q, seg_k = _pad_inputs(
        cfg, q, k, v, opts["segment_ids_q"], opts["segment_ids_kv"]
    )
    tp, hp = qp.shape[1], qp.shape[3]

    def rows(x):  # [B, T, N] -> padded [B, N, Tp] float32
        return _pad_to(jnp.swapaxes(x.astype(jnp.float32), 1, 2), 2, tp)

    out_p = _pad_to(_pad_to(out.astype(q.dtype), 1, tp), 3, hp)
    dout_p = _pad_to(_pad_to(dout.astype(q.dtype), 1, tp), 3, hp)
    dlse_p = None if dlse is None else rows(dlse)
    dq, dk, dv = flash_bwd(cfg, params, qp, kp, vp, seg_q, seg_k, out_p, rows(lse), dout_p, dlse_p)
    s = k.shape[1]
    return dq[:, :t, :, :h], dk[:, :s, :, :h], dv[:, :s, :, :h]


# Keyword arguments shared by the forward and `pallas_attention_bwd`, in `_prepare`'s order.
_KWARGS = {
    "causal": True,
    "segment_ids_q": None,
    "segment_ids_kv": None,
    "sliding_window": None,
    "scale": None,
    "q_offset": 0,
    "kv_offset": 0,
    "block_q": 64,
    "block_k": 64,
    "interpret": False,
    "logit_softcap": None,
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, params, q, k, v, seg_q, seg_k):
    return tuple(flash_fwd(cfg, params, q, k, v, seg_q, seg_k))


def _flash_fwd_rule(cfg, params, q, k, v, seg_q, seg_k):
    out, lse = flash_fwd(cfg, params, q, k, v, seg_q, seg_k)
    return (out, lse), (params, q, k, v, seg_q, seg_k, out, lse)


def _flash_bwd_rule(cfg, residuals, cotangents):
    params, q, k, v, seg_q, seg_k, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv = flash_bwd(cfg, params, q, k, v, seg_q, seg_k, out, lse, dout, dlse)
    return None, dq, dk, dv, None, None


_flash.defvjp(_flash_fwd_rule, _flash_bwd_rule)


def _pad_to(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _pad_inputs(cfg: KernelConfig, q, k, v, seg_q, seg_k):
    """Zero-pad T, S to the block sizes and H to a power of two (padded keys are masked in
    the kernels; padded query rows are sliced off and get zero cotangents)."""
    tp = -(-cfg.t // cfg.block_q) * cfg.block_q
    sp = -(-cfg.s // cfg.block_k) * cfg.block_k
    hp = max(16, _next_pow2(q.shape[3]))
    q = _pad_to(_pad_to(q, 1, tp), 3, hp)
    k = _pad_to(_pad_to(k, 1, sp), 3, hp)
    v = _pad_to(_pad_to(v, 1, sp), 3, hp)
    if cfg.has_segments:
        seg_q = _pad_to(seg_q.astype(jnp.int32), 1, tp)
        seg_k = _pad_to(seg_k.astype(jnp.int32), 1, sp)
    else:
        seg_q = seg_k = None
    return q, k, v, seg_q, seg_k


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _is_int_scalar(x) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int | np.integer):
        return True
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer) and np.ndim(x) == 0


def _check_block(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(
            f"{name}={value!r}: block sizes must be python ints that are powers of two >= 16 "
            f"(Triton tiles), e.g. {name}=64"
        )


def _prepare(
    q,
    k,
    v,
    causal,
    seg_q,
    seg_k,
    window,
    scale,
    q_offset,
    kv_offset,
    block_q,
    block_k,
    interpret,
    logit_softcap=None,
):
    """Validate the call and build its static config and int32 params [q_off, kv_off, W, 0]."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.ndim(x) != 4:
            raise ValueError(
                f"{name} must be 4-D ([B, T, N, H] for q, [B, S, K, H] for k and v); "
                f"got shape {np.shape(x)}"
            )
    b, t, n, h = q.shape
    _, s, kh, _ = k.shape
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != b or k.shape[3] != h:
        raise ValueError(
            f"k/v {tuple(k.shape)} must share batch and head dim with q {tuple(q.shape)} "
            "([B, S, K, H] against [B, T, N, H])"
        )
    if t < 1 or s < 1 or n < 1 or kh < 1 or h < 1:
        raise ValueError(f"empty attention: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if n % kh:
        raise ValueError(
            f"query heads N={n} must be a multiple of kv heads K={kh} (grouped-query attention)"
        )
    if h > MAX_HEAD_DIM:
        raise ValueError(f"head dim H={h} is above {MAX_HEAD_DIM}; use the blockwise attention")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(
            f"q, k, v must share one of float32, bfloat16, float16; got {q.dtype}, {k.dtype}, "
            f"{v.dtype} (cast them first)"
        )
    if (seg_q is None) != (seg_k is None):
        raise ValueError(
            "segment_ids_q and segment_ids_kv must be given together (pass the same [B, T] "
            "array twice for self-attention)"
        )
    if seg_q is not None:
        for name, x, shape in (("segment_ids_q", seg_q, (b, t)), ("segment_ids_kv", seg_k, (b, s))):
            if tuple(np.shape(x)) != shape or not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(
                    f"{name} must be an integer array of shape {shape}; got "
                    f"{getattr(x, 'dtype', type(x))} {tuple(np.shape(x))}"
                )
    if window is not None:
        if not _is_int_scalar(window):
            raise ValueError(
                f"sliding_window must be None, a python int or an int32 scalar; got {window!r}"
            )
        if isinstance(window, int | np.integer) and window < 1:
            raise ValueError(f"sliding_window={window} admits no key; use >= 1 (or None: off)")
    for name, x in (("q_offset", q_offset), ("kv_offset", kv_offset)):
        if not _is_int_scalar(x):
            raise ValueError(f"{name} must be a python int or an int32 scalar; got {x!r}")
    if isinstance(scale, bool) or not isinstance(scale, float | int | np.floating):
        raise ValueError(f"scale must be a python float (static), e.g. H**-0.5; got {scale!r}")
    if not isinstance(causal, bool | np.bool_):
        raise ValueError(f"causal must be a python bool; got {causal!r}")
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    hp = max(16, _next_pow2(h))
    block_q = min(block_q, max(16, _next_pow2(t)))
    block_k = min(block_k, max(16, _next_pow2(s)))
    cfg = KernelConfig(
        causal=bool(causal),
        has_window=window is not None,
        has_segments=seg_q is not None,
        scale=float(scale),
        block_q=block_q,
        block_k=block_k,
        t=t,
        s=s,
        g=n // kh,
        interpret=bool(interpret),
        # Triton's usual choices: 4 warps for 64-wide tiles, 8 for big tiles or wide heads;
        # three pipeline stages of k/v loads in the forward, two in the (register-heavier)
        # backward.
        num_warps=8 if hp > 64 or block_q * block_k >= 128 * 128 else 4,
        num_stages_fwd=3 if hp <= 128 else 2,
        num_stages_bwd=2,
        softcap=check_softcap(logit_softcap),
    )
    w = 0 if window is None else jnp.minimum(jnp.asarray(window, jnp.int32), _WINDOW_CAP)
    if isinstance(window, int | np.integer):
        w = min(int(window), _WINDOW_CAP)
    params = jnp.stack([jnp.asarray(x, jnp.int32) for x in (q_offset, kv_offset, w, 0)])
    return cfg, params
