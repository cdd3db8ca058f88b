"""Reading HuggingFace checkpoint folders into sharded parameters, and writing them back.

`from_pretrained` memory-maps the safetensors files (one file or several with an index) and
builds every parameter with `jax.make_array_from_callback`: each device's shard is assembled
from the mapped tensors for that device alone, so the model never sits whole on one device, and
host memory holds one layer's tensor at a time. Missing, unexpected or mis-shaped tensors are
errors that name them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from jaxrl.models import lora
from jaxrl.models.config import GEMMA_TYPES, DecoderConfig, RopeConfig, from_hf_config
from jaxrl.models.hf_names import IGNORABLE_SUFFIXES, Entry, entries, hf_names, num_experts
from jaxrl.models.params import Params, param_shapes
from jaxrl.sharding.layouts import Layout
from jaxrl.sharding.logical import Rules, sharding_for

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder that does not hold what its config.json describes."""


def load_config(path: str | os.PathLike, **options: Any) -> DecoderConfig:
    """The `DecoderConfig` of a checkpoint folder (`config.json`, read by transformers)."""
    from transformers import AutoConfig

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: no config.json; expected an HF checkpoint folder")
    overrides = options.pop("override_config", None)
    hf = AutoConfig.from_pretrained(str(folder))
    return from_hf_config(hf, overrides=overrides, **options)


def checkpoint_problems(path: str | os.PathLike) -> list[str]:
    """What keeps `path` from being read as an HF checkpoint folder (empty: nothing)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        return ["no such folder"]
    if not folder.is_dir():
        return ["not a folder (expected an HF checkpoint folder with config.json)"]
    problems = []
    if not (folder / "config.json").is_file():
        problems.append("no config.json: not an HF checkpoint folder")
    if (folder / INDEX_FILE).is_file():
        try:
            shards = set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError) as e:
            return [*problems, f"{INDEX_FILE} is unreadable ({e})"]
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            problems.append(f"weight shards listed in {INDEX_FILE} are missing: {missing}")
    elif not (folder / SINGLE_FILE).is_file():
        found = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt")
        )
        hint = f" (found {found}: convert them with transformers' save_pretrained)" if found else ""
        problems.append(f"no {SINGLE_FILE} or {INDEX_FILE}{hint}")
    return problems


@contextlib.contextmanager
def _open_tensors(folder: Path) -> Iterator[dict[str, Any]]:
    """name -> memory-mapped tensor handle over the folder's safetensors files."""
    from safetensors import safe_open

    if (folder / INDEX_FILE).is_file():
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise CheckpointError(
            f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} (jaxrl reads safetensors checkpoints; "
            "convert .bin files with transformers' save_pretrained)"
        )
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        for name in files:
            f = stack.enter_context(safe_open(str(folder / name), framework="numpy"))
            handles.update({key: f for key in f.keys()})  # noqa: SIM118 (safe_open has no iter)
        yield handles


def _base_prefix(names: set[str]) -> str:
    """`model.` for *ForCausalLM / *ForTokenClassification files, `` for bare base models."""
    return (
        ""
        if "embed_tokens.weight" in names and "model.embed_tokens.weight" not in names
        else "model."
    )


def _check_names(config: DecoderConfig, table: list[Entry], available: set[str], folder: Path):
    experts = num_experts(config)
    expected = {n for e in table for n in hf_names(e, config.num_layers, experts)}
    missing = sorted(expected - available)
    unexpected = sorted(
        n
        for n in available - expected
        if not n.endswith(IGNORABLE_SUFFIXES)
        and not (n == "lm_head.weight" and config.tie_word_embeddings)
    )
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing[:8])}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected[:8])}")
    if problems:
        raise CheckpointError(
            f"{folder} does not match its config.json ({config.model_type}, head "
            f"{config.head}): " + "; ".join(problems)
        )


def _read(handles: dict[str, Any], name: str, entry: Entry, shape: tuple[int, ...]) -> np.ndarray:
    x = entry.to_jax(handles[name].get_tensor(name))
    if x.shape != shape:
        raise CheckpointError(f"tensor {name}: shape {x.shape} after layout, expected {shape}")
    return x


def from_pretrained(
    path: str | os.PathLike,
    dtype: str | jnp.dtype = "float32",
    mesh: Mesh | None = None,
    layout: Rules | None = None,
    **options: Any,
) -> tuple[DecoderConfig, Params]:
    """Read an HF checkpoint folder: `(config, params)`.

    Args:
        path: Folder with `config.json` and `model.safetensors` (or shards + index).
        dtype: Parameter dtype (`config.param_dtype`); the compute dtype is `options["dtype"]`
            via `config.replace(dtype=...)`, float32 by default.
        mesh: Place parameters on this mesh by `layout`; None: the first device.
        layout: A `jaxrl.sharding.Layout` (its mesh is used when `mesh` is None), or a mapping
            of logical axis names to mesh axes.
        **options: Further `DecoderConfig` fields (`remat`, `head`, `override_config`, ...).
    """
    if isinstance(layout, Layout):
        mesh, layout = mesh or layout.mesh, layout.rule_map
    folder = Path(path).expanduser()
    config = load_config(folder, param_dtype=jnp.dtype(dtype).name, **options)
    with _open_tensors(folder) as handles:
        prefix = _base_prefix(set(handles))
        table = list(entries(config, prefix))
        _check_names(config, table, set(handles), folder)
        specs = param_shapes(config)
        params: dict[str, Any] = {}
        for entry in table:
            spec = specs
            for key in entry.path:
                spec = spec[key]
            shape, logical = spec
            if mesh is None:
                sharding = SingleDeviceSharding(jax.local_devices()[0])
            else:
                sharding = sharding_for(shape, logical, mesh, layout or {})
            array = _make_array(handles, entry, shape, config, sharding)
            node = params
            for key in entry.path[:-1]:
                node = node.setdefault(key, {})
            node[entry.path[-1]] = array
    return config, params


def _make_array(handles, entry: Entry, shape, config: DecoderConfig, sharding) -> jax.Array:
    np_dtype = np.dtype(jnp.dtype(config.param_dtype))

    def _read_expert(i: int, j: int) -> np.ndarray:
        return _read(handles, entry.hf_name.format(i=i, j=j), entry, shape[2:])

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        if entry.per_expert:  # [L, E, ...]: one tensor per layer and expert
            layers = range(config.num_layers)[index[0]]
            experts = range(shape[1])[index[1]]
            tail = _read_expert(layers[0], experts[0])[index[2:]].shape
            out = np.empty((len(layers), len(experts), *tail), np_dtype)
            for a, i in enumerate(layers):
                for b, j in enumerate(experts):
                    out[a, b] = _read_expert(i, j)[index[2:]]
            return out
        if not entry.stacked:
            return _read(handles, entry.hf_name, entry, shape)[index].astype(np_dtype, copy=False)
        layers = range(config.num_layers)[index[0]]
        out = None
        for j, i in enumerate(layers):  # fill in place: one copy per layer, no np.stack
            layer = _read(handles, entry.hf_name.format(i=i), entry, shape[1:])[index[1:]]
            if out is None:
                out = np.empty((len(layers), *layer.shape), np_dtype)
            out[j] = layer
        return out

    return jax.make_array_from_callback(shape, sharding, shard, dtype=np_dtype)


# ---------------------------------------------------------------------------------- export


def _rope_parameters(r: RopeConfig) -> dict[str, Any]:
    out = {"rope_type": r.type, "rope_theta": r.theta}
    optional = ("factor", "original_max_position_embeddings", "low_freq_factor")
    optional += ("high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "mscale")
    for key in (*optional, "mscale_all_dim"):
        if getattr(r, key) is not None:
            out[key] = getattr(r, key)
    if r.type == "yarn" and not r.truncate:
        out["truncate"] = False
    return out


_ARCH = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
         "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral",
         "gemma2": "Gemma2", "gemma3_text": "Gemma3Text"}  # fmt: skip
# Where the causal LM's class name is not _ARCH + "ForCausalLM".
_CAUSAL_LM_ARCH = {"gemma3_text": "Gemma3ForCausalLM"}
_HEAD_ARCH = {
    "causal_lm": "ForCausalLM",
    "token_classification": "ForTokenClassification",
    "sequence_classification": "ForSequenceClassification",
}


def to_hf_config(config: DecoderConfig, base: Mapping[str, Any] | None = None) -> Any:
    """A `transformers` config equal to `config` (starting from `base`, e.g. the original)."""
    from transformers import AutoConfig

    c = config
    fields: dict[str, Any] = dict(base or {})
    for key in ("model_type", "transformers_version", "architectures", "rope_scaling"):
        fields.pop(key, None)
    fields.update(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.rope.max_position_embeddings,
        rope_parameters=_rope_parameters(c.rope),
        tie_word_embeddings=c.tie_word_embeddings,
        pad_token_id=c.pad_token_id,
        eos_token_id=list(c.eos_token_id)
        if len(c.eos_token_id) > 1
        else (c.eos_token_id[0] if c.eos_token_id else None),
        architectures=[_architecture(c)],
        dtype=c.param_dtype,
    )
    if c.model_type in ("llama", "qwen3", "qwen3_moe", *GEMMA_TYPES):
        fields["attention_bias"] = c.qkv_bias
    if c.model_type in GEMMA_TYPES:
        fields.update(_gemma_fields(c))
    if c.model_type in ("qwen2_moe", "qwen3_moe"):
        fields.update(num_experts=c.moe.num_experts, num_experts_per_tok=c.moe.top_k,
                      norm_topk_prob=c.moe.norm_topk_prob,
                      moe_intermediate_size=c.moe_intermediate_size,
                      mlp_only_layers=[], decoder_sparse_step=1)  # fmt: skip
    if c.model_type == "qwen2_moe":
        shared = c.shared_expert_intermediate_size
        fields.update(qkv_bias=c.qkv_bias, shared_expert_intermediate_size=shared)
    if c.model_type == "mixtral":
        fields.update(num_local_experts=c.moe.num_experts, num_experts_per_tok=c.moe.top_k,
                      intermediate_size=c.moe_intermediate_size)  # fmt: skip
    if c.model_type == "llama":
        fields["mlp_bias"] = c.mlp_bias
    windows = {w for w in c.sliding_windows if w is not None}
    if len(windows) > 1:
        raise ValueError(f"HF configs hold one sliding window; this model has {sorted(windows)}")
    window = windows.pop() if windows else None
    if c.model_type in ("mistral", "mixtral"):
        fields["sliding_window"] = window
    elif c.model_type == "qwen3_moe":
        fields.update(use_sliding_window=window is not None, sliding_window=window)
    elif c.model_type in ("qwen2", "qwen3", "qwen2_moe", *GEMMA_TYPES):
        fields.update(
            sliding_window=window,
            layer_types=[
                "full_attention" if w is None else "sliding_attention" for w in c.sliding_windows
            ],
        )
        if c.model_type not in GEMMA_TYPES:  # Gemma has no switch: layer_types says it
            fields["use_sliding_window"] = window is not None
    if c.head != "causal_lm":
        fields["num_labels"] = c.num_labels
        fields.pop("id2label", None)
        fields.pop("label2id", None)
    return AutoConfig.for_model(c.model_type, **fields)


def _architecture(config: DecoderConfig) -> str:
    if config.head == "causal_lm" and config.model_type in _CAUSAL_LM_ARCH:
        return _CAUSAL_LM_ARCH[config.model_type]
    return _ARCH[config.model_type] + _HEAD_ARCH[config.head]


def _gemma_fields(c: DecoderConfig) -> dict[str, Any]:
    """The Gemma entries of a transformers config (`from_hf_config`'s `_gemma_from_hf`
    inverted); only the gemma layouts (its four (1 + w) norms, GeGLU, scaled embeddings)."""
    gemma_layout = (c.norm_unit_offset, c.post_norms, c.scale_embeddings, c.mlp_activation)
    if gemma_layout != (True, True, True, "gelu_tanh") or c.query_pre_attn_scalar is None:
        raise ValueError(f"{c.model_type} config without Gemma's layer layout: {c}")
    scalar = c.query_pre_attn_scalar
    fields: dict[str, Any] = dict(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
        final_logit_softcapping=c.final_logit_softcap,
        use_bidirectional_attention=False,
    )
    if c.model_type == "gemma2":
        fields["attn_logit_softcapping"] = c.attn_logit_softcap
    else:  # rope_parameters by layer type
        local = c.rope_local or c.rope
        fields["rope_parameters"] = {"full_attention": _rope_parameters(c.rope),
                                     "sliding_attention": _rope_parameters(local)}  # fmt: skip
    return fields


def save_pretrained(
    config: DecoderConfig,
    params: Params,
    path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    base_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write an HF checkpoint folder that `transformers` loads back.

    Args:
        config: The model.
        params: Its parameters (gathered to the host one tensor at a time).
        path: Output folder (created).
        tokenizer: Saved alongside when given (`tokenizer.save_pretrained`).
        dtype: Storage dtype; default the parameters' own.
        max_shard_bytes: Split into `model-0000i-of-0000n.safetensors` + index past this size.
        base_config: The original `config.json` as a dict, to keep its extra entries.

    A tree with LoRA adapters is written merged (`lora.fold`: W + (alpha/r)·A B): the same
    function as a plain checkpoint (`jaxrl.models.peft_io.save_adapter` writes the adapters).
    """
    from safetensors.numpy import save_file

    if lora.has_adapters(params):
        params = lora.fold(config, params)

    out = Path(path).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(jnp.dtype(dtype or config.param_dtype))
    tensors: dict[str, np.ndarray] = {}
    for entry in entries(config):
        leaf = params
        for key in entry.path:
            leaf = leaf[key]
        host = np.asarray(jax.device_get(leaf))
        if entry.per_expert:
            layers = [host[i, j] for i in range(config.num_layers)
                      for j in range(host.shape[1])]  # fmt: skip
        else:
            layers = [host[i] for i in range(config.num_layers)] if entry.stacked else [host]
        names = hf_names(entry, config.num_layers, num_experts(config))
        for name, x in zip(names, layers, strict=True):
            tensors[name] = np.ascontiguousarray(entry.to_hf(x).astype(np_dtype))
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, x in tensors.items():
        if size and size + x.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(x.nbytes for x in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    hf_config = to_hf_config(config, base_config)
    hf_config.dtype = np_dtype.name
    hf_config.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
