"""Gemma 2 and Gemma 3 (text) beyond the shared HF-parity tests (which run every
`jaxrl.testing.tiny` config, these included: logits of left/right-padded and packed rows past
the sliding window, and the export round trip in test_hf_io): the rollout's cached decode
equals the full forward, the CPU kernels refuse the families, and configs jaxrl cannot run
are refused by name.

Tokens are compared exactly; log-probs from another program (prefill + decode against one
forward) at `LOG_PROB_ATOL` (its reason: `jaxrl.testing.numerics`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl.models as M
from jaxrl.models.cached import extend, init_cache, prefill
from jaxrl.models.params import init_params, param_shapes
from jaxrl.rollout import RolloutEngine, SamplingParams, generate
from jaxrl.rollout.backends import CpuKernelsBackend, choose_backend
from jaxrl.testing.numerics import LOG_PROB_ATOL, assert_close_to_scale
from jaxrl.testing.tiny import hf_config

GREEDY = SamplingParams(temperature=0.0, do_sample=False, max_tokens=8, ignore_eos=True)


def _prompts():
    """Two prompts of 6 tokens, the second left-padded to 4 real ones: with 8 new tokens both
    rows run past the tiny models' windows (3 and 4)."""
    ids = np.random.RandomState(0).randint(2, 97, (2, 6))
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    return ids * mask, mask


def _forward_tokens_and_log_probs(config, params, prompt, response):
    """The full forward's greedy choice after each prefix of prompt + response, and the
    chunked `token_log_probs` of the response's tokens."""
    ids = jnp.asarray(np.concatenate([prompt, response])[None])
    p = len(prompt)
    argmax = jnp.argmax(M.forward(config, params, ids)[0, p - 1 : -1], -1)
    h = M.hidden_states(config, params, ids)
    log_probs, _ = M.token_log_probs(config, params, h[:, :-1], ids[:, 1:], chunk_size=3)
    return np.asarray(argmax), np.asarray(log_probs[0, p - 1 :])


@pytest.mark.parametrize("name", ["gemma2_softcap", "gemma3_local_rope"])
def test_the_engine_decodes_greedily_as_the_forward_past_the_window(name, tiny_model):
    """The rollout engine (per-layer weights, a Python loop over the layers) and `generate`
    (stacked weights, the layers scanned) decode every row, left-padded or not, as the full
    forward's argmax, token by token, with its (soft-capped) log-probs."""
    _, config, params = tiny_model(name)
    ids, mask = _prompts()
    engine = RolloutEngine(config, None, max_num_seqs=2, max_model_len=32)
    engine.load_weights(params)
    assert engine.backend.name == "xla"  # auto never picks the CPU kernels for Gemma
    ours = engine.generate(ids, mask, GREEDY, jax.random.key(0))
    scanned = generate(config, params, ids, mask, GREEDY, jax.random.key(0), max_num_seqs=2)
    np.testing.assert_array_equal(np.asarray(scanned.responses), np.asarray(ours.responses))
    for row in range(2):
        response = np.asarray(ours.responses)[row]
        want_tokens, want_log_probs = _forward_tokens_and_log_probs(
            config, params, ids[row][mask[row] > 0], response
        )
        np.testing.assert_array_equal(response, want_tokens)
        for out in (ours, scanned):
            got = np.asarray(out.log_probs)[row]
            np.testing.assert_allclose(got, want_log_probs, atol=LOG_PROB_ATOL)


@pytest.mark.parametrize("name", ["gemma2_softcap", "gemma3_capped_mqa_untied"])
def test_extend_past_the_window_equals_the_forward(name, tiny_model):
    """Rows prefilled with 2 and 4 tokens, then extended by 7 and 5 (a conversation's tool
    output: `extend`, the layers scanned over the stacked weights) end with the hidden states
    of the full forward over all 9 tokens."""
    _, config, params = tiny_model(name)
    ids = np.random.RandomState(1).randint(2, 97, (2, 9))
    cache = init_cache(config, 2, 16)
    for row, start in enumerate((2, 4)):
        one = np.ones((1, start), np.int32)
        _, k, v, _ = prefill(config, params, ids[row : row + 1, :start], np.arange(start)[None],
                             one)  # fmt: skip
        cache = cache.write(np.array([row]), k, v, one)
    index = np.full((2, 7), 16)  # past the cache: padding, not written
    index[0], index[1, :5] = 2 + np.arange(7), 4 + np.arange(5)
    new_ids = np.zeros((2, 7), np.int64)
    new_ids[0], new_ids[1, :5] = ids[0, 2:], ids[1, 4:]
    h, _, _ = jax.jit(extend, static_argnums=0)(config, params, new_ids, index, cache, index)
    want = M.hidden_states(config, params, jnp.asarray(ids))
    # one float32 forward in two pieces against one piece: ~1e-6 of the scale apart
    assert_close_to_scale(h[0], want[0, 2:], rtol=1e-5)
    assert_close_to_scale(h[1, :5], want[1, 4:], rtol=1e-5)


def test_the_cpu_kernels_refuse_gemma(tiny_model):
    _, config, params = tiny_model("gemma3_local_rope")
    with pytest.raises(ValueError, match=r"post-attention and post-MLP norms.*decode_backend=xla"):
        choose_backend("cpu_kernels", config, None)
    with pytest.raises(ValueError, match=r"\(1 \+ w\) RMSNorms.*decode_backend=xla"):
        CpuKernelsBackend().prepare(config, params)


def test_norms_initialise_as_offsets_from_one():
    """Gemma's (1 + w) norms start at w = 0 (the unit scale), as HF initialises them; the
    sandwich norms are parameters of their own."""
    config = M.from_hf_config(hf_config("gemma3_local_rope"))
    layers = param_shapes(config)["layers"]
    assert layers["ln_attn_out_d"][0] == layers["ln_mlp_out_d"][0] == (3, 48)
    params = init_params(config, jax.random.key(0))
    for name in ("ln_attn_d", "ln_attn_out_d", "ln_mlp_d", "ln_mlp_out_d"):
        assert not np.asarray(params["layers"][name]).any()
    assert not np.asarray(params["layers"]["attn"]["q_norm_h"]).any()
    assert not np.asarray(params["final_norm_d"]).any()


@pytest.mark.parametrize(
    "name, change, match",
    [
        ("gemma3_local_rope", dict(use_bidirectional_attention=True),
         "use_bidirectional_attention=True .* not supported"),
        ("gemma2_softcap", dict(use_bidirectional_attention=True),
         "use_bidirectional_attention=True .* not supported"),
        ("gemma2_softcap", dict(hidden_activation="gelu"),
         "hidden_activation='gelu' is not supported for gemma2"),
    ],
)  # fmt: skip
def test_unsupported_gemma_options_are_named(name, change, match):
    with pytest.raises(ValueError, match=match):
        M.from_hf_config(hf_config(name, **change))


def test_multimodal_gemma3_is_refused_with_the_way_to_its_text_model():
    import transformers

    with pytest.raises(ValueError, match=r"'gemma3' .* not supported by jaxrl yet.*text_config"):
        M.from_hf_config(transformers.Gemma3Config())
