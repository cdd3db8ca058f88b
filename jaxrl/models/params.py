"""The parameter pytree of a decoder, its logical axis names, and random initialisation.

Parameters are a nested dict of arrays; names end in the dimension letters of their shape
(D model, F feed-forward, V vocab, N query heads, K kv heads, H head dim, C labels). Every
array under `layers` has a leading L axis (layers are stacked and run with `lax.scan`):

    embed/tokens_vd                          [V, D]
    layers/ln_attn_d, layers/ln_mlp_d        [L, D]        (attention / MLP input norms)
    layers/ln_attn_out_d, ln_mlp_out_d       [L, D]        (their output norms: Gemma)
    layers/attn/w_q_dnh  (b_q_nh)            [L, D, N, H]
    layers/attn/w_k_dkh, w_v_dkh  (b_*_kh)   [L, D, K, H]
    layers/attn/w_o_nhd  (b_o_d)             [L, N, H, D]
    layers/attn/q_norm_h, k_norm_h           [L, H]        (Qwen3)
    layers/mlp/w_gate_df, w_up_df (b_*_f)    [L, D, F]
    layers/mlp/w_down_fd  (b_down_d)         [L, F, D]
    final_norm_d                             [D]
    lm_head_dv                               [D, V]        (untied causal LM)
    score/w_dc  (b_c)                        [D, C]        (classification heads)
    layers/{attn,mlp}/lora/<weight>/{a, b}   LoRA adapters (`config.lora`; `jaxrl.models.lora`)

`logical_axes(config)` gives the same tree with a tuple of logical names per array (DESIGN §3):
`vocab, embed, mlp, heads, kv_heads, head_dim, layers, labels`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.models import lora
from jaxrl.models.config import DecoderConfig
from jaxrl.sharding.layouts import Layout

Params = dict[str, Any]


def param_shapes(config: DecoderConfig) -> dict[str, Any]:
    """The tree of (shape, logical axes) pairs that defines the parameter layout."""
    c = config
    L, D, F, V = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
    attn: dict[str, Any] = {
        "w_q_dnh": ((L, D, N, H), ("layers", "embed", "heads", "head_dim")),
        "w_k_dkh": ((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        "w_v_dkh": ((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        "w_o_nhd": ((L, N, H, D), ("layers", "heads", "head_dim", "embed")),
    }
    if c.qkv_bias:
        attn["b_q_nh"] = ((L, N, H), ("layers", "heads", "head_dim"))
        attn["b_k_kh"] = ((L, K, H), ("layers", "kv_heads", "head_dim"))
        attn["b_v_kh"] = ((L, K, H), ("layers", "kv_heads", "head_dim"))
    if c.o_bias:
        attn["b_o_d"] = ((L, D), ("layers", "embed"))
    if c.qk_norm:
        attn["q_norm_h"] = ((L, H), ("layers", "head_dim"))
        attn["k_norm_h"] = ((L, H), ("layers", "head_dim"))
    mlp: dict[str, Any] = {
        "w_gate_df": ((L, D, F), ("layers", "embed", "mlp")),
        "w_up_df": ((L, D, F), ("layers", "embed", "mlp")),
        "w_down_fd": ((L, F, D), ("layers", "mlp", "embed")),
    }
    if c.mlp_bias:
        mlp["b_gate_f"] = ((L, F), ("layers", "mlp"))
        mlp["b_up_f"] = ((L, F), ("layers", "mlp"))
        mlp["b_down_d"] = ((L, D), ("layers", "embed"))
    layers: dict[str, Any] = {
        "ln_attn_d": ((L, D), ("layers", "embed")),
        "ln_mlp_d": ((L, D), ("layers", "embed")),
        "attn": attn,
    }
    if c.post_norms:
        layers["ln_attn_out_d"] = ((L, D), ("layers", "embed"))
        layers["ln_mlp_out_d"] = ((L, D), ("layers", "embed"))
    if c.moe is None:
        layers["mlp"] = mlp
    else:  # the experts split over the `experts` logical axis (mesh `ep`)
        E, Fe = c.moe.num_experts, c.moe_intermediate_size
        layers["moe"] = {
            "router_de": ((L, D, E), ("layers", "embed", None)),
            "w_gate_edf": ((L, E, D, Fe), ("layers", "experts", "embed", "mlp")),
            "w_up_edf": ((L, E, D, Fe), ("layers", "experts", "embed", "mlp")),
            "w_down_efd": ((L, E, Fe, D), ("layers", "experts", "mlp", "embed")),
        }
        if Fs := c.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert and its gate
            layers["moe"]["shared"] = {
                "w_gate_df": ((L, D, Fs), ("layers", "embed", "mlp")),
                "w_up_df": ((L, D, Fs), ("layers", "embed", "mlp")),
                "w_down_fd": ((L, Fs, D), ("layers", "mlp", "embed")),
            }
            layers["moe"]["shared_gate_d"] = ((L, D), ("layers", "embed"))
    tree: dict[str, Any] = {
        "embed": {"tokens_vd": ((V, D), ("vocab", "embed"))},
        "layers": layers,
        "final_norm_d": ((D,), ("embed",)),
    }
    if c.head == "causal_lm" and not c.tie_word_embeddings:
        tree["lm_head_dv"] = ((D, V), ("embed", "vocab"))
    if c.head != "causal_lm":
        tree["score"] = {"w_dc": ((D, c.num_labels), ("embed", "labels"))}
        if c.score_bias:
            tree["score"]["b_c"] = ((c.num_labels,), ("labels",))
    return lora.merge(tree, lora.adapter_shapes(c, tree))


def _is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)


def logical_axes(config: DecoderConfig) -> dict[str, Any]:
    """The parameter tree with a tuple of logical axis names in place of each array."""
    return jax.tree.map(lambda spec: spec[1], param_shapes(config), is_leaf=_is_spec)


def abstract_params(config: DecoderConfig) -> dict[str, Any]:
    """The parameter tree as `jax.ShapeDtypeStruct`s in `config.param_dtype` (LoRA adapters
    in `config.lora.dtype`)."""

    def abstract(shapes, dtype):
        return jax.tree.map(
            lambda spec: jax.ShapeDtypeStruct(spec[0], jnp.dtype(dtype)), shapes, is_leaf=_is_spec
        )

    base = abstract(param_shapes(config.replace(lora=None)), config.param_dtype)
    if config.lora is None:
        return base
    return lora.merge(base, abstract(adapter_spec(config), config.lora.dtype))


def adapter_spec(config: DecoderConfig) -> dict[str, Any]:
    """The LoRA adapters' part of `param_shapes` (empty without `config.lora`)."""
    return lora.split(param_shapes(config))[1]


def param_shardings(config: DecoderConfig, layout: Layout) -> dict[str, Any]:
    """The `NamedSharding` tree of the parameters of `config` in `layout`: each array's
    logical axes mapped by the layout's rules onto its mesh."""
    return layout.tree(abstract_params(config), logical_axes(config))


def init_params(config: DecoderConfig, key: jax.Array, std: float = 0.02) -> Params:
    """Random parameters: normal(0, std) weights, zero biases, unit norm scales (zero
    offsets under `config.norm_unit_offset`: the same unit scale), as HF inits; with
    `config.lora`, fresh adapters (`lora.init_adapters`)."""
    if config.lora is not None:
        base = init_params(config.replace(lora=None), key, std)
        adapters = lora.init_adapters(config, jax.random.fold_in(key, 1), adapter_spec(config))
        return lora.merge(base, adapters)
    specs = param_shapes(config)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(specs, _is_spec)[0]]
    keys = jax.random.split(key, len(leaves))
    dtype = jnp.dtype(config.param_dtype)
    norm_init = jnp.zeros if config.norm_unit_offset else jnp.ones
    out = []
    for path, (shape, _), k in zip(paths, leaves, keys, strict=True):
        name = path.rsplit("'", 2)[-2]
        if "norm" in name or name.startswith("ln_"):
            out.append(norm_init(shape, dtype))
        elif name.startswith("b_"):
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def parameter_counts(config: DecoderConfig) -> tuple[int, int]:
    """(all parameters, those one token uses): a mixture of experts' token runs k of its E
    experts (and the shared expert), so (E - k) / E of the expert weights are idle for it;
    equal for a dense model. LoRA adapters are not counted."""
    shapes = param_shapes(config.replace(lora=None))
    total = sum(math.prod(s[0]) for s in jax.tree.leaves(shapes, is_leaf=_is_spec))
    if config.moe is None:
        return total, total
    moe = shapes["layers"]["moe"]
    experts = sum(math.prod(moe[name][0]) for name in ("w_gate_edf", "w_up_edf", "w_down_efd"))
    idle = experts * (config.moe.num_experts - config.moe.top_k) // config.moe.num_experts
    return total, total - idle
