"""verl keys that jaxrl does not hold as its own, so that verl command lines still load.

Three kinds, checked in this order after jaxrl's own keys:

- `RENAMED`: verl keys whose concept jaxrl has under another name; the value is moved there and
  a notice is logged (`actor_rollout_ref.actor.fsdp_config.model_dtype=bf16` sets
  `actor_rollout_ref.actor.model_dtype`).
- `IGNORED`: engine settings of vLLM, FSDP, Megatron, Ray or profilers that change speed or
  memory but not results, or that name a feature through a key jaxrl has no use for. They are
  dropped with a warning that says why. Where a value would change results and jaxrl cannot
  honour it, the entry lists the values it accepts; any other value is an error naming the
  jaxrl alternative, never a silent difference.
- anything else is an unknown key: an error naming the closest valid key.

Patterns are `fnmatch` patterns over dotted keys (`*` also matches dots).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_ANY: tuple[Any, ...] | None = None  # any value is accepted (and ignored)

RENAMED: dict[str, str] = {
    "actor_rollout_ref.actor.fsdp_config.model_dtype": "actor_rollout_ref.actor.model_dtype",
    "actor_rollout_ref.actor.fsdp_config.dtype": "actor_rollout_ref.actor.dtype",
    "actor_rollout_ref.ref.fsdp_config.model_dtype": "actor_rollout_ref.ref.model_dtype",
    "actor_rollout_ref.ref.fsdp_config.dtype": "actor_rollout_ref.ref.dtype",
    "critic.model.fsdp_config.model_dtype": "critic.model_dtype",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "actor_rollout_ref.actor.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": (
        "actor_rollout_ref.actor.optimizer_offload"
    ),
    "actor_rollout_ref.ref.fsdp_config.param_offload": "actor_rollout_ref.ref.param_offload",
    "critic.model.fsdp_config.param_offload": "critic.param_offload",
    "critic.model.fsdp_config.optimizer_offload": "critic.optimizer_offload",
    "critic.fsdp.param_offload": "critic.param_offload",
    "critic.fsdp.optimizer_offload": "critic.optimizer_offload",
    "critic.fsdp.model_dtype": "critic.model_dtype",
    "critic.fsdp.dtype": "critic.dtype",
    "actor_rollout_ref.actor.optim.clip_grad": "actor_rollout_ref.actor.grad_clip",
    "critic.optim.clip_grad": "critic.grad_clip",
    "actor_rollout_ref.actor.optim.warmup_style": "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler_type",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": "mesh.ep",
    **{
        f"actor_rollout_ref.{role}.{engine}.router_replay.{key}": (
            f"actor_rollout_ref.{role}.router_replay.{key}"
        )
        for role in ("actor", "ref")
        for engine in ("megatron", "veomni")
        for key in ("mode", "record_file", "replay_file")
    },
    # Megatron's MoE settings (verl passes them through override_transformer_config)
    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_expert_capacity_factor": (
        "actor_rollout_ref.model.moe_capacity_factor"
    ),
    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff": (
        "actor_rollout_ref.actor.moe_aux_loss_coeff"
    ),
    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_z_loss_coeff": (
        "actor_rollout_ref.actor.moe_z_loss_coeff"
    ),
    # verl 0.9.1's new `reward` group, mapped onto the classic groups jaxrl keeps.
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.custom_reward_function.reward_kwargs": "custom_reward_function.reward_kwargs",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_model.enable_resource_pool": "reward_model.enable_resource_pool",
    "reward.reward_model.n_gpus_per_node": "reward_model.n_gpus_per_node",
    "reward.reward_model.nnodes": "reward_model.nnodes",
}

_VLLM = "a vLLM/SGLang engine setting; jaxrl generates with its own jitted engine"
_FSDP = "an FSDP/Megatron engine setting; jaxrl shards over the `mesh.*` axes"
_TORCH = "a PyTorch/CUDA performance switch with no JAX counterpart (XLA compiles every step)"
_RAY = "a Ray/cluster setting; jaxrl is one JAX program (see launch/ for several hosts)"
_PROFILER = "a verl profiler setting; use JAX's profiler (jax.profiler) instead"
_DEPRECATED_MICRO = "deprecated in verl; use the matching `*_per_gpu` key (per device in jaxrl)"
_MEGATRON_LORA = (
    "Megatron's LoRA group; jaxrl takes verl's FSDP keys: model.lora_rank, lora_alpha, "
    "target_modules, exclude_modules, lora_adapter_path"
)


@dataclass(frozen=True)
class Ignored:
    """A verl key jaxrl drops.

    Attributes:
        reason: Why it has no effect, and what to use instead.
        accepted: Values that are safe to ignore; None: any value.
    """

    reason: str
    accepted: tuple[Any, ...] | None = _ANY


IGNORED: dict[str, Ignored] = {
    # rollout (vLLM / SGLang)
    "actor_rollout_ref.rollout.name": Ignored(_VLLM),
    "actor_rollout_ref.rollout.mode": Ignored(_VLLM),
    "actor_rollout_ref.rollout.gpu_memory_utilization": Ignored(
        _VLLM + " (the KV cache is sized exactly from max_num_seqs and the lengths)"
    ),
    "actor_rollout_ref.rollout.data_parallel_size": Ignored(
        "every device outside tensor_model_parallel_size is a generation replica in jaxrl"
    ),
    **{
        f"actor_rollout_ref.rollout.{k}": Ignored(_VLLM)
        for k in (
            "enforce_eager",
            "free_cache_engine",
            "cudagraph_capture_sizes",
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "load_format",
            "layered_summon",
            "disable_log_stats",
            "engine_kwargs*",
            "max_num_batched_tokens",
            "skip_tokenizer_init",
            "scheduling_policy",
            "multi_stage_wake_up",
            "nnodes",
            "n_gpus_per_node",
            "full_determinism",
            "checkpoint_engine.*",
            "trace.*",
            "prometheus.*",
            "qat",
            "mtp*",
            "moe_load_balance_metrics_interval",
            "router_config_path",
            "disaggregation.*",
        )
    },
    "actor_rollout_ref.rollout.multi_turn.function_tool_path": Ignored(
        "@function_tool files are not supported yet: declare the tools in tool_config_path "
        "(a BaseTool class each)",
        (None,),
    ),
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template": Ignored(
        "jaxrl trains on the token ids the policy produced (verl's default)", (False,)
    ),
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": Ignored(
        "jaxrl's tool turns are the chat template's own tokens; tests check the whole "
        "trajectory against the template"
    ),
    "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts": Ignored(
        "use actor_rollout_ref.rollout.n", (None,)
    ),
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": Ignored(
        "interactions (a simulated user) are not implemented in jaxrl yet", (None,)
    ),
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": Ignored(
        "custom agent loops are not supported yet: rows choose single_turn_agent or tool_agent",
        (None,),
    ),
    "actor_rollout_ref.rollout.agent.custom_async_server.*": Ignored(_VLLM),
    "actor_rollout_ref.rollout.agent.agent_loop_manager_class": Ignored(
        "jaxrl runs its agent loop in the trainer process", (None,)
    ),
    "actor_rollout_ref.rollout.disaggregation.enabled": Ignored(
        "prefill/decode disaggregation is a vLLM feature", (False,)
    ),
    "actor_rollout_ref.rollout.expert_parallel_size": Ignored(
        "jaxrl's rollout keeps every expert on each tensor-parallel group (mesh.ep splits the "
        "experts for training only)",
        (1,),
    ),
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": Ignored(
        "pipeline parallelism is not used in jaxrl", (1,)
    ),
    "actor_rollout_ref.rollout.logprobs_mode": Ignored(
        "jaxrl returns processed log-probs (after temperature, top-k and top-p)",
        ("processed_logprobs",),
    ),
    "actor_rollout_ref.rollout.quantization*": Ignored(
        "quantized rollout is not implemented in jaxrl; use rollout.dtype", (None,)
    ),
    # FSDP / Megatron / torch engine settings of every role
    "*.fsdp_config.*": Ignored(_FSDP),
    "critic.fsdp.*": Ignored(_FSDP),
    "*.megatron.*": Ignored(_FSDP),
    "*.strategy": Ignored(_FSDP),
    "*.ulysses_sequence_parallel_size": Ignored(
        "jaxrl shards the sequence over the mesh axis `sp`: set mesh.sp instead", (1,)
    ),
    "*.use_torch_compile": Ignored(_TORCH),
    "*.use_fused_kernels": Ignored(_TORCH),
    "*.fused_kernel_options.*": Ignored(_TORCH),
    "*.use_liger": Ignored(_TORCH),
    "*.entropy_checkpointing": Ignored(_TORCH),
    "*.pad_to_length*": Ignored(_TORCH),
    "*.enable_activation_offload": Ignored(_TORCH),
    "*.tiled_mlp.*": Ignored(_TORCH),
    "*.use_shm": Ignored(_TORCH),
    "*.profiler.*": Ignored(_PROFILER),
    "global_profiler.*": Ignored(_PROFILER),
    "*.rollout_n": Ignored("derived by verl from actor_rollout_ref.rollout.n"),
    "actor_rollout_ref.actor.use_remove_padding": Ignored(
        "set actor_rollout_ref.model.use_remove_padding (verl derives this key from it)"
    ),
    "actor_rollout_ref.actor.freeze_vision_tower": Ignored("no vision models in jaxrl yet"),
    "actor_rollout_ref.actor.use_prefix_grouper": Ignored(
        "prefix grouping is not implemented in jaxrl", (False,)
    ),
    "*.qat.enable": Ignored("quantization-aware training is not implemented in jaxrl", (False,)),
    "*.qat.*": Ignored(_TORCH),
    "*.checkpoint.strict": Ignored("jaxrl always restores strictly"),
    "actor_rollout_ref.actor.ppo_micro_batch_size": Ignored(_DEPRECATED_MICRO, (None,)),
    "critic.ppo_micro_batch_size": Ignored(_DEPRECATED_MICRO, (None,)),
    "critic.forward_micro_batch_size": Ignored(_DEPRECATED_MICRO, (None,)),
    "*.log_prob_micro_batch_size": Ignored(_DEPRECATED_MICRO, (None,)),
    # optimizer
    "*.optim.optimizer_impl": Ignored("jaxrl's optimizers are optax's"),
    "*.optim.zero_indexed_step": Ignored(
        "jaxrl's schedules count steps from 0, as verl's default", (True,)
    ),
    "*.optim.override_optimizer_config": Ignored(
        "extra optimizer arguments are not supported; use the optim.* keys", (None,)
    ),
    # model
    "*.model.hf_config_path": Ignored("put config.json in model.path", (None,)),
    "*.model.external_lib": Ignored(
        "jaxrl implements its model families itself (llama, qwen2, qwen3, mistral, qwen2_moe, "
        "qwen3_moe, mixtral, gemma2, gemma3_text)",
        (None,),
    ),
    "*.model.lora.rank": Ignored(_MEGATRON_LORA, (0,)),
    "*.model.lora.adapter_path": Ignored(_MEGATRON_LORA, (None,)),
    "*.model.lora.*": Ignored(_MEGATRON_LORA),
    "*.model.mtp.enable": Ignored("multi-token prediction is not implemented in jaxrl", (False,)),
    "*.model.mtp.*": Ignored("multi-token prediction is not implemented in jaxrl"),
    # data
    **{
        f"data.{k}": Ignored("a torch DataLoader or multimodal setting with no use in jaxrl")
        for k in (
            "dataloader_num_workers",
            "return_raw_input_ids",
            "return_raw_chat",
            "return_full_prompt",
            "filter_overlong_prompts_workers",
            "image_key",
            "video_key",
            "audio_key",
            "image_patch_size",
            "return_multi_modal_inputs",
            "mm_processor_kwargs*",
        )
    },
    **{
        f"data.{k}": Ignored(
            "jaxrl measures and renders prompts with the tools of "
            "actor_rollout_ref.rollout.multi_turn.tool_config_path"
        )
        for k in ("tool_config_path", "function_tool_path")
    },
    "data.custom_cls.path": Ignored("custom torch Dataset classes cannot be used", (None,)),
    "data.custom_cls.name": Ignored("custom torch Dataset classes cannot be used"),
    # trainer / cluster
    "actor_rollout_ref.hybrid_engine": Ignored(
        "jaxrl always colocates actor and rollout and reshards under jit", (True,)
    ),
    "actor_rollout_ref.nccl_timeout": Ignored(_RAY),
    "trainer.device": Ignored(
        "JAX picks the platform: install jaxrl[gpu] or jaxrl[tpu] for accelerators"
    ),
    "trainer.ray_wait_register_center_timeout": Ignored(_RAY),
    "trainer.esi_redundant_time": Ignored(_RAY),
    "trainer.del_local_ckpt_after_load": Ignored("jaxrl never deletes checkpoints on load"),
    "trainer.default_hdfs_dir": Ignored("HDFS upload is not implemented in jaxrl", (None,)),
    "trainer.checkpoint_callback_class": Ignored("not supported in jaxrl", (None,)),
    "trainer.use_v1": Ignored("verl's worker generations do not apply to jaxrl"),
    "trainer.v1.*": Ignored("verl's worker generations do not apply to jaxrl"),
    "trainer.use_legacy_worker_impl": Ignored("verl's worker generations do not apply to jaxrl"),
    "ray_kwargs.*": Ignored(_RAY),
    "ray_init.*": Ignored(_RAY),
    "transfer_queue.enable": Ignored("jaxrl has no transfer queue", (False,)),
    "transfer_queue.*": Ignored("jaxrl has no transfer queue"),
    # distillation: verl's dataclass markers (the teachers' own, `teacher_models.*`, are free)
    "distillation._target_": Ignored("verl's dataclass marker; jaxrl's schema is its own"),
    "distillation.distillation_loss._target_": Ignored(
        "verl's dataclass marker; jaxrl's schema is its own"
    ),
    # algorithm
    "algorithm.filter_groups.max_inflight_gen_batches": Ignored(
        "verl's v1 asynchronous replay buffer's concurrency; jaxrl generates one batch at a time"
    ),
    # rewards
    **{
        f"reward_model.{k}": Ignored(_RAY)
        for k in (
            "num_workers",
            "launch_reward_fn_async",
            "use_dynamic_bsz",
            "forward_max_token_len_per_gpu",
            "reward_loop_*",
            "rollout.*",
            "model.use_remove_padding",
            "model.use_fused_kernels",
        )
    },
    "reward.num_workers": Ignored(_RAY),
    "reward.reward_manager.source": Ignored("jaxrl's reward managers are built in", ("register",)),
    "reward.reward_manager.module.*": Ignored("custom reward manager classes are not supported"),
    "reward.reward_model.rollout.*": Ignored(_VLLM),
    "*sandbox_fusion.url": Ignored("sandboxed code execution is not available in jaxrl", (None,)),
    "*sandbox_fusion.*": Ignored("sandboxed code execution is not available in jaxrl"),
}


def ignored_entry(key: str, table: Mapping[str, Ignored] | None = None) -> Ignored | None:
    """The entry of `table` (default `IGNORED`) for `key`, or None.

    Where several patterns match (`*.qat.enable` and `*.qat.*`), one that restricts the
    accepted values wins, so a broad "any value" pattern never hides a restriction.
    """
    table = IGNORED if table is None else table
    matches = [e for p, e in table.items() if fnmatch.fnmatchcase(key, p)]
    restrictive = [e for e in matches if e.accepted is not None]
    return (restrictive or matches or [None])[0]
