"""LoRA adapters (Hu et al., 2021; as PEFT builds them) beside a frozen base model.

A target projection `y = x W` (W [in, out]) computes

    y = x W + (alpha / r) · (x A) B        A [in, r], B [r, out]

with A drawn as PEFT's `kaiming_uniform_(a=sqrt(5))` (uniform in ±1/sqrt(in)) and B zero, so
a fresh adapter leaves the model unchanged. The adapters live inside the parameter tree,
next to the weight they adapt, stacked over the layers as the base is:

    layers/attn/lora/w_q_dnh/{a, b}     a [L, D, r]     b [L, r, N, H]
    layers/attn/lora/w_o_nhd/{a, b}     a [L, N, H, r]  b [L, r, D]
    layers/mlp/lora/w_down_fd/{a, b}    a [L, F, r]     b [L, r, D]     (and so on)

so the model's one forward pass (`transformer._block`, also the rollout's decode step) applies
whatever adapters the tree holds: the base without them is the reference policy, with them
the actor. Their logical axes are the adapted weight's input (a) or output (b) axes, the rank
axis `lora_rank` (replicated by the default rules): an adapter shards like its weight.

    config = config.replace(lora=LoraSpec(rank=16, alpha=32, targets=ALL_LINEAR))
    params = merge(base, init_adapters(config, key, params.adapter_spec(config)))
    frozen, trainable = split(params)            # the base, the adapters
    folded = fold(config, params)                # W + (alpha/r)·A B, no adapters left
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.models.config import DecoderConfig, LoraSpec

# HF module name -> (group in the layer, the weight it adapts, its input axes count)
PROJECTIONS: dict[str, tuple[str, str, int]] = {
    "q_proj": ("attn", "w_q_dnh", 1),
    "k_proj": ("attn", "w_k_dkh", 1),
    "v_proj": ("attn", "w_v_dkh", 1),
    "o_proj": ("attn", "w_o_nhd", 2),
    "gate_proj": ("mlp", "w_gate_df", 1),
    "up_proj": ("mlp", "w_up_df", 1),
    "down_proj": ("mlp", "w_down_fd", 1),
}
ALL_LINEAR = tuple(PROJECTIONS)
_HF_GROUP = {"attn": "self_attn", "mlp": "mlp"}
ADAPTERS = "lora"  # the key of a layer group's adapters


def module_names(config: DecoderConfig) -> list[str]:
    """Every adaptable module's full HF name (`model.layers.{i}.self_attn.q_proj`, ...)."""
    return [
        f"model.layers.{i}.{_HF_GROUP[group]}.{name}"
        for i in range(config.num_layers)
        for name, (group, _, _) in PROJECTIONS.items()
    ]


def _selected(names: list[str], pattern: str | Sequence[str]) -> set[str]:
    """PEFT's matching: a string is a regex that must match the whole name; a list matches a
    name equal to an entry or ending in `.entry`."""
    if isinstance(pattern, str):
        return {n for n in names if re.fullmatch(pattern, n)}
    return {n for n in names for p in pattern if n == p or n.endswith(f".{p}")}


def resolve_targets(
    config: DecoderConfig,
    target_modules: str | Sequence[str] | None,
    exclude_modules: str | Sequence[str] | None = None,
    key: str = "model.target_modules",
) -> tuple[str, ...]:
    """The projections (`ALL_LINEAR` names) LoRA adapts, from verl's / PEFT's
    `target_modules` (`all-linear`, a list of module names, or a regex over full names) and
    `exclude_modules`.

    Raises:
        ValueError: naming the key, for a name this family has no module for (the LM head and
            embeddings are not adaptable here), or a selection that covers a projection on
            some layers only (the layers are stacked: an adapter spans all of them).
    """
    names = module_names(config)
    if target_modules is None or target_modules == "all-linear":
        chosen = set(names)
    else:
        if not isinstance(target_modules, str):
            target_modules = [str(t) for t in target_modules]
            unknown = [t for t in target_modules if not _selected(names, [t])]
            if unknown:
                raise ValueError(
                    f"{key}: {unknown} name no module of this {config.model_type} model; "
                    f"LoRA adapts {', '.join(ALL_LINEAR)} (or all-linear)"
                )
        chosen = _selected(names, target_modules)
    if exclude_modules:
        if not isinstance(exclude_modules, str):
            exclude_modules = [str(t) for t in exclude_modules]
        chosen -= _selected(names, exclude_modules)
    targets = []
    for proj in ALL_LINEAR:
        group = _HF_GROUP[PROJECTIONS[proj][0]]
        layers = [
            i for i in range(config.num_layers) if f"model.layers.{i}.{group}.{proj}" in chosen
        ]
        if layers and len(layers) != config.num_layers:
            raise ValueError(
                f"{key} / exclude_modules select {proj} on layers {layers} of "
                f"{config.num_layers}: jaxrl's adapters span every layer (they are stacked as "
                "the layers are); select a projection on all layers or none"
            )
        if layers:
            targets.append(proj)
    if not targets:
        raise ValueError(
            f"{key}={target_modules!r} with exclude_modules={exclude_modules!r} leaves no module "
            f"to adapt; choose among {', '.join(ALL_LINEAR)} or all-linear"
        )
    return tuple(targets)


def adapter_shapes(config: DecoderConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The adapters' tree of (shape, logical axes) pairs for the base tree of such pairs
    `base` (`params.param_shapes`: each adapter follows its weight's shape and axes); empty
    without `config.lora`."""
    spec = config.lora
    if spec is None:
        return {}
    r = spec.rank
    layers: dict[str, Any] = {}
    for proj in spec.targets:
        group, weight, n_in = PROJECTIONS[proj]
        (L, *shape), (_, *axes) = base["layers"][group][weight]
        n = 1 + n_in
        pair = {
            "a": ((L, *shape[: n - 1], r), ("layers", *axes[: n - 1], "lora_rank")),
            "b": ((L, r, *shape[n - 1 :]), ("layers", "lora_rank", *axes[n - 1 :])),
        }
        layers.setdefault(group, {ADAPTERS: {}})[ADAPTERS][weight] = pair
    return {"layers": layers}


def init_adapters(config: DecoderConfig, key: jax.Array, shapes: dict[str, Any]) -> dict[str, Any]:
    """Fresh adapters of the (shape, axes) tree `shapes` (`params.adapter_spec`) in
    `config.lora.dtype`: A uniform in ±1/sqrt(in) (PEFT's `kaiming_uniform_(a=sqrt(5))` over
    the input features), B zero."""
    spec = config.lora
    dtype = jnp.dtype(spec.dtype)
    out: dict[str, Any] = {"layers": {}}
    for i, proj in enumerate(spec.targets):
        group, weight, n_in = PROJECTIONS[proj]
        shapes_ab = shapes["layers"][group][ADAPTERS][weight]
        a_shape = shapes_ab["a"][0]
        bound = 1.0 / math.sqrt(math.prod(a_shape[1 : 1 + n_in]))
        a = jax.random.uniform(jax.random.fold_in(key, i), a_shape, jnp.float32, -bound, bound)
        pair = {"a": a.astype(dtype), "b": jnp.zeros(shapes_ab["b"][0], dtype)}
        out["layers"].setdefault(group, {ADAPTERS: {}})[ADAPTERS][weight] = pair
    return out


def merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """The union of two parameter trees (dicts merged key by key; no array is copied)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and k in out else v
    return out


def split(params: Mapping[str, Any], keep: Sequence[str] = ()) -> tuple[dict, dict]:
    """(base, adapters) of a parameter tree; top-level entries named in `keep` (e.g. a
    critic's fresh `score` head) go with the adapters (trained)."""
    base: dict[str, Any] = {}
    adapters: dict[str, Any] = {}
    for k, v in params.items():
        if k in keep or k == ADAPTERS:
            adapters[k] = v
        elif isinstance(v, Mapping):
            b, a = split(v)
            base[k] = b
            if a:
                adapters[k] = a
        else:
            base[k] = v
    return base, adapters


def has_adapters(params: Mapping[str, Any]) -> bool:
    return bool(split(params)[1])


def low_rank(x: jax.Array, pair: Mapping[str, jax.Array], scale: float, eq: str) -> jax.Array:
    """(alpha/r) · (x A) B for the projection `einsum(eq, x, W)` (e.g. `btd,dnh->btnh`):
    A contracts W's input letters, B produces its output letters."""
    lhs, out = eq.split("->")
    x_sub, w_sub = lhs.split(",")
    contracted = "".join(c for c in w_sub if c in x_sub)
    w_out = "".join(c for c in w_sub if c not in x_sub)
    rows = "".join(c for c in x_sub if c not in w_sub)
    xa = jnp.einsum(f"{x_sub},{contracted}r->{rows}r", x, pair["a"].astype(x.dtype))
    return jnp.einsum(
        f"{rows}r,r{w_out}->{out}", xa * jnp.asarray(scale, x.dtype), pair["b"].astype(x.dtype)
    )


def delta(config: DecoderConfig, weight: str, pair: Mapping[str, jax.Array]) -> jax.Array:
    """The weight update (alpha/r) · A B [L, *in, *out] of one adapted weight (float32)."""
    n_in = {w: n for _, w, n in PROJECTIONS.values()}[weight]
    a = pair["a"].astype(jnp.float32)
    b = pair["b"].astype(jnp.float32)
    L, r = a.shape[0], a.shape[-1]
    ab = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r), b.reshape(L, r, -1))
    return (config.lora.scale * ab).reshape(*a.shape[: 1 + n_in], *b.shape[2:])


def fold(config: DecoderConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters with every adapter merged into its weight (W + (alpha/r)·A B, in W's
    dtype) and no adapters left: the same function as the adapted model."""
    base, adapters = split(params)
    layers = dict(base["layers"])
    for group, tree in adapters.get("layers", {}).items():
        weights = dict(layers[group])
        for weight, pair in tree[ADAPTERS].items():
            w = weights[weight]
            weights[weight] = (w.astype(jnp.float32) + delta(config, weight, pair)).astype(w.dtype)
        layers[group] = weights
    return {**base, "layers": layers}


def with_lora(config: DecoderConfig, spec: LoraSpec | None) -> DecoderConfig:
    """`config` adapted by `spec` (None: no LoRA); the spec's targets are checked against the
    family's modules."""
    if spec is None:
        return config.replace(lora=None)
    unknown = [t for t in spec.targets if t not in PROJECTIONS]
    if unknown:
        raise ValueError(f"LoRA targets {unknown}: this family adapts {', '.join(ALL_LINEAR)}")
    return config.replace(lora=spec)
