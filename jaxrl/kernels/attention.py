"""The attention entry point every model calls, and its implementations.

    out_btnh = attention(q_btnh, k_bskh, v_bskh, causal=True, segment_ids=seg_bt)

Letters: B batch, T query length, S key length, N query heads, K kv heads (N = K * G), H head
dim. Query row t sits at position `t + q_offset`, key row s at `s + kv_offset` (both 0 for a
full forward; `q_offset` is the cache length when decoding). A query attends to key s when all
of these hold:

- causal: `pos_k <= pos_q`;
- same segment: `segment_ids_q[t] == segment_ids_kv[s]` (packed rows; padding is its own
  segment, so real tokens never attend to padding);
- sliding window: `pos_q - pos_k < sliding_window` (HF's convention: the window counts the
  query itself).

A row with no admissible key (none occurs for real tokens) gets zeros in every implementation.

Scores are s = scale · q·k (scale `softmax_scale`, default 1/sqrt(H)); with `logit_softcap` c
(Gemma 2) they are capped to c · tanh(s / c) before the mask, and the backward goes through the
cap (∂/∂s = 1 - (s_capped / c)²). Then p = softmax(s over the admissible keys), in float32, and
out = p · v.

Implementations (`implementation=`):

- `reference`: dense [B, K, G, T, S] scores; the oracle.
- `blockwise`: online-softmax blocks in `jax.numpy` with a recomputing backward, O(T) memory
  (`jaxrl.kernels.blockwise`). A row with no admissible key gets zeros.
- `pallas_gpu`: a Pallas/Triton flash-attention kernel (`jaxrl.kernels.pallas_gpu`); off a
  GPU it is refused unless `JAXRL_PALLAS_INTERPRET=1` (Pallas' interpret mode; tests only).
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`; no segment ids, offsets,
  traced windows or logit soft-cap (refused rather than attending across segments).
- `ring`: sequence parallelism over the `layout` argument's `sp` axis (`jaxrl.kernels.ring`); the
  tokens must be in zigzag order (`jaxrl.kernels.ring.zigzag`), as `hidden_states` lays them.
- `auto`: `ring` when `layout` has `sp > 1`; on a GPU `pallas_gpu` (head dim up to
  256); elsewhere `blockwise` from `BLOCKWISE_MIN_LENGTH` keys on, else `reference`. Logged
  once per choice.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxrl.kernels.blockwise import NO_WINDOW, blockwise_attention, check_softcap, softcap

IMPLEMENTATIONS = ("reference", "blockwise", "pallas_gpu", "cudnn", "ring")
# On the CPU, the dense scores of shorter sequences are cheap and faster than blocks.
BLOCKWISE_MIN_LENGTH = 1024
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
_log = logging.getLogger(__name__)
_logged: set[str] = set()

SegmentIds = Int[Array, "b t"] | tuple[Int[Array, "b t"], Int[Array, "b s"]] | None


def attention(
    q: Float[Array, "b t n h"],
    k: Float[Array, "b s k h"],
    v: Float[Array, "b s k h"],
    *,
    causal: bool = True,
    segment_ids: SegmentIds = None,
    sliding_window: int | Int[Array, ""] | None = None,
    softmax_scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    kv_offset: int | Int[Array, ""] = 0,
    implementation: str = "auto",
    layout: Any = None,
    logit_softcap: float | None = None,
) -> Float[Array, "b t n h"]:
    """Softmax attention with grouped-query heads, causal, segment and sliding-window masks.

    Args:
        q: Queries [B, T, N, H].
        k: Keys [B, S, K, H], N a multiple of K.
        v: Values [B, S, K, H].
        causal: Mask keys after the query's own position.
        segment_ids: [B, T] when queries and keys are the same tokens, else a pair
            ([B, T] for queries, [B, S] for keys).
        sliding_window: Keys this many positions back or further are masked (None: off).
            May be a traced scalar, so scanned layers can differ.
        softmax_scale: Score scale; default 1/sqrt(H).
        q_offset: Position of the first query row.
        kv_offset: Position of the first key row.
        implementation: One of `IMPLEMENTATIONS` or `auto`.
        layout: The sharding layout the arrays are laid out in (a `jaxrl.sharding.Layout`,
            passed by the model: this module imports no sharding): `ring` runs over its `sp`
            axis, and `auto` picks `ring` when that axis is > 1. None: one sequence shard.
        logit_softcap: Gemma 2's score cap c, a python float > 0: scores s = scale · q·k become
            c · tanh(s / c) before the mask (None: uncapped). `cudnn` refuses it.

    Returns:
        [B, T, N, H] in the dtype of `q`.
    """
    if implementation not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(
            f"attention implementation {implementation!r} is not available; "
            f"use one of auto, {', '.join(IMPLEMENTATIONS)}"
        )
    b, _, n, h = q.shape
    kv_heads = k.shape[2]
    if n % kv_heads:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({kv_heads})")
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != h:
        raise ValueError(f"k {k.shape} and v {v.shape} do not match q {q.shape}")
    scale = h**-0.5 if softmax_scale is None else float(softmax_scale)
    cap = check_softcap(logit_softcap)
    if implementation == "auto":
        implementation = _choose(k.shape[1], h, layout)
    if segment_ids is not None and not isinstance(segment_ids, tuple):
        if q.shape[1] != k.shape[1]:
            raise ValueError(
                f"one segment_ids array serves only queries and keys of one length (T={q.shape[1]},"
                f" S={k.shape[1]}); pass a pair (segment_ids_q [B, T], segment_ids_kv [B, S])"
            )
        segment_ids = (segment_ids, segment_ids)
    seg_q, seg_kv = segment_ids if segment_ids is not None else (None, None)
    if implementation == "reference":
        return _reference(
            q, k, v, causal, (seg_q, seg_kv), sliding_window, scale, q_offset, kv_offset, cap
        )
    if implementation == "ring":
        return _ring(
            q, k, v, causal, seg_q, seg_kv, sliding_window, scale, q_offset, kv_offset, layout, cap
        )
    if implementation == "cudnn":
        return _cudnn(q, k, v, causal, seg_q, sliding_window, scale, q_offset, kv_offset, cap)
    kw = dict(
        causal=causal,
        segment_ids_q=seg_q,
        segment_ids_kv=seg_kv,
        scale=scale,
        sliding_window=sliding_window,
        q_offset=q_offset,
        kv_offset=kv_offset,
        logit_softcap=cap,
    )
    if implementation == "pallas_gpu":
        from jaxrl.kernels.pallas_gpu import pallas_attention

        return pallas_attention(q, k, v, interpret=_pallas_interpret(), **kw)[0]
    return blockwise_attention(q, k, v, **kw)[0]


def _choose(s: int, h: int = 64, layout: Any = None) -> str:
    """The `auto` implementation for `s` keys of head dim `h` in `layout` here (logged once
    per choice)."""
    if layout is not None and layout.mesh.shape.get("sp", 1) > 1:
        choice, why = "ring", f"the layout has sp={layout.mesh.shape['sp']}"
    elif jax.default_backend() == "gpu" and h <= _pallas_max_head_dim():
        choice, why = "pallas_gpu", "the backend is a GPU"
    elif s >= BLOCKWISE_MIN_LENGTH:
        choice, why = "blockwise", f"{s} keys >= {BLOCKWISE_MIN_LENGTH} on {jax.default_backend()}"
    else:
        choice, why = "reference", f"{s} keys < {BLOCKWISE_MIN_LENGTH} on {jax.default_backend()}"
    if choice not in _logged:
        _logged.add(choice)
        _log.info("attention implementation %s (auto: %s)", choice, why)
    return choice


def _pallas_interpret() -> bool:
    """Off a GPU the Pallas kernel only runs interpreted (slow), and only when asked for."""
    if jax.default_backend() == "gpu":
        return False
    if os.environ.get("JAXRL_PALLAS_INTERPRET") == "1":
        return True
    raise ValueError(
        f"implementation='pallas_gpu' needs a CUDA GPU (the backend is {jax.default_backend()}); "
        "use 'auto' or 'blockwise', or set JAXRL_PALLAS_INTERPRET=1 to interpret the kernel "
        "(tests only: slow)"
    )


def _pallas_max_head_dim() -> int:
    from jaxrl.kernels.pallas_gpu import MAX_HEAD_DIM

    return MAX_HEAD_DIM


def _static_zero(x) -> bool:
    return isinstance(x, int | np.integer) and x == 0


def _cudnn(q, k, v, causal, seg_q, sliding_window, scale, q_offset, kv_offset, cap=None):
    """cuDNN's fused attention; refuses what it cannot express."""
    if cap is not None:
        raise ValueError(
            f"implementation='cudnn' has no logit_softcap (got {cap}; Gemma 2's score cap); "
            "use 'pallas_gpu' or 'blockwise'"
        )
    if seg_q is not None:
        raise ValueError(
            "implementation='cudnn' has no segment ids (packed or padded rows would attend "
            "across segments); use 'pallas_gpu' or 'blockwise'"
        )
    if not (_static_zero(q_offset) and _static_zero(kv_offset)):
        raise ValueError("implementation='cudnn' takes no position offsets; use 'pallas_gpu'")
    window = cudnn_window(sliding_window, causal, k.shape[1])
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, local_window_size=window, implementation="cudnn"
    )


def cudnn_window(sliding_window, causal: bool, s: int) -> tuple[int, int] | None:
    """`jax.nn.dot_product_attention`'s (keys before, keys after) for our sliding window: only
    keys behind the query are limited (`pos_q - pos_k < w`), as in every implementation."""
    if sliding_window is None:
        return None
    if not isinstance(sliding_window, int | np.integer):
        raise ValueError("implementation='cudnn' needs a static (python int) sliding_window")
    if sliding_window >= NO_WINDOW:
        return None
    return int(sliding_window) - 1, 0 if causal else s


def _ring(
    q, k, v, causal, seg_q, seg_kv, sliding_window, scale, q_offset, kv_offset, layout, cap=None
):
    """Ring attention over `layout`'s `sp` axis (tokens in zigzag order)."""
    from jaxrl.kernels.ring import ring_attention

    if layout is None or layout.mesh.shape.get("sp", 1) < 2:
        raise ValueError(
            "implementation='ring' needs a layout with an `sp` axis > 1 "
            "(mesh.sp in the config); use 'blockwise' on one sequence shard"
        )
    if seg_q is not seg_kv or not (_static_zero(q_offset) and _static_zero(kv_offset)):
        raise ValueError(
            "implementation='ring' attends one sequence to itself: one segment_ids array "
            "and no offsets"
        )
    heads = layout.spec(q.shape, ("batch", "seq", "heads", "head_dim"))
    kv_heads = layout.spec(k.shape, ("batch", "seq", "kv_heads", "head_dim"))
    return ring_attention(
        q,
        k,
        v,
        mesh=layout.mesh,
        segment_ids=seg_q,
        causal=causal,
        sliding_window=sliding_window,
        scale=scale,
        batch_axes=heads[0],
        head_axes=heads[2] if heads[2] == kv_heads[2] else None,
        logit_softcap=cap,
    )


def _mask_bts(b, t, s, causal, segment_ids, sliding_window, q_offset, kv_offset) -> jax.Array:
    """Admissible (query, key) pairs as a boolean [B, T, S]."""
    pos_q = jnp.arange(t)[:, None] + q_offset
    pos_k = jnp.arange(s)[None, :] + kv_offset
    mask = jnp.ones((b, t, s), bool)
    if causal:
        mask &= (pos_k <= pos_q)[None]
    if sliding_window is not None:
        mask &= (pos_q - pos_k < sliding_window)[None]
    seg_q, seg_k = segment_ids
    if seg_q is not None:
        mask &= seg_q[:, :, None] == seg_k[:, None, :]
    return mask


def _reference(q, k, v, causal, segment_ids, sliding_window, scale, q_offset, kv_offset, cap=None):
    """Dense attention: the [B, K, G, T, S] score tensor (capped to cap · tanh(s / cap) with a
    `cap`), softmax in float32."""
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    q_btkgh = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k, preferred_element_type=jnp.float32)
    mask = _mask_bts(b, t, s, causal, segment_ids, sliding_window, q_offset, kv_offset)
    scores = scores * scale
    if cap is not None:
        scores = softcap(scores, cap)
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask.any(-1)[:, None, None, :, None], probs, 0.0).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, h)
