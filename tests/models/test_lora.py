"""LoRA adapters equal PEFT's on the same base and adapter weights (llama, qwen2, qwen3), the
PEFT folder round-trip, merging, and the target-module rules.

Logits against PEFT: `assert_close_to_scale` at `COMPOSITE_RTOL` over the real tokens (a
forward pass in another framework, measured <= 8e-7 of the scale); ours against ours at the
tolerances stated where they are compared."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import jaxrl.models as M
from jaxrl.models import lora
from jaxrl.models.config import LoraSpec
from jaxrl.models.params import adapter_spec
from jaxrl.models.peft_io import AdapterError, load_adapter, read_spec, save_adapter
from jaxrl.testing import import_reference
from jaxrl.testing.hf_reference import (
    hf_model,
    random_batch,
    right_padded,
)
from jaxrl.testing.numerics import assert_close_to_scale
from jaxrl.testing.tiny import save_tiny


@pytest.fixture(scope="module")
def peft():
    """The reference: PEFT (a test dependency; skips, or fails under
    JAXRL_REQUIRE_REFERENCE=1, where it is missing)."""
    return import_reference("peft")


FAMILIES = ["llama_gqa_bias_llama3", "qwen2_gqa_tied", "qwen3_bias_mqa_sliding"]


def _random_tree(tree, seed=0, std=0.1):
    """Normal(0, std) values (numpy's generator: no per-shape compiles) for an abstract tree."""
    rng = np.random.RandomState(seed)
    return jax.tree.map(lambda s: jnp.asarray(std * rng.standard_normal(s.shape), s.dtype), tree)


def _random_adapters(config, seed=0):
    """Adapters with A and B non-zero (a fresh B is zero: the update would be invisible)."""
    return _random_tree(lora.split(M.abstract_params(config))[1], seed)


def _peft_model(peft, folder, adapter_dir):
    base = hf_model(folder)
    return peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def _batch():
    ids, lengths = random_batch(3, 10, vocab=97, seed=3)
    return right_padded(ids, lengths)


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_equals_peft(peft, name, tmp_path):
    """Our adapters, written as a PEFT folder and loaded by PeftModel onto the transformers
    base: logits equal (COMPOSITE_RTOL), for every target and a rank that is not a power of two."""
    folder = save_tiny(name, tmp_path / "base")
    base_config, base = M.from_pretrained(folder)
    config = base_config.replace(lora=LoraSpec(rank=3, alpha=5.0, targets=lora.ALL_LINEAR))
    adapters = _random_adapters(config)
    params = lora.merge(base, adapters)
    save_adapter(config, params, tmp_path / "adapter", base_model=str(folder))
    ids, mask = _batch()
    with torch.no_grad():
        ref = _peft_model(peft, folder, tmp_path / "adapter")(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)
        ).logits.numpy()
    ours = M.forward(config, params, ids, mask)
    assert_close_to_scale(ours, ref, mask.astype(bool))
    # the adapters change the function (the check above is not the base against the base): by
    # ~1.8 on logits of scale ~2.3, far above any rounding
    plain = np.asarray(M.forward(config, base, ids, mask))
    assert np.abs(plain - ref)[mask.astype(bool)].max() > 1e-2


def test_peft_init_and_load_round_trip(peft, tmp_path):
    """PEFT's own fresh adapter (kaiming-uniform A, zero B) loads into jaxrl with PEFT's very
    values, and after B moved with PEFT's logits; jaxrl's own init draws A within PEFT's
    ±1/sqrt(in) and B zero."""
    folder = save_tiny("llama_gqa_bias_llama3", tmp_path / "base")
    config, base = M.from_pretrained(folder)
    model = peft.get_peft_model(
        hf_model(folder),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]),
    )
    model.save_pretrained(str(tmp_path / "fresh"))
    spec, fresh = load_adapter(tmp_path / "fresh", config)
    assert spec == LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "down_proj"))
    a_q0 = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    np.testing.assert_array_equal(
        fresh["layers"]["attn"]["lora"]["w_q_dnh"]["a"][0], a_q0.detach().numpy().T
    )
    assert not fresh["layers"]["mlp"]["lora"]["w_down_fd"]["b"].any()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    model.save_pretrained(str(tmp_path / "peft"))
    _, adapters = load_adapter(tmp_path / "peft", config)
    lora_config = config.replace(lora=spec)
    ids, mask = _batch()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    ours = M.forward(lora_config, lora.merge(base, adapters), ids, mask)
    assert_close_to_scale(ours, ref.numpy(), mask.astype(bool))
    # jaxrl's init draws from PEFT's distribution: A within ±1/sqrt(in), B zero
    own = lora.init_adapters(lora_config, jax.random.key(0), adapter_spec(lora_config))["layers"]
    a_q = np.asarray(own["attn"]["lora"]["w_q_dnh"]["a"])
    bound = 1 / np.sqrt(config.hidden_size)
    # not rounding: the largest of 576 uniform draws falls below 0.9 of the bound with
    # probability 0.9^576 ~ 1e-26 (and the key is fixed)
    assert np.abs(a_q).max() <= bound and np.abs(a_q).max() > 0.9 * bound
    assert not np.asarray(own["mlp"]["lora"]["w_down_fd"]["b"]).any()


def test_rank_zero_and_base_are_todays_model(tmp_path):
    """No adapters in the tree: the forward is exactly the model's (bit for bit), whatever
    `config.lora` says; fresh adapters (B = 0) leave the logits unchanged."""
    folder = save_tiny("qwen3_qknorm", tmp_path / "base")
    config, base = M.from_pretrained(folder)
    ids, mask = _batch()
    plain = np.asarray(M.forward(config, base, ids, mask))
    adapted = config.replace(lora=LoraSpec(4, 8.0, lora.ALL_LINEAR))
    assert np.array_equal(np.asarray(M.forward(adapted, base, ids, mask)), plain)
    fresh = lora.merge(base, lora.init_adapters(adapted, jax.random.key(1), adapter_spec(adapted)))
    # The adapters add exact zeros (B = 0); only XLA's fusion of the larger program may reorder
    # a float32 sum: ~1e-7 of the logits' scale (measured exact), so 1e-6 of it.
    assert_close_to_scale(M.forward(adapted, fresh, ids, mask), plain, rtol=1e-6)


def test_fold_and_merged_export_equal_adapted(tmp_path):
    """`fold` (W + (alpha/r)·A B) and `save_pretrained` of a LoRA tree (written merged) give
    the adapted model's logits (transformers loading a merged export: test_lora_training)."""
    folder = save_tiny("qwen2_sliding_yarn", tmp_path / "base")
    base_config, base = M.from_pretrained(folder)
    config = base_config.replace(lora=LoraSpec(2, 3.0, ("v_proj", "o_proj", "up_proj")))
    params = lora.merge(base, _random_adapters(config))
    ids, mask = _batch()
    adapted = M.forward(config, params, ids, mask)
    folded = lora.fold(config, params)
    assert not lora.has_adapters(folded)
    # W + (alpha/r) A B rounded to float32 once, then a forward pass in another grouping
    # (x (W + s A B) against x W + s (x A) B): measured 6.8e-7 of the logits' scale; 1e-5 of
    # it leaves a 15x margin.
    assert_close_to_scale(M.forward(base_config, folded, ids, mask), adapted, rtol=1e-5)
    M.save_pretrained(config, params, tmp_path / "merged")
    merged_config, merged = M.from_pretrained(tmp_path / "merged")
    assert merged_config.lora is None
    assert_close_to_scale(M.forward(merged_config, merged, ids, mask), adapted, rtol=1e-5)  # idem


def test_gradients_reach_only_adapters(tmp_path):
    """Differentiating the adapted loss by the (base, adapters) split: the gradient tree is
    the adapters' alone; fresh adapters (B = 0) get non-zero gradients on every B (A's is
    zero through B = 0, as in PEFT), and once B moved on every A and B."""
    config = M.DecoderConfig(
        model_type="llama", vocab_size=31, hidden_size=16, intermediate_size=24,
        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
        lora=LoraSpec(2, 4.0, lora.ALL_LINEAR),
    )  # fmt: skip
    frozen, adapters = lora.split(_random_tree(M.abstract_params(config), std=0.3))
    assert set(adapters) == {"layers"} and "lora" not in str(jax.tree_util.tree_structure(frozen))
    fresh = jax.tree_util.tree_map_with_path(  # as initialised: B = 0
        lambda p, x: jnp.zeros_like(x) if "'b'" in jax.tree_util.keystr(p) else x, adapters
    )
    ids = jnp.arange(12).reshape(2, 6) % 31

    def loss(adapters):
        return M.forward(config, lora.merge(frozen, adapters), ids).astype(jnp.float32).var()

    def largest(grads, which):
        flat = jax.tree_util.tree_flatten_with_path(grads)[0]
        assert flat and all("lora" in jax.tree_util.keystr(p) for p, _ in flat)
        return [float(jnp.abs(g).max()) for p, g in flat if f"'{which}'" in jax.tree_util.keystr(p)]

    grad = jax.jit(jax.grad(loss))
    grads = grad(fresh)
    assert min(largest(grads, "b")) > 0 and max(largest(grads, "a")) == 0
    grads = grad(adapters)
    assert min(largest(grads, "a")) > 0 and min(largest(grads, "b")) > 0


@pytest.mark.parametrize(
    "targets, exclude, expected",
    [
        ("all-linear", None, lora.ALL_LINEAR),
        (["q_proj", "v_proj"], None, ("q_proj", "v_proj")),
        (["self_attn.o_proj"], None, ("o_proj",)),
        (".*mlp.*", None, ("gate_proj", "up_proj", "down_proj")),
        (
            "all-linear",
            ["gate_proj", "up_proj", "down_proj"],
            ("q_proj", "k_proj", "v_proj", "o_proj"),
        ),
    ],
)
def test_target_modules(targets, exclude, expected):
    config = M.DecoderConfig(
        model_type="qwen2", vocab_size=8, hidden_size=8, intermediate_size=8,
        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
    )  # fmt: skip
    assert lora.resolve_targets(config, targets, exclude) == expected


def test_target_module_errors(tmp_path):
    config = M.DecoderConfig(
        model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"model.target_modules: \['c_attn'\].*q_proj"):
        lora.resolve_targets(config, ["q_proj", "c_attn"])
    with pytest.raises(ValueError, match=r"lm_head"):
        lora.resolve_targets(config, ["lm_head"])
    with pytest.raises(ValueError, match=r"layers \[0\] of 2"):
        lora.resolve_targets(config, r"model\.layers\.0\..*")
    with pytest.raises(ValueError, match="leaves no module"):
        lora.resolve_targets(config, ["q_proj"], ["q_proj"])
    with pytest.raises(ValueError, match="rank=-1"):
        LoraSpec(-1, 8.0, ("q_proj",))
    with pytest.raises(ValueError, match="alpha=0"):
        LoraSpec(4, 0.0, ("q_proj",))
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True})
    )
    with pytest.raises(AdapterError, match="use_dora=True is not supported"):
        read_spec(tmp_path / "dora", config)
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        read_spec(tmp_path, config)
    # a folder with a tensor LoRA's A and B do not explain, or a wrong shape, is refused
    spec = LoraSpec(2, 4.0, ("q_proj",))
    adapted = config.replace(lora=spec)
    params = lora.merge(_random_tree(M.abstract_params(config)), _random_adapters(adapted))
    save_adapter(adapted, params, tmp_path / "ok")
    tensors = load_file(str(tmp_path / "ok" / "adapter_model.safetensors"))
    name = next(iter(tensors))
    save_file({**tensors, name.replace("weight", "bias"): np.zeros(2, np.float32)},
              str(tmp_path / "ok" / "adapter_model.safetensors"))  # fmt: skip
    with pytest.raises(AdapterError, match=r"tensors jaxrl would not use .*bias"):
        load_adapter(tmp_path / "ok", config)
    save_file(
        {**tensors, name: tensors[name][:, :-1]}, str(tmp_path / "ok" / "adapter_model.safetensors")
    )
    with pytest.raises(AdapterError, match=r"has shape .* needs"):
        load_adapter(tmp_path / "ok", config)
