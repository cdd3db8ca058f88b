"""`pallas_gpu` flash attention against a dense float32 reference (forward, lse, gradients),
its block skipping, its input validation, and its CUDA (Triton) lowering on any host.

The kernels run in the Pallas interpreter unless JAX sees a GPU; JAXRL_PALLAS_INTERPRET=0/1
forces compiled / interpreted kernels (run with JAX_PLATFORMS=cuda on a GPU machine, since
conftest defaults JAX to the CPU).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import SOFTCAP, capped_reference

from jaxrl.kernels.pallas_gpu import NEG_INF, pallas_attention, pallas_attention_bwd
from jaxrl.testing.attention import dense_attention

_ENV = os.environ.get("JAXRL_PALLAS_INTERPRET")
INTERPRET = jax.default_backend() != "gpu" if _ENV is None else _ENV != "0"
# Tolerances (DESIGN §6), atol and rtol alike: the inputs are unit normals, so out (a weighted
# mean of rows of v), lse and the gradients are O(1) to O(10) by construction.
# Forward, float32: the same terms (<= 70 keys) summed in another order (the kernel's blocks
# against the dense oracle): ~1e-7 of those magnitudes, measured <= 1.2e-6 (0.04 of it).
F32_TOL = 1e-5
# Gradients, float32: a loss and its gradient (composite, DESIGN's 1e-4); measured <= 2.4e-6,
# 0.015 of it.
GRAD_TOL = 1e-4
# bfloat16 values (8 significant bits) against the float32 oracle on the same values: out and
# the gradients are rounded to bf16 and so are the probabilities before the PV product
# (test_attention: |out - ref| < 1.6e-2 for |out| < 4); measured <= 0.32 of it. lse is float32
# from scores of bf16 inputs (exact products, float32 sums) and takes F32_TOL.
BF16_TOL = 2e-2


def _segments(rng, b, length, n_seg=3):
    return jnp.asarray(np.sort(rng.randint(0, n_seg, (b, length)), axis=1), jnp.int32)


def _inputs(b, t, s, n, kh, h, dtype=jnp.float32, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (b, t, n, h), jnp.float32).astype(dtype),
        jax.random.normal(kk, (b, s, kh, h), jnp.float32).astype(dtype),
        jax.random.normal(kv, (b, s, kh, h), jnp.float32).astype(dtype),
    )


def _case(name):
    """(shape (B, T, S, N, K, H), mask kwargs) of a named test case."""
    rng = np.random.RandomState(0)
    cases = {
        "causal_gqa_n4_k1": ((2, 32, 32, 4, 1, 24), dict(causal=True)),
        "segments": (
            (2, 40, 40, 4, 2, 16),
            dict(causal=True, segment_ids_q=_segments(rng, 2, 40)),
        ),
        "window": ((1, 50, 50, 4, 2, 16), dict(causal=True, sliding_window=7)),
        "non_causal_ragged": ((2, 37, 53, 4, 2, 16), dict(causal=False)),
        "offsets": ((1, 24, 70, 4, 2, 16), dict(causal=True, q_offset=46, kv_offset=3)),
        "window_offsets_non_causal": (
            (1, 30, 45, 2, 1, 16),
            dict(causal=False, sliding_window=9, q_offset=5, kv_offset=-20),
        ),
        # Keys start after the first queries: rows 0..9 have no admissible key.
        "empty_rows": ((1, 40, 40, 4, 2, 16), dict(causal=True, kv_offset=10)),
        "segments_window_ragged": (
            (2, 45, 45, 4, 2, 40),
            dict(causal=True, sliding_window=12, segment_ids_q=_segments(rng, 2, 45)),
        ),
    }
    shape, kwargs = cases[name]
    if "segment_ids_q" in kwargs:
        kwargs["segment_ids_kv"] = kwargs["segment_ids_q"]
    return shape, kwargs


def _reference_kwargs(kwargs, scale):
    return dict(
        causal=kwargs.get("causal", True),
        seg_q=kwargs.get("segment_ids_q"),
        seg_k=kwargs.get("segment_ids_kv"),
        window=kwargs.get("sliding_window"),
        scale=scale,
        q_offset=kwargs.get("q_offset", 0),
        kv_offset=kwargs.get("kv_offset", 0),
    )


# Forward-only cases; GRADIENT_CASES check the forward values as well.
FORWARD_CASES = ["non_causal_ragged", "segments", "window", "offsets", "window_offsets_non_causal"]
GRADIENT_CASES = ["causal_gqa_n4_k1", "segments_window_ragged", "empty_rows"]


def _attention_and_vjp(**opts):
    """jit((q, k, v, dout, dlse) -> (out, lse, dq, dk, dv)) through the kernels: one compile
    per configuration (the interpreter is slow to trace, quick to run once compiled)."""

    @jax.jit
    def run(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(lambda *a: pallas_attention(*a, **opts), q, k, v)
        return out, lse, *vjp((dout, dlse))

    return run


def _reference_grads(kwargs, scale):
    """jit((q, k, v, dout, dlse) -> (dq, dk, dv)) of the dense reference, in float32."""

    @jax.jit
    def run(q, k, v, dout, dlse):
        _, vjp = jax.vjp(
            lambda *a: dense_attention(*a, **_reference_kwargs(kwargs, scale)),
            *(x.astype(jnp.float32) for x in (q, k, v)),
        )
        return vjp((dout.astype(jnp.float32), dlse))

    return run


def _cotangents(q, seed=7):
    """Weights of a random linear function of (out, lse): sum(w_out·out) + sum(w_lse·lse)."""
    k_out, k_lse = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k_out, q.shape, q.dtype), jax.random.normal(k_lse, q.shape[:3])


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_forward_vs_dense(name):
    (b, t, s, n, kh, h), kwargs = _case(name)
    q, k, v = _inputs(b, t, s, n, kh, h)
    scale = h**-0.5
    run = jax.jit(
        lambda q, k, v: pallas_attention(
            q, k, v, scale=scale, block_q=16, block_k=16, interpret=INTERPRET, **kwargs
        )
    )
    out, lse = run(q, k, v)
    ref_out, ref_lse = dense_attention(q, k, v, **_reference_kwargs(kwargs, scale), xp=np)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, t, n) and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_out, atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_allclose(lse, ref_lse, atol=F32_TOL, rtol=F32_TOL)


def test_traced_offsets_and_window_under_jit():
    q, k, v = _inputs(1, 40, 56, 4, 2, 16)
    scale = 0.3

    @jax.jit
    def run(q, k, v, q_offset, kv_offset, window):
        return pallas_attention(
            q,
            k,
            v,
            scale=scale,
            q_offset=q_offset,
            kv_offset=kv_offset,
            sliding_window=window,
            block_q=16,
            block_k=16,
            interpret=INTERPRET,
        )

    for q_offset, kv_offset, window in ((16, 0, 2**30), (20, 7, 11), (0, 5, 3)):
        out, lse = run(q, k, v, jnp.int32(q_offset), jnp.int32(kv_offset), jnp.int32(window))
        ref_out, ref_lse = dense_attention(
            q,
            k,
            v,
            causal=True,
            seg_q=None,
            seg_k=None,
            window=window,
            scale=scale,
            q_offset=q_offset,
            kv_offset=kv_offset,
            xp=np,
        )
        np.testing.assert_allclose(out, ref_out, atol=F32_TOL, rtol=F32_TOL)
        np.testing.assert_allclose(lse, ref_lse, atol=F32_TOL, rtol=F32_TOL)


@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_forward_and_gradients_vs_dense(name):
    (b, t, s, n, kh, h), kwargs = _case(name)
    q, k, v = _inputs(b, t, s, n, kh, h, seed=1)
    scale = h**-0.5
    dout, dlse = _cotangents(q)
    run = _attention_and_vjp(scale=scale, block_q=16, block_k=32, interpret=INTERPRET, **kwargs)
    out, lse, *grads = run(q, k, v, dout, dlse)
    ref_out, ref_lse = dense_attention(q, k, v, **_reference_kwargs(kwargs, scale), xp=np)
    np.testing.assert_allclose(out, ref_out, atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_allclose(lse, ref_lse, atol=F32_TOL, rtol=F32_TOL)
    if name == "empty_rows":
        assert np.all(np.asarray(lse[:, :10]) == NEG_INF)
        assert np.all(np.asarray(out[:, :10]) == 0.0)
    ref_grads = _reference_grads(kwargs, scale)(q, k, v, dout, dlse)
    for name_, g, r in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=f"d{name_}")


def test_softcap_forward_and_gradients_vs_reference():
    """With a logit soft-cap (scores s2 = log2(e)·c·tanh(s / c) in the kernels, tanh' in both
    backward kernels): causal, segments, a window, GQA and a padded head dim."""
    (b, t, s, n, kh, h), kwargs = _case("segments_window_ragged")
    q, k, v = _inputs(b, t, s, n, kh, h, seed=1)
    scale = h**-0.5
    dout, dlse = _cotangents(q)
    opts = dict(scale=scale, block_q=16, block_k=32, interpret=INTERPRET, logit_softcap=SOFTCAP)
    out, lse, *grads = _attention_and_vjp(**opts, **kwargs)(q, k, v, dout, dlse)

    @jax.jit
    def reference(q, k, v, dout, dlse):
        outs, vjp = jax.vjp(
            lambda *a: capped_reference(*a, **_reference_kwargs(kwargs, scale)), q, k, v
        )
        return *outs, *vjp((dout, dlse))

    ref_out, ref_lse, *ref_grads = reference(q, k, v, dout, dlse)
    _, uncapped_lse = dense_attention(q, k, v, **_reference_kwargs(kwargs, scale), xp=np)
    assert np.abs(ref_lse - uncapped_lse).max() > 0.1  # the cap binds
    np.testing.assert_allclose(out, ref_out, atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_allclose(lse, ref_lse, atol=F32_TOL, rtol=F32_TOL)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=f"d{name}")


def test_bfloat16_vs_dense():
    (b, t, s, n, kh, h), kwargs = _case("segments")
    q, k, v = _inputs(b, t, s, n, kh, h, dtype=jnp.bfloat16, seed=2)
    scale = h**-0.5
    dout, dlse = _cotangents(q)
    run = _attention_and_vjp(scale=scale, block_q=16, block_k=16, interpret=INTERPRET, **kwargs)
    out, lse, *grads = run(q, k, v, dout, dlse)
    # The reference sees the same bfloat16 values and computes in float32.
    ref_out, ref_lse = dense_attention(q, k, v, **_reference_kwargs(kwargs, scale), xp=np)
    ref_grads = _reference_grads(kwargs, scale)(q, k, v, dout, dlse)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), ref_out, atol=BF16_TOL, rtol=BF16_TOL)
    np.testing.assert_allclose(lse, ref_lse, atol=F32_TOL, rtol=F32_TOL)  # float32, see above
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            g.astype(jnp.float32), r, atol=BF16_TOL, rtol=BF16_TOL, err_msg=f"d{name}"
        )


def test_external_backward_equals_custom_vjp():
    (b, t, s, n, kh, h), kwargs = _case("segments_window_ragged")
    q, k, v = _inputs(b, t, s, n, kh, h, seed=3)
    opts = dict(scale=h**-0.5, block_q=16, block_k=16, interpret=INTERPRET, **kwargs)
    dout, dlse = _cotangents(q)

    @jax.jit
    def both(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(lambda *a: pallas_attention(*a, **opts), q, k, v)
        return (
            vjp((dout, dlse)),
            pallas_attention_bwd(q, k, v, out, lse, dout, dlse, **opts),
            vjp((dout, jnp.zeros_like(dlse))),
            pallas_attention_bwd(q, k, v, out, lse, dout, **opts),  # dlse=None
        )

    with_dlse, external, without_dlse, external_no_dlse = both(q, k, v, dout, dlse)
    for name, g, e, g0, e0 in zip(
        "qkv", with_dlse, external, without_dlse, external_no_dlse, strict=True
    ):
        # The kernels' custom_vjp backward and pallas_attention_bwd on the same arguments, in
        # one program: the same ops (measured exact); 1e-6 (a few ulps of O(1) values) allows
        # XLA to fuse the two copies differently.
        np.testing.assert_allclose(e, g, atol=1e-6, rtol=1e-6, err_msg=f"d{name}")
        np.testing.assert_allclose(e0, g0, atol=1e-6, rtol=1e-6, err_msg=f"d{name}, no dlse")


def test_masked_blocks_are_never_visited():
    """NaN in blocks that the causal mask or the window rules out must not reach any result:
    a visited block would multiply its NaN values by p = 0 and poison the row."""
    b, t, n, kh, h = 1, 64, 2, 1, 16
    q, k, v = _inputs(b, t, t, n, kh, h, seed=4)
    ones, zeros = jnp.ones_like(q), jnp.zeros(q.shape[:3])
    opts = dict(scale=0.25, causal=True, block_q=16, block_k=16, interpret=INTERPRET)

    def finite(x):
        return bool(np.isfinite(np.asarray(x)).all())

    causal = _attention_and_vjp(**opts)
    # Key block 3 lies after every query of blocks 0-2 (forward and dq loops stop before it).
    nan_k, nan_v = k.at[:, 48:].set(jnp.nan), v.at[:, 48:].set(jnp.nan)
    out, lse, dq, _, _ = causal(q, nan_k, nan_v, ones, zeros + 1.0)
    assert finite(out[:, :48]) and finite(lse[:, :48]) and finite(dq[:, :48])
    # Query block 0 precedes every key of blocks 1-3 (the dk/dv loops start after it).
    _, _, _, dk, dv = causal(q.at[:, :16].set(jnp.nan), k, v, ones.at[:, :16].set(0.0), zeros)
    assert finite(dk[:, 16:]) and finite(dv[:, 16:])
    # Window 8: key block 0 is out of reach of query rows >= 32 (loops start after it).
    windowed = _attention_and_vjp(**opts, sliding_window=8)
    out, lse, dq, _, _ = windowed(q, k.at[:, :16].set(jnp.nan), v, ones, zeros + 1.0)
    assert finite(out[:, 32:]) and finite(lse[:, 32:]) and finite(dq[:, 32:])
    # ... and query block 2 onwards is out of reach of key block 0 (dk/dv loops stop before).
    nan_q = q.at[:, 32:].set(jnp.nan)
    _, _, _, dk, dv = windowed(nan_q, k, v, ones.at[:, 32:].set(0.0), zeros)
    assert finite(dk[:, :16]) and finite(dv[:, :16])


def _bad_calls():
    q, k, v = _inputs(1, 16, 16, 4, 2, 16)
    seg = jnp.zeros((1, 16), jnp.int32)
    ok = dict(scale=0.25)
    return [
        ("q must be 4-D", (q[0], k, v), ok),
        ("same shape", (q, k, v[:, :8]), ok),
        ("share batch and head dim", (q, k[..., :8], v[..., :8]), ok),
        ("multiple of kv heads", (q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)), ok),
        ("given together", (q, k, v), dict(ok, segment_ids_q=seg)),
        ("segment_ids_kv must be", (q, k, v), dict(ok, segment_ids_q=seg, segment_ids_kv=seg[0])),
        ("block_q=48", (q, k, v), dict(ok, block_q=48)),
        ("block_k=8", (q, k, v), dict(ok, block_k=8)),
        ("head dim H=512", (q.repeat(32, 3), k.repeat(32, 3), v.repeat(32, 3)), ok),
        ("share one of float32", (q, k.astype(jnp.bfloat16), v), ok),
        ("sliding_window=0", (q, k, v), dict(ok, sliding_window=0)),
        ("q_offset must be", (q, k, v), dict(ok, q_offset=1.5)),
        ("scale must be a python float", (q, k, v), dict(scale=jnp.float32(0.3))),
        ("logit_softcap=0.0 must be > 0", (q, k, v), dict(ok, logit_softcap=0.0)),
    ]


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("match,args,kwargs", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_is_refused(match, args, kwargs):
    with pytest.raises(ValueError, match=match):
        pallas_attention(*args, interpret=True, **kwargs)


def test_bad_backward_input_is_refused():
    q, k, v = _inputs(1, 16, 16, 2, 2, 16)
    with pytest.raises(ValueError, match="lse has shape"):
        pallas_attention_bwd(q, k, v, q, q[..., 0].T, q, scale=0.25)
    with pytest.raises(ValueError, match="unknown keyword"):
        pallas_attention_bwd(q, k, v, q, q[..., 0], q, scale=0.25, softmax_scale=0.2)


@pytest.mark.parametrize("masks", ["segments_window_traced", "causal_ragged"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cuda_lowering(dtype, masks, monkeypatch):
    """The real Triton lowering (interpret=False) runs on any host: forward and gradient, with
    GQA and a head dim padded to 64; with segment ids, traced offsets and window, or causal
    alone with a ragged key length (so the mask-free loops are lowered too)."""
    from jax._src.lib import triton as jaxlib_triton
    from jax._src.lib import version as jaxlib_version
    from jax._src.pallas.triton import lowering as triton_lowering

    # jaxlib 0.10.2 leaves Triton IR -> PTX to XLA:GPU (custom call __gpu$xla.gpu.triton);
    # some later ones compile to PTX while lowering, through a handler the CUDA plugin
    # installs; jaxlib 0.11.2 (the GPU machine's, 2026-11-26) has no such query and lowers.
    has_handler = getattr(jaxlib_triton, "has_compilation_handler", None)
    if jaxlib_version > (0, 10, 2) and has_handler is not None and not has_handler("cuda"):
        pytest.skip("this jaxlib lowers Pallas Triton only with the CUDA plugin installed")

    # Keep the Triton modules to verify them (where this private hook exists).
    modules = []
    hooked = hasattr(triton_lowering, "lower_jaxpr_to_triton_module")
    if hooked:
        lower_module = triton_lowering.lower_jaxpr_to_triton_module

        def keep_module(*args, **kwargs):
            result = lower_module(*args, **kwargs)
            modules.append(result.module)
            return result

        monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", keep_module)
    b, t, s, n, kh, h = 2, 200, 200, 8, 2, 40
    if masks == "causal_ragged":
        t, s = 256, 300
    q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
    kv = jax.ShapeDtypeStruct((b, s, kh, h), dtype)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)

    def loss(q, k, v, seg, offset, window):
        opts = dict(segment_ids_q=seg, segment_ids_kv=seg, q_offset=offset, kv_offset=offset)
        if masks == "segments_window_traced":
            opts["sliding_window"] = window
        else:
            opts = dict(q_offset=s - t)
        out, lse = pallas_attention(q, k, v, scale=h**-0.5, block_q=64, block_k=32, **opts)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    args = (q, kv, kv, seg, scalar, scalar)
    for fn, kernels in ((loss, 1), (jax.grad(loss, (0, 1, 2)), 3)):
        modules.clear()
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        # jaxlib <= 0.10.2 emits XLA's Triton custom call; later ones compile the kernel
        # while lowering and emit triton_kernel_call_ffi.
        calls = text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call_ffi")
        assert calls == kernels, text[:2000]
        if hooked:
            assert len(modules) == kernels
            for module in modules:  # the Triton IR is well formed (types, tt.dot shapes...)
                assert module.operation.verify()
