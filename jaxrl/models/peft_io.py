"""PEFT adapter folders: LoRA adapters in and out (`adapter_config.json` +
`adapter_model.safetensors`), as `peft.PeftModel.save_pretrained` writes them.

    save_adapter(config, params, "out", base_model="path/to/base")   # PeftModel loads it
    spec, adapters = load_adapter("out", config)                    # jaxrl's adapter tree

PEFT stores per layer `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in]
and `....lora_B.weight` [out, r] (torch's [out, in] convention); jaxrl stacks the layers and keeps
the head axes: a [L, *in, r], b [L, r, *out] (`jaxrl.models.lora`).
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
    "target_parameters": None,
    "lora_bias": False,
    "trainable_token_indices": None,
    "layer_replication": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
    "use_bdlora": None,
}


class AdapterError(ValueError):
    """An adapter folder jaxrl cannot load, naming the file and the entry."""


def _tensor_name(proj: str, layer: int, which: str) -> str:
    group = lora.PROJECTIONS[proj][0]
    return f"{_PREFIX}model.layers.{layer}.{lora._HF_GROUP[group]}.{proj}.lora_{which}.weight"


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
    for proj in spec.targets:
        group, weight, _ = lora.PROJECTIONS[proj]
        pair = params["layers"][group][lora.ADAPTERS][weight]
        np_dtype = np.dtype(jnp.dtype(dtype or "float32"))
        a = np.asarray(jax.device_get(pair["a"])).astype(np_dtype)
        b = np.asarray(jax.device_get(pair["b"])).astype(np_dtype)
        r = spec.rank
        for i in range(config.num_layers):
            tensors[_tensor_name(proj, i, "A")] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            tensors[_tensor_name(proj, i, "B")] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": sorted(spec.targets),
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
    out: dict[str, Any] = {"layers": {}}
    used = set()
    for proj in spec.targets:
        group, weight, _ = lora.PROJECTIONS[proj]
        pair_shapes = shapes["layers"][group][lora.ADAPTERS][weight]
        pair = {}
        for which, key in (("A", "a"), ("B", "b")):
            shape = pair_shapes[key][0]  # [L, *in, r] or [L, r, *out]
            r, rest = spec.rank, int(np.prod(shape[1:])) // spec.rank
            expected = (r, rest) if which == "A" else (rest, r)  # PEFT's [r, in] / [out, r]
            layers = []
            for i in range(config.num_layers):
                name = _tensor_name(proj, i, which)
                if name not in tensors:
                    raise AdapterError(f"{weights}: no tensor {name}")
                if tuple(tensors[name].shape) != expected:
                    raise AdapterError(
                        f"{weights}: {name} has shape {tuple(tensors[name].shape)}; this model "
                        f"with rank {spec.rank} needs {expected}"
                    )
                used.add(name)
                layers.append(np.asarray(tensors[name], np.float32).T.reshape(shape[1:]))
            pair[key] = np.stack(layers)
        out["layers"].setdefault(group, {lora.ADAPTERS: {}})[lora.ADAPTERS][weight] = pair
    if extra := sorted(set(tensors) - used):
        raise AdapterError(
            f"{weights}: tensors jaxrl would not use ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}): an adapter with more than LoRA's A and B of "
            "its target_modules cannot load exactly"
        )
    return spec, out
