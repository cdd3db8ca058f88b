"""The models of an RL run (verl's roles), each a `RoleSpec` read from the config by
`role_specs` and loaded by `load_role`:

- actor: the policy, `model_dtype` master weights (fp32) and `dtype` compute (bf16), trained;
- rollout: the actor's weights in `rollout.dtype` and the rollout layout (not loaded: copied
  from the actor, `Cluster.sync_weights`);
- ref: a frozen copy of the initial policy in its own dtypes (KL loss / KL in reward);
- critic: the policy's checkpoint (or `critic.model.path`) with a 1-label token-classification
  head in place of the LM head, as verl builds it (`AutoModelForTokenClassification` from a
  causal LM: a fresh head, normal(0, initializer_range));
- reward: a frozen sequence-classification reward model (`reward_model.enable`);
- teacher: a frozen causal LM scoring the student's responses (`distillation.enabled`), of any
  family or size whose tokenizer equals the actor's (`check_teacher_tokenizer`); with several
  teachers one role `teacher:<key>` each, all on the teacher's devices, each scoring the rows
  routed to it (`jaxrl.trainer.teachers`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from transformers import AutoTokenizer

from jaxrl.config import Config
from jaxrl.config.checks import (
    critic_enabled,
    lora_enabled,
    reference_enabled,
    teacher_roles,
    teachers,
)
from jaxrl.models import lora
from jaxrl.models.config import DecoderConfig, LoraSpec
from jaxrl.models.hf_io import checkpoint_problems, from_pretrained, load_config
from jaxrl.models.params import abstract_params, adapter_spec, param_shardings
from jaxrl.models.peft_io import load_adapter, read_spec
from jaxrl.sharding.layouts import Layout, placed_abstract, use_layout
from jaxrl.sharding.processes import global_array
from jaxrl.trainer.sequences import response_log_probs, response_statistics, response_values

log = logging.getLogger("jaxrl.train")

DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def dtype_name(value: str, key: str) -> str:
    if value not in DTYPES:
        raise ValueError(f"{key}={value!r}: use one of {sorted(DTYPES)}")
    return DTYPES[value]


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """One model of the run: where its weights come from and how it computes.

    Attributes:
        name: verl's role name (`actor`, `rollout`, `ref`, `critic`, `reward`).
        path: The HF checkpoint folder.
        param_dtype: Dtype the parameters are held in.
        compute_dtype: Dtype the forward pass computes in.
        remat: Rematerialisation policy of the trained forward pass (`none` when frozen).
        override_config: HF config fields replaced at load (verl's `override_config`).
        attention_impl: The attention implementation of its forward passes.
        moe_capacity_factor: A mixture of experts' capacity under `ep` (None: dropless).
        trainable: Whether the run updates it (it then has an optimizer state).
        head: `causal_lm`, `value` (the critic: the LM head replaced by a fresh 1-label token
            head) or `reward` (a sequence-classification checkpoint, used as it is).
        param_offload: Parameters live in host memory between the passes that use them.
        optimizer_offload: The optimizer state lives in host memory outside the update.
        lora: LoRA adapters on a trainable role (its base frozen), or None.
    """

    name: str
    path: str
    param_dtype: str
    compute_dtype: str
    remat: str = "none"
    override_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    attention_impl: str = "auto"
    moe_capacity_factor: float | None = None
    trainable: bool = False
    head: str = "causal_lm"
    param_offload: bool = False
    optimizer_offload: bool = False
    lora: LoraOptions | None = None

    @property
    def offloads(self) -> bool:
        """Some of its state lives in host memory between uses."""
        return self.param_offload or self.optimizer_offload


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """A role's LoRA keys (verl's `model.lora_*`), resolved against the model at load.

    Attributes:
        key: The config group they came from (`actor_rollout_ref.model`), for messages.
        rank: `lora_rank`.
        alpha: `lora_alpha`.
        target_modules: `target_modules`.
        exclude_modules: `exclude_modules`.
        adapter_path: `lora_adapter_path`: a PEFT folder to start from (its config rules).
        target_parameters: `target_parameters`: a mixture of experts' expert parameters.
    """

    key: str
    rank: int
    alpha: float
    target_modules: Any = "all-linear"
    exclude_modules: Any = None
    adapter_path: str | None = None
    target_parameters: Any = None

    @classmethod
    def from_config(cls, model, key: str) -> LoraOptions | None:
        """The options of a `model` group, or None when LoRA is off (rank 0, no adapter)."""
        if not lora_enabled(model):
            return None
        plain = lambda v: v if v is None or isinstance(v, str) else [str(x) for x in v]  # noqa: E731
        return cls(
            key,
            model.lora_rank,
            float(model.lora_alpha),
            plain(model.target_modules),
            plain(model.exclude_modules),
            model.lora_adapter_path,
            plain(getattr(model, "target_parameters", None)),
        )


def _remat(model) -> str:
    return model.remat_policy if model.enable_gradient_checkpointing else "none"


def _without_ring(attention_impl: str) -> str:
    return "auto" if attention_impl == "ring" else attention_impl


def role_specs(cfg: Config) -> dict[str, RoleSpec]:
    """The roles `cfg` uses, in verl's order: actor and rollout always, ref with a KL loss or
    KL in the reward, critic by `critic_enabled`, teacher with `distillation.enabled`, reward
    with `reward_model.enable`."""
    actor_rollout_ref = cfg.actor_rollout_ref
    model, actor, rollout = (
        actor_rollout_ref.model,
        actor_rollout_ref.actor,
        actor_rollout_ref.rollout,
    )
    policy = dict(
        path=model.path,
        override_config=dict(model.override_config),
        attention_impl=model.attention_impl,
        moe_capacity_factor=model.moe_capacity_factor,
    )
    master = dtype_name(actor.model_dtype, "actor.model_dtype")
    specs = {
        "actor": RoleSpec(
            "actor",
            param_dtype=master,
            compute_dtype=dtype_name(actor.dtype, "actor.dtype"),
            remat=_remat(model),
            trainable=True,
            param_offload=actor.param_offload,
            optimizer_offload=actor.optimizer_offload,
            lora=LoraOptions.from_config(model, "actor_rollout_ref.model"),
            **policy,
        ),
        # The actor's weights held in the rollout dtype (cast once per sync: the same values
        # the per-use cast gives, at the rollout dtype's size, as verl's vLLM copy); the
        # rollout mesh has no `sp`, so ring attention becomes `auto`.
        "rollout": RoleSpec(
            "rollout",
            param_dtype=dtype_name(rollout.dtype, "rollout.dtype"),
            compute_dtype=dtype_name(rollout.dtype, "rollout.dtype"),
            **{**policy, "attention_impl": _without_ring(model.attention_impl)},
        ),
    }
    if reference_enabled(cfg):
        ref = actor_rollout_ref.ref
        specs["ref"] = RoleSpec(
            "ref",
            param_dtype=dtype_name(ref.model_dtype, "ref.model_dtype"),
            compute_dtype=dtype_name(ref.dtype, "ref.dtype"),
            param_offload=ref.param_offload,
            **policy,
        )
    if critic_enabled(cfg):
        c = cfg.critic
        specs["critic"] = RoleSpec(
            "critic",
            c.model.path,
            param_dtype=dtype_name(c.model_dtype, "critic.model_dtype"),
            compute_dtype=dtype_name(c.dtype, "critic.dtype"),
            remat=_remat(c.model),
            override_config=dict(c.model.override_config),
            attention_impl=c.model.attention_impl,
            trainable=True,
            head="value",
            param_offload=c.param_offload,
            optimizer_offload=c.optimizer_offload,
            lora=LoraOptions.from_config(c.model, "critic.model"),
        )
    if cfg.distillation.enabled:
        specs.update(teacher_specs(cfg))
    if cfg.reward_model.enable:
        rm = cfg.reward_model
        if not rm.model.path:
            raise ValueError(
                "reward_model.enable needs reward_model.model.path (an HF sequence-"
                "classification checkpoint folder)"
            )
        dtype = dtype_name(rm.dtype, "reward_model.dtype")
        specs["reward"] = RoleSpec("reward", rm.model.path, dtype, dtype, head="reward")
    return specs


def teacher_specs(cfg: Config) -> dict[str, RoleSpec]:
    """The distillation teachers by role name (`teacher_roles`: `teacher`, or `teacher:<key>`
    for each of several), frozen, each in its `inference.dtype` (verl's default: the
    rollout's dtype)."""
    specs, found = {}, teachers(cfg)
    for role, (name, _) in teacher_roles(cfg).items():
        entry = found[name]
        inference = entry.get("inference") or {}
        dtype = inference.get("dtype") or cfg.actor_rollout_ref.rollout.dtype
        dtype = dtype_name(dtype, f"distillation.teacher_models.{name}.inference.dtype")
        specs[role] = RoleSpec(role, entry["model_path"], param_dtype=dtype, compute_dtype=dtype)
    return specs


def is_teacher(role: str) -> bool:
    """Whether `role` names a distillation teacher (`teacher` or `teacher:<key>`)."""
    return placement_group(role) == "teacher"


def placement_group(role: str) -> str:
    """The `mesh.placement` entry a role's devices come from: its name, but every teacher's
    is `teacher` (several teachers share the teacher's devices)."""
    return role.split(":", 1)[0]


def check_teacher_tokenizer(path: str, tokenizer: Any) -> None:
    """Raise ValueError unless the teacher checkpoint `path` ships a tokenizer with the
    student's vocabulary (the same token ids: the teacher scores the student's tokens as
    they are)."""
    if problems := checkpoint_problems(path):
        raise ValueError(
            f"distillation.teacher_models.*.model_path={path}: {problems[0]}; point it at the "
            "teacher's checkpoint folder (`python -m jaxrl.export` writes one from a jaxrl run)"
        )
    try:
        teacher = AutoTokenizer.from_pretrained(str(Path(path).expanduser()))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"distillation teacher {path}: no tokenizer could be read there ({e}); the teacher "
            "needs its tokenizer files so that jaxrl can check it equals the student's"
        ) from e
    ours, theirs = tokenizer.get_vocab(), teacher.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"distillation teacher {path}: its tokenizer differs from the student's "
            f"({len(theirs)} vs {len(ours)} tokens; e.g. {differ}): the teacher must score the "
            "student's token ids, so use a teacher with the same tokenizer (cross-tokenizer "
            "distillation is not supported)"
        )


def load_role(
    spec: RoleSpec, layout: Layout | None, *, abstract: bool = False
) -> tuple[DecoderConfig, Any]:
    """The role's (config, params) in `layout` (see `load_model`; the critic gets its value
    head by `critic_from_policy`)."""
    config, params = load_model(
        spec.path,
        param_dtype=spec.param_dtype,
        compute_dtype=spec.compute_dtype,
        layout=layout,
        remat=spec.remat,
        override_config=dict(spec.override_config),
        attention_impl=spec.attention_impl,
        moe_capacity_factor=spec.moe_capacity_factor,
        abstract=abstract,
    )
    if spec.head == "value":
        config, params = critic_from_policy(spec.path, config, params, layout)
    if spec.lora is not None:
        config, params = attach_lora(spec.lora, config, params, layout)
    return config, params


def lora_spec(options: LoraOptions, config: DecoderConfig) -> LoraSpec:
    """The adapters `options` ask for on this model: a PEFT folder's own (rank, alpha and
    targets from its `adapter_config.json`, as verl's `PeftModel.from_pretrained`), or fresh
    ones from the keys (targets checked against the family's modules)."""
    if options.adapter_path:
        spec = read_spec(options.adapter_path, config)
        if options.rank > 0 and (options.rank, options.alpha) != (spec.rank, spec.alpha):
            log.warning(
                "%s.lora_adapter_path: the adapter's rank %d and alpha %g are used, not "
                "lora_rank=%d / lora_alpha=%g", options.key, spec.rank, spec.alpha,
                options.rank, options.alpha,
            )  # fmt: skip
        return spec
    targets = lora.resolve_targets(
        config, options.target_modules, options.exclude_modules, f"{options.key}.target_modules",
        target_parameters=options.target_parameters,
    )  # fmt: skip
    return LoraSpec(options.rank, options.alpha, targets)


def attach_lora(
    options: LoraOptions, config: DecoderConfig, params: Any, layout: Layout | None, seed: int = 0
) -> tuple[DecoderConfig, Any]:
    """The model with LoRA adapters beside its (frozen) weights, in `layout`: fresh (A
    kaiming-uniform, B zero; `lora.init_adapters`) or read from `options.adapter_path`.
    Abstract parameters get abstract adapters."""
    config = config.replace(lora=lora_spec(options, config))
    _, shardings = lora.split(param_shardings(config, layout)) if layout else (None, None)
    if is_abstract(params):
        adapters = lora.split(abstract_params(config))[1]
        if shardings is not None:
            adapters = placed_abstract(adapters, shardings)
    elif options.adapter_path:
        _, host = load_adapter(options.adapter_path, config)
        adapters = jax.tree.map(global_array, host, shardings) if shardings else host
        adapters = jax.tree.map(jnp.asarray, adapters)
    else:
        spec = adapter_spec(config)
        init = jax.jit(lambda key: lora.init_adapters(config, key, spec), out_shardings=shardings)
        adapters = init(jax.random.key(seed))
    return config, lora.merge(params, adapters)


def load_model(
    path: str,
    *,
    param_dtype: str,
    compute_dtype: str,
    layout: Layout | None,
    remat: str = "none",
    override_config: dict | None = None,
    attention_impl: str = "auto",
    moe_capacity_factor: float | None = None,
    abstract: bool = False,
) -> tuple[DecoderConfig, Any]:
    """An HF causal LM as (config, params) in `layout`, with separate parameter and compute
    dtypes, the attention implementation the forward passes use and a mixture of experts'
    capacity under `ep`. `abstract`: only
    `config.json` is read and the parameters are `jax.ShapeDtypeStruct`s in their shardings,
    nothing loaded or allocated (for compiling programs without running them,
    `Cluster.load(..., abstract=True)`)."""
    options = dict(remat=remat, override_config=override_config or None)
    if not abstract:
        config, params = from_pretrained(path, dtype=param_dtype, layout=layout, **options)
    else:
        config = load_config(path, param_dtype=param_dtype, **options)
        params = abstract_params(config)
        if layout is not None:
            params = placed_abstract(params, param_shardings(config, layout))
    config = config.replace(dtype=compute_dtype, attention_impl=attention_impl)
    if config.moe is not None:
        config = config.replace(
            moe=dataclasses.replace(config.moe, capacity_factor=moe_capacity_factor)
        )
    return config, params


def is_abstract(tree: Any) -> bool:
    """Whether a parameter tree holds `jax.ShapeDtypeStruct`s (an abstract model)."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _initializer_range(path: str) -> float:
    config = json.loads((Path(path).expanduser() / "config.json").read_text())
    return float(config.get("initializer_range", 0.02))


def critic_from_policy(
    path: str, config: DecoderConfig, params: Any, layout: Layout | None, seed: int = 0
) -> tuple[DecoderConfig, Any]:
    """A value model from a causal LM: the LM head is dropped and a 1-label token head is
    added, weights normal(0, initializer_range) and bias 0 (HF's token-classification init)."""
    if config.head != "causal_lm":
        return config, params
    critic = config.replace(head="token_classification", num_labels=1, score_bias=True)
    std = _initializer_range(path)
    abstract = is_abstract(params)
    params = {k: v for k, v in params.items() if k != "lm_head_dv"}
    dtype = jnp.dtype(config.param_dtype)
    shardings = param_shardings(critic, layout)["score"] if layout is not None else None
    if abstract:
        score = abstract_params(critic)["score"]
        if shardings is not None:
            score = placed_abstract(score, shardings)
        return critic, {**params, "score": score}
    w = std * jax.random.normal(jax.random.key(seed), (config.hidden_size, 1), jnp.float32)
    score = {"w_dc": w.astype(dtype), "b_c": jnp.zeros((1,), dtype)}
    if shardings is not None:
        score = jax.device_put(score, shardings)
    return critic, {**params, "score": score}


def log_prob_fn(
    config: DecoderConfig,
    layout: Layout | None,
    *,
    temperature: float,
    chunk_size: int | None,
):
    """jit of `(params, micro_batch) -> log-probs [m, r]` (`statistics_fn` for more per-token
    quantities from the same pass)."""

    def fn(params, mb):
        with use_layout(layout):
            lp, _ = response_log_probs(
                config, params, mb, temperature=temperature, chunk_size=chunk_size
            )
        return lp

    return jax.jit(fn)


def statistics_fn(
    config: DecoderConfig,
    layout: Layout | None,
    names: tuple[str, ...],
    chunk_size: int | None,
    temperature: float = 1.0,
    record_routes: bool = False,
):
    """jit of `(params, micro_batch) -> ` a tuple of `response_statistics` [m, r] in the order
    of `names` (log_probs, entropy, sum_pi_squared, mean_logit, top1): one chunked pass.
    `record_routes` (a mixture of experts, routing replay R2): then also the routes taken,
    the response's [m, r, L, k] and, last, the prompt's [m, p, L, k]."""

    def fn(params, mb):
        with use_layout(layout):
            stats = response_statistics(
                config, params, mb, names, temperature=temperature, chunk_size=chunk_size,
                with_router=record_routes,
            )  # fmt: skip
        out = tuple(stats[k] for k in names)
        if not record_routes:
            return out
        routes, p = stats["router"].routes, mb["prompts"].shape[1]
        return (*out, routes[:, p:], routes[:, :p])

    return jax.jit(fn)


def top_k_fn(config: DecoderConfig, layout: Layout | None, k: int, chunk_size: int | None):
    """jit of `(params, micro_batch) -> (log-probs [m, r, k], token ids [m, r, k])`: the k
    most likely next tokens at each response position under the raw logits (temperature 1),
    largest first (the distillation teacher's top-k)."""

    def fn(params, mb):
        with use_layout(layout):
            stats = response_statistics(config, params, mb, (), top_k=k, chunk_size=chunk_size)
        return stats["top_k_log_probs"], stats["top_k_ids"]

    return jax.jit(fn)


def values_fn(config: DecoderConfig, layout: Layout | None):
    """jit of `(params, micro_batch) -> values [m, r]`."""

    def fn(params, mb):
        with use_layout(layout):
            return response_values(config, params, mb)

    return jax.jit(fn)
