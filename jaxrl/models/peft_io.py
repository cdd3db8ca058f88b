"""PEFT adapter folders: LoRA adapters in and out (`adapter_config.json` +
`adapter_model.safetensors`), as `peft.PeftModel.save_pretrained` writes them.

    save_adapter(config, params, "out", base_model="path/to/base")   # PeftModel loads it
    spec, adapters = load_adapter("out", config)                    # jaxrl's adapter tree

PEFT stores per layer `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in]
and `....lora_B.weight` [out, r] (torch's [out, in] convention); jaxrl stacks the layers and keeps
the head axes: a [L, *in, r], b [L, r, *out] (`jaxrl.models.lora`).

A mixture of experts' expert parameters (`target_parameters`: `mlp.experts.gate_up_proj`
[E, 2F, D], `mlp.experts.down_proj` [E, D, F]) are PEFT `ParamWrapper`s on the `mlp.experts`
module: per layer `lora_A.weight` [E r, in] (row e r + j: expert e's A row j) and
`lora_B.weight` [out, r E] (column j E + e: expert e's B column j), the update of expert e
being (alpha/r) B_e A_e in the parameter's [out, in] layout. With both parameters targeted the
wrappers nest in the order the module registers them: gate_up_proj's under
`mlp.experts.base_layer.lora_*`, down_proj's under `mlp.experts.lora_*` (one alone: under
`mlp.experts`). jaxrl's a [L, E, in, r] and b [L, E, r, *out] (gate_up: out [2, F], gate's
rows first as HF fuses them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import lora
from jaxrl.models.config import DecoderConfig, LoraSpec
from jaxrl.models.params import adapter_spec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# adapter_config.json entries jaxrl cannot honour, with the value that is fine
_UNSUPPORTED = {
    "use_dora": False,
    "use_rslora": False,
    "bias": "none",
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "lora_bias": False,
    "trainable_token_indices": None,
    "layer_replication": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
    "use_bdlora": None,
}


class AdapterError(ValueError):
    """An adapter folder jaxrl cannot load, naming the file and the entry."""


def _tensor_name(config: DecoderConfig, name: str, layer: int, which: str) -> str:
    """PEFT's name of target `name`'s A or B (`which`) on `layer` (module doc)."""
    t = lora.adaptable(config)[name]
    path = t.hf
    if t.experts:  # nested ParamWrappers: a later-registered parameter's wraps an earlier's
        wrapped = [p for p in lora.EXPERT_PARAMETERS if p in config.lora.targets]
        depth = len(wrapped) - 1 - wrapped.index(name)
        path = "mlp.experts" + ".base_layer" * depth
    return f"{_PREFIX}model.layers.{layer}.{path}.lora_{which}.weight"


def _to_peft(a: np.ndarray, b: np.ndarray, experts: bool) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (A, B) as PEFT stores them from jaxrl's a [(E,) *in, r], b [(E,) r, *out]:
    [r, in], [out, r] for a module; [E r, in], [out, r E] for an expert parameter."""
    if not experts:
        r = a.shape[-1]
        return a.reshape(-1, r).T, b.reshape(r, -1).T
    e, r = a.shape[0], a.shape[-1]
    a_peft = a.reshape(e, -1, r).transpose(0, 2, 1).reshape(e * r, -1)
    b_peft = b.reshape(e, r, -1).transpose(2, 1, 0).reshape(-1, r * e)
    return a_peft, b_peft


def _from_peft(tensor: np.ndarray, which: str, shape: tuple[int, ...], experts: bool):
    """`_to_peft`'s inverse for one layer's A or B (`which`): jaxrl's [(E,) *in, r] or
    [(E,) r, *out] (`shape`)."""
    if not experts:
        return tensor.T.reshape(shape)
    e = shape[0]
    if which == "A":  # [E r, in] -> [E, in, r]
        return tensor.reshape(e, shape[-1], -1).transpose(0, 2, 1).reshape(shape)
    # [out, r E] -> [E, r, out]
    return tensor.reshape(-1, shape[1], e).transpose(2, 1, 0).reshape(shape)


def _peft_shape(shape: tuple[int, ...], which: str, rank: int, experts: bool) -> tuple[int, int]:
    """PEFT's 2-D shape of one layer's A or B of jaxrl's per-layer `shape`."""
    e = shape[0] if experts else 1
    rest = int(np.prod(shape)) // (rank * e)  # in (A) or out (B)
    return (e * rank, rest) if which == "A" else (rest, rank * e)


def save_adapter(
    config: DecoderConfig,
    params: Any,
    path: str | os.PathLike,
    *,
    base_model: str | None = None,
    dtype: str | None = None,
) -> Path:
    """Write the adapters of `params` (a LoRA tree of `config`) as a PEFT folder, in `dtype`
    (default float32)."""
    from safetensors.numpy import save_file

    spec = config.lora
    if spec is None or not lora.has_adapters(params):
        raise ValueError("save_adapter: the model carries no LoRA adapters (config.lora unset)")
    out = Path(path).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    table = lora.adaptable(config)
    np_dtype = np.dtype(jnp.dtype(dtype or "float32"))
    for name in spec.targets:
        t = table[name]
        pair = lora.group_at(params["layers"], t.path)[lora.ADAPTERS][t.weight]
        a = np.asarray(jax.device_get(pair["a"])).astype(np_dtype)
        b = np.asarray(jax.device_get(pair["b"])).astype(np_dtype)
        for i in range(config.num_layers):
            a_peft, b_peft = _to_peft(a[i], b[i], t.experts)
            tensors[_tensor_name(config, name, i, "A")] = np.ascontiguousarray(a_peft)
            tensors[_tensor_name(config, name, i, "B")] = np.ascontiguousarray(b_peft)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    modules = [name for name in spec.targets if not table[name].experts]
    parameters = [table[name].hf for name in spec.targets if table[name].experts]
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": sorted(modules),
        "target_parameters": parameters or None,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2))
    return out


def read_spec(path: str | os.PathLike, config: DecoderConfig) -> LoraSpec:
    """The `LoraSpec` an adapter folder describes, for the model `config`.

    Raises:
        AdapterError: a missing file, a non-LoRA adapter, or a PEFT option jaxrl does not
            implement (DoRA, rsLoRA, biases, per-layer ranks or layers, modules_to_save).
    """
    folder = Path(path).expanduser()
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(
            f"{folder}: no {CONFIG_FILE}; lora_adapter_path must name a PEFT adapter folder "
            "(what PeftModel.save_pretrained or `python -m jaxrl.export` writes)"
        )
    cfg = json.loads(file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type={cfg['peft_type']!r}; jaxrl loads LORA adapters")
    for key, fine in _UNSUPPORTED.items():
        value = cfg.get(key, fine)
        if value not in (None, False, {}, []) and value != fine:
            raise AdapterError(
                f"{file}: {key}={value!r} is not supported by jaxrl (it needs {key}={fine!r})"
            )
    targets = lora.resolve_targets(
        config,
        cfg.get("target_modules"),
        cfg.get("exclude_modules"),
        key=f"{file}: target_modules",
        target_parameters=cfg.get("target_parameters"),
    )
    return LoraSpec(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), targets=targets)


def load_adapter(path: str | os.PathLike, config: DecoderConfig) -> tuple[LoraSpec, dict]:
    """(spec, adapters) of a PEFT adapter folder: the adapters as host arrays (float32) in
    jaxrl's tree (`params.adapter_spec` of `config` adapted by the spec)."""
    from safetensors.numpy import load_file

    folder = Path(path).expanduser()
    spec = read_spec(folder, config)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"{folder}: no {WEIGHTS_FILE} (only safetensors adapters load)")
    tensors = {k.replace(".default.", "."): v for k, v in load_file(str(weights)).items()}
    adapted = lora.with_lora(config, spec)
    shapes = adapter_spec(adapted)
    table = lora.adaptable(adapted)
    out: dict[str, Any] = {"layers": {}}
    used = set()
    for target in spec.targets:
        t = table[target]
        pair_shapes = lora.group_at(shapes["layers"], t.path)[lora.ADAPTERS][t.weight]
        pair = {}
        for which, key in (("A", "a"), ("B", "b")):
            shape = pair_shapes[key][0][1:]  # a layer's [(E,) *in, r] or [(E,) r, *out]
            expected = _peft_shape(shape, which, spec.rank, t.experts)
            layers = []
            for i in range(config.num_layers):
                name = _tensor_name(adapted, target, i, which)
                if name not in tensors:
                    raise AdapterError(f"{weights}: no tensor {name}")
                if tuple(tensors[name].shape) != expected:
                    raise AdapterError(
                        f"{weights}: {name} has shape {tuple(tensors[name].shape)}; this model "
                        f"with rank {spec.rank} needs {expected}"
                    )
                used.add(name)
                tensor = np.asarray(tensors[name], np.float32)
                layers.append(_from_peft(tensor, which, shape, t.experts))
            pair[key] = np.stack(layers)
        lora.adapters_at(out["layers"], t.path)[t.weight] = pair
    if extra := sorted(set(tensors) - used):
        raise AdapterError(
            f"{weights}: tensors jaxrl would not use ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}): an adapter with more than LoRA's A and B of "
            "its target_modules cannot load exactly"
        )
    return spec, out
