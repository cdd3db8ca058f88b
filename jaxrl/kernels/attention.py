"""The attention entry point every model calls, and its dense reference implementation.

    out_btnh = attention(q_btnh, k_bskh, v_bskh, causal=True, segment_ids=seg_bt)

Letters: B batch, T query length, S key length, N query heads, K kv heads (N = K * G), H head
dim. Query row t of `q` sits at key index `t + q_offset` (0 for a full forward; the cache length
when decoding). A query attends to key s when all of these hold:

- causal: `s <= t + q_offset`;
- same segment: `segment_ids_q[t] == segment_ids_kv[s]` (packed rows; padding is its own
  segment, so real tokens never attend to padding);
- sliding window: `t + q_offset - s < sliding_window` (HF's convention: the window counts the
  query itself).

Rows with no admissible key (none occur for real tokens) get a uniform average rather than
NaN, so gradients stay finite. The long-context issue adds `blockwise`, `pallas_gpu`, `cudnn`
and ring implementations behind this same call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

IMPLEMENTATIONS = ("reference",)
# A sliding window that never binds; lets scanned layers mix windowed and full attention.
NO_WINDOW = 2**30
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention(
    q: Float[Array, "b t n h"],
    k: Float[Array, "b s k h"],
    v: Float[Array, "b s k h"],
    *,
    causal: bool = True,
    segment_ids: Int[Array, "b t"] | tuple[Int[Array, "b t"], Int[Array, "b s"]] | None = None,
    sliding_window: int | Int[Array, ""] | None = None,
    softmax_scale: float | None = None,
    q_offset: int | Int[Array, ""] = 0,
    implementation: str = "auto",
) -> Float[Array, "b t n h"]:
    """Softmax attention with grouped-query heads, causal, segment and sliding-window masks.

    Args:
        q: Queries [B, T, N, H].
        k: Keys [B, S, K, H], N a multiple of K.
        v: Values [B, S, K, H].
        causal: Mask keys after the query's own index.
        segment_ids: [B, T] when queries and keys are the same tokens, else a pair
            ([B, T] for queries, [B, S] for keys).
        sliding_window: Keys further back than this many positions are masked (None: off).
            May be a traced scalar, so scanned layers can differ.
        softmax_scale: Score scale; default 1/sqrt(H).
        q_offset: Key index of the first query row.
        implementation: `reference` or `auto` (the best available; `reference` for now).

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
    scale = h**-0.5 if softmax_scale is None else softmax_scale
    return _reference(q, k, v, causal, segment_ids, sliding_window, scale, q_offset)


def _mask_bts(
    b: int, t: int, s: int, causal: bool, segment_ids, sliding_window, q_offset
) -> jax.Array:
    """Admissible (query, key) pairs as a boolean [B, T, S]."""
    q_idx = jnp.arange(t)[:, None] + q_offset
    k_idx = jnp.arange(s)[None, :]
    mask = jnp.ones((b, t, s), bool)
    if causal:
        mask &= (k_idx <= q_idx)[None]
    if sliding_window is not None:
        mask &= (q_idx - k_idx < sliding_window)[None]
    if segment_ids is not None:
        seg_q, seg_k = segment_ids if isinstance(segment_ids, tuple) else (segment_ids,) * 2
        mask &= seg_q[:, :, None] == seg_k[:, None, :]
    return mask


def _reference(q, k, v, causal, segment_ids, sliding_window, scale, q_offset):
    """Dense attention: the [B, K, G, T, S] score tensor, softmax in float32."""
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    q_btkgh = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k, preferred_element_type=jnp.float32)
    mask = _mask_bts(b, t, s, causal, segment_ids, sliding_window, q_offset)
    scores = jnp.where(mask[:, None, None], scores * scale, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, h)
