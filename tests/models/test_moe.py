"""`jaxrl.models.moe` against transformers' own MoE blocks (float32): Qwen3-MoE's and
Mixtral's routers and experts token for token, with and without renormalisation; the sorted
(ragged_dot) path equal to the dense oracle in values and gradients; HF's load-balancing loss
with and without a mask and Switch Transformers' z-loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models.moe import (
    MoeSpec,
    experts_dense,
    experts_sorted,
    layer_stats,
    load_balancing_loss,
    route,
    router_z_loss,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

D, F, E, K, T = 16, 12, 8, 2, 24


def _hf_block(family, norm_topk_prob=False):
    torch.manual_seed(0)
    if family == "qwen":
        from transformers.models.qwen3_moe import modeling_qwen3_moe as m

        config = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F,
                                             num_experts=E, num_experts_per_tok=K,
                                             norm_topk_prob=norm_topk_prob)  # fmt: skip
        block = m.Qwen3MoeSparseMoeBlock(config)
    else:
        from transformers.models.mixtral import modeling_mixtral as m

        config = transformers.MixtralConfig(hidden_size=D, intermediate_size=F,
                                            num_local_experts=E, num_experts_per_tok=K)  # fmt: skip
        block = m.MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return block.eval()


def _jax_params(block):
    """HF's fused [E, 2F, D] gate_up and [E, D, F] down as jaxrl's [E, D, F] and [E, F, D]."""
    gate_up = block.experts.gate_up_proj.detach().numpy()
    down = block.experts.down_proj.detach().numpy()
    moe = {"w_gate_edf": gate_up[:, :F].transpose(0, 2, 1),
           "w_up_edf": gate_up[:, F:].transpose(0, 2, 1),
           "w_down_efd": down.transpose(0, 2, 1)}  # fmt: skip
    return {k: jnp.asarray(v) for k, v in moe.items()}, jnp.asarray(
        block.gate.weight.detach().numpy().T
    )


@pytest.mark.parametrize(("family", "norm"), [("qwen", False), ("qwen", True), ("mixtral", True)])
def test_the_block_equals_transformers(family, norm):
    block = _hf_block(family, norm)
    x = np.random.default_rng(1).normal(size=(2, T // 2, D)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy().reshape(T, D)
        hf_logits, hf_weights, hf_experts = block.gate(torch.from_numpy(x).reshape(T, D))
    moe, router_de = _jax_params(block)
    spec = MoeSpec(E, K, router=family, norm_topk_prob=norm)
    x_td = jnp.asarray(x.reshape(T, D))
    weights, experts, logits = route(x_td, router_de, spec)
    np.testing.assert_array_equal(np.asarray(experts), hf_experts.numpy())
    # float32 matmuls in two libraries: equal to rounding
    np.testing.assert_allclose(np.asarray(logits), hf_logits.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(weights), hf_weights.numpy(), rtol=1e-5, atol=1e-6)
    for path in (experts_sorted, experts_dense):
        got = path(x_td, moe, weights, experts)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_sorted_equals_dense_in_values_and_gradients():
    block = _hf_block("qwen", True)
    moe, router_de = _jax_params(block)
    spec = MoeSpec(E, K, router="qwen", norm_topk_prob=True)
    x_td = jax.random.normal(jax.random.key(0), (T, D))

    def loss(path, moe, router_de, x_td):
        weights, experts, _ = route(x_td, router_de, spec)
        return jnp.sum(jnp.sin(path(x_td, moe, weights, experts)))

    sorted_out = jax.value_and_grad(lambda *a: loss(experts_sorted, *a), argnums=(0, 1, 2))(
        moe, router_de, x_td
    )
    dense_out = jax.value_and_grad(lambda *a: loss(experts_dense, *a), argnums=(0, 1, 2))(
        moe, router_de, x_td
    )
    # the same sums in another order (float32)
    for a, b in zip(jax.tree.leaves(sorted_out), jax.tree.leaves(dense_out), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def _losses(logits_lte, mask_t):
    stats = jax.vmap(layer_stats, (0, None, None))(jnp.asarray(logits_lte), jnp.asarray(mask_t), K)
    return float(load_balancing_loss(stats)), float(router_z_loss(stats))


def test_losses_equal_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    from transformers.models.switch_transformers.modeling_switch_transformers import (
        router_z_loss_func,
    )

    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, T, E)).astype(np.float32) * 2
    mask = (rng.random(T) > 0.3).astype(np.float32)
    layers = tuple(torch.from_numpy(layer) for layer in logits)
    for m in (None, mask):
        want = load_balancing_loss_func(layers, E, K, None if m is None else
                                        torch.from_numpy(m).reshape(2, T // 2)).item()  # fmt: skip
        got, _ = _losses(logits, np.ones(T) if m is None else m)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    _, z = _losses(logits, np.ones(T))
    np.testing.assert_allclose(z, router_z_loss_func(torch.from_numpy(logits)).item(), rtol=1e-6)
    _, masked = _losses(logits, mask)
    keep = mask > 0
    np.testing.assert_allclose(masked, router_z_loss_func(torch.from_numpy(logits[:, keep])).item(),
                               rtol=1e-6)  # fmt: skip


def _tiny(family):
    common = dict(vocab_size=64, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts_per_tok=K)  # fmt: skip
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=32,
                                           moe_intermediate_size=F, num_experts=E,
                                           norm_topk_prob=True)  # fmt: skip
    if family == "qwen2_moe":  # a shared expert with its gate, q/k/v biases
        return transformers.Qwen2MoeConfig(**common, intermediate_size=32,
                                           moe_intermediate_size=F, num_experts=E,
                                           shared_expert_intermediate_size=20)  # fmt: skip
    return transformers.MixtralConfig(**common, intermediate_size=F, num_local_experts=E)


def _saved(family, folder):
    """A random tiny HF model of `family` (weights N(0, 0.3)) saved to `folder`, and jaxrl's
    (config, params) read from it."""
    from jaxrl.models import from_pretrained

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_tiny(family)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(folder)
    return (model, *from_pretrained(folder))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_the_decoder_read_from_an_hf_folder_equals_transformers(family, tmp_path):
    """An MoE checkpoint as transformers saves it (one tensor per layer and expert) read by
    `from_pretrained`: the whole decoder's logits equal transformers' (float32, a
    left-padded row)."""
    from jaxrl.models import save_pretrained
    from jaxrl.models.transformer import hidden_states, lm_logits

    model, config, params = _saved(family, tmp_path)
    assert config.moe is not None and config.moe.router == ("qwen" if "qwen" in family else
                                                            "mixtral")  # fmt: skip
    assert bool(config.shared_expert_intermediate_size) == (family == "qwen2_moe")
    ids = np.random.default_rng(3).integers(1, 64, size=(2, 10))
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                     position_ids=torch.from_numpy(np.clip(mask.cumsum(-1) - 1, 0, None))
                     ).logits.numpy()  # fmt: skip
    h = hidden_states(config, params, jnp.asarray(ids), jnp.asarray(mask))
    got = np.asarray(lm_logits(config, params, h))
    keep = mask.astype(bool)
    # float32 in two libraries over two layers: 1e-4 (the bound)
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-4, atol=1e-4)
    # written back as an HF folder, transformers reads the same model
    save_pretrained(config, params, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        back = again(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                     position_ids=torch.from_numpy(np.clip(mask.cumsum(-1) - 1, 0, None))
                     ).logits.numpy()  # fmt: skip
    np.testing.assert_allclose(back[keep], want[keep], rtol=1e-5, atol=1e-5)


def test_parameter_counts_are_transformers_and_a_token_uses_k_of_e_experts(tmp_path):
    """`parameter_counts`: all parameters as transformers counts them; per token the idle
    (E - k) / E of the routed experts' weights left out."""
    from jaxrl.models.params import parameter_counts

    model, config, _ = _saved("qwen2_moe", tmp_path)
    total, active = parameter_counts(config)
    assert total == model.num_parameters()
    experts = 3 * config.num_layers * E * D * F  # gate, up, down of every expert
    assert total - active == experts * (E - K) // E


def test_the_engine_generates_an_moe_model_greedily_as_its_forward(tmp_path):
    """The rollout engine (cache, decode; the CPU kernels refuse MoE, XLA decodes) samples
    greedily what the full forward's argmax gives, token by token."""
    from jaxrl.models.transformer import hidden_states, lm_logits
    from jaxrl.rollout.engine import RolloutEngine
    from jaxrl.rollout.sampling import SamplingParams

    _, config, params = _saved("qwen3_moe", tmp_path)
    engine = RolloutEngine(config, None, max_num_seqs=2, max_model_len=32)
    engine.load_weights(params)
    prompt = np.asarray([[5, 9, 3, 7]], np.int32)
    greedy = SamplingParams(temperature=0.0, do_sample=False, max_tokens=6, ignore_eos=True)
    out = engine.generate(prompt, np.ones_like(prompt), greedy, jax.random.key(0))
    tokens = np.asarray(out.responses)[0]
    ids = jnp.asarray(np.concatenate([prompt[0], tokens])[None])
    logits = lm_logits(config, params, hidden_states(config, params, ids))
    # each sampled token is the forward's argmax after the ones before it
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits[0, 3:-1], -1)), tokens)


def test_the_decoders_aux_loss_and_its_gradient_equal_transformers(tmp_path):
    """The router sums the decoder's scan returns give HF's `aux_loss`
    (`output_router_logits=True`, left-padded rows masked) and its gradient with respect to
    every layer's router weights."""
    from jaxrl.models.transformer import hidden_states_and_router

    model, config, params = _saved("qwen3_moe", tmp_path)
    ids = np.random.default_rng(4).integers(1, 64, size=(2, 10))
    mask = np.ones_like(ids)
    mask[0, :4] = 0
    out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                position_ids=torch.from_numpy(np.clip(mask.cumsum(-1) - 1, 0, None)),
                output_router_logits=True)  # fmt: skip
    out.aux_loss.backward()
    want_grad = np.stack([layer.mlp.gate.weight.grad.numpy().T for layer in model.model.layers])

    def aux(router_lde):
        p = {
            **params,
            "layers": {
                **params["layers"],
                "moe": {**params["layers"]["moe"], "router_de": router_lde},
            },
        }
        _, routing = hidden_states_and_router(config, p, jnp.asarray(ids), jnp.asarray(mask))
        return load_balancing_loss(routing.stats)

    got, grad = jax.value_and_grad(aux)(params["layers"]["moe"]["router_de"])
    # float32 in two libraries; the counts are exact, the probabilities agree to ~1e-6
    np.testing.assert_allclose(float(got), out.aux_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)


def test_routing_replay_records_the_rollouts_routes_and_closes_the_mismatch():
    """The engine records every fed token's experts (`record_routes`): the full forward's
    native routes at the real prompt tokens and every response token but the last (never fed:
    -1), and replaying native routes changes nothing. A rollout whose router drifted from the
    trainer's (noise on its weights; top-1 with renormalisation, so an expert's output depends
    on the route alone) samples with other routes: the trainer's log-probs of its tokens
    differ, and replaying the recorded routes makes them the rollout's."""
    import jaxrl.models as M
    from jaxrl.models.moe import MoeSpec
    from jaxrl.models.transformer import hidden_states_and_router
    from jaxrl.rollout.engine import RolloutEngine
    from jaxrl.rollout.sampling import SamplingParams
    from jaxrl.testing.numerics import LOG_PROB_ATOL
    from jaxrl.trainer.sequences import response_log_probs

    config = M.DecoderConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=D,
                             intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=8, qk_norm=True, moe_intermediate_size=F,
                             moe=MoeSpec(num_experts=E, top_k=1, norm_topk_prob=True))  # fmt: skip
    params = M.init_params(config, jax.random.key(0), std=0.3)
    drifted = jax.tree.map(lambda x: x, params)
    noise = jax.random.normal(jax.random.key(1), params["layers"]["moe"]["router_de"].shape)
    drifted["layers"]["moe"]["router_de"] = params["layers"]["moe"]["router_de"] + noise
    prompts = np.asarray([[5, 9, 3, 7, 2], [0, 0, 4, 8, 6]], np.int32)
    prompt_mask = (prompts > 0).astype(np.int32)
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, record_routes=True)
    engine = RolloutEngine(config, None, max_num_seqs=2, max_model_len=32)

    def rollout(weights):
        engine.load_weights(weights)
        out = engine.generate(prompts, prompt_mask, sampling, jax.random.key(2))
        mb = {"prompts": prompts, "prompt_mask": prompt_mask, "responses": out.responses,
              "response_mask": out.response_mask, "prompt_routes": out.prompt_routes,
              "response_routes": out.response_routes}  # fmt: skip
        return {k: jnp.asarray(v) for k, v in mb.items()}, np.asarray(out.log_probs)

    mb, _ = rollout(params)
    ids = jnp.concatenate([mb["prompts"], mb["responses"]], 1)
    mask = jnp.concatenate([mb["prompt_mask"], mb["response_mask"]], 1)
    h, native = hidden_states_and_router(config, params, ids, mask)
    recorded = np.concatenate([mb["prompt_routes"], mb["response_routes"]], 1)
    fed = np.asarray(mask, bool).copy()
    fed[:, -1] = False  # the last response token (max_tokens, no EOS) was never fed
    np.testing.assert_array_equal(recorded[fed], np.asarray(native.routes)[fed])
    assert (recorded[~fed] == -1).all()
    h_replayed, _ = hidden_states_and_router(config, params, ids, mask, routes=recorded)
    np.testing.assert_array_equal(np.asarray(h_replayed)[fed], np.asarray(h)[fed])

    mb, rollout_lp = rollout(drifted)
    without = {k: v for k, v in mb.items() if not k.endswith("_routes")}
    trained, _ = response_log_probs(config, params, without, temperature=1.0)
    replayed, _ = response_log_probs(config, params, mb, temperature=1.0)
    real = np.asarray(mb["response_mask"], bool)
    assert np.abs(np.asarray(trained) - rollout_lp)[real].max() > 1e-2  # the mismatch
    np.testing.assert_allclose(np.asarray(replayed)[real], rollout_lp[real], atol=LOG_PROB_ATOL)
