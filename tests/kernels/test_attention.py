"""`jaxrl.kernels.attention`: blockwise (and the entry point's other implementations) equal the
dense reference, outputs, log-sum-exp and gradients; refusals name the problem."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels import attention
from jaxrl.kernels.blockwise import NEG_INF, blockwise_attention, blockwise_backward
from jaxrl.testing.attention import dense_attention

SCALE = 0.3


def dense(q, k, v, *, causal=True, seg_q=None, seg_kv=None, window=None, q_offset=0, kv_offset=0):
    """(out, lse) by the definition (`jaxrl.testing.attention`), at this file's scale."""
    return dense_attention(q, k, v, scale=SCALE, causal=causal, seg_q=seg_q, seg_k=seg_kv,
                           window=window, q_offset=q_offset, kv_offset=kv_offset)  # fmt: skip


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


def _call(case, q, k, v, seg):
    *_, causal, _, window, q_off, kv_off, bq, bk = case
    return blockwise_attention(
        q, k, v, causal=causal, segment_ids_q=seg, segment_ids_kv=seg, sliding_window=window,
        scale=SCALE, q_offset=q_off, kv_offset=kv_off, block_q=bq, block_k=bk,
    )  # fmt: skip


def _dense(case, q, k, v, seg):
    _, _, _, _, causal, _, window, q_off, kv_off, _, _ = case
    return dense(q, k, v, causal=causal, seg_q=seg, seg_kv=seg, window=window, q_offset=q_off,
                 kv_offset=kv_off)  # fmt: skip


def _segments(case, b):
    t, s, *_ = case
    return packed_segments(b, t) if case[5] and t == s else None


@pytest.mark.parametrize("name", list(CASES))
def test_blockwise_equals_dense(name):
    case = CASES[name]
    t, s, n, kh = case[:4]
    q, k, v = inputs(2, t, s, n, kh)
    seg = _segments(case, 2)
    out, lse = jax.jit(lambda q, k, v: _call(case, q, k, v, seg))(q, k, v)
    ref_out, ref_lse = _dense(case, q, k, v, seg)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5, rtol=1e-6)

    # Gradients of a random function of both outputs (the lse cotangent is what ring uses).
    rng = np.random.default_rng(1)
    w_out = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=lse.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v)[0] * w_out) + jnp.sum(fn(q, k, v)[1] * w_lse)

    grads = jax.jit(jax.grad(loss(lambda *a: _call(case, *a, seg)), (0, 1, 2)))(q, k, v)
    ref_grads = jax.grad(loss(lambda *a: _dense(case, *a, seg)), (0, 1, 2))(q, k, v)
    for g, ref in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-4)


def test_traced_offsets_and_window_under_jit():
    case = CASES["window"]
    q, k, v = inputs(1, 24, 24, 4, 2)

    @jax.jit
    def run(q_off, kv_off, window):
        return blockwise_attention(q, k, v, scale=SCALE, sliding_window=window, q_offset=q_off,
                                   kv_offset=kv_off, block_q=8, block_k=8)[0]  # fmt: skip

    for q_off, kv_off, window in ((24, 0, 9), (0, 0, 3), (48, 40, 30)):
        ref, _ = dense(q, k, v, window=window, q_offset=q_off, kv_offset=kv_off)
        np.testing.assert_allclose(run(q_off, kv_off, window), ref, atol=1e-5)
    del case


def test_external_backward_equals_custom_vjp():
    q, k, v = inputs(2, 40, 40, 4, 2)
    kw = dict(scale=SCALE, block_q=16, block_k=8)
    (out, lse), vjp = jax.vjp(lambda q, k, v: blockwise_attention(q, k, v, **kw), q, k, v)
    dout = jnp.asarray(np.random.default_rng(2).normal(size=out.shape), jnp.float32)
    dlse = jnp.asarray(np.random.default_rng(3).normal(size=lse.shape), jnp.float32)
    for cot_lse in (jnp.zeros_like(lse), dlse):
        expected = vjp((dout, cot_lse))
        got = blockwise_backward(q, k, v, out, lse, dout, cot_lse, **kw)
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_rows_without_keys_give_zero_and_neg_inf():
    q, k, v = inputs(1, 8, 8, 2, 1)
    out, lse = blockwise_attention(q, k, v, scale=SCALE, kv_offset=100, block_q=4, block_k=4)
    assert not jnp.any(out) and jnp.all(lse == NEG_INF)
    grads = jax.grad(lambda q: blockwise_attention(q, k, v, scale=SCALE, kv_offset=100)[0].sum())
    assert not jnp.any(grads(q))


def test_bfloat16_close_to_float32_dense():
    q, k, v = inputs(2, 70, 70, 4, 2, dtype=jnp.bfloat16)
    seg = packed_segments(2, 70)
    kw = dict(scale=SCALE, segment_ids_q=seg, segment_ids_kv=seg, block_q=16, block_k=32)

    def loss(q, k, v):
        return jnp.sum(blockwise_attention(q, k, v, **kw)[0].astype(jnp.float32) ** 2)

    run = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    (val, grads) = run(q, k, v)
    ref_val, ref_grads = jax.value_and_grad(
        lambda q, k, v: jnp.sum(dense(q, k, v, seg_q=seg, seg_kv=seg)[0] ** 2), (0, 1, 2)
    )(*(x.astype(jnp.float32) for x in (q, k, v)))
    out = blockwise_attention(q, k, v, scale=SCALE, segment_ids_q=seg, segment_ids_kv=seg)[0]
    assert out.dtype == jnp.bfloat16
    ref_out = dense(q, k, v, seg_q=seg, seg_kv=seg)[0]
    np.testing.assert_allclose(out.astype(jnp.float32), ref_out, atol=2e-2)
    np.testing.assert_allclose(val, ref_val, rtol=2e-2)
    for g, ref in zip(grads, ref_grads, strict=True):
        scale = float(jnp.abs(ref).max())
        np.testing.assert_allclose(g.astype(jnp.float32) / scale, ref / scale, atol=2e-2)


# ----------------------------------------------------------------------- the entry point


@pytest.mark.parametrize("implementation", ["reference", "blockwise", "pallas_gpu", "auto"])
def test_entry_point_implementations_agree(implementation, monkeypatch):
    monkeypatch.setenv("JAXRL_PALLAS_INTERPRET", "1")  # no GPU here: interpret the kernel
    q, k, v = inputs(2, 50, 50, 4, 2)
    seg = packed_segments(2, 50)
    out = attention(q, k, v, segment_ids=seg, sliding_window=20, softmax_scale=SCALE,
                    implementation=implementation)  # fmt: skip
    ref, _ = dense(q, k, v, seg_q=seg, seg_kv=seg, window=20)
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_entry_point_offsets_and_segment_pairs():
    q, k, v = inputs(2, 10, 30, 4, 2)
    seg_q = jnp.ones((2, 10), jnp.int32)
    seg_kv = jnp.asarray(np.r_[np.zeros(5), np.ones(25)][None].repeat(2, 0), jnp.int32)
    ref, _ = dense(q, k, v, seg_q=seg_q, seg_kv=seg_kv, q_offset=20, kv_offset=0)
    for impl in ("reference", "blockwise"):
        out = attention(q, k, v, segment_ids=(seg_q, seg_kv), softmax_scale=SCALE, q_offset=20,
                        implementation=impl)  # fmt: skip
        np.testing.assert_allclose(out, ref, atol=1e-5, err_msg=impl)


@pytest.mark.parametrize("implementation", ["reference", "blockwise"])
def test_rows_without_keys_are_zero_in_every_implementation(implementation):
    q, k, v = inputs(1, 8, 8, 2, 1)
    out = attention(q, k, v, kv_offset=4, softmax_scale=SCALE, implementation=implementation)
    ref, _ = dense(q, k, v, kv_offset=4)
    assert not jnp.any(out[:, :4])
    np.testing.assert_allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_window_means_keys_behind(causal):
    """The window tuple given to `jax.nn.dot_product_attention` (checked through its XLA
    implementation here: no GPU) limits only keys behind the query, as the oracle does."""
    from jaxrl.kernels.attention import cudnn_window

    q, k, v = inputs(1, 12, 12, 4, 2)
    window = cudnn_window(3, causal, 12)
    out = jax.nn.dot_product_attention(
        q, k, v, scale=SCALE, is_causal=causal, local_window_size=window, implementation="xla"
    )
    np.testing.assert_allclose(out, dense(q, k, v, causal=causal, window=3)[0], atol=1e-5)


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
