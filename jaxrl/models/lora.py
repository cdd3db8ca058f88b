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

A mixture of experts (`jaxrl.models.moe`) has no `mlp` group: its Linear modules are the
attention's and Qwen2-MoE's shared expert's (`mlp.shared_expert.{gate,up,down}_proj`, adapted
as above under `layers/moe/shared/lora`). Its routed experts are 3-D parameters, adapted as
PEFT's `target_parameters` (`ParamWrapper`) adapts them: one pair per parameter, with a rank-r
A and B per expert e,

    experts.gate_up_proj -> layers/moe/lora/w_gate_up_edf   a [L, E, D, r]  b [L, E, r, 2, F]
    experts.down_proj    -> layers/moe/lora/w_down_efd      a [L, E, F, r]  b [L, E, r, D]

    W_gate[e] += (alpha/r) A_gu[e] B_gu[e, :, 0]    W_up[e] += (alpha/r) A_gu[e] B_gu[e, :, 1]
    W_down[e] += (alpha/r) A_d[e] B_d[e]

HF fuses gate and up into one parameter gate_up_proj [E, 2F, D] (gate rows first), so one
adapter serves both: gate and up share A (x A_gu is computed once) and B's output is 2F, kept
as [2, F] so that each half shards like W_gate and W_up (`experts` on `ep`, `mlp` on `tp`).
A is uniform in ±1/sqrt(in) and B zero, as PEFT inits them. The forward passes add the updates
per (token, expert) pair (`moe.swiglu_grouped`, `moe_ep.experts_parallel`).

    config = config.replace(lora=LoraSpec(rank=16, alpha=32, targets=ALL_LINEAR))
    params = merge(base, init_adapters(config, key, params.adapter_spec(config)))
    frozen, trainable = split(params)            # the base, the adapters
    folded = fold(config, params)                # W + (alpha/r)·A B, no adapters left
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.models.config import DecoderConfig, LoraSpec
from jaxrl.models.moe import ADAPTERS, DOWN_ADAPTER, GATE_UP_ADAPTER

log = logging.getLogger(__name__)

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
# A mixture of experts' routed expert parameters (PEFT's target_parameters) -> their adapter
EXPERT_PARAMETERS: dict[str, str] = {
    "experts.gate_up_proj": GATE_UP_ADAPTER,
    "experts.down_proj": DOWN_ADAPTER,
}
# ADAPTERS (`lora`, defined beside the experts in `jaxrl.models.moe`): a group's adapters' key


@dataclasses.dataclass(frozen=True)
class Target:
    """One weight a family can adapt (`adaptable`).

    Attributes:
        path: Its group under `layers` (`("attn",)`, `("mlp",)`, `("moe", "shared")`,
            `("moe",)`); the adapter is `layers/<path>/lora/<weight>`.
        weight: The adapter's key: the weight it adapts (`w_gate_up_edf` for HF's fused
            gate_up_proj, which adapts `w_gate_edf` and `w_up_edf`).
        n_in: The weight's input axes (after L, and E for experts).
        hf: Its HF name inside a layer (`self_attn.q_proj`, `mlp.shared_expert.gate_proj`,
            `mlp.experts.gate_up_proj`).
        experts: A routed experts' parameter: a and b carry E after L.
    """

    path: tuple[str, ...]
    weight: str
    n_in: int
    hf: str
    experts: bool = False


def adaptable(config: DecoderConfig) -> dict[str, Target]:
    """The weights LoRA can adapt in this family, by target name (`LoraSpec.targets`):
    `ALL_LINEAR`'s projections where the family has them (an MoE's gate/up/down are its shared
    expert's, when it has one), and an MoE's `EXPERT_PARAMETERS`."""
    out: dict[str, Target] = {}
    for name, (group, weight, n_in) in PROJECTIONS.items():
        if group == "attn":
            out[name] = Target(("attn",), weight, n_in, f"self_attn.{name}")
        elif config.moe is None:
            out[name] = Target(("mlp",), weight, n_in, f"mlp.{name}")
        elif config.shared_expert_intermediate_size:
            out[name] = Target(("moe", "shared"), weight, n_in, f"mlp.shared_expert.{name}")
    if config.moe is not None:
        for name, weight in EXPERT_PARAMETERS.items():
            out[name] = Target(("moe",), weight, 1, f"mlp.{name}", experts=True)
    return out


def module_names(config: DecoderConfig) -> list[str]:
    """Every adaptable module's full HF name (`model.layers.{i}.self_attn.q_proj`, ...)."""
    targets = [t for t in adaptable(config).values() if not t.experts]
    return [f"model.layers.{i}.{t.hf}" for i in range(config.num_layers) for t in targets]


def parameter_names(config: DecoderConfig) -> list[str]:
    """Every adaptable expert parameter's full HF name
    (`model.layers.{i}.mlp.experts.gate_up_proj`, ...; none for a dense family)."""
    targets = [t for t in adaptable(config).values() if t.experts]
    return [f"model.layers.{i}.{t.hf}" for i in range(config.num_layers) for t in targets]


def _selected(names: list[str], pattern: str | Sequence[str]) -> set[str]:
    """PEFT's matching: a string is a regex that must match the whole name; a list matches a
    name equal to an entry or ending in `.entry`."""
    if isinstance(pattern, str):
        return {n for n in names if re.fullmatch(pattern, n)}
    return {n for n in names for p in pattern if n == p or n.endswith(f".{p}")}


def _on_every_layer(config, chosen: set[str], candidates: dict[str, Target], what: str):
    """The candidates `chosen` selects, each on all layers; raises for one on some only."""
    out = []
    for name, t in candidates.items():
        layers = [i for i in range(config.num_layers) if f"model.layers.{i}.{t.hf}" in chosen]
        if layers and len(layers) != config.num_layers:
            raise ValueError(
                f"{what} select {t.hf} on layers {layers} of {config.num_layers}: jaxrl's "
                "adapters span every layer (they are stacked as the layers are); select it on "
                "all layers or none"
            )
        if layers:
            out.append(name)
    return out


def _warn_peft_all_linear(config: DecoderConfig, key: str) -> None:
    """Where PEFT's `all-linear` reaches further than jaxrl can on this family, say so."""
    if config.model_type in ("qwen3_moe", "mixtral"):
        log.warning(
            "%s=all-linear on %s adapts the attention projections. PEFT (with transformers "
            "v5's fused experts) also adapts the routed experts (gate_up_proj at rank 2r) and "
            "the router (mlp.gate.weight); jaxrl adapts no router, and the experts only through "
            "target_parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj, at rank r)",
            key, config.model_type,
        )  # fmt: skip
    elif config.model_type == "qwen2_moe":
        log.warning(
            "%s=all-linear on qwen2_moe adapts the attention and the shared expert's "
            "projections; PEFT also adapts the shared expert's gate (mlp.shared_expert_gate), "
            "which jaxrl does not", key,
        )  # fmt: skip


def resolve_targets(
    config: DecoderConfig,
    target_modules: str | Sequence[str] | None,
    exclude_modules: str | Sequence[str] | None = None,
    key: str = "model.target_modules",
    target_parameters: Sequence[str] | None = None,
    parameters_key: str | None = None,
) -> tuple[str, ...]:
    """The weights LoRA adapts (`adaptable` names, modules first) from verl's / PEFT's
    `target_modules` (`all-linear`, a list of module names, or a regex over full names),
    `exclude_modules`, and `target_parameters` (a list of parameter names, matched as PEFT
    matches them: equal to, or the end after a `.` of, the full name
    `model.layers.{i}.mlp.experts.gate_up_proj`; the exclusions do not apply to them). A None
    `target_modules` is all-linear, or no module when `target_parameters` names some (PEFT).

    Raises:
        ValueError: naming the key, for a name this family has no module or expert parameter
            for (the LM head, embeddings, routers are not adaptable here), target_parameters
            on a dense model, or a selection that covers a weight on some layers only (the
            layers are stacked: an adapter spans all of them).
    """
    parameters_key = parameters_key or key.replace("target_modules", "target_parameters")
    table = adaptable(config)
    modules = {name: t for name, t in table.items() if not t.experts}
    experts = {name: t for name, t in table.items() if t.experts}
    names = module_names(config)
    if target_modules is None:
        target_modules = [] if target_parameters else "all-linear"
    if target_modules == "all-linear":
        chosen = set(names)
        _warn_peft_all_linear(config, key)
    else:
        if not isinstance(target_modules, str):
            target_modules = [str(t) for t in target_modules]
            unknown = [t for t in target_modules if not _selected(names, [t])]
            if unknown:
                hint = (
                    f" (the routed experts are parameters, not modules: adapt them with "
                    f"{parameters_key}: {', '.join(f'mlp.{p}' for p in experts)})"
                    if experts
                    else ""
                )
                raise ValueError(
                    f"{key}: {unknown} name no module of this {config.model_type} model; "
                    f"LoRA adapts {', '.join(modules)} (or all-linear){hint}"
                )
        chosen = _selected(names, target_modules)
    if exclude_modules:
        if not isinstance(exclude_modules, str):
            exclude_modules = [str(t) for t in exclude_modules]
        chosen -= _selected(names, exclude_modules)
    targets = _on_every_layer(config, chosen, modules, f"{key} / exclude_modules")
    if target_parameters:
        targets += _expert_targets(config, target_parameters, experts, parameters_key)
    if not targets:
        raise ValueError(
            f"{key}={target_modules!r} with exclude_modules={exclude_modules!r} and "
            f"{parameters_key}={target_parameters!r} leaves no module to adapt; choose among "
            f"{', '.join(modules)} or all-linear"
            + (f", or the expert parameters {', '.join(experts)}" if experts else "")
        )
    return tuple(targets)


def _expert_targets(config, target_parameters, experts: dict[str, Target], key: str) -> list:
    """The `EXPERT_PARAMETERS` names `target_parameters` selects (PEFT's matching)."""
    if isinstance(target_parameters, str):
        raise ValueError(
            f"{key}={target_parameters!r}: a list of parameter names (PEFT's "
            "target_parameters), e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj]"
        )
    wanted = [str(p) for p in target_parameters]
    if not experts:
        raise ValueError(
            f"{key}={wanted}: this {config.model_type} model is dense and has no expert "
            "parameters; target_parameters adapts a mixture of experts' "
            f"{', '.join(f'mlp.{p}' for p in EXPERT_PARAMETERS)}. Set {key} to null and "
            "choose the projections with target_modules"
        )
    names = parameter_names(config)
    unknown = [p for p in wanted if not _selected(names, [p])]
    if unknown:
        raise ValueError(
            f"{key}: {unknown} name no expert parameter of this {config.model_type} model; "
            f"LoRA adapts {', '.join(f'mlp.{p}' for p in experts)} (a name matches the full "
            "`model.layers.{i}.mlp.experts.<param>` when equal to it or to its end after a `.`)"
        )
    return _on_every_layer(config, _selected(names, wanted), experts, key)


def group_at(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
    """The group at `path` (a `Target.path`) in a tree's `layers`."""
    for k in path:
        tree = tree[k]
    return tree


def adapters_at(tree: dict[str, Any], path: Sequence[str]) -> dict[str, Any]:
    """The `lora` dict of the group at `path` in a tree's `layers`, created where missing."""
    for k in path:
        tree = tree.setdefault(k, {})
    return tree.setdefault(ADAPTERS, {})


def adapter_shapes(config: DecoderConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The adapters' tree of (shape, logical axes) pairs for the base tree of such pairs
    `base` (`params.param_shapes`: each adapter follows its weight's shape and axes); empty
    without `config.lora`."""
    spec = config.lora
    if spec is None:
        return {}
    r = spec.rank
    table = adaptable(config)
    layers: dict[str, Any] = {}
    for name in spec.targets:
        t = table[name]
        group = group_at(base["layers"], t.path)
        lead = 2 if t.experts else 1  # L, and E for experts
        n = lead + t.n_in
        fused = t.weight == GATE_UP_ADAPTER  # b's output [2, F]: gate's and up's
        (shape, axes) = group["w_gate_edf" if fused else t.weight]
        out_shape, out_axes = shape[n:], axes[n:]
        if fused:
            out_shape, out_axes = (2, *out_shape), (None, *out_axes)
        pair = {
            "a": ((*shape[:n], r), (*axes[:n], "lora_rank")),
            "b": ((*shape[:lead], r, *out_shape), (*axes[:lead], "lora_rank", *out_axes)),
        }
        adapters_at(layers, t.path)[t.weight] = pair
    return {"layers": layers}


def init_adapters(config: DecoderConfig, key: jax.Array, shapes: dict[str, Any]) -> dict[str, Any]:
    """Fresh adapters of the (shape, axes) tree `shapes` (`params.adapter_spec`) in
    `config.lora.dtype`: A uniform in ±1/sqrt(in) (PEFT's `kaiming_uniform_(a=sqrt(5))` over
    the input features, for a module and, per expert, for an expert parameter), B zero."""
    spec = config.lora
    dtype = jnp.dtype(spec.dtype)
    table = adaptable(config)
    out: dict[str, Any] = {"layers": {}}
    for i, name in enumerate(spec.targets):
        t = table[name]
        shapes_ab = group_at(shapes["layers"], t.path)[ADAPTERS][t.weight]
        a_shape = shapes_ab["a"][0]  # [L, (E,) *in, r]
        lead = 2 if t.experts else 1
        bound = 1.0 / math.sqrt(math.prod(a_shape[lead:-1]))
        a = jax.random.uniform(jax.random.fold_in(key, i), a_shape, jnp.float32, -bound, bound)
        pair = {"a": a.astype(dtype), "b": jnp.zeros(shapes_ab["b"][0], dtype)}
        adapters_at(out["layers"], t.path)[t.weight] = pair
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
    """The weight update (alpha/r) · A B of one adapter (float32): [L, *in, *out] for a
    module's, [L, E, *in, *out] for an expert parameter's (`w_gate_up_edf`: [L, E, D, 2, F],
    gate's then up's)."""
    lead = 2 if weight in EXPERT_PARAMETERS.values() else 1
    a = pair["a"].astype(jnp.float32)
    b = pair["b"].astype(jnp.float32)
    heads, r = a.shape[:lead], a.shape[-1]
    ab = jnp.matmul(a.reshape(*heads, -1, r), b.reshape(*heads, r, -1))
    return (config.lora.scale * ab).reshape(*a.shape[:-1], *b.shape[lead + 1 :])


def _fold_group(config: DecoderConfig, group: Mapping[str, Any]) -> dict[str, Any]:
    """A group with its adapters (and its subgroups') merged into their weights."""
    out = {
        k: _fold_group(config, v) if isinstance(v, Mapping) else v
        for k, v in group.items()
        if k != ADAPTERS
    }

    def add(name: str, update: jax.Array) -> None:
        w = out[name]
        out[name] = (w.astype(jnp.float32) + update).astype(w.dtype)

    for weight, pair in group.get(ADAPTERS, {}).items():
        update = delta(config, weight, pair)
        if weight == GATE_UP_ADAPTER:  # [L, E, D, 2, F]: W_gate's, W_up's
            add("w_gate_edf", update[..., 0, :])
            add("w_up_edf", update[..., 1, :])
        else:
            add(weight, update)
    return out


def fold(config: DecoderConfig, params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters with every adapter merged into its weight (W + (alpha/r)·A B, in W's
    dtype; per expert for the experts' adapters) and no adapters left: the same function as
    the adapted model."""
    base, _ = split(params)
    return {**base, "layers": _fold_group(config, params["layers"])}


def with_lora(config: DecoderConfig, spec: LoraSpec | None) -> DecoderConfig:
    """`config` adapted by `spec` (None: no LoRA); the spec's targets are checked against the
    family's modules and expert parameters (`adaptable`)."""
    if spec is None:
        return config.replace(lora=None)
    table = adaptable(config)
    unknown = [t for t in spec.targets if t not in table]
    if unknown:
        raise ValueError(
            f"LoRA targets {unknown}: this {config.model_type} model adapts {', '.join(table)}"
        )
    return config.replace(lora=spec)
