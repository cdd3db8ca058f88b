"""HF checkpoint folders: sharded (index) loading, placement on a mesh, export, and errors.

Logits are compared with transformers' by `assert_close_to_scale` at `COMPOSITE_RTOL` over the
real tokens (a forward pass in another framework: measured <= 2.5e-6 of the scale); loaded and
exported parameters exactly.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxrl.models as M
from jaxrl.models.params import param_shardings
from jaxrl.sharding import make_mesh
from jaxrl.testing.hf_reference import hf_run, left_padded, random_batch
from jaxrl.testing.numerics import assert_close_to_scale
from jaxrl.testing.tiny import save_tiny


def batch(seed=0):
    return random_batch(3, 12, vocab=97, seed=seed)


# A training-style layout: weights sharded over fsdp (ZeRO-3) and tp.
FSDP_TP = {
    "vocab": "tp",
    "embed": "fsdp",
    "mlp": "tp",
    "heads": "tp",
    "kv_heads": "tp",
}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return save_tiny("qwen2_gqa_tied", tmp_path_factory.mktemp("qwen2"))


def test_sharded_index_checkpoint_loads(tmp_path):
    import transformers

    folder = save_tiny("qwen3_qknorm", tmp_path / "single")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    config, params = M.from_pretrained(tmp_path / "sharded")
    ids, mask = left_padded(*batch())
    assert_close_to_scale(M.forward(config, params, ids, mask), hf_run(folder, ids, mask), mask > 0)


def test_load_onto_mesh_gives_same_logits(qwen2):
    mesh = make_mesh({"fsdp": 4, "tp": 2})
    config, params = M.from_pretrained(qwen2, mesh=mesh, layout=FSDP_TP)
    w_q = params["layers"]["attn"]["w_q_dnh"]  # [L, D=48, N=6, H=8]
    assert w_q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp", None)
    # Each device holds one eighth of the tensor, never the whole of it.
    assert {s.data.shape for s in w_q.addressable_shards} == {(3, 12, 3, 8)}
    ids, mask = left_padded(*batch())
    logits = jax.jit(M.forward, static_argnums=0)(config, params, ids, mask)
    assert_close_to_scale(logits, hf_run(qwen2, ids, mask), mask > 0)


def test_load_with_a_layout_object(qwen2):
    from jaxrl.sharding import TRAIN_RULES, Layout

    layout = Layout.create(make_mesh({"fsdp": 4, "tp": 2}), TRAIN_RULES)
    config, params = M.from_pretrained(qwen2, layout=layout)
    expected = param_shardings(config, layout)
    jax.tree.map(
        lambda x, s: x.sharding.is_equivalent_to(s, x.ndim) or pytest.fail(str(s)), params, expected
    )


def test_indivisible_dims_are_replicated(qwen2):
    mesh = make_mesh({"fsdp": 8})  # vocab 97 and kv heads 2 do not divide by 8
    _, params = M.from_pretrained(qwen2, mesh=mesh, layout={"vocab": "fsdp", "kv_heads": "fsdp"})
    assert params["embed"]["tokens_vd"].sharding.spec == jax.sharding.PartitionSpec(None, None)


@pytest.mark.parametrize(
    "name",
    ["qwen2_sliding_yarn", "llama_gqa_bias_llama3", "qwen3_bias_mqa_sliding", "mistral_sliding",
     "gemma2_softcap", "gemma2_mqa_untied_bias", "gemma3_local_rope",
     "gemma3_capped_mqa_untied"],
)  # fmt: skip
def test_export_round_trip(name, tmp_path):
    """jaxrl params -> save_pretrained -> transformers: the same logits, config preserved."""
    import transformers

    folder = save_tiny(name, tmp_path / "orig")
    config, params = M.from_pretrained(folder)
    # Change the weights so the round trip cannot pass by copying the original files.
    params = jax.tree.map(lambda x: x * 1.5, params)
    out = M.save_pretrained(config, params, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids, mask = left_padded(*batch())
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)
    with torch.no_grad():
        ref = reloaded(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(pos),
        ).logits.numpy()
    assert_close_to_scale(M.forward(config, params, ids, mask), ref, mask > 0)
    config2, params2 = M.from_pretrained(out)
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_export_value_model_and_shards(tmp_path):
    folder = save_tiny("llama_mha_tied", tmp_path / "orig", head="token_classification")
    config, params = M.from_pretrained(folder)
    out = M.save_pretrained(config, params, tmp_path / "export", max_shard_bytes=30_000)
    assert (out / "model.safetensors.index.json").is_file()
    config2, params2 = M.from_pretrained(out)
    assert config2.head == "token_classification" and config2.score_bias
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_export_bfloat16(qwen2, tmp_path):
    config, params = M.from_pretrained(qwen2)
    out = M.save_pretrained(config, params, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    _, params2 = M.from_pretrained(out, dtype="bfloat16")
    assert params2["embed"]["tokens_vd"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        params2["embed"]["tokens_vd"], params["embed"]["tokens_vd"].astype(jnp.bfloat16)
    )


def test_missing_and_unexpected_tensors_are_named(qwen2, tmp_path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(qwen2 / "model.safetensors"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((qwen2 / "config.json").read_text())
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(M.CheckpointError) as info:
        M.from_pretrained(broken)
    msg = str(info.value)
    assert "missing tensors (1): model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected tensors (1): model.layers.1.mlp.extra.weight" in msg


def test_wrong_shape_is_named(qwen2, tmp_path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(qwen2 / "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((qwen2 / "config.json").read_text())
    tensors["model.norm.weight"] = np.ones(47, np.float32)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(M.CheckpointError, match=r"model\.norm\.weight: shape \(47,\)"):
        M.from_pretrained(bad)


def test_folder_errors(tmp_path):
    with pytest.raises(M.CheckpointError, match=r"no config\.json"):
        M.from_pretrained(tmp_path)
    folder = save_tiny("llama_mha_tied", tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(M.CheckpointError, match=r"no model\.safetensors"):
        M.from_pretrained(folder)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(model_type="gpt2"), "model type 'gpt2' is not supported"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (dict(rope_parameters={"rope_type": "longrope"}), "rope type 'longrope' is not supported"),
    ],
)
def test_unsupported_options_are_named(change, match):
    from jaxrl.testing.tiny import hf_config

    hf = hf_config("llama_mha_tied")
    for key, value in change.items():
        setattr(hf, key, value)
    with pytest.raises(ValueError, match=match):
        M.from_hf_config(hf)
