"""The decode step's C++ CPU kernels (`jaxrl.kernels.cpu_decode`) against XLA's decode step:
the matmul against `jnp.matmul`, and whole generations (every layer variant: biases, q/k norm,
sliding windows, GQA / MQA, left padding, slot refills) with the kernels on and off."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl.models as M
from jaxrl.kernels import cpu_decode
from jaxrl.rollout import RolloutEngine, SamplingParams, generate
from jaxrl.rollout.backends import CpuKernelsBackend, XlaBackend, choose_backend
from jaxrl.rollout.generation import _compiled, bucket
from jaxrl.testing.numerics import COMPOSITE_RTOL
from jaxrl.testing.tiny import save_tiny

pytestmark = pytest.mark.skipif(
    not cpu_decode.enabled(jnp.float32), reason="CPU decode kernels unavailable (no compiler)"
)

# Tiny models whose head_dim (16) the layer kernel takes, one per layer variant.
LAYER_VARIANTS = {
    "llama_gqa_bias_llama3": {},  # attention and MLP biases, llama3 rope, GQA 6/2
    # q/k RMSNorm per head; hidden and MLP sizes that end in partial weight panels (not
    # multiples of 16)
    "qwen3_qknorm": dict(hidden_size=40, intermediate_size=72),
    "qwen2_sliding_yarn": dict(hidden_size=64),  # window 4 on the upper layers, yarn rope
    "qwen3_bias_mqa_sliding": dict(head_dim=16),  # multi-query, biases, window 3
}


@pytest.mark.parametrize("stack", [(), (3,), (2, 2)])
@pytest.mark.parametrize("o, d", [(37, 24), (32, 16), (5, 40), (48, 33)])
def test_panels_layout(stack, o, d):
    """panels(W)[..., i, d, r] = W[..., 16 i + r, d], zero past O, from either orientation."""
    w_od = np.asarray(jax.random.normal(jax.random.key(0), (*stack, o, d)))
    p = -(-o // 16)
    want = np.zeros((*stack, p * 16, d), np.float32)
    want[..., :o, :] = w_od
    want = np.swapaxes(want.reshape(*stack, p, 16, d), -1, -2)
    np.testing.assert_array_equal(
        jax.jit(cpu_decode.panels, static_argnames="in_major")(jnp.asarray(w_od), in_major=False),
        want,
    )
    w_do = jnp.asarray(np.swapaxes(w_od, -1, -2))
    np.testing.assert_array_equal(cpu_decode.panels(w_do, in_major=True), want)


@pytest.mark.parametrize(
    "o, d, b", [(1536, 512, 16), (37, 24, 5), (512, 1536, 40), (8, 16, 1), (1000, 64, 17)]
)
def test_matmul_equals_xla(o, d, b):
    w = jax.random.normal(jax.random.key(0), (o, d))
    x = jax.random.normal(jax.random.key(1), (d, b))
    y = jax.jit(lambda w, x: cpu_decode.matmul(cpu_decode.panels(w, in_major=False), x, o))(w, x)
    want = jnp.matmul(w, x, precision="highest")
    assert y.shape == (o, b)
    # float32 dots of d <= 1536 unit-normal products summed in another order (the kernel's
    # panels, XLA's tiles): the rounding grows with the partial sums, ~sqrt(d) u of the outputs'
    # scale; measured <= 1.6e-6 of the scale, so 1e-5 of it (atol) and of each value (rtol).
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_matmul_rejects_foreign_panels():
    w_p = jnp.zeros((3, 24, 16))
    with pytest.raises(ValueError, match=r"cpu_decode\.panels"):
        cpu_decode.matmul(w_p, jnp.zeros((24, 4)), 49)  # more rows than 3 panels hold
    with pytest.raises(ValueError, match=r"cpu_decode\.panels"):
        cpu_decode.matmul(w_p, jnp.zeros((20, 4)), 40)  # the wrong input width


def prompts(b=5, p=9, vocab=97, seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(2, vocab, (b, p))
    lengths = np.array([p, 3, p - 2, 1, p - 4][:b])
    mask = (np.arange(p)[None] >= (p - lengths)[:, None]).astype(np.int32)
    return np.where(mask, ids, 0), mask


@pytest.fixture(scope="module", params=sorted(LAYER_VARIANTS))
def variant(request, tmp_path_factory):
    folder = save_tiny(
        request.param, tmp_path_factory.mktemp(request.param), **LAYER_VARIANTS[request.param]
    )
    config, params = M.from_pretrained(folder)
    assert config.head_dim == 16
    return config, params


def uses_layer_kernel(config, params, ids, mask, sp) -> bool:
    b, p = ids.shape
    rows = bucket(b * sp.n, 1)
    fn = _compiled(config, sp, None, rows, bucket(p), rows, CpuKernelsBackend())
    ids = jnp.zeros((rows, bucket(p)), jnp.int32)
    text = fn.lower(
        params, ids, ids, jax.random.key(0), jnp.int32(rows), jnp.arange(rows)
    ).as_text()
    return "jaxrl_decode_layer" in text and "jaxrl_decode_matmul" in text


@pytest.mark.parametrize("max_num_seqs", [None, 2])
def test_generation_with_kernels_equals_xla(variant, monkeypatch, max_num_seqs):
    config, params = variant
    ids, mask = prompts()
    sp = SamplingParams(max_tokens=14, do_sample=False, temperature=0.0, n=2, ignore_eos=True)
    assert uses_layer_kernel(config, params, ids, mask, sp)
    out = {
        backend: generate(
            config, params, ids, mask, sp, max_num_seqs=max_num_seqs, decode_backend=backend
        )
        for backend in ("xla", "cpu_kernels")
    }
    np.testing.assert_array_equal(out["cpu_kernels"].responses, out["xla"].responses)
    np.testing.assert_array_equal(out["cpu_kernels"].lengths, out["xla"].lengths)
    # Every layer of the decode step through other kernels: a composite float32 computation
    # (COMPOSITE_RTOL, measured <= 5e-7 relative); atol for a log-prob near 0 (a near-certain
    # token), which keeps the logits' absolute rounding (~1e-6). Measured <= 0.007 of it.
    np.testing.assert_allclose(
        out["cpu_kernels"].log_probs, out["xla"].log_probs, rtol=COMPOSITE_RTOL, atol=1e-5
    )
    # auto picks the kernels here (float32, one CPU device) on a CPU with AVX-512, XLA on one
    # without (where the kernels' registers spill), and XLA when they are turned off
    monkeypatch.setattr(cpu_decode, "vectors_fit", lambda: True)
    assert choose_backend("auto", config, None) == CpuKernelsBackend()
    monkeypatch.setattr(cpu_decode, "vectors_fit", lambda: False)
    assert choose_backend("auto", config, None) == XlaBackend()
    monkeypatch.setattr(cpu_decode, "vectors_fit", lambda: True)
    monkeypatch.setenv("JAXRL_CPU_KERNELS", "0")
    assert choose_backend("auto", config, None) == XlaBackend()
    with pytest.raises(ValueError, match="decode_backend=cpu_kernels cannot run here"):
        choose_backend("cpu_kernels", config, None)


def test_conversation_with_kernels_equals_xla(variant):
    """The conversation programs (decode, append a tool output, decode) on both backends."""
    config, params = variant
    ids, mask = prompts(b=3)
    sp = SamplingParams(max_tokens=6, do_sample=False, temperature=0.0, ignore_eos=True)
    turns = {}
    for backend in ("xla", "cpu_kernels"):
        engine = RolloutEngine(config, max_num_seqs=4, max_model_len=48, decode_backend=backend)
        engine.load_weights(params)
        slots = engine.start(ids, mask)
        first = engine.decode(slots, sp)
        engine.append(slots, [[3, 4, 5]] * 3)
        turns[backend] = first.tokens + engine.decode(slots, sp).tokens
    np.testing.assert_array_equal(turns["cpu_kernels"], turns["xla"])


def test_sampled_log_probs_with_kernels_are_the_models(variant):
    """Sampled generation through the kernels: each returned log-prob is the model's own
    log-softmax (a full forward over prompt + response) at the sampled token."""
    config, params = variant
    ids, mask = prompts(b=3)
    sp = SamplingParams(max_tokens=10, temperature=0.7, ignore_eos=True)
    out = generate(config, params, ids, mask, sp, jax.random.key(3))
    full_ids = jnp.concatenate([jnp.asarray(ids), out.responses], axis=1)
    full_mask = jnp.concatenate([jnp.asarray(mask), out.response_mask], axis=1)
    logits = M.forward(config, params, full_ids, full_mask)[:, ids.shape[1] - 1 : -1]
    want = jnp.take_along_axis(
        jax.nn.log_softmax(logits / 0.7, axis=-1), out.responses[..., None], axis=-1
    )[..., 0]
    # Decode steps through the kernels against one full forward: a composite float32
    # computation, COMPOSITE_RTOL (measured <= 3.2e-7 relative, 0.006 of the tolerance); atol as
    # above for log-probs near 0.
    np.testing.assert_allclose(out.log_probs, want, rtol=COMPOSITE_RTOL, atol=1e-5)


def test_enabled_only_for_float32_on_one_device(monkeypatch):
    from jaxrl.sharding import ROLLOUT_RULES, Layout, rollout_mesh

    assert cpu_decode.enabled("float32")
    assert not cpu_decode.enabled("bfloat16")
    layout = Layout.create(rollout_mesh(2, jax.devices()[:2]), ROLLOUT_RULES)
    assert not cpu_decode.enabled("float32", layout)
    monkeypatch.setenv("JAXRL_CPU_KERNELS", "0")
    assert not cpu_decode.enabled("float32")


def test_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("JAXRL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger="jaxrl.kernels"):
        assert cpu_decode._library.__wrapped__() is None
    assert "decode_backend=auto decodes with XLA" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_layer_drops_writes_outside_the_cache_and_checks_its_length(variant):
    """A write index outside [0, C) leaves the cache untouched (XLA's scatter drops it too);
    a cache length that is not a multiple of 16 is refused with the fix in the message."""
    from jaxrl.models.cached import init_cache

    config, params = variant
    layers = CpuKernelsBackend().prepare(config, params)["layers"]
    cache = init_cache(config, batch=2, length=32)
    k0 = jax.random.normal(jax.random.key(0), cache.k.shape)
    v0 = jax.random.normal(jax.random.key(1), cache.v.shape)
    x_db = jax.random.normal(jax.random.key(2), (config.hidden_size, 2))
    cos = sin = jnp.ones((2, config.head_dim))
    valid = jnp.ones((2, 32), jnp.int32)
    kw = dict(eps=1e-6, window=0, qk_norm=config.qk_norm)
    index = jnp.array([-1, 32], jnp.int32)
    _, k1, v1 = cpu_decode.layer(layers, 1, x_db, cos, sin, index, valid, k0, v0, **kw)
    np.testing.assert_array_equal(k1, k0)
    np.testing.assert_array_equal(v1, v0)
    short = init_cache(config, batch=2, length=24)
    with pytest.raises(ValueError, match="cache_geometry"):
        cpu_decode.layer(layers, 0, x_db, cos, sin, index, valid, short.k, short.v, **kw)
