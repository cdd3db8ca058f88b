"""LoRA on a mixture of experts' expert parameters, equal to PEFT's `target_parameters`
(`ParamWrapper`): a tiny Qwen3-MoE and a Qwen2-MoE (its shared expert's projections as
modules) read from PEFT's folder give PEFT's logits and are written back as PEFT's very
tensors; a fresh adapter changes nothing; `fold` is the adapted model; the sorted experts
equal the dense oracle, and the expert-parallel ones the sorted, in values and the adapters'
gradients; the configuration's errors name the key and the valid names."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import jaxrl.models as M
from jaxrl.models import lora
from jaxrl.models.config import LoraSpec
from jaxrl.models.moe import (
    DOWN_ADAPTER,
    GATE_UP_ADAPTER,
    MoeSpec,
    experts_dense,
    experts_sorted,
    route,
)
from jaxrl.models.moe_ep import capacity, experts_parallel
from jaxrl.models.params import adapter_spec
from jaxrl.models.peft_io import load_adapter, save_adapter
from jaxrl.sharding import make_mesh
from jaxrl.testing import import_reference
from jaxrl.testing.numerics import assert_close_to_scale, assert_trees_close_to_scale

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

D, F, E, K, T = 16, 12, 8, 2, 24
R, ALPHA = 4, 8.0
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
BOTH = ("experts.gate_up_proj", "experts.down_proj")


@pytest.fixture(scope="module")
def peft():
    return import_reference("peft")


def _tiny(family):
    """tests/models/test_moe.py's tiny configs (vocab 64, D 16, E 8, k 2, 2 layers)."""
    common = dict(vocab_size=64, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts_per_tok=K)  # fmt: skip
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=32,
                                           moe_intermediate_size=F, num_experts=E,
                                           norm_topk_prob=True)  # fmt: skip
    return transformers.Qwen2MoeConfig(**common, intermediate_size=32,
                                       moe_intermediate_size=F, num_experts=E,
                                       shared_expert_intermediate_size=20)  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> an HF folder of its tiny model with normal(0, 0.3) weights."""
    out = {}
    for family in ("qwen3_moe", "qwen2_moe"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_tiny(family)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3)
        out[family] = tmp_path_factory.mktemp(family)
        model.save_pretrained(out[family])
    return out


def _batch():
    ids = np.random.default_rng(3).integers(1, 64, size=(2, 10))
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


def _hf_logits(model, ids, mask):
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                     position_ids=torch.from_numpy(positions)).logits.numpy()  # fmt: skip


def _random_adapters(config, seed=0, std=0.1):
    """Adapters with A and B non-zero (a fresh B is zero: the update would be invisible)."""
    rng = np.random.RandomState(seed)
    tree = lora.split(M.abstract_params(config))[1]
    return jax.tree.map(lambda s: jnp.asarray(std * rng.standard_normal(s.shape), s.dtype), tree)


@pytest.mark.parametrize(
    ("family", "modules", "targets"),
    [
        ("qwen3_moe", ["q_proj", "v_proj"], ("q_proj", "v_proj", *BOTH)),
        # the shared expert's Linear layers, by their module names
        ("qwen2_moe", ["o_proj", "gate_proj", "up_proj", "down_proj"],
         ("o_proj", "gate_proj", "up_proj", "down_proj", *BOTH)),
    ],
)  # fmt: skip
def test_peft_folder_in_and_out(peft, folders, family, modules, targets, tmp_path):
    """PEFT's adapter (random A and B on the attention, the shared expert, and both expert
    parameters) read by jaxrl gives PEFT's logits; jaxrl writes back PEFT's very tensors
    (names, nesting, layout) and PeftModel reads them with the same logits."""
    folder = folders[family]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = peft.get_peft_model(hf, peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=modules,
                                                    target_parameters=EXPERTS))  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "peft")
    ids, mask = _batch()
    want = _hf_logits(model.eval(), ids, mask)

    config, base = M.from_pretrained(folder)
    spec, adapters = load_adapter(tmp_path / "peft", config)
    assert spec == LoraSpec(R, ALPHA, targets)
    adapted = config.replace(lora=spec)
    params = lora.merge(base, jax.tree.map(jnp.asarray, adapters))
    got = np.asarray(M.forward(adapted, params, jnp.asarray(ids), jnp.asarray(mask)))
    keep = mask.astype(bool)
    # float32 in two libraries over two routed layers: test_moe.py's 1e-4 bound (measured
    # <= 4.5e-7 on logits of scale ~1.7)
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-4, atol=1e-4)
    # the adapters change the function (the check above is not the base against the base)
    plain = np.asarray(M.forward(config, base, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(plain - want)[keep].max() > 1e-2

    save_adapter(adapted, params, tmp_path / "ours")
    theirs = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    ours = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():  # reshapes and transposes only: exact
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert written["target_parameters"] == EXPERTS
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    again = peft.PeftModel.from_pretrained(base_hf, str(tmp_path / "ours")).eval()
    # the same float32 tensors in the same library: equal
    np.testing.assert_array_equal(_hf_logits(again, ids, mask)[keep], want[keep])


def _all_targets(config):
    return LoraSpec(R, ALPHA, tuple(lora.adaptable(config)))


def test_fresh_adapters_change_nothing_and_fold_is_the_adapted_model(folders, tmp_path):
    """Fresh adapters (PEFT's init: A uniform in ±1/sqrt(in) per expert, B zero) on every
    target of Qwen2-MoE leave the logits unchanged; with random ones, `fold` (W + (alpha/r)
    A B per expert, gate and up from the fused adapter's halves) gives the adapted logits, as
    does the merged HF folder `save_pretrained` writes of the adapted tree."""
    config, base = M.from_pretrained(folders["qwen2_moe"])
    adapted = config.replace(lora=_all_targets(config))
    assert adapted.lora.targets == (*lora.ALL_LINEAR, *BOTH)
    shapes = adapter_spec(adapted)["layers"]["moe"]["lora"]
    assert shapes[GATE_UP_ADAPTER]["a"] == ((2, E, D, R), ("layers", "experts", "embed",
                                                             "lora_rank"))  # fmt: skip
    assert shapes[GATE_UP_ADAPTER]["b"] == ((2, E, R, 2, F), ("layers", "experts", "lora_rank",
                                                              None, "mlp"))  # fmt: skip
    assert shapes[DOWN_ADAPTER]["a"][0] == (2, E, F, R)
    assert shapes[DOWN_ADAPTER]["b"] == ((2, E, R, D), ("layers", "experts", "lora_rank",
                                                        "embed"))  # fmt: skip
    ids, mask = jnp.asarray(_batch()[0]), jnp.asarray(_batch()[1])
    plain = M.forward(config, base, ids, mask)
    fresh = lora.init_adapters(adapted, jax.random.key(1), adapter_spec(adapted))
    experts = fresh["layers"]["moe"]["lora"]
    for key, fan_in in ((GATE_UP_ADAPTER, D), (DOWN_ADAPTER, F)):
        a = np.abs(np.asarray(experts[key]["a"]))
        # not rounding: the largest of >= 768 uniform draws falls below 0.9 of the bound with
        # probability 0.9^768 ~ 1e-35 (and the key is fixed)
        assert 0.9 / np.sqrt(fan_in) < a.max() <= 1 / np.sqrt(fan_in)
        assert not np.asarray(experts[key]["b"]).any()
    # B = 0 adds exact zeros; only XLA's fusion of the larger program may reorder a float32
    # sum (test_lora.py's bound)
    assert_close_to_scale(M.forward(adapted, lora.merge(base, fresh), ids, mask), plain,
                          rtol=1e-6)  # fmt: skip
    params = lora.merge(base, _random_adapters(adapted))
    want = M.forward(adapted, params, ids, mask)
    folded = lora.fold(adapted, params)
    assert not lora.has_adapters(folded)
    # W + (alpha/r) A B rounded to float32 once, then another grouping of the sums: measured
    # 3.9e-7 of the logits' scale, 1e-5 (test_lora.py's) leaves 25x; such rounding moves no
    # token's top-k here
    assert_close_to_scale(M.forward(config, folded, ids, mask), want, rtol=1e-5)
    M.save_pretrained(adapted, params, tmp_path / "merged")
    merged_config, merged = M.from_pretrained(tmp_path / "merged")
    assert merged_config.lora is None
    assert_close_to_scale(M.forward(merged_config, merged, ids, mask), want, rtol=1e-5)  # idem
    assert np.abs(np.asarray(want - plain)).max() > 1e-2  # the adapters matter


def _moe_inputs(seed=0, t=T):
    """Random expert weights, adapters (A and B non-zero), tokens and their routing."""
    rng = np.random.default_rng(seed)

    def normal(*shape, std=0.3):
        return jnp.asarray(rng.normal(size=shape) * std, jnp.float32)

    moe = {"w_gate_edf": normal(E, D, F), "w_up_edf": normal(E, D, F),
           "w_down_efd": normal(E, F, D), "router_de": normal(D, E),
           "lora": {GATE_UP_ADAPTER: {"a": normal(E, D, R), "b": normal(E, R, 2, F)},
                    DOWN_ADAPTER: {"a": normal(E, F, R), "b": normal(E, R, D)}}}  # fmt: skip
    return normal(t, D, std=1.0), moe


def test_sorted_equals_dense_with_adapters():
    """The ragged_dot path and the all-experts oracle with adapters: equal values and
    gradients (the tokens, the expert weights, and every adapter's A and B)."""
    spec = MoeSpec(E, K, router="qwen", norm_topk_prob=True)
    x_td, moe = _moe_inputs()

    def loss(path, x_td, moe):
        weights, experts, _ = route(x_td, moe["router_de"], spec)
        return jnp.sum(jnp.sin(path(x_td, moe, weights, experts, lora_scale=ALPHA / R)))

    ours = jax.jit(jax.value_and_grad(lambda *a: loss(experts_sorted, *a), (0, 1)))(x_td, moe)
    ref = jax.jit(jax.value_and_grad(lambda *a: loss(experts_dense, *a), (0, 1)))(x_td, moe)
    # the same float32 sums in another order: measured <= 4.4e-6 of each leaf's scale (both
    # within 7e-6 of a float64 run), COMPOSITE_RTOL (1e-4) per leaf
    assert_trees_close_to_scale(ours, ref)
    # the adapters take part: without them the value moves
    plain = {k: v for k, v in moe.items() if k != "lora"}
    assert abs(float(loss(experts_sorted, x_td, plain) - ours[0])) > 1e-2


@pytest.mark.parametrize("factor", [None, E / K], ids=["gather", "all_to_all"])
def test_expert_parallel_with_adapters_equals_sorted(factor):
    """ep = 2 (mesh dp 4 x ep 2, tokens over both): the gather dispatch, and the all-to-all
    one with a capacity that drops nothing (C = T_l), equal `experts_sorted` with adapters in
    values and the gradients of the tokens and of every expert weight and adapter."""
    mesh = make_mesh({"dp": 4, "ep": 2})
    x_td, moe = _moe_inputs(seed=1, t=32)
    if factor is not None:
        assert capacity(factor, 32 // 8, K, E) == 32 // 8
    weights, experts, _ = route(x_td, moe["router_de"], MoeSpec(E, K, norm_topk_prob=True))
    probe = jnp.asarray(np.random.default_rng(9).normal(size=x_td.shape), jnp.float32)

    def parallel(x, moe, weights, experts, lora_scale):
        return experts_parallel(x, moe, weights, experts, mesh=mesh, token_axes=("dp", "ep"),
                                capacity_factor=factor, lora_scale=lora_scale)[0]  # fmt: skip

    def value_and_grads(path):
        def loss(x, moe):
            y = path(x, moe, weights, experts, lora_scale=ALPHA / R)
            return jnp.sum(y * probe), y

        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x_td, moe)

    (_, y), grads = value_and_grads(parallel)
    (_, y_ref), grads_ref = value_and_grads(experts_sorted)
    # the same float32 sums in another order (the psum over ep): measured <= 2e-7 (y) and
    # 6e-7 (gradients) of the scale; test_moe_ep.py's 1e-5 and COMPOSITE_RTOL (1e-4)
    assert_close_to_scale(y, y_ref, rtol=1e-5, what="y")
    flat = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), g_ref in zip(flat, jax.tree.leaves(grads_ref), strict=True):
        if "router_de" not in jax.tree_util.keystr(path):  # routed outside: no gradient
            assert_close_to_scale(g, g_ref, what=jax.tree_util.keystr(path))
    assert float(jnp.abs(grads[1]["lora"][GATE_UP_ADAPTER]["a"]).max()) > 0


def _config(model_type="qwen3_moe", shared=0):
    moe = None if model_type in ("llama", "qwen2") else MoeSpec(E, K)
    return M.DecoderConfig(model_type=model_type, vocab_size=64, hidden_size=D,
                           intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=8, moe=moe, moe_intermediate_size=F if moe else 0,
                           shared_expert_intermediate_size=shared)  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "shared", "modules", "parameters", "expected"),
    [
        ("qwen3_moe", 0, "all-linear", None, ("q_proj", "k_proj", "v_proj", "o_proj")),
        ("qwen2_moe", 20, "all-linear", None, lora.ALL_LINEAR),  # the shared expert's
        ("qwen3_moe", 0, ["q_proj"], ["experts.down_proj"], ("q_proj", "experts.down_proj")),
        ("qwen3_moe", 0, None, ["gate_up_proj", "mlp.experts.down_proj"], BOTH),  # PEFT's None
        ("mixtral", 0, [], ["model.layers.0.mlp.experts.gate_up_proj",
                            "model.layers.1.mlp.experts.gate_up_proj"], BOTH[:1]),
    ],
)  # fmt: skip
def test_target_parameters_resolve_as_peft_matches(model_type, shared, modules, parameters,
                                                   expected):  # fmt: skip
    config = _config(model_type, shared)
    got = lora.resolve_targets(config, modules, target_parameters=parameters)
    assert got == expected
    lora.with_lora(config, LoraSpec(R, ALPHA, got))  # every name is one the family adapts


def test_target_parameter_errors():
    """A dense model, an unknown or partial name, a bare string, and the experts named as
    modules: ValueErrors naming the key and the valid names."""
    key = "actor_rollout_ref.model.target_modules"
    dense = r"model\.target_parameters=\['experts\.up'\]: this llama model is dense .*\.down_proj"
    with pytest.raises(ValueError, match=dense):
        lora.resolve_targets(_config("llama"), "all-linear", None, key, ["experts.up"])
    moe = _config()
    unknown = (r"target_parameters: \['gate\.weight'\] name no expert parameter .* "
               r"mlp\.experts\.gate_up_proj, mlp\.experts\.down_proj")  # fmt: skip
    with pytest.raises(ValueError, match=unknown):
        lora.resolve_targets(moe, ["q_proj"], None, key, ["down_proj", "gate.weight"])
    with pytest.raises(ValueError, match=r"on layers \[1\] of 2"):
        lora.resolve_targets(moe, [], None, key, ["layers.1.mlp.experts.down_proj"])
    with pytest.raises(ValueError, match="a list of parameter names"):
        lora.resolve_targets(moe, [], None, key, "mlp.experts.down_proj")
    # Qwen3-MoE has no gate/up/down modules (no shared expert): point at target_parameters
    with pytest.raises(ValueError, match=r"\['down_proj'\] name no module .* adapt them with "
                       r"actor_rollout_ref\.model\.target_parameters"):  # fmt: skip
        lora.resolve_targets(moe, ["q_proj", "down_proj"], None, key)
    with pytest.raises(ValueError, match=r"LoRA targets \['experts\.down_proj'\]: this qwen2 "):
        lora.with_lora(_config("qwen2"), LoraSpec(R, ALPHA, ("q_proj", "experts.down_proj")))


def test_the_config_key_reaches_the_spec():
    """verl's `model.target_parameters` is a model key (no longer ignored) that the role's
    LoRA options carry into the spec."""
    from jaxrl.config.schema import ModelConfig
    from jaxrl.trainer.roles import LoraOptions, lora_spec

    model = ModelConfig(path="x", lora_rank=R, lora_alpha=ALPHA, target_modules=["q_proj"],
                        target_parameters=["mlp.experts.gate_up_proj"])  # fmt: skip
    options = LoraOptions.from_config(model, "actor_rollout_ref.model")
    assert options.target_parameters == ["mlp.experts.gate_up_proj"]
    assert lora_spec(options, _config()).targets == ("q_proj", "experts.gate_up_proj")
