"""The config trees of the offline trainers: `python -m jaxrl.sft` (verl's SFT trainer's keys)
and `python -m jaxrl.dpo` (TRL's `DPOConfig` / `KTOConfig` keys under `dpo.*`).

Both share verl's SFT groups for the model (`model.*`), the optimizer (`optim.*`) and the loop
(`trainer.*`), jaxrl's `mesh` group (the training axes) and `assets` (the offline demos' files).
`load_config(path, overrides, schema=SFT)` (or `DPO`) loads them as the RL config loads. Keys
marked *jaxrl* have no verl/TRL counterpart; `*TRL<0.29*` marks TRL keys that TRL 1.16 removed
and jaxrl keeps, with the semantics they had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from jaxrl.config.checks import LOGGERS, _Problems, canonical_spellings, replace
from jaxrl.config.errors import ConfigError
from jaxrl.config.load import Schema
from jaxrl.config.mesh import TRAIN_MESH_AXES, TRAIN_RULES, resolve_axis_sizes, rule_problems
from jaxrl.config.schema import AssetsConfig, LoopConfig, ModelConfig, OptimConfig
from jaxrl.config.verl_compat import Ignored

# `jaxrl.core_algos.preference`'s loss types (a test keeps the lists in step).
DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "sigmoid_norm", "robust", "exo_pair", "nca_pair", "bco_pair",
    "sppo_hard", "apo_zero", "apo_down", "discopop", "sft",
)  # fmt: skip
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
SMOOTHED = ("sigmoid", "robust", "exo_pair")  # the types that read label_smoothing
TRUNCATIONS = ("error", "left", "right")
TRUNCATION_MODES = ("keep_start", "keep_end", "error")
SCHEDULES = ("constant", "cosine", "linear")


# ----------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class OfflineModelConfig(ModelConfig):
    """`model.*`: the HF checkpoint trained (verl's SFT `model` group: the RL model keys,
    with `path` for verl's older `model.partial_pretrain`, and the dtypes).

    Attributes:
        model_dtype: Dtype the trained parameters are held in (verl's `engine.model_dtype`).
        dtype: Dtype the forward pass computes in (verl's `engine.dtype`).
        logits_chunk_size: *jaxrl*. Sequence positions whose [*, V] logits exist at once when
            computing log-probs (each chunk's logits recomputed in the backward pass); null:
            the whole sequence at once (verl's `engine.entropy_from_logits_chunk_size`).
    """

    model_dtype: str = "fp32"
    dtype: str = "bf16"
    logits_chunk_size: int | None = 128


@dataclass(frozen=True)
class OfflineOptimConfig(OptimConfig):
    """`optim.*`: AdamW and its schedule (verl's SFT defaults: lr 1e-5, betas (0.9, 0.95),
    10% warm-up, cosine).

    Attributes:
        lr_scheduler_type: `constant`, `cosine`, or `linear` (TRL's default: from the peak
            down to 0 at the last step).
        clip_grad: Clip the gradient's global norm to this (null: no clipping).
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.01
    lr_warmup_steps_ratio: float = 0.1
    lr_scheduler_type: str = "cosine"
    clip_grad: float | None = 1.0


@dataclass(frozen=True)
class OfflineTrainerConfig(LoopConfig):
    """`trainer.*`: the step loop, logs, validation and checkpoints (verl's SFT keys; the
    defaults verl's SFT trainer has).

    Attributes:
        seed: Seed of the training data order.
        max_ckpt_to_keep: Keep only the newest n checkpoints; null: all.
    """

    project_name: str = "jaxrl-offline"
    experiment_name: str = "test"
    total_epochs: int = 4
    val_before_train: bool = False
    seed: int = 1
    max_ckpt_to_keep: int | None = None


@dataclass(frozen=True)
class OfflineMeshConfig:
    """`mesh.*`: *jaxrl*. The training mesh (see the RL config's `mesh` group).

    Attributes:
        dp: Pure data parallelism.
        fsdp: Fully-sharded data parallelism; -1: the rest of the devices.
        ep: Expert parallelism (a mixture of experts' experts split; the batch too).
        tp: Tensor parallelism.
        sp: Sequence parallelism (ring attention); verl's `ulysses_sequence_parallel_size`
            sets it.
        train_rules: Logical axis -> mesh axes of the training layout.
    """

    dp: int = 1
    fsdp: int = -1
    ep: int = 1
    tp: int = 1
    sp: int = 1
    train_rules: dict[str, Any] = field(default_factory=lambda: dict(TRAIN_RULES))


# ------------------------------------------------------------------------------------------- SFT


@dataclass(frozen=True)
class MultiTurnConfig:
    """`data.multiturn.*`: conversations instead of prompt/response columns.

    Attributes:
        enable: Read each row's `messages_key` list of `{role, content}` messages; the loss
            covers the assistant turns only (each turn's tokens after its role header, its
            end-of-turn token included; verl's `MultiTurnSFTDataset`).
        messages_key: The column of messages.
        tools_key: A column of tool schemas given to the chat template (optional).
        enable_thinking_key: A column of per-row `enable_thinking` flags given to the
            template (optional).
        enable_thinking_default: The flag of rows without an `enable_thinking_key` value
            (null: the template's own default).
        ignore_input_ids_mismatch: A conversation the template renders differently from its
            messages one by one: train on the messages' concatenation with a warning instead
            of refusing the row (verl 0.9.1).
    """

    enable: bool = False
    messages_key: str = "messages"
    tools_key: str = "tools"
    enable_thinking_key: str = "enable_thinking"
    enable_thinking_default: bool | None = None
    ignore_input_ids_mismatch: bool = False


@dataclass(frozen=True)
class SFTDataConfig:
    """`data.*`: the SFT dataset (parquet).

    Attributes:
        train_files: Parquet file or list of files.
        val_files: Parquet file or list of files for the validation loss (null: none).
        train_max_samples: Use at most this many training rows (-1: all).
        val_max_samples: Use at most this many validation rows (-1: all).
        prompt_key: Column of the prompt: a string (sent as one user message through the chat
            template, with the generation prompt) or a list of chat messages.
        response_key: Column of the response (a string; the tokenizer's EOS is appended).
        prompt_dict_keys: Keys into a dict-valued prompt column (the value at that path is
            the prompt).
        response_dict_keys: Keys into a dict-valued response column.
        multiturn: Conversations (`messages`) instead of prompt/response.
        max_length: Tokens of a whole sequence (prompt + response).
        truncation: A sequence longer than `max_length`: `error` (names the file and row),
            `left` (drop its first tokens) or `right` (drop its last tokens).
        train_batch_size: Sequences per optimizer step (global).
        micro_batch_size_per_gpu: Sequences per device per micro-batch (gradient accumulation;
            the loss is normalised by the whole batch's tokens, so it does not change results).
        use_dynamic_bsz: Cut micro-batches by a token budget instead of a row count.
        max_token_len_per_gpu: The budget of `use_dynamic_bsz`, in tokens per device.
        apply_chat_template_kwargs: Extra keyword arguments for `apply_chat_template`.
        shuffle: Shuffle the training rows each epoch (seed `trainer.seed`).
        skip_bad_rows: *jaxrl*. Skip malformed rows (counted and logged) instead of stopping
            with an error naming the file, row and column.
    """

    train_files: Any = "~/data/gsm8k/train.parquet"
    val_files: Any = None
    train_max_samples: int = -1
    val_max_samples: int = -1
    prompt_key: str = "question"
    response_key: str = "answer"
    prompt_dict_keys: tuple[str, ...] | None = None
    response_dict_keys: tuple[str, ...] | None = None
    multiturn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    max_length: int = 1024
    truncation: str = "error"
    train_batch_size: int = 256
    micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: int = 8192
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    shuffle: bool = True
    skip_bad_rows: bool = False


@dataclass(frozen=True)
class SFTConfig:
    """The whole SFT run (`python -m jaxrl.sft`).

    Attributes:
        data: The dataset and batch sizes.
        model: The checkpoint trained.
        optim: The optimizer.
        trainer: Loop, logs, validation and checkpoints.
        ulysses_sequence_parallel_size: verl's sequence parallelism; jaxrl's `mesh.sp` (ring
            attention) when above 1.
        mesh: The device mesh (jaxrl).
        assets: Files the run makes for itself (jaxrl; the SFT demo's model and data).
    """

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: OfflineModelConfig = field(default_factory=OfflineModelConfig)
    optim: OfflineOptimConfig = field(default_factory=OfflineOptimConfig)
    trainer: OfflineTrainerConfig = field(default_factory=OfflineTrainerConfig)
    ulysses_sequence_parallel_size: int = 1
    mesh: OfflineMeshConfig = field(default_factory=OfflineMeshConfig)
    assets: AssetsConfig = field(default_factory=AssetsConfig)


# ---------------------------------------------------------------------------------- DPO and KTO


@dataclass(frozen=True)
class PreferenceDataConfig:
    """`data.*`: preference rows (parquet): paired `prompt`, `chosen`, `rejected` for DPO, or
    unpaired `prompt`, `completion`, `label` for KTO; each a string or a list of chat
    messages (TRL's dataset formats).

    Attributes:
        train_files: Parquet file or list of files.
        val_files: Parquet file or list of files for validation (null: none).
        train_max_samples: Use at most this many training rows (-1: all).
        val_max_samples: Use at most this many validation rows (-1: all).
        prompt_key: Column of the prompt.
        chosen_key: Column of the preferred completion (DPO).
        rejected_key: Column of the dispreferred completion (DPO).
        completion_key: Column of the completion (KTO).
        label_key: Column of the KTO label (true: desirable).
        train_batch_size: Pairs (DPO) or rows (KTO) per optimizer step (global).
        micro_batch_size_per_gpu: Pairs (rows) per device per micro-batch; chosen and rejected
            of a pair always share one forward pass.
        val_batch_size: Pairs (rows) per validation batch; null: `train_batch_size`.
        apply_chat_template_kwargs: Extra keyword arguments for `apply_chat_template`.
        shuffle: Shuffle the training rows each epoch (seed `trainer.seed`).
        skip_bad_rows: *jaxrl*. Skip malformed rows (counted and logged) instead of stopping
            with an error naming the file, row and column.
    """

    train_files: Any = MISSING
    val_files: Any = None
    train_max_samples: int = -1
    val_max_samples: int = -1
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    completion_key: str = "completion"
    label_key: str = "label"
    train_batch_size: int = 64
    micro_batch_size_per_gpu: int = 8
    val_batch_size: int | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    shuffle: bool = True
    skip_bad_rows: bool = False


@dataclass(frozen=True)
class DPOAlgoConfig:
    """`dpo.*`: the preference loss, with TRL's `DPOConfig` / `KTOConfig` names and defaults.

    Attributes:
        beta: The temperature beta of the implicit reward beta log(pi / pi_ref).
        loss_type: A DPO loss type or a list of them (summed with `loss_weights`): sigmoid,
            hinge, ipo, sigmoid_norm, robust, exo_pair, nca_pair, bco_pair, sppo_hard,
            apo_zero, apo_down, discopop, sft; or an unpaired KTO loss: `kto`,
            `apo_zero_unpaired` (rows `prompt`, `completion`, `label`).
        loss_weights: Weights of the `loss_type` list; null: all 1.
        label_smoothing: The assumed label-noise rate e (robust, exo_pair, and conservative
            DPO for sigmoid; see docs/offline.md for TRL 1.16's difference).
        reference_free: *TRL<0.29*. No reference model: its log-probs are taken as 0.
        precompute_ref_log_probs: Compute the reference log-probs of the whole dataset once
            before training (then the reference model is freed) instead of per batch.
        rpo_alpha: *TRL<0.29*. Adds rpo_alpha x the chosen completions' per-token NLL (TRL
            1.16's `sft` loss term with that weight).
        max_length: Tokens of a whole sequence (prompt + completion); null: no limit.
        max_prompt_length: *TRL<0.29*. Tokens of the prompt; a longer prompt keeps its last
            tokens (`truncation_mode: error`: refused); null: no limit. DPO only.
        max_completion_length: *TRL<0.29*. Tokens of a completion; longer ones keep their
            first tokens; null: no limit. DPO only.
        truncation_mode: A sequence longer than `max_length`: `keep_start` (drop its end; a
            prompt that alone fills `max_length` drops the row, as TRL), `keep_end` (drop its
            start) or `error` (*jaxrl*: refuse, naming the file and row). KTO: `keep_start`
            only, as TRL's KTO.
        discopop_tau: DiscoPOP's tau.
        desirable_weight: KTO's weight of desirable rows.
        undesirable_weight: KTO's weight of undesirable rows.
    """

    beta: float = 0.1
    loss_type: Any = "sigmoid"
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0
    reference_free: bool = False
    precompute_ref_log_probs: bool = False
    rpo_alpha: float | None = None
    max_length: int | None = 1024
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    truncation_mode: str = "keep_start"
    discopop_tau: float = 0.05
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


@dataclass(frozen=True)
class DPOOptimConfig(OfflineOptimConfig):
    """`optim.*`: AdamW and its schedule (TRL's defaults: lr 1e-6, no weight decay, linear
    decay, no warm-up, clip 1.0)."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: str = "linear"


@dataclass(frozen=True)
class DPOConfig:
    """The whole DPO / KTO run (`python -m jaxrl.dpo`).

    Attributes:
        data: The preference dataset and batch sizes.
        model: The checkpoint trained (and, frozen, the reference policy).
        optim: The optimizer.
        dpo: The loss (TRL's keys).
        trainer: Loop, logs, validation and checkpoints.
        mesh: The device mesh (jaxrl).
        assets: Files the run makes for itself (jaxrl; the DPO demo's model and data).
    """

    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    model: OfflineModelConfig = field(default_factory=OfflineModelConfig)
    optim: DPOOptimConfig = field(default_factory=DPOOptimConfig)
    dpo: DPOAlgoConfig = field(default_factory=DPOAlgoConfig)
    trainer: OfflineTrainerConfig = field(default_factory=OfflineTrainerConfig)
    mesh: OfflineMeshConfig = field(default_factory=OfflineMeshConfig)
    assets: AssetsConfig = field(default_factory=AssetsConfig)


# ------------------------------------------------------------------------------ verl's other keys

_ENGINE = "an FSDP engine setting; jaxrl shards over the `mesh.*` axes"
_SHM = "shared-memory model loading has no JAX counterpart"
RENAMED: dict[str, str] = {
    "model.partial_pretrain": "model.path",
    "model.fsdp_config.model_dtype": "model.model_dtype",
    "engine.model_dtype": "model.model_dtype",
    "engine.dtype": "model.dtype",
    "engine.ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",
    "engine.entropy_from_logits_chunk_size": "model.logits_chunk_size",
    "use_remove_padding": "model.use_remove_padding",
    "optim.warmup_steps_ratio": "optim.lr_warmup_steps_ratio",
    "optim.lr_scheduler": "optim.lr_scheduler_type",
    "optim.warmup_style": "optim.lr_scheduler_type",
    "data.messages_key": "data.multiturn.messages_key",
    "data.tools_key": "data.multiturn.tools_key",
    "data.enable_thinking_key": "data.multiturn.enable_thinking_key",
    "data.enable_thinking_default": "data.multiturn.enable_thinking_default",
    "data.ignore_input_ids_mismatch": "data.multiturn.ignore_input_ids_mismatch",
}
IGNORED: dict[str, Ignored] = {
    "model.fsdp_config.*": Ignored(_ENGINE),
    "engine.*": Ignored(_ENGINE),
    "model.strategy": Ignored(_ENGINE),
    "model.use_shm": Ignored(_SHM),
    "data.use_shm": Ignored(_SHM),
    "model.external_lib": Ignored("HF model code is not used; jaxrl has its own model families"),
    "model.use_liger": Ignored("a PyTorch kernel switch with no JAX counterpart"),
    "model.use_fused_kernels": Ignored("a PyTorch kernel switch with no JAX counterpart"),
    "model.enable_activation_offload": Ignored(_ENGINE),
    "model.hf_config_path": Ignored("the config is read from model.path"),
    "data.chat_template": Ignored("set model.custom_chat_template"),
    "data.balance_dp_token": Ignored("not implemented in verl either"),
    "data.num_workers": Ignored("rows are tokenized on the main thread"),
    "data.pad_mode": Ignored(
        "model.use_remove_padding packs rows (verl's no_padding); without it each micro-batch "
        "is trimmed to its longest row; the loss is the same either way"
    ),
    "data.custom_cls.*": Ignored("custom dataset classes are not supported", (None,)),
    "trainer.default_hdfs_dir": Ignored("HDFS copies are not supported", (None,)),
    "trainer.device": Ignored("JAX uses whatever devices it sees"),
    "trainer.checkpoint.*": Ignored("checkpoints hold the model, optimizer and data state"),
    "checkpoint.*": Ignored("checkpoints hold the model, optimizer and data state"),
    "trainer.balance_batch": Ignored("micro-batches are dealt in order"),
    "trainer.profile_interval": Ignored("use JAX's profiler (jax.profiler) instead"),
    "profiler.*": Ignored("use JAX's profiler (jax.profiler) instead"),
    "optim.optimizer_impl": Ignored("optax's AdamW"),
    "optim.zero_indexed_step": Ignored("the schedule counts steps from 0", (True,)),
    "optim.override_optimizer_config": Ignored("not supported", (None,)),
    "dpo.disable_dropout": Ignored("jaxrl's models have no dropout"),
    "dpo.padding_free": Ignored("micro-batches are trimmed to their longest row", (False,)),
    "dpo.f_divergence_type": Ignored("only DPO's reverse KL is implemented", ("reverse_kl",)),
    "dpo.use_weighting": Ignored("WPO weighting is not implemented", (False,)),
    "dpo.ld_alpha": Ignored("LD-DPO is not implemented", (None,)),
    "dpo.sync_ref_model": Ignored("TR-DPO's reference sync is not implemented", (False,)),
}


def _normalize_common(cfg: Any) -> Any:
    return canonical_spellings(
        cfg,
        files=("data.train_files", "data.val_files"),
        optional_files=("data.val_files",),
        dtypes=("model.model_dtype", "model.dtype"),
        optimizers=("optim.optimizer",),
    )


def normalize_sft(cfg: SFTConfig) -> SFTConfig:
    """Canonical spellings; `ulysses_sequence_parallel_size` > 1 sets `mesh.sp`."""
    cfg = _normalize_common(cfg)
    sp = cfg.ulysses_sequence_parallel_size
    if sp > 1 and cfg.mesh.sp in (1, sp):
        cfg = replace(cfg, "mesh.sp", sp)
    elif sp > 1:
        raise ConfigError([
            f"ulysses_sequence_parallel_size={sp} and mesh.sp={cfg.mesh.sp} disagree: set one"
        ])  # fmt: skip
    return cfg


def loss_types(cfg: DPOConfig) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The configured DPO loss terms and their weights, `rpo_alpha` as an `sft` term."""
    types = cfg.dpo.loss_type
    types = (types,) if isinstance(types, str) else tuple(types)
    weights = cfg.dpo.loss_weights or (1.0,) * len(types)
    if cfg.dpo.rpo_alpha is not None:
        types, weights = (*types, "sft"), (*weights, float(cfg.dpo.rpo_alpha))
    return types, tuple(float(w) for w in weights)


def is_kto(cfg: DPOConfig) -> bool:
    """Whether the preference run is KTO (unpaired rows): `loss_type` a KTO type (or a list
    of exactly one)."""
    types = cfg.dpo.loss_type
    types = (types,) if isinstance(types, str) else tuple(types)
    return len(types) == 1 and types[0] in KTO_LOSS_TYPES


def normalize_dpo(cfg: DPOConfig) -> DPOConfig:
    """Canonical spellings; `loss_type` a tuple of names (a KTO type: its name alone)."""
    cfg = _normalize_common(cfg)
    if not isinstance(cfg.dpo.loss_type, str):
        cfg = replace(cfg, "dpo.loss_type", tuple(str(t) for t in cfg.dpo.loss_type))
    if is_kto(cfg) and not isinstance(cfg.dpo.loss_type, str):
        cfg = replace(cfg, "dpo.loss_type", cfg.dpo.loss_type[0])
    return cfg


# ---------------------------------------------------------------------------------------- checks


def _check_common(cfg: Any, p: _Problems, num_devices: int | None, rows_per_item: int) -> None:
    p.choice(cfg, "model.remat_policy", ("full", "save_dots"))
    p.choice(cfg, "optim.lr_scheduler_type", SCHEDULES)
    p.choice(cfg, "trainer.resume_mode", ("auto", "disable", "resume_path"))
    for name in cfg.trainer.logger:
        if name not in LOGGERS:
            p.append(f"trainer.logger: unknown logger {name!r}; use any of {', '.join(LOGGERS)}")
    p.extend(rule_problems(dict(cfg.mesh.train_rules), TRAIN_MESH_AXES, "mesh.train_rules"))
    for key in ("data.train_batch_size", "data.micro_batch_size_per_gpu"):
        p.at_least(cfg, key, 1)
    p.at_least(cfg, "model.lora_rank", 0)
    if cfg.model.lora_rank > 0 and cfg.model.lora_alpha <= 0:
        p.append(f"model.lora_alpha must be > 0 with LoRA, got {cfg.model.lora_alpha}")
    if num_devices is None or p:
        return
    try:
        sizes = offline_mesh(cfg, num_devices)
    except ValueError as e:
        p.append(f"mesh: {e}")
        return
    shards = sizes["dp"] * sizes["fsdp"] * sizes["ep"]
    batch = cfg.data.train_batch_size
    if batch % shards:
        p.append(
            f"data.train_batch_size ({batch}) must be a multiple of the data-parallel shards "
            f"(mesh dp x fsdp x ep = {shards}) so every device gets whole "
            f"{'pairs' if rows_per_item == 2 else 'rows'}"
        )


def offline_mesh(cfg: Any, num_devices: int) -> dict[str, int]:
    """The `mesh.*` sizes over `num_devices`, -1 resolved (ValueError if they do not fit)."""
    return resolve_axis_sizes({a: getattr(cfg.mesh, a) for a in TRAIN_MESH_AXES}, num_devices)


def check_sft(cfg: SFTConfig, *, num_devices: int | None = None) -> None:
    p = _Problems()
    p.choice(cfg, "data.truncation", TRUNCATIONS)
    p.at_least(cfg, "data.max_length", 2)
    if cfg.data.use_dynamic_bsz and cfg.data.max_token_len_per_gpu < cfg.data.max_length:
        p.append(
            f"data.max_token_len_per_gpu ({cfg.data.max_token_len_per_gpu}) must hold one "
            f"sequence of data.max_length ({cfg.data.max_length})"
        )
    _check_common(cfg, p, num_devices, 1)
    if p:
        raise ConfigError(p)


def check_dpo(cfg: DPOConfig, *, num_devices: int | None = None) -> None:
    p = _Problems()
    d = cfg.dpo
    kto = is_kto(cfg)
    types, weights = loss_types(cfg)
    if not kto:
        for t in types:
            if t not in DPO_LOSS_TYPES:
                allowed = ", ".join((*DPO_LOSS_TYPES, *KTO_LOSS_TYPES))
                p.append(f"dpo.loss_type: {t!r} is not one of {allowed}")
        if len(weights) != len(types):
            p.append(
                f"dpo.loss_weights has {len(weights)} entries for {len(types)} loss types "
                f"({', '.join(types)})"
            )
    else:
        if d.loss_weights is not None or d.rpo_alpha is not None:
            p.append("dpo.loss_weights and dpo.rpo_alpha apply to DPO losses, not to KTO")
        for key, value in (
            ("truncation_mode", d.truncation_mode != "keep_start"),
            ("max_prompt_length", d.max_prompt_length is not None),
            ("max_completion_length", d.max_completion_length is not None),
        ):
            if value:
                p.append(
                    f"dpo.{key}={getattr(d, key)!r} with KTO: TRL's KTOConfig has no such key "
                    "(KTO keeps each sequence's start, cut to dpo.max_length); leave it unset"
                )  # fmt: skip
        if d.loss_type == "kto" and cfg.data.train_batch_size < 2:
            p.append(
                "dpo.loss_type=kto needs data.train_batch_size >= 2 (per process): the KL "
                "estimate pairs each prompt with another row's completion"
            )
    if d.beta <= 0:
        p.append(f"dpo.beta must be > 0, got {d.beta}")
    e = d.label_smoothing
    if not 0 <= e < 1:
        p.append(f"dpo.label_smoothing must be in [0, 1), got {e}")
    if "robust" in types and not 0 <= e < 0.5:
        p.append(f"dpo.label_smoothing must be in [0, 0.5) for robust, got {e}")
    if "exo_pair" in types and not 0 < e < 1:
        p.append(f"dpo.label_smoothing must be in (0, 1) for exo_pair, got {e}")
    if d.label_smoothing and not set(types) & set(SMOOTHED):
        p.append(
            f"dpo.label_smoothing={d.label_smoothing} has no effect on {', '.join(types)}; "
            f"it applies to {', '.join(SMOOTHED)}"
        )
    if kto and d.precompute_ref_log_probs and d.loss_type == "kto":
        p.append(
            "dpo.precompute_ref_log_probs with loss_type kto: the KL estimate's mismatched "
            "pairs change with every batch and need the reference each step; set it false"
        )
    if d.reference_free and d.precompute_ref_log_probs:
        p.append("dpo.reference_free and dpo.precompute_ref_log_probs exclude each other")
    p.choice(cfg, "dpo.truncation_mode", TRUNCATION_MODES)
    for key in ("dpo.max_length", "dpo.max_prompt_length", "dpo.max_completion_length"):
        p.at_least(cfg, key, 1, optional=True)
    _check_common(cfg, p, num_devices, 1 if kto else 2)
    if p:
        raise ConfigError(p)


SFT = Schema(SFTConfig, RENAMED, IGNORED, normalize_sft, check_sft)
DPO = Schema(DPOConfig, RENAMED, IGNORED, normalize_dpo, check_dpo)
