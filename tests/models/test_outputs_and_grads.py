"""Log-probs and entropy (vs verl's torch functions), chunking, remat, dtypes, jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl.models as M
from jaxrl.testing import import_reference
from jaxrl.testing.hf_reference import left_padded, random_batch
from jaxrl.testing.numerics import assert_close_to_scale, assert_trees_close_to_scale
from jaxrl.testing.tiny import save_tiny, tiny_decoder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = save_tiny("qwen3_qknorm", tmp_path_factory.mktemp("qwen3"))
    return M.from_pretrained(folder)


@pytest.fixture(scope="module")
def inputs():
    ids, lengths = random_batch(3, 16, vocab=97, seed=4)
    return left_padded(ids, lengths)


def test_log_probs_and_entropy_match_verl(model, inputs):
    torch_functional = import_reference("verl.utils.torch_functional")
    import torch

    config, params = model
    ids, mask = inputs
    temperature = 0.7
    logits = np.asarray(M.forward(config, params, ids, mask), np.float32)
    targets = np.roll(ids, -1, axis=1)
    z = torch.tensor(logits) / temperature
    ref_lp = torch_functional.logprobs_from_logits(z, torch.tensor(targets)).numpy()
    ref_ent = torch_functional.entropy_from_logits(z).numpy()
    h = M.hidden_states(config, params, ids, mask)
    lp, ent = M.token_log_probs(
        config, params, h, targets, temperature=temperature, with_entropy=True
    )
    # A log-softmax (and entropy) over 97 logits of |z / T| < 10, ours from the hidden states
    # (the head's matmul in another program), verl's from the logits: float32 simple ops,
    # ~1e-7 of those magnitudes; measured <= 0.018 of the tolerance (DESIGN §6's 1e-5).
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_sum_pi_squared_matches_verl(model, inputs, chunk_size):
    """sum_v pi_v^2 of logits / temperature (the optimal token baseline's input), chunked or
    not, equals verl's `calculate_sum_pi_squared_from_logits`; extreme logits stay finite."""
    torch_functional = import_reference("verl.utils.torch_functional")
    import torch

    config, params = model
    ids, mask = inputs
    temperature = 0.7
    logits = np.asarray(M.forward(config, params, ids, mask), np.float32)
    want = torch_functional.calculate_sum_pi_squared_from_logits(
        torch.tensor(logits) / temperature
    ).numpy()
    h = M.hidden_states(config, params, ids, mask)
    targets = np.roll(ids, -1, axis=1)
    got = M.token_statistics(config, params, h, targets, ("sum_pi_squared",),
                             temperature=temperature, chunk_size=chunk_size)  # fmt: skip
    # float32 simple ops as above, relative (rtol 1e-5); the values lie in [1/97, 1] by
    # construction, so atol 1e-7 is below 1e-5 of the smallest. Measured <= 0.1 of it.
    np.testing.assert_allclose(got["sum_pi_squared"], want, rtol=1e-5, atol=1e-7)
    extreme = np.array([[1e4, 0.0, -1e4], [0.0, 0.0, 0.0]], np.float32)
    # exact values [1, 1/3] against a softmax and a sum of 3 squares: a few float32 roundings
    # (6e-8 relative each); measured 2e-8
    np.testing.assert_allclose(M.sum_pi_squared_from_logits(extreme), [1.0, 1 / 3], rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_equals_whole(model, inputs, chunk_size):
    config, params = model
    ids, mask = inputs
    targets = np.roll(ids, -1, axis=1)
    h = M.hidden_states(config, params, ids, mask)
    whole = M.token_log_probs(config, params, h, targets, with_entropy=True)
    chunked = M.token_log_probs(
        config, params, h, targets, chunk_size=chunk_size, with_entropy=True
    )
    # The same rows' ops, chunked: only XLA's tiling of the [chunk, D] x [D, V] head may differ,
    # a few ulps of |lp| < 8 (ulp 4.8e-7; measured 9.5e-7); the tolerance is >= 13 ulps.
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(chunked[1], whole[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_top_k_and_log_probs_at_ids_equal_torch(model, inputs, chunk_size):
    """The distillation passes' statistics, chunked (with padding: 16 positions in chunks of
    5) or not: `top_k` gives torch's top-k of log softmax(logits / T) (values and ids), `ids`
    the log-probs at given ids [B, T, K], aligned with their positions; the gradient through
    the gathered log-probs equals the whole-sequence one."""
    import torch

    config, params = model
    ids, mask = inputs
    temperature, k = 0.7, 4
    logits = np.asarray(M.forward(config, params, ids, mask), np.float32)
    z = torch.log_softmax(torch.tensor(logits) / temperature, dim=-1)
    want_values, want_ids = torch.topk(z, k, dim=-1)
    rng = np.random.RandomState(0)
    picked = rng.randint(0, logits.shape[-1], (*ids.shape, 3)).astype(np.int32)
    want_at = torch.gather(z, -1, torch.tensor(picked, dtype=torch.long)).numpy()
    h = M.hidden_states(config, params, ids, mask)
    targets = np.roll(ids, -1, axis=1)

    def stats(h_, chunk):
        return M.token_statistics(config, params, h_, targets, ("log_probs",),
                                  temperature=temperature, chunk_size=chunk,
                                  ids=jnp.asarray(picked), top_k=k)  # fmt: skip

    got = {name: np.asarray(x) for name, x in stats(h, chunk_size).items()}
    real = np.asarray(mask) > 0  # left padding's hidden states are not the forward's
    # as in test_log_probs_and_entropy_match_verl (a log-softmax against torch's)
    np.testing.assert_allclose(got["top_k_log_probs"][real], want_values.numpy()[real],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    np.testing.assert_array_equal(got["top_k_ids"][real], want_ids.numpy()[real])
    assert got["top_k_ids"].dtype == np.int32
    np.testing.assert_allclose(got["ids_log_probs"][real], want_at[real], rtol=1e-5, atol=1e-5)

    def gathered(h_, chunk):
        return jnp.sum(stats(h_, chunk)["ids_log_probs"] * jnp.arange(3.0))

    # The gradient in h, chunked or not: the same ops tiled otherwise, relative to its scale
    # (its magnitude is the model's); measured <= 3.7e-7 of the scale.
    assert_close_to_scale(jax.grad(gathered)(h, chunk_size), jax.grad(gathered)(h, None),
                          rtol=1e-5)  # fmt: skip


def test_chunking_bounds_logit_memory():
    """The compiled gradient never holds all [B, T, V] float32 logits at once."""
    config = tiny_decoder(
        vocab_size=4096, hidden_size=32, intermediate_size=32, num_kv_heads=2, head_dim=16
    )
    params = M.init_params(config, jax.random.key(0))
    b, t = 4, 256
    h = jnp.zeros((b, t, 32))
    ids = jnp.zeros((b, t), jnp.int32)

    def loss(params, h, chunk_size):
        return M.token_log_probs(config, params, h, ids, chunk_size=chunk_size)[0].sum()

    def temp_bytes(chunk_size):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
        return grad.lower(params, h, chunk_size).compile().memory_analysis().temp_size_in_bytes

    full_logits = b * t * config.vocab_size * 4  # 16 MiB
    assert temp_bytes(None) >= full_logits
    assert temp_bytes(16) < full_logits / 4


def _loss(config, params, ids, mask):
    h = M.hidden_states(config, params, ids, mask)
    lp, _ = M.token_log_probs(config, params, h, jnp.roll(ids, -1, axis=1))
    return jnp.sum(lp * mask) / jnp.sum(mask)


def test_gradients_finite_and_equal_across_remat(model, inputs):
    config, params = model
    ids, mask = inputs
    grads = {
        remat: jax.jit(jax.grad(_loss, argnums=1), static_argnums=0)(
            config.replace(remat=remat), params, ids, mask
        )
        for remat in ("none", "full", "save_dots")
    }
    for remat, g in grads.items():
        assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(g)), remat
        # Remat recomputes the same ops; only their fusion may differ. Each leaf relative to its
        # own scale (the gradients' magnitudes are the model's): measured <= 2e-7 of it.
        assert_trees_close_to_scale(g, grads["none"], rtol=1e-5)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(grads["none"])) > 0


def test_bfloat16_compute_with_float32_master_weights(model, inputs):
    config, params = model
    ids, mask = inputs
    ref = M.forward(config, params, ids, mask)
    bf16 = config.replace(dtype="bfloat16")
    out = M.forward(bf16, params, ids, mask)
    assert out.dtype == jnp.bfloat16
    assert params["embed"]["tokens_vd"].dtype == jnp.float32
    # bf16 has 8 significant bits: every matmul's inputs and each layer's activations are
    # rounded (up to 2^-9 relative each) through 3 layers and the head, and the errors add up
    # along the residual stream: measured 1.3e-2 of the logits' scale (both XLA CPU
    # configurations alike), 3e-2 is 2.3x that.
    assert_close_to_scale(out, ref, mask > 0, rtol=3e-2)


def test_shapes_and_logical_axes_agree(model):
    config, params = model
    abstract = M.abstract_params(config)
    axes = M.logical_axes(config)
    is_names = lambda x: isinstance(x, tuple) and all(isinstance(n, str) for n in x)  # noqa: E731
    assert jax.tree.structure(abstract) == jax.tree.structure(params)
    assert jax.tree.structure(axes, is_leaf=is_names) == jax.tree.structure(params)
    jax.tree.map(lambda a, p: (a.shape == p.shape) or pytest.fail(str(a)), abstract, params)
    jax.tree.map(lambda a, names: len(names) == a.ndim or pytest.fail(str(names)), abstract, axes)
    out = jax.eval_shape(lambda p: M.forward(config, p, jnp.zeros((2, 5), jnp.int32)), abstract)
    assert out.shape == (2, 5, config.vocab_size)


def test_init_params_runs_a_fresh_model():
    config = tiny_decoder(
        model_type="qwen2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qkv_bias=True,
        tie_word_embeddings=True,
    )
    params = M.init_params(config, jax.random.key(0))
    logits = jax.jit(M.forward, static_argnums=0)(config, params, jnp.ones((1, 4), jnp.int32))
    assert logits.shape == (1, 4, 64) and bool(jnp.isfinite(logits).all())
    assert float(jnp.abs(params["layers"]["attn"]["b_q_nh"]).max()) == 0.0
    assert float(params["final_norm_d"].min()) == 1.0


def test_bad_head_requests():
    config = tiny_decoder(vocab_size=8)
    ids = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="1-label classification head"):
        M.values(config, M.init_params(config, jax.random.key(0)), ids)
    with pytest.raises(ValueError, match="must be a multiple"):
        config.replace(num_kv_heads=3)
    with pytest.raises(ValueError, match="remat='some' is not supported"):
        config.replace(remat="some")
