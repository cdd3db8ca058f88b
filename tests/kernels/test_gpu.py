"""On a CUDA GPU (marker `gpu`, skipped elsewhere): the Pallas/Triton attention kernels compiled
and run for real at training lengths against the blockwise reference (forward, dq, dk/dv), the
cuDNN path, and KV-cache decode with XLA's GPU backend against teacher-forced argmax.

    JAX_PLATFORMS=cuda python -m pytest -m gpu tests      # benchmarks/gpu_suite.sh runs this

(conftest defaults JAX to the CPU, hence JAX_PLATFORMS=cuda.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels.attention import attention
from jaxrl.kernels.blockwise import blockwise_attention
from jaxrl.kernels.pallas_gpu import pallas_attention
from jaxrl.models import forward, init_params
from jaxrl.rollout import SamplingParams, generate
from jaxrl.testing.tiny import tiny_decoder

pytestmark = pytest.mark.gpu

# Tolerances against the blockwise reference, both accumulating in float32, atol and rtol alike
# (the inputs are unit normals: out, lse and dq are O(1) by construction). bf16 inputs and
# outputs carry 8 significant bits: each rounding is up to 2^-8 = 3.9e-3 relative, and the
# output and the probabilities are rounded (test_attention: < 1.6e-2 for |out| < 4), so 2e-2.
# float32 differs by summation order over 2048 keys in other tiles (and the GPU's exp/log):
# ~sqrt(2048) u ~ 3e-6 relative per sum, 2e-4 leaves room for the GPU's approximate
# transcendental functions (not measurable here: no GPU).
TOL = {jnp.float32: 2e-4, jnp.bfloat16: 2e-2}
# dk and dv sum over all queries (2048, grouped 4 heads per kv head): larger values and more
# rounded terms than out and dq, so 4x the tolerance.
DKV_FACTOR = 4


def _inputs(b, t, n, kh, h, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, t, kh, h), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, t, kh, h), jnp.float32).astype(dtype)
    dout = jax.random.normal(keys[3], (b, t, n, h), jnp.float32).astype(dtype)
    return q, k, v, dout


def _forward_and_grads(fn, q, k, v, dout):
    """(out, lse, dq, dk, dv) of `fn(q, k, v) -> (out, lse)` with cotangent `dout` on out."""
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    dq, dk, dv = vjp((dout, jnp.zeros_like(lse)))
    return out, lse, dq, dk, dv


def _close(got, want, tol):
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t, segments", [(2048, False), (1000, True)])
def test_pallas_compiled_vs_blockwise(dtype, t, segments):
    b, n, kh, h = 2, 8, 2, 64
    q, k, v, dout = _inputs(b, t, n, kh, h, dtype)
    seg = jnp.asarray(np.sort(np.random.RandomState(0).randint(0, 3, (b, t)), 1), jnp.int32)
    masks = dict(causal=True, scale=h**-0.5)
    if segments:
        masks.update(segment_ids_q=seg, segment_ids_kv=seg)
    ours = jax.jit(
        lambda *a: _forward_and_grads(
            lambda q, k, v: pallas_attention(q, k, v, interpret=False, **masks), *a
        )
    )(q, k, v, dout)
    ref = jax.jit(
        lambda *a: _forward_and_grads(
            lambda q, k, v: blockwise_attention(q, k, v, block_q=256, block_k=256, **masks), *a
        )
    )(q, k, v, dout)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), ours, ref, strict=True):
        assert got.dtype == want.dtype, name
        _close(got, want, TOL[dtype] * (DKV_FACTOR if name in ("dk", "dv") else 1))


def test_cudnn_path_vs_blockwise():
    b, t, n, kh, h = 2, 2048, 8, 2, 64
    q, k, v, dout = _inputs(b, t, n, kh, h, jnp.bfloat16)

    def run(impl):
        def loss(q, k, v):
            out = attention(q, k, v, causal=True, implementation=impl)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

        out = attention(q, k, v, causal=True, implementation=impl)
        return out, jax.grad(loss, (0, 1, 2))(q, k, v)

    out, grads = jax.jit(lambda: run("cudnn"))()
    ref_out, ref_grads = jax.jit(lambda: run("blockwise"))()
    _close(out, ref_out, TOL[jnp.bfloat16])
    for got, want in zip(grads, ref_grads, strict=True):
        # all three from cuDNN's fused bf16 backward (its own tiles and roundings of dP, dS):
        # dq at the dk/dv factor too
        _close(got, want, DKV_FACTOR * TOL[jnp.bfloat16])


def test_decode_on_gpu_equals_teacher_forced_argmax():
    """Greedy KV-cache decode (prefill, then one token per step, XLA's GPU kernels) picks the
    argmax of a full forward pass over the same tokens at every position."""
    config = tiny_decoder(
        model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
    )  # fmt: skip
    params = init_params(config, jax.random.key(0), std=0.2)
    rng = np.random.RandomState(0)
    ids = rng.randint(3, config.vocab_size, (4, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # a left-padded prompt
    sp = SamplingParams(do_sample=False, max_tokens=16, ignore_eos=True)
    out = generate(config, params, ids, mask, sp, jax.random.key(1))
    full = np.concatenate([ids, np.asarray(out.responses)], 1)
    full_mask = np.concatenate([mask, np.ones_like(np.asarray(out.responses))], 1)
    logits = forward(config, params, jnp.asarray(full), jnp.asarray(full_mask))
    predicted = np.asarray(jnp.argmax(logits[:, ids.shape[1] - 1 : -1], -1))
    np.testing.assert_array_equal(predicted, np.asarray(out.responses))
    assert jax.default_backend() == "gpu"
