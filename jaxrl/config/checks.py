"""Normalisation and cross-field checks of a merged `Config`.

Each check adds a message that names the keys, their values and what to change; `check` raises
one `ConfigError` with all of them. Checks that need the device count (the mesh, batch splits
over data-parallel shards) run when `num_devices` is given; the context-length check needs the
model's `config.json` and is `check_model_context`, called once the checkpoint is at hand.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
from collections.abc import Iterable
from typing import Any

from jaxrl.config.errors import ConfigError
from jaxrl.config.mesh import (
    AXES,
    PLACED_ROLES,
    ROLLOUT_MESH_AXES,
    TRAIN_MESH_AXES,
    device_groups,
    resolve_axis_sizes,
    rule_problems,
)
from jaxrl.config.schema import ROUTER_REPLAY_MODES, Config

# `jaxrl.kernels.attention` implementations a model may be configured with; `cudnn` is left
# out: it has no segment ids, and every training batch carries padding or packing segments.
MODEL_ATTENTION_IMPLEMENTATIONS = ("auto", "reference", "blockwise", "pallas_gpu", "ring")

# `jaxrl.rollout.backends`' decode backends (`actor_rollout_ref.rollout.decode_backend`).
DECODE_BACKENDS = ("auto", "xla", "cpu_kernels")
# `jaxrl.agent`'s tool-call formats and agent loops (it imports these).
TOOL_FORMATS = ("hermes",)
AGENT_LOOPS = ("single_turn_agent", "tool_agent")

log = logging.getLogger("jaxrl.config")

# verl 0.9.1's registered names. The core_algos issue turns these into registry look-ups.
ADV_ESTIMATORS = (
    "gae", "grpo", "grpo_vectorized", "grpo_passk", "gdpo", "rloo", "rloo_vectorized",
    "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg",
    "optimal_token_baseline", "tir_optimal_token_baseline",
)  # fmt: skip
POLICY_LOSSES = (
    "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean",
    "dro", "cispo", "bypass_mode",
)  # fmt: skip
LOSS_AGG_MODES = (
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
    "token-sum",
)  # fmt: skip
_KL = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTIES = _KL + tuple(k + "+" for k in _KL)
DTYPES = {
    "fp32": "float32", "float32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16",
}  # fmt: skip
OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}
LOGGERS = ("console", "tensorboard", "wandb", "file")

_DTYPE_KEYS = (
    "actor_rollout_ref.actor.model_dtype",
    "actor_rollout_ref.actor.dtype",
    "actor_rollout_ref.ref.model_dtype",
    "actor_rollout_ref.ref.dtype",
    "actor_rollout_ref.rollout.dtype",
    "critic.model_dtype",
    "critic.dtype",
    "reward_model.dtype",
)


def get(cfg: Any, key: str) -> Any:
    """`get(cfg, "a.b.c")` is `cfg.a.b.c`."""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def replace(cfg: Any, key: str, value: Any) -> Any:
    """A copy of the frozen `cfg` with the dotted `key` set to `value`."""
    head, _, rest = key.partition(".")
    new = replace(getattr(cfg, head), rest, value) if rest else value
    return dataclasses.replace(cfg, **{head: new})


# -------------------------------------------------------------------------------- normalize


def normalize(cfg: Config) -> Config:
    """Canonical spellings: file lists as tuples, dtype and optimizer names as JAX/optax's."""
    return canonical_spellings(
        cfg,
        files=("data.train_files", "data.val_files"),
        dtypes=_DTYPE_KEYS,
        optimizers=("actor_rollout_ref.actor.optim.optimizer", "critic.optim.optimizer"),
    )


def canonical_spellings(
    cfg: Any,
    *,
    files: Iterable[str],
    dtypes: Iterable[str],
    optimizers: Iterable[str],
    optional_files: Iterable[str] = (),
) -> Any:
    """`cfg` with the `files` keys as tuples of paths (an `optional_files` key may be null),
    the `dtypes` keys as JAX names and the `optimizers` keys as optax's; `ConfigError`
    listing every value that is none of these."""
    problems: list[str] = []
    for key in files:
        value = get(cfg, key)
        if value is None and key in optional_files:
            continue
        if isinstance(value, str):
            cfg = replace(cfg, key, (value,))
        elif not (isinstance(value, tuple) and all(isinstance(f, str) for f in value)):
            problems.append(f"{key}: expected a path or a list of paths, got {value!r}")
    for key in dtypes:
        name = get(cfg, key)
        if name.lower() in DTYPES:
            cfg = replace(cfg, key, DTYPES[name.lower()])
        else:
            problems.append(f"{key}: unknown dtype {name!r}; use one of fp32, bf16, fp16")
    for key in optimizers:
        name = get(cfg, key)
        if name.lower() in OPTIMIZERS:
            cfg = replace(cfg, key, OPTIMIZERS[name.lower()])
        else:
            problems.append(f"{key}: unknown optimizer {name!r}; use one of AdamW, Adam")
    if problems:
        raise ConfigError(problems)
    return cfg


# ------------------------------------------------------------------------------------ checks


class _Problems(list):
    def choice(self, cfg: Config, key: str, allowed: Iterable[Any]) -> None:
        value, allowed = get(cfg, key), tuple(allowed)
        if value in allowed:
            return
        near = difflib.get_close_matches(str(value), [str(a) for a in allowed], 1, 0.5)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        self.append(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}{hint}")

    def at_least(self, cfg: Config, key: str, low: float, *, optional: bool = False) -> None:
        value = get(cfg, key)
        if optional and value is None:
            return
        if value < low:
            self.append(f"{key} must be >= {low}, got {value}")

    def within(self, cfg: Config, key: str, low: float, high: float) -> None:
        value = get(cfg, key)
        if not low <= value <= high:
            self.append(f"{key} must be in [{low}, {high}], got {value}")


def critic_enabled(cfg: Config) -> bool:
    """verl's rule: `critic.enable`, or when null, whether the estimator is GAE."""
    enable = cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae" if enable is None else enable


def lora_enabled(model: Any) -> bool:
    """verl's rule for LoRA on a model group: `lora_rank > 0` or a `lora_adapter_path`."""
    return model.lora_rank > 0 or bool(model.lora_adapter_path)


def reference_enabled(cfg: Config) -> bool:
    """verl's rule for loading the reference policy: a KL loss or KL in the reward."""
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def _check_choices(cfg: Config, p: _Problems) -> None:
    p.choice(cfg, "data.truncation", ("error", "left", "right", "middle"))
    p.choice(cfg, "algorithm.adv_estimator", ADV_ESTIMATORS)
    p.choice(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode", POLICY_LOSSES)
    p.choice(cfg, "actor_rollout_ref.actor.loss_agg_mode", LOSS_AGG_MODES)
    if cfg.critic.loss_agg_mode != cfg.actor_rollout_ref.actor.loss_agg_mode:
        p.choice(cfg, "critic.loss_agg_mode", LOSS_AGG_MODES)  # else the actor's check covers it
    p.choice(cfg, "actor_rollout_ref.actor.kl_loss_type", KL_PENALTIES)
    p.choice(cfg, "algorithm.kl_penalty", KL_PENALTIES)
    p.choice(cfg, "algorithm.kl_ctrl.type", ("fixed", "adaptive"))
    p.choice(cfg, "algorithm.rollout_correction.rollout_is", (None, "token", "sequence"))
    p.choice(cfg, "algorithm.rollout_correction.loss_type", ("ppo_clip", "reinforce"))
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_rs and rc.rollout_rs_threshold is None:
        p.append(
            f"algorithm.rollout_correction.rollout_rs={rc.rollout_rs!r} needs "
            "algorithm.rollout_correction.rollout_rs_threshold (verl raises the same)"
        )
    if cfg.algorithm.adv_estimator in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        estimator = f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}"
        if not cfg.actor_rollout_ref.actor.calculate_sum_pi_squared:
            p.append(
                f"{estimator} reads the actor's sum_v pi_v^2 (verl asserts the same); set "
                "actor_rollout_ref.actor.calculate_sum_pi_squared=true"
            )
        if rc.bypass_mode:
            p.append(
                f"{estimator} with algorithm.rollout_correction.bypass_mode: bypass mode skips "
                "the old-log-prob pass that computes sum_v pi_v^2 (verl fails the same way); "
                "set bypass_mode=false or use another estimator"
            )
    fg, data = cfg.algorithm.filter_groups, cfg.data
    if fg.enable and not fg.metric:
        p.append(
            "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric (acc, "
            "score, seq_reward, seq_final_reward or another key the reward function returns)"
        )
    if fg.enable and fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        p.append(
            "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward: "
            "the KL penalty needs the log-probs of responses not yet filtered (verl's recipe "
            "fails here too); use seq_reward, or use_kl_in_reward=false"
        )
    _check_streaming(cfg, p)
    if data.gen_batch_size not in (None, data.train_batch_size) and not fg.enable:
        p.append(
            f"data.gen_batch_size={data.gen_batch_size} differs from data.train_batch_size="
            f"{data.train_batch_size} without algorithm.filter_groups.enable: only dynamic "
            "sampling generates batches of another size; drop gen_batch_size or enable it"
        )
    if data.gen_batch_size is not None:
        p.at_least(cfg, "data.gen_batch_size", 1)
    p.at_least(cfg, "algorithm.pf_ppo.weight_pow", 0)
    p.choice(cfg, "algorithm.pf_ppo.reweight_method", ("pow", "max_min", "max_random"))
    if cfg.algorithm.use_pf_ppo and cfg.algorithm.adv_estimator != "gae":
        p.append(
            f"algorithm.use_pf_ppo=true with adv_estimator={cfg.algorithm.adv_estimator!r}: "
            "verl 0.9.1 resamples the batch after GAE only (with any other estimator it "
            "silently does nothing); set algorithm.adv_estimator=gae, or "
            "algorithm.use_pf_ppo=false"
        )
    p.choice(cfg, "actor_rollout_ref.rollout.decode_backend", DECODE_BACKENDS)
    p.choice(cfg, "assets.task", ("repeat", "copy", "reverse", "add"))
    p.choice(cfg, "reward_model.reward_manager", ("naive", "batch", "dapo", "prime", "parallel"))
    p.choice(cfg, "trainer.resume_mode", ("auto", "disable", "resume_path"))
    for role in ("actor_rollout_ref", "critic"):
        p.choice(cfg, f"{role}.model.remat_policy", ("full", "save_dots"))
        p.choice(cfg, f"{role}.model.attention_impl", MODEL_ATTENTION_IMPLEMENTATIONS)
    for role in ("actor_rollout_ref.actor", "critic"):
        p.choice(cfg, f"{role}.optim.lr_scheduler_type", ("constant", "cosine"))
    p.extend(rule_problems(dict(cfg.mesh.train_rules), TRAIN_MESH_AXES, "mesh.train_rules"))
    p.extend(rule_problems(dict(cfg.mesh.rollout_rules), ROLLOUT_MESH_AXES, "mesh.rollout_rules"))
    for name in cfg.trainer.logger:
        if name not in LOGGERS:
            p.append(f"trainer.logger: unknown logger {name!r}; use any of {', '.join(LOGGERS)}")


def _check_ranges(cfg: Config, p: _Problems) -> None:
    for key in (
        "data.train_batch_size",
        "data.max_prompt_length",
        "data.max_response_length",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_epochs",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.actor.entropy_from_logits_chunk_size",
        "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.rollout.val_kwargs.n",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.rollout.max_num_seqs",
        "trainer.total_epochs",
    ):
        p.at_least(cfg, key, 1)
    for model in ("actor_rollout_ref.model", "critic.model"):
        p.at_least(cfg, f"{model}.lora_rank", 0)
        if get(cfg, f"{model}.lora_rank") > 0 and get(cfg, f"{model}.lora_alpha") <= 0:
            p.append(f"{model}.lora_alpha must be > 0, got {get(cfg, f'{model}.lora_alpha')}")
    for key in ("ppo_mini_batch_size", "ppo_epochs"):  # unless they follow the actor's
        if get(cfg, f"critic.{key}") != get(cfg, f"actor_rollout_ref.actor.{key}"):
            p.at_least(cfg, f"critic.{key}", 1)
    for key in (
        "data.val_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "critic.ppo_micro_batch_size_per_gpu",
        "critic.forward_micro_batch_size_per_gpu",
        "reward_model.micro_batch_size_per_gpu",
        "trainer.total_training_steps",
    ):
        p.at_least(cfg, key, 1, optional=True)
    actor = "actor_rollout_ref.actor"
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "grad_clip"):
        if get(cfg, f"{actor}.{key}") <= 0:
            p.append(f"{actor}.{key} must be > 0, got {get(cfg, f'{actor}.{key}')}")
    if cfg.actor_rollout_ref.actor.clip_ratio_c <= 1.0:
        p.append(
            f"{actor}.clip_ratio_c must be > 1 (dual-clip lower bound), "
            f"got {cfg.actor_rollout_ref.actor.clip_ratio_c}"
        )
    for role in (actor, "critic"):
        p.at_least(cfg, f"{role}.optim.lr", 0.0)
        p.at_least(cfg, f"{role}.optim.weight_decay", 0.0)
        p.within(cfg, f"{role}.optim.lr_warmup_steps_ratio", 0.0, 1.0)
        p.within(cfg, f"{role}.optim.min_lr_ratio", 0.0, 1.0)
        betas = get(cfg, f"{role}.optim.betas")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            p.append(f"{role}.optim.betas must be two numbers in [0, 1), got {list(betas)}")
    for key in ("trainer.save_freq", "trainer.test_freq"):
        if get(cfg, key) == 0 or get(cfg, key) < -1:
            p.append(f"{key} must be -1 (off) or >= 1, got {get(cfg, key)}")
    if not math.isfinite(cfg.reward_model.error_score):
        p.append(
            f"reward_model.error_score must be a finite number, got {cfg.reward_model.error_score}"
        )
    limit = cfg.trainer.max_consecutive_nonfinite_steps
    if limit is not None and limit < 1:
        p.append(
            f"trainer.max_consecutive_nonfinite_steps must be >= 1 or null (never stop), "
            f"got {limit}"
        )


def _check_sampling(cfg: Config, p: _Problems) -> None:
    for key in ("actor_rollout_ref.rollout", "actor_rollout_ref.rollout.val_kwargs"):
        s = get(cfg, key)
        if s.top_k == 0 or s.top_k < -1:
            p.append(f"{key}.top_k must be -1 (off) or >= 1, got {s.top_k}")
        if not 0.0 < s.top_p <= 1.0:
            p.append(f"{key}.top_p must be in (0, 1], got {s.top_p}")
        if s.temperature < 0:
            p.append(f"{key}.temperature must be >= 0, got {s.temperature}")
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.temperature == 0:
        p.append(
            "actor_rollout_ref.rollout.temperature must be > 0: training log-probs are taken "
            "of logits / temperature; for greedy generation set do_sample=false and keep the "
            "temperature positive"
        )
    if rollout.prompt_length < cfg.data.max_prompt_length:
        p.append(
            f"actor_rollout_ref.rollout.prompt_length ({rollout.prompt_length}) is shorter than "
            f"data.max_prompt_length ({cfg.data.max_prompt_length}); leave it unset to follow it"
        )
    total = rollout.prompt_length + rollout.response_length
    if rollout.max_model_len is not None and rollout.max_model_len < total:
        p.append(
            f"actor_rollout_ref.rollout.max_model_len ({rollout.max_model_len}) is below "
            f"prompt_length + response_length ({total}); raise it or leave it null"
        )


def _check_streaming(cfg: Config, p: _Problems) -> None:
    """`algorithm.filter_groups.streaming`: dynamic sampling through the engine's slots, for
    batch generation of at least one group's responses at once."""
    fg, rollout = cfg.algorithm.filter_groups, cfg.actor_rollout_ref.rollout
    if not fg.streaming:
        return
    key = "algorithm.filter_groups.streaming=true"
    if not fg.enable:
        p.append(f"{key} streams dynamic sampling: set algorithm.filter_groups.enable=true too")
    if rollout.multi_turn.enable:
        p.append(
            f"{key} with actor_rollout_ref.rollout.multi_turn.enable: streaming judges single "
            "responses; set streaming=false for the agent loop"
        )
    if rollout.over_sample_rate > 0:
        p.append(
            f"{key} with actor_rollout_ref.rollout.over_sample_rate={rollout.over_sample_rate}:"
            " the stream already stops once enough groups are kept; set the rate to 0"
        )
    if cfg.algorithm.adv_estimator == "remax":
        p.append(
            f"{key} with adv_estimator=remax: ReMax's greedy baselines are generated per batch;"
            " set streaming=false"
        )
    if rollout.max_num_seqs < rollout.n:
        p.append(
            f"{key} holds a group's rollout.n={rollout.n} responses in the engine's slots at "
            f"once: raise actor_rollout_ref.rollout.max_num_seqs ({rollout.max_num_seqs}) to at "
            f"least {rollout.n}"
        )


def _check_over_sample(cfg: Config, p: _Problems) -> None:
    """`rollout.over_sample_rate`: in [0, 1), leaving at least one row of a generation to
    finish, single-turn only."""
    rollout, key = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout.over_sample_rate"
    rate = rollout.over_sample_rate
    if not 0.0 <= rate < 1.0:
        p.append(f"{key}={rate}: must be in [0, 1)")
        return
    rows = (cfg.data.gen_batch_size or cfg.data.train_batch_size) * rollout.n
    if rate and int(rows * (1 - rate)) < 1:
        p.append(
            f"{key}={rate} lets int({rows} x (1 - {rate})) = 0 of a generation's {rows} rows "
            f"finish: lower it below {1 - 1 / rows:.4g}"
        )
    if rate and rollout.multi_turn.enable:
        p.append(
            f"{key}={rate} with actor_rollout_ref.rollout.multi_turn.enable: the early abort is "
            "built for single-turn rollouts only; set it to 0"
        )


def _check_algorithm(cfg: Config, p: _Problems) -> None:
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    if algo.adv_estimator == "gae" and cfg.critic.enable is False:
        p.append(
            "algorithm.adv_estimator=gae needs a critic but critic.enable=false; enable the "
            "critic or pick a critic-free estimator such as grpo"
        )
    if algo.kl_ctrl.type == "adaptive" and (
        algo.kl_ctrl.horizon <= 0 or algo.kl_ctrl.target_kl <= 0
    ):
        p.append("algorithm.kl_ctrl: the adaptive controller needs horizon > 0 and target_kl > 0")
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        p.append("trainer.resume_mode=resume_path needs trainer.resume_from_path=CHECKPOINT_DIR")
    if actor.use_kl_loss and algo.use_kl_in_reward:
        log.warning(
            "both actor_rollout_ref.actor.use_kl_loss and algorithm.use_kl_in_reward are set: "
            "the KL to the reference is penalised twice"
        )


def _divisors_near(n: int, target: int, k: int = 3) -> list[int]:
    return sorted((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - target))[:k]


def placed_devices(cfg: Config) -> dict[str, int]:
    """Devices of each role placed on its own group (`mesh.placement.<role>.devices`; the
    reward model's also from verl's `reward_model.enable_resource_pool`: `nnodes` x
    `n_gpus_per_node`); 0: colocated with the trainer."""
    counts = {role: getattr(cfg.mesh.placement, role).devices for role in PLACED_ROLES}
    rm = cfg.reward_model
    if rm.enable_resource_pool and not counts["reward"]:
        counts["reward"] = rm.nnodes * rm.n_gpus_per_node
    distill = cfg.distillation
    if distill.enabled and not counts["teacher"]:
        counts["teacher"] = distill.nnodes * distill.n_gpus_per_node
    return counts


def role_devices(cfg: Config, num_devices: int) -> dict[str, range]:
    """Device index ranges of the trainer (`train`) and of each placed role (see
    `jaxrl.config.mesh.device_groups`); ValueError if they do not fit `num_devices`."""
    return device_groups(placed_devices(cfg), num_devices)


def resolved_mesh(cfg: Config, num_devices: int, role: str = "train") -> dict[str, int]:
    """The mesh sizes of the trainer (`mesh.*`, over all devices but the placed roles') or
    of a placed role (`mesh.placement.<role>.*`), -1 resolved; ValueError if they do not fit."""
    count = len(role_devices(cfg, num_devices)[role])
    group = cfg.mesh if role == "train" else getattr(cfg.mesh.placement, role)
    return resolve_axis_sizes({a: getattr(group, a) for a in AXES}, count)


def data_parallel_size(cfg: Config, num_devices: int, role: str = "train") -> int:
    """Batch shards of a training-style mesh: dp x fsdp x ep (the batch is split over all
    three)."""
    sizes = resolved_mesh(cfg, num_devices, role)
    return sizes["dp"] * sizes["fsdp"] * sizes["ep"]


def _check_mini_batch(cfg: Config, p: _Problems, role: str, mini: int, shards: int | None) -> bool:
    """Whole mini-batches per step, split evenly over the data-parallel shards."""
    batch, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    if mini > batch or batch % mini:
        p.append(
            f"data.train_batch_size ({batch}) must be a multiple of {role}.ppo_mini_batch_size "
            f"({mini}) so that every step has whole mini-batches; e.g. set "
            f"{role}.ppo_mini_batch_size to one of {_divisors_near(batch, mini)}"
        )
        return False
    if shards is not None and (mini * n) % shards:
        p.append(
            f"{role}.ppo_mini_batch_size x rollout.n = {mini} x {n} = {mini * n} sequences "
            f"cannot be split evenly over the {shards} data-parallel shards (dp x fsdp x ep of "
            f"its mesh); make it a multiple of {shards} or change the mesh"
        )
        return False
    return True


def _check_micro_batch(cfg: Config, p: _Problems, role: str, rc: Any, shards: int | None) -> None:
    """Micro-batches tile each shard's mini-batch; a token budget holds a whole sequence."""
    n = cfg.actor_rollout_ref.rollout.n
    micro, mini = rc.ppo_micro_batch_size_per_gpu, rc.ppo_mini_batch_size
    if micro is not None and not rc.use_dynamic_bsz and shards is not None:
        per_shard = mini * n // shards
        if per_shard % micro:
            p.append(
                f"{role}.ppo_micro_batch_size_per_gpu ({micro}) must divide the "
                f"{per_shard} sequences of a mini-batch on each data-parallel shard "
                f"(ppo_mini_batch_size {mini} x rollout.n {n} / {shards} shards); e.g. use "
                f"one of {_divisors_near(per_shard, micro)}"
            )
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    if rc.use_dynamic_bsz and rc.ppo_max_token_len_per_gpu < seq_len:
        p.append(
            f"{role}.ppo_max_token_len_per_gpu ({rc.ppo_max_token_len_per_gpu}) must hold one "
            f"whole sequence (max_prompt_length + max_response_length = {seq_len})"
        )


def _check_batches(cfg: Config, p: _Problems, shards: dict[str, int] | None) -> None:
    """Mini- and micro-batch splits over the data-parallel shards of the actor's mesh
    (`shards["train"]`) and the critic's (`shards["critic"]`: its own when placed)."""
    shards = shards or {}
    actor_key, actor = "actor_rollout_ref.actor", cfg.actor_rollout_ref.actor
    actor_shards = shards.get("train")
    actor_ok = _check_mini_batch(cfg, p, actor_key, actor.ppo_mini_batch_size, actor_shards)
    if actor_ok:
        _check_micro_batch(cfg, p, actor_key, actor, actor_shards)
    if not critic_enabled(cfg):
        return
    critic, critic_shards = cfg.critic, shards.get("critic", actor_shards)
    # A critic mini-batch that follows the actor's was checked with it: one message, not two.
    if critic.ppo_mini_batch_size == actor.ppo_mini_batch_size and critic_shards == actor_shards:
        critic_ok = actor_ok
    else:
        critic_ok = _check_mini_batch(cfg, p, "critic", critic.ppo_mini_batch_size, critic_shards)
    if critic_ok:
        _check_micro_batch(cfg, p, "critic", critic, critic_shards)


def _role_in_use(cfg: Config, role: str) -> bool:
    return {
        "rollout": True,
        "ref": reference_enabled(cfg),
        "critic": critic_enabled(cfg),
        "reward": cfg.reward_model.enable,
        "teacher": cfg.distillation.enabled,
    }[role]


def _check_placement(cfg: Config, p: _Problems, num_devices: int) -> dict[str, int] | None:
    """Device groups of placed roles; returns the data-parallel shards of the trainer's
    mesh (`train`) and of a placed critic (`critic`) when the meshes are valid."""
    counts = placed_devices(cfg)
    rm = cfg.reward_model
    pool = rm.nnodes * rm.n_gpus_per_node
    if rm.enable_resource_pool and (pool < 1 or counts["reward"] != pool):
        p.append(
            "reward_model.enable_resource_pool needs reward_model.nnodes x n_gpus_per_node = "
            f"{rm.nnodes} x {rm.n_gpus_per_node} >= 1 devices (and "
            f"mesh.placement.reward.devices, if set, the same); got {counts['reward']}"
        )
    if counts["ref"] and lora_enabled(cfg.actor_rollout_ref.model):
        p.append(
            f"mesh.placement.ref.devices={counts['ref']} with LoRA on the actor "
            "(actor_rollout_ref.model.lora_rank): the reference is the actor's base without "
            "adapters, on the actor's devices; unset mesh.placement.ref"
        )
    for role, count in counts.items():
        if count and not _role_in_use(cfg, role):
            key = f"mesh.placement.{role}.devices={count}"
            if role == "reward" and rm.enable_resource_pool:
                key = "reward_model.enable_resource_pool=true"
            p.append(f"{key}, but this run has no {role} role (reward_model.enable etc.); unset it")
    rollout = cfg.mesh.placement.rollout
    if (rollout.dp, rollout.fsdp, rollout.ep, rollout.tp, rollout.sp) != (1, -1, 1, 1, 1):
        p.append(
            "mesh.placement.rollout takes only `devices`: the rollout mesh is dp (the rest) x "
            "actor_rollout_ref.rollout.tensor_model_parallel_size"
        )
    try:
        groups = role_devices(cfg, num_devices)
    except ValueError as e:
        p.append(f"mesh.placement: {e}")
        return None
    shards: dict[str, int] = {}
    for role in ("train", "ref", "critic", "reward", "teacher"):
        if role not in groups:
            continue
        key = "mesh.dp, mesh.fsdp, mesh.ep, mesh.tp, mesh.sp" if role == "train" else ""
        key = key or f"mesh.placement.{role}"
        try:
            shards[role] = data_parallel_size(cfg, num_devices, role)
        except ValueError as e:
            p.append(f"{key}: {e}")
    rollout_devices = len(groups.get("rollout", groups["train"]))
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if tp >= 1 and rollout_devices % tp:
        p.append(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size ({tp}) must divide the "
            f"rollout's {rollout_devices} devices (the rollout mesh is dp={rollout_devices}/tp "
            "x tp)"
        )
    return shards if "train" in shards else None


def _check_devices(cfg: Config, p: _Problems, num_devices: int) -> dict[str, int] | None:
    """Mesh, placement and host checks; returns the data-parallel shard counts (see
    `_check_placement`) when the meshes are valid."""
    shards = _check_placement(cfg, p, num_devices)
    if shards is not None:
        # (model group, the mesh it trains or scores on) for ring attention's sequence axis
        critic_mesh = "critic" if "critic" in shards else "train"
        meshes = [("actor_rollout_ref", "train"), ("critic", critic_mesh)]
        if "ref" in shards:
            meshes.append(("actor_rollout_ref", "ref"))
        for role, group in meshes:
            sp_key = "mesh.sp" if group == "train" else f"mesh.placement.{group}.sp"
            sp = resolved_mesh(cfg, num_devices, group)["sp"]
            if get(cfg, f"{role}.model.attention_impl") == "ring" and sp < 2:
                p.append(
                    f"{role}.model.attention_impl=ring needs a sequence-parallel mesh: set "
                    f"{sp_key} to 2 or more, or use attention_impl=auto"
                )
    nodes, per_node = cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node
    reward_pool = placed_devices(cfg)["reward"] if cfg.reward_model.enable_resource_pool else 0
    if per_node is not None and (nodes or 1) * per_node + reward_pool != num_devices:
        pool = f" + the reward model's pool of {reward_pool}" if reward_pool else ""
        p.append(
            f"trainer.nnodes x trainer.n_gpus_per_node = {nodes or 1} x {per_node}{pool} but "
            f"JAX sees {num_devices} devices; fix them or leave both null (jaxrl uses every "
            "device)"
        )
    return shards


def check(cfg: Config, *, num_devices: int | None = None) -> None:
    """Raise `ConfigError` listing every problem of `cfg` (device checks need `num_devices`)."""
    p = _Problems()
    _check_choices(cfg, p)
    _check_ranges(cfg, p)
    _check_sampling(cfg, p)
    _check_over_sample(cfg, p)
    _check_algorithm(cfg, p)
    _check_multi_turn(cfg, p)
    _check_distillation(cfg, p)
    _check_async(cfg, p)
    shards = _check_devices(cfg, p, num_devices) if num_devices is not None else None
    if not p:  # batch arithmetic assumes the ranges above hold
        _check_batches(cfg, p, shards)
    if p:
        raise ConfigError(p)


# verl 0.9.1's distillation losses: the sampled-token estimators, and the top-k forward KL.
DISTILLATION_ESTIMATORS = _KL
DISTILLATION_TOPK = ("forward_kl_topk",)
TEACHER_KEYS = ("key", "model_path", "num_replicas", "inference", "_target_")


def teachers(cfg: Config) -> dict[str, dict]:
    """The distillation teachers by entry name, resolved as verl resolves `teacher_models`:
    one entry is the teacher; of several, the default entry `teacher_model` is dropped and
    each other one is a teacher (routed to by its `key`). Entries without a `model_path` are
    left out (`_check_distillation` names them where verl would refuse)."""
    return {name: e for name, e in _teacher_entries(cfg).items() if e.get("model_path")}


def _teacher_entries(cfg: Config) -> dict[str, dict]:
    """`distillation.teacher_models` as verl resolves it: of several entries, the default
    `teacher_model` is dropped."""
    entries = {name: dict(e or {}) for name, e in (cfg.distillation.teacher_models or {}).items()}
    if len(entries) > 1:
        entries.pop("teacher_model", None)
    return entries


def teacher_roles(cfg: Config) -> dict[str, tuple[str, Any]]:
    """The cluster's teacher roles: {role name: (entry name, routing key)}. One teacher is
    the role `teacher` (every row, key None); several are `teacher:<key>`, each scoring the
    rows whose `distillation.teacher_key` field equals its `key` (verl's routing; a key is a
    string, as verl types it)."""
    found = teachers(cfg)
    if len(found) == 1:
        return {"teacher": (next(iter(found)), None)}
    return {f"teacher:{e['key']}": (name, str(e["key"])) for name, e in found.items()}


def _check_distillation(cfg: Config, p: _Problems) -> None:
    """verl's refusals of `DistillationLossConfig`, a teacher with a model (several: each with
    its own key, `_check_teacher_routing`), and the teachers' device pool (`nnodes` x
    `n_gpus_per_node` and `mesh.placement.teacher`)."""
    distill, key = cfg.distillation, "distillation.distillation_loss"
    if not distill.enabled:
        return
    loss = distill.distillation_loss
    p.choice(cfg, f"{key}.loss_mode", DISTILLATION_ESTIMATORS + DISTILLATION_TOPK)
    if loss.loss_mode in DISTILLATION_TOPK and not (loss.topk or 0) >= 1:
        p.append(f"{key}.topk={loss.topk}: loss_mode={loss.loss_mode} needs topk >= 1")
    p.choice(cfg, f"{key}.policy_loss_mode", ("vanilla",))
    if loss.loss_mode == "k1" and not loss.use_policy_gradient:
        p.append(
            f"{key}.loss_mode=k1 with use_policy_gradient=false: k1's gradient does not depend "
            "on the teacher's log-probs (verl refuses it too); set use_policy_gradient=true or "
            "use k3"
        )
    if loss.loss_max_clamp is not None and not loss.loss_max_clamp > 0:
        p.append(f"{key}.loss_max_clamp={loss.loss_max_clamp}: use a value > 0, or null")
    if loss.loss_mode in DISTILLATION_TOPK and loss.use_policy_gradient:
        log.warning(
            "%s.loss_mode=forward_kl_topk with use_policy_gradient=true: the update then uses "
            "only the sampled token's log-prob, so most of the top-k signal is unused (verl "
            "warns the same); use_policy_gradient=false backpropagates it", key
        )  # fmt: skip
    for name, entry in (distill.teacher_models or {}).items():
        inference = (entry or {}).get("inference")
        if inference is not None and not hasattr(inference, "get"):
            p.append(
                f"distillation.teacher_models.{name}.inference must be a mapping (verl's "
                f"rollout keys; jaxrl reads its dtype), not {inference!r}"
            )
        unknown = sorted(set(entry or {}) - set(TEACHER_KEYS))
        if unknown:
            p.append(
                f"distillation.teacher_models.{name}: unknown keys {unknown}; a teacher has "
                f"{list(TEACHER_KEYS)}"
            )
    found = teachers(cfg)
    if not found:
        p.append(
            "distillation.enabled needs a teacher: set "
            "distillation.teacher_models.teacher_model.model_path=HF_CHECKPOINT_DIR"
        )
    _check_teacher_routing(cfg, p)
    pool = distill.nnodes * distill.n_gpus_per_node
    placed = cfg.mesh.placement.teacher.devices
    if pool and placed and pool != placed:
        p.append(
            f"distillation.nnodes x n_gpus_per_node = {pool} teacher devices, but "
            f"mesh.placement.teacher.devices={placed}; set one of them"
        )


def _check_teacher_routing(cfg: Config, p: _Problems) -> None:
    """Several teachers (verl's multi-teacher distillation): each needs a `model_path` and a
    `key` of its own; the default entry `teacher_model` is dropped, as verl drops it."""
    given = cfg.distillation.teacher_models or {}
    if len(given) < 2:
        return
    dropped = given.get("teacher_model") or {}
    if dropped.get("model_path"):
        log.warning(
            "distillation.teacher_models has %d entries: the default entry teacher_model "
            "(model_path=%s) is dropped, as verl drops it; give that teacher another name (e.g. "
            "teacher_model1) to use it", len(given), dropped["model_path"]
        )  # fmt: skip
    keys: dict[str, str] = {}  # verl types `key` as a string: 1 and "1" are one key
    for name, entry in _teacher_entries(cfg).items():
        where = f"distillation.teacher_models.{name}"
        if not entry.get("model_path"):
            p.append(f"{where}.model_path is not set: every teacher of several needs one")
        if entry.get("key") is None:
            p.append(
                f"{where}.key is not set: with several teachers each row goes to the teacher "
                f"whose key equals its distillation.teacher_key={cfg.distillation.teacher_key!r} "
                "field; set the value of the rows this teacher scores"
            )
        elif str(entry["key"]) in keys:
            p.append(
                f"{where}.key={entry['key']!r} is also the key of "
                f"distillation.teacher_models.{keys[str(entry['key'])]}: each key routes to one "
                "teacher"
            )
        else:
            keys[str(entry["key"])] = name


def _check_multi_turn(cfg: Config, p: _Problems) -> None:
    key = "actor_rollout_ref.rollout.multi_turn"
    p.choice(cfg, f"{key}.format", TOOL_FORMATS)
    p.choice(cfg, f"{key}.tool_response_truncate_side", ("left", "middle", "right"))
    p.choice(cfg, "actor_rollout_ref.rollout.agent.default_agent_loop", AGENT_LOOPS)
    for name in ("max_assistant_turns", "max_user_turns"):
        p.at_least(cfg, f"{key}.{name}", 1, optional=True)
    for name in ("max_parallel_calls", "max_tool_response_length", "tool_workers", "decode_chunk"):
        p.at_least(cfg, f"{key}.{name}", 1)
    if cfg.actor_rollout_ref.rollout.multi_turn.tool_timeout <= 0:
        p.append(f"{key}.tool_timeout must be > 0 seconds")
    path = cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path
    if path and not os.path.isfile(os.path.expanduser(path)):
        p.append(f"{key}.tool_config_path={path}: no such file (a tool YAML: `tools: [...]`)")
    _check_external(cfg, p)
    _check_router_replay(cfg, p)


def _check_external(cfg: Config, p: _Problems) -> None:
    """`rollout.agent.external`: a user's episode function in place of the agent loop."""
    rollout = cfg.actor_rollout_ref.rollout
    spec, key = rollout.agent.external, "actor_rollout_ref.rollout.agent.external"
    if not spec:
        return
    module, _, name = str(spec).rpartition(":")
    if not module or not name:
        p.append(f"{key}={spec!r}: name the function as module:function or "
                 "path/to/file.py:function")  # fmt: skip
    if not rollout.multi_turn.enable:
        p.append(f"{key} runs multi-turn episodes: set actor_rollout_ref.rollout.multi_turn."
                 "enable=true")  # fmt: skip
    if rollout.multi_turn.tool_config_path:
        p.append(f"{key}: the external agent runs its own tools; set actor_rollout_ref.rollout."
                 "multi_turn.tool_config_path=null")  # fmt: skip
    if rollout.agent.external_timeout <= 0:
        p.append(f"{key}_timeout must be > 0 seconds")
    if not 0 <= rollout.agent.external_port < 65536:
        p.append(f"{key}_port={rollout.agent.external_port}: a port (0: any free one)")
    if cfg.async_training.mode == "fully_async":
        p.append(f"{key} with async_training.mode=fully_async: the rollouter streams the "
                 "internal agent loop's groups (an external agent's not built yet); use "
                 "async_training.mode=sync or one_step_off")  # fmt: skip
    # the episodes' rewards are what the agent returns: what would score them otherwise
    bypassed = {
        "reward_model.enable=true": cfg.reward_model.enable,
        "reward_model.overlong_buffer.enable=true": cfg.reward_model.overlong_buffer.enable,
        "custom_reward_function.path": bool(cfg.custom_reward_function.path),
        "algorithm.adv_estimator=remax (its greedy baselines are scored by the reward "
        "function)": cfg.algorithm.adv_estimator == "remax",
    }
    for name, on in bypassed.items():
        if on:
            p.append(f"{key} with {name}: the agent's function returns each episode's reward, "
                     "so nothing else scores it; fold that score into what the function "
                     "returns, or unset it")  # fmt: skip


def _check_router_replay(cfg: Config, p: _Problems) -> None:
    """Routing replay (verl's `router_replay` and `enable_rollout_routing_replay`); that the
    model is a mixture of experts is checked when it loads."""
    arr = cfg.actor_rollout_ref
    record = arr.rollout.enable_rollout_routing_replay
    modes = {"actor": arr.actor.router_replay.mode, "ref": arr.ref.router_replay.mode}
    for role, mode in modes.items():
        key = f"actor_rollout_ref.{role}.router_replay"
        allowed = ROUTER_REPLAY_MODES if role == "actor" else ("disabled", "R3")
        if mode not in allowed:
            p.append(f"{key}.mode={mode!r}: one of {', '.join(allowed)}")
        replay = getattr(arr, role).router_replay
        for name in ("record_file", "replay_file"):
            if getattr(replay, name) is not None:
                p.append(f"{key}.{name}: routes to or from files are not supported in jaxrl "
                         "(the routes ride in the batch); set it to null")  # fmt: skip
        if mode == "R3" and not record:
            p.append(f"{key}.mode=R3 replays the rollout's routes: set actor_rollout_ref.rollout."
                     "enable_rollout_routing_replay=true")  # fmt: skip
    if modes["actor"] == "R2" and record:
        p.append("actor_rollout_ref.actor.router_replay.mode=R2 records the routes in the "
                 "old-log-prob pass; actor_rollout_ref.rollout.enable_rollout_routing_replay "
                 "serves R3 only: set it to false (as verl requires)")  # fmt: skip
    if not record:
        return
    key = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    if arr.rollout.multi_turn.enable:
        p.append(f"{key}: routes are recorded on single-turn rollouts only; set "
                 "actor_rollout_ref.rollout.multi_turn.enable=false")  # fmt: skip
    if cfg.async_training.mode == "fully_async":
        p.append(f"{key} with async_training.mode=fully_async: the rollouter's streamed groups "
                 "carry no routes yet; use async_training.mode=sync or one_step_off")  # fmt: skip
    if cfg.algorithm.filter_groups.enable:
        p.append(f"{key} with algorithm.filter_groups.enable=true: the dynamic-sampling pool "
                 "carries no routes yet; disable one of them")  # fmt: skip


ASYNC_MODES = ("sync", "one_step_off", "fully_async")


def _check_async(cfg: Config, p: _Problems) -> None:
    """`async_training.mode`: the rollout runs ahead on devices of its own, generating with
    the fixed-batch path (the host only dispatches it), or one_step_off's agent loop on a
    thread of its own; what would need the step's host during generation is refused by
    name."""
    p.choice(cfg, "async_training.mode", ASYNC_MODES)
    mode = cfg.async_training.mode
    if mode == "sync":
        return
    key = f"async_training.mode={mode}"
    if not cfg.mesh.placement.rollout.devices:
        p.append(
            f"{key} generates during the update, on devices of the rollout's own: set "
            "mesh.placement.rollout.devices to the rollout's share (verl's one_step_off recipe "
            "likewise gives the rollout its own GPUs)"
        )
    rollout = cfg.actor_rollout_ref.rollout
    host = ("the host drives that generation (or a second one) and the step would wait for it; "
            "not built for the async modes yet. Use async_training.mode=sync")  # fmt: skip
    # each refused combination: (whether it is set, why not and what to do instead)
    unsupported = {
        "algorithm.adv_estimator=remax (greedy baselines)": (
            cfg.algorithm.adv_estimator == "remax", host),
    }  # fmt: skip
    if mode == "fully_async":  # it judges dynamic sampling's groups as they finish, runs
        # the agent loop's trajectories as groups
        _check_fully_async(cfg, p)
        unsupported["actor_rollout_ref.rollout.over_sample_rate>0"] = (
            bool(rollout.over_sample_rate),
            "fully_async takes groups in the order they finish, so the slowest never hold a "
            "step back (they train in a later one, within the staleness bound): the early "
            "abort has nothing to cut. Set actor_rollout_ref.rollout.over_sample_rate=0",
        )
        unsupported[
            "actor_rollout_ref.rollout.multi_turn.enable=true and algorithm.filter_groups"
        ] = (
            rollout.multi_turn.enable and cfg.algorithm.filter_groups.enable,
            "the rollouter's judge scores a group's single-turn responses, not agent "
            "trajectories (not built yet). Use async_training.mode=sync for dynamic sampling "
            "of agent trajectories",
        )
    else:  # one_step_off runs the agent loop ahead on a thread of its own
        unsupported["algorithm.filter_groups.enable=true"] = (
            cfg.algorithm.filter_groups.enable,
            "its rounds of generation would wait on the step's judge. async_training."
            "mode=fully_async judges each group as it finishes: use it (or mode=sync)",
        )
    for name, (on, why) in unsupported.items():
        if on:
            p.append(f"{key} with {name}: {why}")


def _check_fully_async(cfg: Config, p: _Problems) -> None:
    at, mini = cfg.async_training, cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    p.at_least(cfg, "async_training.trigger_parameter_sync_step", 1)
    p.at_least(cfg, "async_training.require_batches", 1)
    p.at_least(cfg, "async_training.staleness_threshold", 0)
    if at.rollout_timeout <= 0:
        p.append("async_training.rollout_timeout must be > 0 seconds")
    if at.require_batches * mini != cfg.data.train_batch_size:
        p.append(
            f"async_training.mode=fully_async trains each step on async_training."
            f"require_batches x actor.ppo_mini_batch_size = {at.require_batches} x {mini} "
            f"groups, and data.train_batch_size={cfg.data.train_batch_size}: set "
            f"data.train_batch_size={at.require_batches * mini} (verl's fully_async takes "
            "the same count)"
        )


def check_model_context(cfg: Config, max_position_embeddings: int | None, model_key: str) -> None:
    """The longest sequence must fit the model's context (`max_position_embeddings`)."""
    if max_position_embeddings is None:
        return
    rollout = cfg.actor_rollout_ref.rollout
    total = rollout.max_model_len or rollout.prompt_length + rollout.response_length
    if total > max_position_embeddings:
        raise ConfigError(
            [
                f"data.max_prompt_length + data.max_response_length = {total} tokens exceeds "
                f"the context of {model_key} (max_position_embeddings = "
                f"{max_position_embeddings}); shorten them to fit"
            ]
        )


__all__ = [
    "ADV_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "check",
    "check_model_context",
    "critic_enabled",
    "normalize",
    "resolved_mesh",
]
