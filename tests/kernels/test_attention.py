"""`jaxrl.kernels.attention`: blockwise (and the entry point's other implementations) equal the
dense reference, outputs, log-sum-exp and gradients, with Gemma 2's logit soft-cap too (the capped
reference against transformers' own); refusals name the problem."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels import attention, cpu_decode, decode_attention, extend_attention
from jaxrl.kernels.attention import _mask_bts, _reference
from jaxrl.kernels.blockwise import NEG_INF, blockwise_attention, blockwise_backward, softcap
from jaxrl.testing.attention import dense_attention
from jaxrl.testing.numerics import assert_close_to_scale

SCALE = 0.3
# Tolerances (DESIGN §6). The inputs are unit normals, so the outputs' magnitudes are fixed by
# construction: `out` is a softmax-weighted mean of rows of v (|out| <= max|v| < 5) and `lse` a
# log-sum-exp of scores SCALE q.k (|lse| < 10). Blockwise (online softmax over blocks) and the
# dense oracle add the same float32 terms (<= 70 keys) in another order: ~1e-7 of those
# magnitudes, measured <= 1.1e-6 under both XLA CPU configurations.
OUT_ATOL = 1e-5  # 9x the measured error
LSE_TOL = dict(atol=1e-5, rtol=1e-6)  # likewise; rtol for |lse| up to 10
# The gradients' magnitudes vary with the case (up to ~6): relative to the reference's scale.
# A loss and its gradient, float32: measured <= 5.5e-7 of the scale; 1e-5 leaves 18x.
GRAD_RTOL = 1e-5
# bfloat16 inputs against the float32 oracle on the same bf16 values: the output is rounded to
# bf16 (half an ulp: <= 7.8e-3 for |out| < 4) and the probabilities are rounded to bf16 before
# the PV product (2^-9 of sum p |v| <= 2^-9 max|v| < 8e-3), so |out - ref| < 1.6e-2 in the
# worst case (measured 7.3e-3). The gradients go through a few such roundings (p and dS before
# their products, the result), relative to their scale: measured 6.7e-3 of it.
BF16_TOL = 2e-2
# Gemma 2's logit soft-cap in the capped tests, small enough to bind: the scores SCALE q.k of
# these unit normals (H=16) reach |s| ~ 5 and are squashed into (-2, 2).
SOFTCAP = 2.0


def dense(
    q, k, v, *, causal=True, seg_q=None, seg_kv=None, window=None, q_offset=0, kv_offset=0, xp=jnp
):
    """(out, lse) by the definition (`jaxrl.testing.attention`), at this file's scale; `xp=np`
    for a forward-only reference (numpy: nothing to compile)."""
    return dense_attention(q, k, v, scale=SCALE, causal=causal, seg_q=seg_q, seg_k=seg_kv,
                           window=window, q_offset=q_offset, kv_offset=kv_offset,
                           xp=xp)  # fmt: skip


def capped_reference(
    q, k, v, *, scale=SCALE, causal=True, seg_q=None, seg_k=None, window=None, q_offset=0,
    kv_offset=0, cap=SOFTCAP,
):  # fmt: skip
    """(out, lse) with the scores capped to cap · tanh(s / cap), arguments as `dense_attention`:
    out is `attention._reference`'s (the oracle), lse = log sum_s exp(capped s) over the
    admissible keys (the kernels return it too; no row here is without keys)."""
    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    seg = (seg_q, seg_k)
    out = _reference(q, k, v, causal, seg, window, scale, q_offset, kv_offset, cap)
    k_bsnh = jnp.repeat(k.astype(jnp.float32), n // kh, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k_bsnh) * scale
    mask = _mask_bts(b, t, s, causal, seg, window, q_offset, kv_offset)[:, None]
    lse = jax.nn.logsumexp(jnp.where(mask, softcap(scores, cap), -jnp.inf), axis=-1)
    return out, jnp.swapaxes(lse, 1, 2)


def weighted(fn, w_out, w_lse):
    """(q, k, v) -> sum(w_out * out) + sum(w_lse * lse) of `fn(q, k, v) -> (out, lse)`."""

    def loss(q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)

    return loss


def inputs(b, t, s, n, kh, h=16, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=shape) for shape in ((b, t, n, h), (b, s, kh, h), (b, s, kh, h)))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def packed_segments(b, t, seed=0):
    """Sorted segment ids (packed rows), each row starting a segment at 0."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(1, t, size=(b, 3)), axis=1)
    return jnp.asarray((np.arange(t)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)


# (t, s, n, kh, causal, segments, window, q_offset, kv_offset, block_q, block_k)
CASES = {
    "causal": (37, 37, 4, 2, True, False, None, 0, 0, 8, 16),
    "non_causal_gqa_1": (40, 53, 4, 1, False, False, None, 0, 0, 16, 8),
    "segments": (33, 33, 4, 2, True, True, None, 0, 0, 8, 8),
    "segments_non_causal": (33, 33, 4, 4, False, True, None, 0, 0, 16, 8),
    "window": (45, 45, 4, 2, True, False, 7, 0, 0, 8, 8),
    "window_segments": (30, 30, 2, 1, True, True, 5, 0, 0, 8, 16),
    "q_offset": (20, 50, 4, 2, True, False, None, 30, 0, 8, 16),
    "kv_offset_chunk": (24, 24, 4, 2, True, False, None, 48, 24, 8, 8),
    "one_block": (19, 19, 4, 2, True, False, None, 0, 0, 512, 512),
}


def _call(case, q, k, v, seg, **kw):
    *_, causal, _, window, q_off, kv_off, bq, bk = case
    return blockwise_attention(
        q, k, v, causal=causal, segment_ids_q=seg, segment_ids_kv=seg, sliding_window=window,
        scale=SCALE, q_offset=q_off, kv_offset=kv_off, block_q=bq, block_k=bk, **kw,
    )  # fmt: skip


def _call_capped(case, q, k, v, seg):
    return _call(case, q, k, v, seg, logit_softcap=SOFTCAP)


def _capped_reference(case, q, k, v, seg):
    _, _, _, _, causal, _, window, q_off, kv_off, _, _ = case
    return capped_reference(q, k, v, causal=causal, seg_q=seg, seg_k=seg, window=window,
                            q_offset=q_off, kv_offset=kv_off)  # fmt: skip


def _dense(case, q, k, v, seg):
    _, _, _, _, causal, _, window, q_off, kv_off, _, _ = case
    return dense(q, k, v, causal=causal, seg_q=seg, seg_kv=seg, window=window, q_offset=q_off,
                 kv_offset=kv_off)  # fmt: skip


def _segments(case, b):
    t, s, *_ = case
    return packed_segments(b, t) if case[5] and t == s else None


@functools.partial(jax.jit, static_argnums=(0, 1))
def _outputs_and_grads(fn, case, q, k, v, seg, w_out, w_lse):
    """(out, lse) of `fn(case, q, k, v, seg)` and the gradients in (q, k, v) of
    sum(w_out * out) + sum(w_lse * lse), in one program (run eagerly, the dense oracle's ops
    and their gradients would each compile on their own: ~80 programs per case)."""
    loss = weighted(lambda *a: fn(case, *a, seg), w_out, w_lse)
    return fn(case, q, k, v, seg), jax.grad(loss, (0, 1, 2))(q, k, v)


@pytest.mark.parametrize("name", list(CASES))
def test_blockwise_equals_dense(name):
    _assert_equals_oracle(CASES[name], _call, _dense)


def test_blockwise_softcap_equals_reference():
    """With a logit soft-cap: the forward caps every block's scores, the backward goes through
    the tanh (causal, segments, a window, GQA)."""
    _assert_equals_oracle(CASES["window_segments"], _call_capped, _capped_reference)


def _assert_equals_oracle(case, fn, oracle):
    """`fn` and `oracle` ((case, q, k, v, seg) -> (out, lse)) agree on the case's inputs."""
    t, s, n, kh = case[:4]
    q, k, v = inputs(2, t, s, n, kh)
    seg = _segments(case, 2)
    # Gradients of a random function of both outputs (the lse cotangent is what ring uses).
    rng = np.random.default_rng(1)
    w_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)
    (out, lse), grads = _outputs_and_grads(fn, case, q, k, v, seg, w_out, w_lse)
    (ref_out, ref_lse), ref_grads = _outputs_and_grads(oracle, case, q, k, v, seg, w_out, w_lse)
    np.testing.assert_allclose(out, ref_out, atol=OUT_ATOL)
    np.testing.assert_allclose(lse, ref_lse, **LSE_TOL)
    for name_, g, ref in zip("qkv", grads, ref_grads, strict=True):
        assert_close_to_scale(g, ref, rtol=GRAD_RTOL, what=f"d{name_}")


def test_traced_offsets_and_window_under_jit():
    case = CASES["window"]
    q, k, v = inputs(1, 24, 24, 4, 2)

    @jax.jit
    def run(q_off, kv_off, window):
        return blockwise_attention(q, k, v, scale=SCALE, sliding_window=window, q_offset=q_off,
                                   kv_offset=kv_off, block_q=8, block_k=8)[0]  # fmt: skip

    for q_off, kv_off, window in ((24, 0, 9), (0, 0, 3), (48, 40, 30)):
        ref, _ = dense(q, k, v, window=window, q_offset=q_off, kv_offset=kv_off, xp=np)
        np.testing.assert_allclose(run(q_off, kv_off, window), ref, atol=OUT_ATOL)
    del case


def test_external_backward_equals_custom_vjp():
    q, k, v = inputs(2, 40, 40, 4, 2)
    kw = dict(scale=SCALE, block_q=16, block_k=8)

    @jax.jit
    def both(q, k, v, dout, cot_lse):
        """(the custom_vjp's gradients, blockwise_backward's) in one program."""
        (out, lse), vjp = jax.vjp(lambda q, k, v: blockwise_attention(q, k, v, **kw), q, k, v)
        return vjp((dout, cot_lse)), blockwise_backward(q, k, v, out, lse, dout, cot_lse, **kw)

    dout = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    dlse = jnp.asarray(np.random.default_rng(3).normal(size=q.shape[:3]), jnp.float32)
    for cot_lse in (jnp.zeros_like(dlse), dlse):
        expected, got = both(q, k, v, dout, cot_lse)
        for a, b in zip(got, expected, strict=True):
            # The custom_vjp's backward is blockwise_backward on the same arguments: the same
            # ops (measured exact); 1e-6 (a few ulps of |grad| < 10) lets XLA fuse the two
            # copies differently.
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_rows_without_keys_give_zero_and_neg_inf():
    q, k, v = inputs(1, 8, 8, 2, 1)
    run = jax.jit(functools.partial(blockwise_attention, scale=SCALE, block_q=4, block_k=4))
    out, lse = run(q, k, v, kv_offset=100)
    assert not jnp.any(out) and jnp.all(lse == NEG_INF)
    grads = jax.jit(jax.grad(lambda q: blockwise_attention(q, k, v, scale=SCALE,
                                                           kv_offset=100)[0].sum()))  # fmt: skip
    assert not jnp.any(grads(q))


def test_bfloat16_close_to_float32_dense():
    q, k, v = inputs(2, 70, 70, 4, 2, dtype=jnp.bfloat16)
    seg = packed_segments(2, 70)
    kw = dict(scale=SCALE, segment_ids_q=seg, segment_ids_kv=seg, block_q=16, block_k=32)

    def loss(q, k, v):
        return jnp.sum(blockwise_attention(q, k, v, **kw)[0].astype(jnp.float32) ** 2)

    run = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    (val, grads) = run(q, k, v)
    ref_val, ref_grads = jax.jit(jax.value_and_grad(
        lambda q, k, v: jnp.sum(dense(q, k, v, seg_q=seg, seg_kv=seg)[0] ** 2), (0, 1, 2)
    ))(*(x.astype(jnp.float32) for x in (q, k, v)))  # fmt: skip
    out = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, scale=SCALE, segment_ids_q=seg,
                                                      segment_ids_kv=seg)[0])(q, k, v)  # fmt: skip
    assert out.dtype == jnp.bfloat16
    ref_out = dense(q, k, v, seg_q=seg, seg_kv=seg, xp=np)[0]
    np.testing.assert_allclose(out.astype(jnp.float32), ref_out, atol=BF16_TOL)
    # A sum of 8960 squares of such outputs, whose roundings average out (measured 6.6e-5
    # relative); BF16_TOL, the elementwise worst case above, is a loose bound for it.
    np.testing.assert_allclose(val, ref_val, rtol=BF16_TOL)
    for name, g, ref in zip("qkv", grads, ref_grads, strict=True):
        assert_close_to_scale(g, ref, rtol=BF16_TOL, what=f"d{name}")


# ----------------------------------------------------------------------- the entry point


@pytest.mark.parametrize("implementation", ["reference", "blockwise", "pallas_gpu", "auto"])
def test_entry_point_implementations_agree(implementation, monkeypatch):
    monkeypatch.setenv("JAXRL_PALLAS_INTERPRET", "1")  # no GPU here: interpret the kernel
    q, k, v = inputs(2, 50, 50, 4, 2)
    seg = packed_segments(2, 50)
    run = jax.jit(functools.partial(attention, sliding_window=20, softmax_scale=SCALE,
                                    implementation=implementation))  # fmt: skip
    out = run(q, k, v, segment_ids=seg)
    ref, _ = dense(q, k, v, seg_q=seg, seg_kv=seg, window=20, xp=np)
    np.testing.assert_allclose(out, ref, atol=OUT_ATOL)


def test_entry_point_offsets_and_segment_pairs():
    q, k, v = inputs(2, 10, 30, 4, 2)
    seg_q = jnp.ones((2, 10), jnp.int32)
    seg_kv = jnp.asarray(np.r_[np.zeros(5), np.ones(25)][None].repeat(2, 0), jnp.int32)
    ref, _ = dense(q, k, v, seg_q=seg_q, seg_kv=seg_kv, q_offset=20, kv_offset=0, xp=np)
    for impl in ("reference", "blockwise"):
        run = jax.jit(functools.partial(attention, softmax_scale=SCALE, q_offset=20,
                                        implementation=impl))  # fmt: skip
        out = run(q, k, v, segment_ids=(seg_q, seg_kv))
        np.testing.assert_allclose(out, ref, atol=OUT_ATOL, err_msg=impl)


@pytest.mark.parametrize("implementation", ["reference", "blockwise"])
def test_rows_without_keys_are_zero_in_every_implementation(implementation):
    q, k, v = inputs(1, 8, 8, 2, 1)
    run = jax.jit(functools.partial(attention, kv_offset=4, softmax_scale=SCALE,
                                    implementation=implementation))  # fmt: skip
    out = run(q, k, v)
    ref, _ = dense(q, k, v, kv_offset=4, xp=np)
    assert not jnp.any(out[:, :4])
    np.testing.assert_allclose(out, ref, atol=OUT_ATOL)


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_window_means_keys_behind(causal):
    """The window tuple given to `jax.nn.dot_product_attention` (checked through its XLA
    implementation here: no GPU) limits only keys behind the query, as the oracle does."""
    from jaxrl.kernels.attention import cudnn_window

    q, k, v = inputs(1, 12, 12, 4, 2)
    window = cudnn_window(3, causal, 12)
    run = jax.jit(functools.partial(jax.nn.dot_product_attention, scale=SCALE, is_causal=causal,
                                    local_window_size=window, implementation="xla"))  # fmt: skip
    out = run(q, k, v)
    ref = dense(q, k, v, causal=causal, window=3, xp=np)[0]
    np.testing.assert_allclose(out, ref, atol=OUT_ATOL)


def test_reference_softcap_equals_transformers_gemma2():
    """`_reference` with a logit soft-cap equals transformers' Gemma 2 eager attention (torch,
    float32) under its additive causal mask, grouped-query heads."""
    import torch
    from transformers.models.gemma2 import modeling_gemma2

    q, k, v = inputs(2, 12, 12, 4, 2)
    run = functools.partial(attention, softmax_scale=SCALE, implementation="reference")
    out = jax.jit(functools.partial(run, logit_softcap=SOFTCAP))(q, k, v)
    # What eager_attention_forward reads of its module (head_dim only when scaling is None).
    module = types.SimpleNamespace(num_key_value_groups=2, training=False)
    mask = torch.full((12, 12), torch.finfo(torch.float32).min).triu(diagonal=1)[None, None]

    def to_bnth(x):
        return torch.tensor(np.asarray(x)).transpose(1, 2)

    want, _ = modeling_gemma2.eager_attention_forward(
        module, to_bnth(q), to_bnth(k), to_bnth(v), mask, scaling=SCALE, softcap=SOFTCAP
    )
    # Both float32 with the same elementwise steps (scale, cap, mask, softmax, weighted sum of
    # <= 12 rows of v, |out| < 4): they differ by the summation order and tanh's last ulps,
    # measured 3.6e-7; OUT_ATOL (1e-5) leaves 28x, and the cap moves out by ~1 (checked below).
    np.testing.assert_allclose(out, want.numpy(), atol=OUT_ATOL)
    assert np.abs(out - jax.jit(run)(q, k, v)).max() > 0.1  # the cap binds


def test_decode_and_extend_softcap_equal_reference():
    """`decode_attention` (in blocks and as one block) and `extend_attention` with a logit
    soft-cap (applied to the pre-scaled query's scores) equal the capped `_reference`: rows at
    different cache indices, left padding, a sliding window."""
    b, c, n, kh, t = 3, 64, 4, 2, 3
    q, k, v = inputs(b, t, c, n, kh)
    query_index = np.array([5, 40, 23])
    valid = np.arange(c)[None] < query_index[:, None] + t  # the extended tokens are cached
    valid[1, :7] = False  # left padding
    k_bkhc, v_bkch = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
    kw = dict(sliding_window=9, softmax_scale=SCALE, logit_softcap=SOFTCAP)
    decode = jax.jit(functools.partial(decode_attention, live=41, **kw), static_argnames="block")
    extend = jax.jit(functools.partial(extend_attention, **kw))
    decoded = [decode(q[:, :1], k_bkhc, v_bkch, valid, query_index, block=blk) for blk in (16, c)]
    extended = extend(q, k_bkhc, v_bkch, valid, query_index[:, None] + np.arange(t))
    reference = jax.jit(functools.partial(attention, implementation="reference", **kw))
    for row in range(b):
        i, rows = int(query_index[row]), slice(row, row + 1)
        seg_kv = jnp.asarray(valid[rows], jnp.int32)
        for got, queries in ((decoded[0], 1), (decoded[1], 1), (extended, t)):
            seg = (jnp.ones((1, queries), jnp.int32), seg_kv)
            want = reference(q[rows, :queries], k[rows], v[rows], segment_ids=seg, q_offset=i)
            # <= 64 float32 terms in another order, q scaled before the dot: measured 2.5e-7
            np.testing.assert_allclose(got[rows], want, atol=OUT_ATOL)


def test_auto_chooses_blockwise_for_long_sequences():
    from jaxrl.kernels.attention import BLOCKWISE_MIN_LENGTH, _choose

    assert _choose(BLOCKWISE_MIN_LENGTH - 1) == "reference"
    assert _choose(BLOCKWISE_MIN_LENGTH) == "blockwise"


def test_refusals_name_the_problem():
    q, k, v = inputs(1, 8, 8, 4, 2)
    seg = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="not available"):
        attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match=r"cudnn.*segment ids"):
        attention(q, k, v, segment_ids=seg, implementation="cudnn")
    with pytest.raises(ValueError, match=r"cudnn.*offsets"):
        attention(q, k, v, q_offset=3, implementation="cudnn")
    with pytest.raises(ValueError, match=r"cudnn.*logit_softcap.*'pallas_gpu' or 'blockwise'"):
        attention(q, k, v, logit_softcap=SOFTCAP, implementation="cudnn")
    for cap in (0.0, -1.0):
        with pytest.raises(ValueError, match=r"logit_softcap=.* must be > 0"):
            attention(q, k, v, logit_softcap=cap)
    with pytest.raises(ValueError, match=r"logit_softcap must be a python float"):
        attention(q, k, v, logit_softcap=jnp.float32(SOFTCAP))
    with pytest.raises(ValueError, match=r"cpu_decode.layer has no logit_softcap.*xla"):
        cpu_decode.layer({}, 0, *[None] * 7, eps=1e-6, window=0, qk_norm=False,
                         logit_softcap=SOFTCAP)  # fmt: skip
    with pytest.raises(ValueError, match=r"ring.*sp"):
        attention(q, k, v, implementation="ring")
    with pytest.raises(ValueError, match="both queries and keys"):
        blockwise_attention(q, k, v, scale=1.0, segment_ids_q=seg)
    with pytest.raises(ValueError, match=r"needs a CUDA GPU.*JAXRL_PALLAS_INTERPRET"):
        attention(q, k, v, implementation="pallas_gpu")
    long_k, long_v = k.repeat(3, axis=1), v.repeat(3, axis=1)
    with pytest.raises(ValueError, match="pass a pair"):
        attention(q, long_k, long_v, segment_ids=seg, implementation="blockwise")
    with pytest.raises(ValueError, match=r"segment ids must be \[B, T\]"):
        blockwise_attention(q, long_k, long_v, scale=1.0, segment_ids_q=seg, segment_ids_kv=seg)
    with pytest.raises(ValueError, match="q_offset must be one integer"):
        blockwise_attention(q, k, v, scale=1.0, q_offset=jnp.zeros(1, jnp.int32))
