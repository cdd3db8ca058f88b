"""Ring attention: sequence parallelism over a mesh axis (`sp`), built on blockwise attention.

The sequence [T] is cut into 2P chunks of c = T / 2P tokens for P devices on the axis. In the
zigzag layout device i holds chunks (i, 2P-1-i), so every device has the same share of the
causal triangle's work. Each device keeps its queries; the key/value chunks travel around the
ring (`ppermute` i -> i+1), P - 1 hops in a loop (one hop's temporaries are reused by the
next, so per-device memory shrinks with P). At hop r, device i holds the keys of device i - r
and merges the partial results of its two query chunks with those key chunks:

    lse = logaddexp(lse_1, lse_2),   out = out_1 · e^(lse_1 - lse) + out_2 · e^(lse_2 - lse)

The backward pass (a `custom_vjp`) makes the same tour with the final (out, lse) of each query
row: `blockwise_backward` gives the exact gradient of the global softmax for one key chunk, dq
stays home, and dk/dv travel with their keys and take one more hop back to their owner.

The caller lays the tokens out in zigzag order once (`zigzag`), and undoes it on the outputs
(`unzigzag`); positions must be computed before the permutation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxrl.kernels.blockwise import (
    NEG_INF,
    blockwise_backward,
    blockwise_forward,
    check_softcap,
)


def zigzag_order(t: int, sp: int) -> np.ndarray:
    """Indices [T]: `x[:, order]` is `x` in zigzag layout for `sp` devices (T % 2sp == 0)."""
    if t % (2 * sp):
        raise ValueError(
            f"ring attention over sp={sp} needs a sequence length divisible by 2*sp={2 * sp}, "
            f"got {t}; pad the batch to a multiple of {2 * sp}"
        )
    chunks = np.arange(t).reshape(2 * sp, t // (2 * sp))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * sp - 1 - i]]) for i in range(sp)])


def zigzag(x: jax.Array, sp: int, axis: int = 1) -> jax.Array:
    """`x` with its sequence axis in zigzag order."""
    return jnp.take(x, zigzag_order(x.shape[axis], sp), axis=axis)


def unzigzag(x: jax.Array, sp: int, axis: int = 1) -> jax.Array:
    """Inverse of `zigzag`."""
    return jnp.take(x, np.argsort(zigzag_order(x.shape[axis], sp)), axis=axis)


def _rotate(tree, axis: str, n: int):
    """Every device sends `tree` to the next one on the ring."""
    return jax.lax.ppermute(tree, axis, [(j, (j + 1) % n) for j in range(n)])


def _halves(x):
    c = x.shape[1] // 2
    return x[:, :c], x[:, c:]


def _chunk_ids(i, n):
    """The global chunk numbers of device i's two halves."""
    return i, 2 * n - 1 - i


def _merge(a, b):
    """Combines two partial attentions (out [B, T, N, H] f32, lse [B, T, N]) over key sets."""
    (o1, l1), (o2, l2) = a, b
    lse = jnp.logaddexp(l1, l2)
    return o1 * jnp.exp(l1 - lse)[..., None] + o2 * jnp.exp(l2 - lse)[..., None], lse


def _pairs(i, src, n, c, seg_q, seg_kv, causal):
    """(query half, key half, offsets and segment ids) for the chunk pairs of one hop.

    Under a causal mask the pair (first query half, second key half) is always empty (chunk
    i < P <= chunk 2P-1-src) and is left out; the other pairs' empty blocks are skipped at
    run time by the blockwise loops.
    """
    for a, qa in enumerate(_chunk_ids(i, n)):
        for b, kb in enumerate(_chunk_ids(src, n)):
            if causal and (a, b) == (0, 1):
                continue
            segs = {}
            if seg_q is not None:
                segs = {"segment_ids_q": _halves(seg_q)[a], "segment_ids_kv": _halves(seg_kv)[b]}
            yield a, b, {"q_offset": qa * c, "kv_offset": kb * c, **segs}


def _blockwise_kwargs(opts, window):
    kw = {key: opts[key] for key in ("causal", "scale", "block_q", "block_k", "logit_softcap")}
    return {**kw, "sliding_window": window}


def _ring_forward(q, k, v, seg_q, seg_kv, window, opts):
    axis, n = opts["axis"], opts["n"]
    kw = _blockwise_kwargs(opts, window)
    i = jax.lax.axis_index(axis)
    c = q.shape[1] // 2
    qs = _halves(q)

    def attend(r, kv, acc):
        """Merges the attention of the local queries over the keys held at hop r into acc."""
        ks, vs = _halves(kv[0]), _halves(kv[1])
        acc = list(acc)
        for a, b, pair in _pairs(i, (i - r) % n, n, c, seg_q, kv[2], opts["causal"]):
            o, lse = blockwise_forward(qs[a], ks[b], vs[b], **pair, **kw)
            acc[a] = _merge(acc[a], (o.astype(jnp.float32), lse))
        return tuple(acc)

    def hop(r, carry):
        kv, acc = carry
        return _rotate(kv, axis, n), attend(r, kv, acc)

    empty = (jnp.zeros(qs[0].shape, jnp.float32), jnp.full(qs[0].shape[:3], NEG_INF, jnp.float32))
    kv, acc = jax.lax.fori_loop(0, n - 1, hop, ((k, v, seg_kv), (empty, empty)))
    acc = attend(n - 1, kv, acc)
    out = jnp.concatenate([acc[0][0], acc[1][0]], axis=1).astype(q.dtype)
    return out, jnp.concatenate([acc[0][1], acc[1][1]], axis=1)


def _ring_backward(q, k, v, seg_q, seg_kv, window, out, lse, dout, opts):
    axis, n = opts["axis"], opts["n"]
    kw = _blockwise_kwargs(opts, window)
    i = jax.lax.axis_index(axis)
    c = q.shape[1] // 2
    qs, outs, lses, douts = _halves(q), _halves(out), _halves(lse), _halves(dout)

    def grads(r, kv, dkv, dq):
        """Adds the gradients through the keys held at hop r to dq and to their dk, dv."""
        ks, vs = _halves(kv[0]), _halves(kv[1])
        dq, (dk, dv) = list(dq), [list(_halves(x)) for x in dkv]
        for a, b, pair in _pairs(i, (i - r) % n, n, c, seg_q, kv[2], opts["causal"]):
            g = blockwise_backward(qs[a], ks[b], vs[b], outs[a], lses[a], douts[a], **pair, **kw)
            dq[a] += g[0].astype(jnp.float32)
            dk[b] += g[1].astype(jnp.float32)
            dv[b] += g[2].astype(jnp.float32)
        return (jnp.concatenate(dk, axis=1), jnp.concatenate(dv, axis=1)), tuple(dq)

    def hop(r, carry):
        kv, dkv, dq = carry
        dkv, dq = grads(r, kv, dkv, dq)
        return (*_rotate((kv, dkv), axis, n), dq)

    zeros = functools.partial(jnp.zeros, dtype=jnp.float32)
    carry = ((k, v, seg_kv), (zeros(k.shape), zeros(v.shape)), (zeros(qs[0].shape),) * 2)
    kv, dkv, dq = jax.lax.fori_loop(0, n - 1, hop, carry)
    dkv, dq = grads(n - 1, kv, dkv, dq)
    dkv = _rotate(dkv, axis, n)  # the last keys' gradients go home
    return (jnp.concatenate(dq, axis=1).astype(q.dtype), *(d.astype(k.dtype) for d in dkv))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ring(q, k, v, seg_q, seg_kv, window, opts):
    return _ring_forward(q, k, v, seg_q, seg_kv, window, dict(opts))[0]


def _ring_fwd(q, k, v, seg_q, seg_kv, window, opts):
    out, lse = _ring_forward(q, k, v, seg_q, seg_kv, window, dict(opts))
    return out, (q, k, v, seg_q, seg_kv, window, out, lse)


def _ring_bwd(opts, residuals, dout):
    q, k, v, seg_q, seg_kv, window, out, lse = residuals
    grads = _ring_backward(q, k, v, seg_q, seg_kv, window, out, lse, dout, dict(opts))
    return (*grads, None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis: str = "sp",
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    sliding_window: int | jax.Array | None = None,
    scale: float,
    batch_axes: str | tuple[str, ...] | None = None,
    head_axes: str | tuple[str, ...] | None = None,
    block_q: int = 512,
    block_k: int = 512,
    logit_softcap: float | None = None,
) -> jax.Array:
    """Attention of q [B, T, N, H] over k, v [B, T, K, H] with T in zigzag order over `axis`.

    The sequence axis is split over `axis` (P devices, T divisible by 2P); the batch over
    `batch_axes` and the heads over `head_axes` (both query and kv heads must divide). Masks
    as `jaxrl.kernels.attention` with positions 0..T-1 in natural order; `segment_ids` [B, T]
    (zigzag order too) are shared by queries and keys; `logit_softcap` caps the scores as
    there (every hop's blocks are capped alike, so the merged softmax is the capped one).
    Returns [B, T, N, H] in zigzag order.
    """
    n = mesh.shape[axis]
    zigzag_order(q.shape[1], n)  # validates T
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"ring attention attends a sequence to itself: k {k.shape}, q {q.shape}")
    local_t = q.shape[1] // n // 2
    opts = (
        ("axis", axis),
        ("n", n),
        ("causal", causal),
        ("scale", float(scale)),
        ("block_q", min(block_q, local_t)),
        ("block_k", min(block_k, local_t)),
        ("logit_softcap", check_softcap(logit_softcap)),
    )
    qkv_spec = PartitionSpec(batch_axes, axis, head_axes, None)
    seg_spec = PartitionSpec(batch_axes, axis)

    window = None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32)

    def local(q, k, v, seg, window):
        return _ring(q, k, v, seg, seg, window, opts)

    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            qkv_spec,
            qkv_spec,
            qkv_spec,
            None if segment_ids is None else seg_spec,
            None if window is None else PartitionSpec(),
        ),
        out_specs=qkv_spec,
        check_vma=False,
    )
    return sharded(q, k, v, segment_ids, window)
