"""The typed configuration tree: verl's groups, keys and defaults, plus jaxrl's `mesh` group.

Every class is a frozen dataclass. `jaxrl.config.load_config` builds an OmegaConf structured
config from `Config`, merges a YAML file and `key=value` overrides into it (OmegaConf checks the
types), resolves interpolations such as `${data.max_prompt_length}` and returns an immutable
`Config` whose lists are tuples.

Each class documents its keys in an `Attributes:` section; `docs/config.md` is generated from
these sections (`python -m jaxrl.config.reference`), and a test keeps the two in step. Keys marked
*jaxrl* have no verl counterpart; everything else has verl 0.9.1's name, meaning and default
unless its entry says how and why it differs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import II, MISSING

from jaxrl.config.mesh import ROLLOUT_RULES, TRAIN_RULES

# ----------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class DataConfig:
    """`data.*`: the RL prompt dataset (verl-format parquet).

    Attributes:
        tokenizer: Tokenizer path; null uses the actor's tokenizer.
        train_files: Parquet file or list of files with verl's columns (`data_source`, `prompt`,
            `ability`, `reward_model`, `extra_info`).
        val_files: Parquet file or list of files for validation.
        train_max_samples: Use at most this many training rows (-1: all).
        val_max_samples: Use at most this many validation rows (-1: all).
        prompt_key: Column holding the chat messages of the prompt.
        reward_fn_key: Column that selects the rule-based scorer (usually `data_source`).
        max_prompt_length: Prompt length in tokens after the chat template (left-padded to it).
        max_response_length: Longest response in tokens.
        train_batch_size: Prompts per training step (before `rollout.n` repetition).
        gen_batch_size: Prompts per generation batch of dynamic sampling
            (`algorithm.filter_groups`); null: `train_batch_size`. Steps default to its
            batches per epoch x `total_epochs`; a step draws as many as it needs, so a run
            may pass over the data more often than verl's recipe, which stops after
            `total_epochs` passes.
        val_batch_size: Prompts per validation generation batch; null: the whole validation set.
        shuffle: Shuffle the training rows each epoch.
        seed: Seed of the training shuffle; null means 1, as in verl.
        validation_shuffle: Shuffle the validation rows.
        filter_overlong_prompts: Drop rows whose templated prompt is longer than
            `max_prompt_length` (the count is logged) instead of applying `truncation`.
        truncation: What to do with an overlong prompt: `error`, `left`, `right` or `middle`.
        apply_chat_template_kwargs: Extra keyword arguments for the tokenizer's
            `apply_chat_template` (e.g. `{enable_thinking: false}`).
        trust_remote_code: Allow tokenizers with custom code.
        skip_bad_rows: *jaxrl*. Skip malformed rows (missing column, wrong type, empty prompt,
            no ground truth) and log how many, instead of stopping with an error that names the
            file, row and column.
    """

    tokenizer: str | None = None
    train_files: Any = "~/data/rlhf/gsm8k/train.parquet"
    val_files: Any = "~/data/rlhf/gsm8k/test.parquet"
    train_max_samples: int = -1
    val_max_samples: int = -1
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    gen_batch_size: int | None = None
    val_batch_size: int | None = None
    shuffle: bool = True
    seed: int | None = None
    validation_shuffle: bool = False
    filter_overlong_prompts: bool = False
    truncation: str = "error"
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    skip_bad_rows: bool = False


# ---------------------------------------------------------------------------------- model, optim


@dataclass(frozen=True)
class ModelConfig:
    """`actor_rollout_ref.model.*` and `critic.model.*`: a HuggingFace checkpoint.

    Attributes:
        path: A local folder with `config.json` and safetensors, or a hub id already in the
            local HF cache (nothing is downloaded at run time).
        tokenizer_path: Tokenizer folder; null uses `path`.
        trust_remote_code: Allow checkpoints and tokenizers with custom code.
        custom_chat_template: A Jinja chat template that replaces the tokenizer's.
        override_config: Entries that override the checkpoint's `config.json`.
        enable_gradient_checkpointing: Rematerialise each layer's activations in the backward
            pass (jax.checkpoint around the scanned layer).
        remat_policy: *jaxrl*. What a checkpointed layer keeps: `full` keeps only the layer
            input; `save_dots` also keeps matmul outputs. Used when
            `enable_gradient_checkpointing` is true.
        use_remove_padding: verl's padding-removal switch. The RL trainer does not pack
            sequences: it trims every micro-batch to its longest row (bucketed), whatever this
            says. The SFT trainer packs its sequences into rows of `data.max_length` tokens
            (segment ids keep them apart) when it is true.
        attention_impl: *jaxrl*. `jaxrl.kernels.attention`'s implementation: `auto` (ring over
            `mesh.sp` > 1; Pallas on a GPU; blockwise for long sequences on a CPU; else
            dense), `reference`, `blockwise`, `pallas_gpu` or `ring` (needs `mesh.sp` > 1).
        moe_capacity_factor: *jaxrl*. A mixture of experts under expert parallelism
            (`mesh.ep` > 1): each expert takes at most ceil(c x tokens x top_k / experts) of a
            device's (token, choice) pairs, the rest are dropped
            (`actor/moe_dropped_token_fraction`); null: dropless (Megatron's
            `moe_expert_capacity_factor`). Generation is always dropless.
        lora_rank: LoRA adapters' rank r; 0 trains the whole model. With LoRA the base stays
            frozen in `model_dtype`, only the adapters (float32) are trained and moved to the
            rollout after the first step, and the reference policy is the base without them.
        lora_alpha: The adapters' scale numerator: the update is (lora_alpha / r) · x A B.
        target_modules: The projections LoRA adapts: `all-linear` (q, k, v, o, gate, up,
            down), a list of module names (`q_proj`, ..., `down_proj`; PEFT's matching), or a
            regex over full module names (`model.layers.{i}.self_attn.q_proj`). A mixture of
            experts' modules are the attention's and Qwen2-MoE's shared expert's
            (`mlp.shared_expert.gate_proj`, ...); its routed experts are parameters
            (`target_parameters`). PEFT's all-linear also adapts Qwen2-MoE's
            `shared_expert_gate`, and on Qwen3-MoE and Mixtral the experts (gate_up_proj at
            rank 2r) and the router: jaxrl does not (it warns).
        target_parameters: A mixture of experts' expert parameters LoRA adapts (PEFT's
            `target_parameters`): a list of names matched against the full names
            `model.layers.{i}.mlp.experts.{gate_up_proj,down_proj}` (equal, or their end after
            a `.`: `mlp.experts.gate_up_proj`, `experts.down_proj`, `down_proj`), each expert
            with its own rank-r A and B; the fused gate_up_proj's adapter serves gate and up
            (one A, B of width 2F). null: none (a dense model takes none).
        exclude_modules: Modules left without adapters (a list of names or a regex, as
            `target_modules`).
        lora_adapter_path: A PEFT adapter folder to start from (its `adapter_config.json`
            sets rank, alpha and targets); turns LoRA on by itself, as in verl.
    """

    path: str = MISSING
    tokenizer_path: str | None = None
    trust_remote_code: bool = False
    custom_chat_template: str | None = None
    override_config: dict[str, Any] = field(default_factory=dict)
    enable_gradient_checkpointing: bool = True
    remat_policy: str = "full"
    use_remove_padding: bool = True
    attention_impl: str = "auto"
    moe_capacity_factor: float | None = None
    lora_rank: int = 0
    lora_alpha: float = 16
    target_modules: Any = "all-linear"
    exclude_modules: Any = None
    target_parameters: Any = None
    lora_adapter_path: str | None = None


@dataclass(frozen=True)
class OptimConfig:
    """`*.optim.*`: the optax optimizer and learning-rate schedule.

    Attributes:
        optimizer: `AdamW` or `Adam` (optax.adamw / optax.adam).
        lr: Peak learning rate.
        lr_warmup_steps: Linear warm-up steps; -1 derives them from `lr_warmup_steps_ratio`.
        lr_warmup_steps_ratio: Warm-up steps as a fraction of the total training steps.
        total_training_steps: Steps of the schedule; -1 takes the trainer's total.
        weight_decay: Decoupled weight decay (AdamW).
        betas: Adam's (beta1, beta2).
        eps: *jaxrl*. Adam's epsilon (torch.optim's default).
        lr_scheduler_type: `constant` or `cosine` (cosine decays to `min_lr_ratio * lr`).
        min_lr_ratio: Floor of the cosine schedule as a fraction of `lr`.
        num_cycles: Cosine cycles over the schedule (0.5: one half-wave down to the floor).
    """

    optimizer: str = "AdamW"
    lr: float = 1e-6
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    total_training_steps: int = -1
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_scheduler_type: str = "constant"
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5


@dataclass(frozen=True)
class CheckpointConfig:
    """`*.checkpoint.*`: what an actor or critic checkpoint holds.

    Attributes:
        save_contents: Parts written: `model`, `optimizer`, `extra` (step, RNG, data state).
        load_contents: Parts restored on resume.
        async_save: Write checkpoints in the background while training goes on.
    """

    save_contents: tuple[str, ...] = ("model", "optimizer", "extra")
    load_contents: tuple[str, ...] = ("model", "optimizer", "extra")
    async_save: bool = False


# ----------------------------------------------------------------------------------------- actor


@dataclass(frozen=True)
class PolicyLossConfig:
    """`actor_rollout_ref.actor.policy_loss.*`: the policy-loss function and its parameters.

    Attributes:
        loss_mode: Name in `jaxrl.core_algos`' policy-loss registry (`vanilla`, `gspo`, ...).
        clip_cov_ratio: Fraction of tokens clipped by `clip_cov`.
        clip_cov_lb: Lower covariance bound of `clip_cov`.
        clip_cov_ub: Upper covariance bound of `clip_cov`.
        kl_cov_ratio: Fraction of tokens given the KL penalty by `kl_cov`.
        ppo_kl_coef: KL coefficient of `kl_cov`.
        dro_beta: Regularisation strength of `dro`; null uses verl's default.
    """

    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


@dataclass(frozen=True)
class RouterReplayConfig:
    """`actor_rollout_ref.{actor,ref}.router_replay.*`: routing replay for a mixture of
    experts (verl's Megatron/VeOmni engine key, `*.megatron.router_replay`): which experts
    the training forwards use.

    Attributes:
        mode: `disabled` (each forward routes natively), `R2` (the actor's old-log-prob pass
            records its routes and the update replays them), `R3` (the rollout records the
            routes it sampled with, `rollout.enable_rollout_routing_replay`, and the
            old-log-prob pass, the update and a reference set to R3 replay them). Replay
            fixes the experts; their weights come from the current router (which keeps its
            gradient). The ref takes `disabled` or `R3`.
        record_file: verl's dump of the routes to a file: not supported (null).
        replay_file: verl's replay of routes from a file: not supported (null).
    """

    mode: str = "disabled"
    record_file: str | None = None
    replay_file: str | None = None


@dataclass(frozen=True)
class ActorConfig:
    """`actor_rollout_ref.actor.*`: the policy's PPO update.

    Attributes:
        ppo_mini_batch_size: Prompts per optimizer step (times `rollout.n` sequences).
        ppo_micro_batch_size_per_gpu: Sequences per device per forward/backward pass; the
            mini-batch is accumulated over micro-batches. null: the device's whole share of
            the mini-batch in one pass.
        use_dynamic_bsz: Form micro-batches by a token budget instead of a sequence count.
        ppo_max_token_len_per_gpu: Token budget per device per micro-batch with
            `use_dynamic_bsz`.
        ppo_epochs: Passes over each batch.
        shuffle: Shuffle sequences between mini-batches.
        data_loader_seed: Seed of that shuffle.
        clip_ratio: PPO clip range (used when `clip_ratio_low`/`high` are not set apart).
        clip_ratio_low: Lower clip range (1 - low).
        clip_ratio_high: Upper clip range (1 + high).
        clip_ratio_c: Dual-clip constant for negative advantages (must be > 1).
        tau_pos: SAPO temperature for positive advantages.
        tau_neg: SAPO temperature for negative advantages.
        policy_loss: The policy-loss function.
        loss_agg_mode: `token-mean`, `seq-mean-token-sum`, `seq-mean-token-mean`,
            `seq-mean-token-sum-norm` or `token-sum`.
        loss_scale_factor: Constant divisor for `seq-mean-token-sum-norm`; null: the response
            length.
        entropy_coeff: Weight of the entropy bonus.
        calculate_entropy: Compute the entropy metric even when `entropy_coeff` is 0.
        calculate_sum_pi_squared: Compute sum_v pi_v^2 per token in the old-log-prob pass:
            required by the optimal-token-baseline estimators (as in verl), the only ones
            that read it (jaxrl computes it only for them).
        use_kl_loss: Add a KL(actor || reference) term to the loss (GRPO style).
        kl_loss_coef: Weight of that term.
        kl_loss_type: KL estimator of that term (`kl`, `abs`, `mse`, `low_var_kl`, ... and `+`
            variants).
        grad_clip: Clip the global gradient norm to this value.
        moe_aux_loss_coeff: Weight of the mixture-of-experts load-balancing loss (HF's
            `load_balancing_loss_func` over the micro-batch's real tokens; Megatron's name). 0,
            as verl runs RL: the loss is still logged (`actor/load_balancing_loss`).
        moe_z_loss_coeff: Weight of the router z-loss (mean logsumexp(router logits)^2;
            Megatron's name), logged as `actor/z_loss`.
        router_replay: A mixture of experts' routing replay (`RouterReplayConfig`).
        entropy_from_logits_with_chunking: Compute log-probs and entropy in sequence chunks so
            the full [B, T, V] float32 logits never exist at once.
        entropy_from_logits_chunk_size: Tokens per chunk for the above.
        model_dtype: Parameter (master-weight) dtype: `fp32`/`float32` or `bf16`/`bfloat16`
            (verl's `fsdp_config.model_dtype`).
        dtype: Compute dtype of the forward and backward pass (verl's `fsdp_config.dtype`).
        param_offload: Keep the parameters in host memory (pinned) between the passes that
            use them: the weight sync to the rollout, the old-log-prob pass and the update
            (verl's `fsdp_config.param_offload`).
        optimizer_offload: Keep the optimizer state in host memory except during the update
            (verl's `fsdp_config.optimizer_offload`).
        optim: Optimizer and schedule.
        checkpoint: Checkpoint contents.
    """

    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    data_loader_seed: int = 42
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    calculate_entropy: bool = False
    calculate_sum_pi_squared: bool = False
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: int = 2048
    model_dtype: str = "fp32"
    dtype: str = "bfloat16"
    param_offload: bool = False
    optimizer_offload: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass(frozen=True)
class RefConfig:
    """`actor_rollout_ref.ref.*`: the frozen reference policy (for KL loss or KL in reward).

    Attributes:
        log_prob_micro_batch_size_per_gpu: Sequences per device per log-prob pass; null: all
            of the device's share at once.
        log_prob_use_dynamic_bsz: Form log-prob micro-batches by token budget.
        log_prob_max_token_len_per_gpu: Token budget per device with dynamic batch size.
        model_dtype: Parameter dtype of the reference copy.
        dtype: Compute dtype of the reference forward pass.
        param_offload: Keep the reference parameters in host memory (pinned) except during
            its log-prob pass (verl's `fsdp_config.param_offload`).
        router_replay: A mixture of experts' routing replay in the reference pass:
            `disabled` or `R3` (the rollout's routes; `RouterReplayConfig`).
    """

    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_use_dynamic_bsz: bool = II("actor_rollout_ref.actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int = II("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    model_dtype: str = "fp32"
    dtype: str = "bfloat16"
    param_offload: bool = False
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)


# --------------------------------------------------------------------------------------- rollout


@dataclass(frozen=True)
class SamplingConfig:
    """`actor_rollout_ref.rollout.val_kwargs.*`: sampling for validation (greedy by default).

    Attributes:
        temperature: Softmax temperature (0 with `do_sample: false` is greedy).
        top_k: Keep the k most likely tokens (-1: off).
        top_p: Nucleus sampling mass (1.0: off).
        n: Responses per validation prompt.
        do_sample: Sample (true) or take the argmax (false).
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1
    do_sample: bool = False


@dataclass(frozen=True)
class MultiTurnConfig:
    """`actor_rollout_ref.rollout.multi_turn.*`: agentic rollouts, where the policy calls tools
    and reads their answers over several turns (`jaxrl.agent`). Only the policy's tokens are
    trained on (`loss_mask`); a tool's answer is attended to, not trained on.

    Attributes:
        enable: Run rows through their agent loop (`agent_name`; `tool_agent` calls tools).
        max_assistant_turns: Turns the policy may take; null: no limit but the response length.
        max_user_turns: Tool (user) turns; null: no limit but the response length.
        max_parallel_calls: Tool calls of one turn that run (the rest are dropped).
        max_tool_response_length: Characters of a tool's answer kept.
        tool_response_truncate_side: Where a long answer is cut: `left`, `middle`, `right`.
        tool_config_path: The tool YAML (verl's: `tools: [{class_name, config,
            tool_schema}]`); null: no tools.
        format: The tool-call format: `hermes` (`<tool_call>{json}</tool_call>`, Qwen2.5/3).
        tool_timeout: *jaxrl*. Seconds a tool call may run before its answer says it timed
            out (the trajectory goes on).
        tool_workers: *jaxrl*. Threads running plain (not async) tool methods at once.
        decode_chunk: *jaxrl*. Tokens decoded between two looks at the tools: a finished tool
            call's answer joins the batch within this many decode steps.
    """

    enable: bool = False
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_config_path: str | None = None
    format: str = "hermes"
    tool_timeout: float = 30.0
    tool_workers: int = 8
    decode_chunk: int = 16


@dataclass(frozen=True)
class AgentConfig:
    """`actor_rollout_ref.rollout.agent.*`: which agent loop runs each row.

    Attributes:
        default_agent_loop: The loop of rows without an `agent_name` column (or with a null
            one): `single_turn_agent` (one turn, no tools) or `tool_agent`.
        num_workers: verl's agent-loop worker count; jaxrl runs every loop in the trainer
            process (accepted, unused).
        external: jaxrl's key (verl has none): `module:function` or `path/to/file.py:function`,
            an `async def f(episode) -> reward` that runs one episode of a row with any
            OpenAI client against `episode.base_url` and `episode.api_key`; the trainer serves
            the policy over the OpenAI API during each rollout, records the episode's calls
            and trains on them in place of the agent loop (`jaxrl.serve.external`; needs
            `multi_turn.enable=true`). It returns a number, or a dict with `score` (and more
            values, validated as a reward function's). null: jaxrl's own agent loop. Its
            conversations' cache is `bucket(prompt_length + response_length) +
            response_length` cells (`rollout.max_model_len` unset): a later call is the
            whole conversation so far, prefilled again.
        external_timeout: Seconds an episode may take; one that takes longer is cancelled
            (its recorded calls kept, reward 0, `agent/external/timeouts`).
        external_port: The port of the trainer's server on 127.0.0.1 (0: a free one); each
            process of a run serves its own rows, process i on this port + i.
    """

    default_agent_loop: str = "single_turn_agent"
    num_workers: int = 8
    external: str | None = None
    external_timeout: float = 600.0
    external_port: int = 0


@dataclass(frozen=True)
class RolloutConfig:
    """`actor_rollout_ref.rollout.*`: jaxrl's jitted generation engine (verl's vLLM/SGLang role).

    Attributes:
        temperature: Softmax temperature of sampling; log-probs use the same temperature.
        top_k: Keep the k most likely tokens (-1: off).
        top_p: Nucleus sampling mass (1.0: off).
        do_sample: Sample (true) or take the argmax (false).
        n: Responses per prompt (GRPO group size), interleaved as in verl.
        over_sample_rate: Training rollouts stop once int(rows x (1 - over_sample_rate)) rows
            have finished; the slowest rows come back empty (response mask 0: no loss, no
            advantage; `response/aborted_ratio` counts them). verl's early abort of the
            slowest requests; 0: off. Single-turn rollouts only. An aborted row is still
            scored (as an empty response) and counts in its group's statistics, as in the
            SGLang rollout that had this key (verl 0.9.1 reads it nowhere); with fewer
            `max_num_seqs` slots than rows, rows still queued are aborted in queue order.
        enable_rollout_routing_replay: A mixture of experts: record the experts every prompt
            and response token used in every layer as the rollout generated, for routing
            replay (`actor.router_replay.mode=R3`). Single-turn rollouts of one process.
            A mini-batch whose rows were all aborted has no loss tokens (NaN loss).
        ignore_eos: Keep generating past EOS, with EOS tokens left unmasked.
        prompt_length: Prompt length the engine is compiled for.
        response_length: Longest response the engine generates.
        dtype: dtype of the rollout copy of the weights and of the KV cache.
        tensor_model_parallel_size: Size of the `tp` axis of the rollout mesh; every other
            device factor is a data-parallel generation replica (verl's default is 2; jaxrl's is
            1 so that a single device works).
        max_num_seqs: Sequences decoded at once (KV-cache slots of continuous batching).
            Under `async_training.mode=fully_async`, at most n x the groups its staleness
            gate lets run at once, rounded up to a multiple of the rollout's dp (the cache
            holds every slot's `max_model_len` tokens).
        max_model_len: Cells of a multi-turn conversation's KV cache (its prompt padded to
            a length bucket, then every response token); null: the prompt length's bucket
            (`jaxrl.data.bucket`) + the response length, within the model's context.
        decode_backend: *jaxrl*. How the decode step runs: `xla` (the model's own step on
            any platform), `cpu_kernels` (jaxrl's C++ CPU kernels: float32 on one CPU device),
            or `auto` (the kernels where they apply on an AVX-512 CPU, else xla).
        calculate_log_probs: Return the log-probs of the sampled tokens.
        seed: Base seed of the sampler; every step folds in the step number.
        log_prob_micro_batch_size_per_gpu: Sequences per device per old-log-prob pass; null:
            all of the device's share at once.
        log_prob_use_dynamic_bsz: Form those micro-batches by token budget.
        log_prob_max_token_len_per_gpu: Token budget per device with dynamic batch size.
        val_kwargs: Sampling for validation.
        multi_turn: Agentic multi-turn rollouts with tools.
        agent: The agent loop of each row.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    n: int = 1
    over_sample_rate: float = 0.0
    enable_rollout_routing_replay: bool = False
    ignore_eos: bool = False
    prompt_length: int = II("data.max_prompt_length")
    response_length: int = II("data.max_response_length")
    dtype: str = "bfloat16"
    tensor_model_parallel_size: int = 1
    max_num_seqs: int = 256
    max_model_len: int | None = None
    decode_backend: str = "auto"
    calculate_log_probs: bool = True
    seed: int = 42
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_use_dynamic_bsz: bool = II("actor_rollout_ref.actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int = II("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    """`actor_rollout_ref.*`: the policy model and its three roles.

    Attributes:
        model: The policy checkpoint.
        actor: The PPO update.
        ref: The reference policy.
        rollout: Generation.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


# ---------------------------------------------------------------------------------------- critic


@dataclass(frozen=True)
class CriticModelConfig(ModelConfig):
    """`critic.model.*`: the value model's checkpoint.

    Attributes:
        path: Checkpoint folder; defaults to the actor's (a value head is added on top of a
            causal LM, as verl does).
    """

    path: str = II("actor_rollout_ref.model.path")


@dataclass(frozen=True)
class CriticOptimConfig(OptimConfig):
    """`critic.optim.*`: the critic's optimizer.

    Attributes:
        lr: Peak learning rate (verl's critic default, 1e-5).
    """

    lr: float = 1e-5


@dataclass(frozen=True)
class CriticConfig:
    """`critic.*`: the value model and its update (PPO with GAE).

    Attributes:
        enable: Train a critic; null: only when `algorithm.adv_estimator` is `gae`.
        model: The value model's checkpoint.
        optim: Optimizer and schedule.
        ppo_mini_batch_size: Prompts per critic optimizer step.
        ppo_micro_batch_size_per_gpu: Sequences per device per forward/backward pass.
        use_dynamic_bsz: Form micro-batches by token budget.
        ppo_max_token_len_per_gpu: Token budget per device per micro-batch.
        forward_micro_batch_size_per_gpu: Sequences per device when computing values.
        forward_max_token_len_per_gpu: Token budget per device when computing values.
        ppo_epochs: Passes over each batch.
        shuffle: Shuffle sequences between mini-batches.
        data_loader_seed: Seed of that shuffle.
        cliprange_value: Clip range of the value loss.
        loss_agg_mode: Aggregation of the value loss (as the actor's).
        loss_scale_factor: Constant divisor for `seq-mean-token-sum-norm`; null: the response
            length.
        grad_clip: Clip the global gradient norm to this value.
        model_dtype: Parameter dtype.
        dtype: Compute dtype.
        param_offload: Keep the parameters in host memory (pinned) except during the value
            pass and the update (verl's `model.fsdp_config.param_offload`).
        optimizer_offload: Keep the optimizer state in host memory except during the update
            (verl's `model.fsdp_config.optimizer_offload`).
        checkpoint: Checkpoint contents.
    """

    enable: bool | None = None
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    ppo_mini_batch_size: int = II("actor_rollout_ref.actor.ppo_mini_batch_size")
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = II("actor_rollout_ref.actor.use_dynamic_bsz")
    ppo_max_token_len_per_gpu: int = 32768
    forward_micro_batch_size_per_gpu: int | None = II("critic.ppo_micro_batch_size_per_gpu")
    forward_max_token_len_per_gpu: int = II("critic.ppo_max_token_len_per_gpu")
    ppo_epochs: int = II("actor_rollout_ref.actor.ppo_epochs")
    shuffle: bool = II("actor_rollout_ref.actor.shuffle")
    data_loader_seed: int = 42
    cliprange_value: float = 0.5
    loss_agg_mode: str = II("actor_rollout_ref.actor.loss_agg_mode")
    loss_scale_factor: float | None = None
    grad_clip: float = 1.0
    model_dtype: str = "fp32"
    dtype: str = "bfloat16"
    param_offload: bool = False
    optimizer_offload: bool = False
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# --------------------------------------------------------------------------------------- rewards


@dataclass(frozen=True)
class RewardModelPathConfig:
    """`reward_model.model.*`: the reward model's checkpoint.

    Attributes:
        path: A checkpoint of an HF sequence- or token-classification model.
        input_tokenizer: The policy's tokenizer, when it differs from the reward model's (the
            response is decoded and re-templated).
        trust_remote_code: Allow custom code.
    """

    path: str | None = None
    input_tokenizer: str | None = None
    trust_remote_code: bool = False


@dataclass(frozen=True)
class OverlongBufferConfig:
    """`reward_model.overlong_buffer.*`: DAPO's soft penalty for responses near the maximum
    length (the `dapo` manager; verl's DAPO recipe keys).

    Attributes:
        enable: Apply the penalty.
        len: Buffer length L: a response longer than max_response_length - L loses
            (length - (max - L)) / L * penalty_factor, at most penalty_factor.
        penalty_factor: Penalty at the maximum length.
        log: Record the penalty in the reward extra info.
    """

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False


@dataclass(frozen=True)
class RewardModelConfig:
    """`reward_model.*`: model-based reward and the reward manager.

    Attributes:
        enable: Score responses with a reward model (its score replaces the rule-based one).
        model: Its checkpoint.
        micro_batch_size_per_gpu: Sequences per device per scoring pass; null: all at once.
        max_length: Longest scored sequence; null: prompt + response length.
        reward_manager: How rule-based scores are computed: `naive` (per sample), `batch`
            (the whole batch in one call), `dapo` (with overlong penalty) or `prime` (alias
            `parallel`: worker processes with a per-sample timeout).
        dtype: Compute dtype of the reward model.
        overlong_buffer: DAPO's overlong penalty (`dapo` manager).
        compute_score_timeout: Seconds per sample for `naive`/`dapo` (main thread only);
            null: none.
        num_workers: *jaxrl*. Scoring processes of the `prime` manager.
        timeout_s: *jaxrl*. Seconds per sample in the `prime` manager before its worker is
            killed and the sample scores `error_score`.
        reward_kwargs: Extra keyword arguments of the `batch` manager's scoring function.
        error_score: *jaxrl*. The score of a row whose scorer raised, timed out, or returned
            something that is not a finite number (counted in `reward/errors`).
        enable_resource_pool: Put the reward model on its own devices, `nnodes` x
            `n_gpus_per_node` of them, apart from the trainer's (`trainer.nnodes` x
            `trainer.n_gpus_per_node`); the same as `mesh.placement.reward.devices`.
        n_gpus_per_node: Devices per host of the reward model's pool.
        nnodes: Hosts of the reward model's pool.
    """

    enable: bool = False
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    micro_batch_size_per_gpu: int | None = None
    max_length: int | None = None
    reward_manager: str = "naive"
    dtype: str = "bfloat16"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    compute_score_timeout: float | None = None
    num_workers: int = 4
    timeout_s: float = 300.0
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    error_score: float = 0.0
    enable_resource_pool: bool = False
    n_gpus_per_node: int = 8
    nnodes: int = 1


@dataclass(frozen=True)
class CustomRewardFunctionConfig:
    """`custom_reward_function.*`: a user's Python scoring function.

    Attributes:
        path: A `.py` file; null uses jaxrl's built-in scorers chosen by `data_source`.
        name: The function in that file, called as verl calls it:
            `fn(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)`.
        reward_kwargs: Extra keyword arguments for it.
    """

    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------- algorithm


@dataclass(frozen=True)
class KLControlConfig:
    """`algorithm.kl_ctrl.*`: the KL-in-reward coefficient controller.

    Attributes:
        type: `fixed` or `adaptive` (Ziegler et al. 2019).
        kl_coef: (Initial) KL coefficient.
        horizon: Adaptive controller horizon.
        target_kl: Adaptive controller target.
    """

    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """`algorithm.rollout_correction.*`: importance correction between rollout and training.

    Attributes:
        rollout_is: Importance-sampling level: null (off), `token` or `sequence`.
        rollout_is_threshold: Truncation threshold of the IS weights.
        rollout_is_batch_normalize: Normalise IS weights to mean 1 over the batch.
        rollout_rs: Rejection-sampling mode: null (off) or a verl mode name.
        rollout_rs_threshold: Threshold(s) of rejection sampling.
        bypass_mode: Use the rollout log-probs as the old log-probs (no recomputation).
        loss_type: Loss in bypass mode: `ppo_clip` or `reinforce`.
    """

    rollout_is: str | None = None
    rollout_is_threshold: Any = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"


@dataclass(frozen=True)
class FilterGroupsConfig:
    """`algorithm.filter_groups.*`: DAPO's dynamic sampling (`jaxrl.trainer.dynamic_sampling`).

    Attributes:
        enable: Train only on prompt groups whose responses' `metric` varies, generating
            batches of `data.gen_batch_size` prompts until `data.train_batch_size` such groups
            exist. Varies: a float64 std > 0 (verl's recipe takes it in float32, where a tied
            group of some non-dyadic scores, e.g. six of 0.6, has std 6e-8 and is kept).
            With `async_training.mode=fully_async` each group is judged as the trainer takes
            it from the rollouter's queue (`docs/async.md`).
        metric: `seq_reward` (or `reward`: the summed token scores), `seq_final_reward` (the
            summed token rewards), or a key of the reward function's extra info (`acc`,
            `score`, ...).
        max_num_gen_batches: Stop the run when a step has generated this many batches without
            enough groups; 0 or less: no limit.
        streaming: *jaxrl*. Instead of whole generation batches, keep the rollout engine's
            `max_num_seqs` slots full of groups, judge each group the moment its responses
            end, and stop generating once the first `train_batch_size` kept groups in prompt
            order are known (fewer tokens per trained group;
            `training/filter_groups/sampled_tokens_per_group`). The same kept set on any
            number of processes. Batch generation (no multi-turn), no over-sampling, not
            with ReMax.
    """

    enable: bool = False
    metric: str | None = None
    max_num_gen_batches: int = 0
    streaming: bool = False


@dataclass(frozen=True)
class PFPPOConfig:
    """`algorithm.pf_ppo.*`: PF-PPO's resampling of the batch by reward
    (`jaxrl.core_algos.reweight`).

    Attributes:
        reweight_method: A row's weight from its score: `pow` (|score| ** weight_pow),
            `max_min` (1 for the batch's best and worst scores, else 0) or `max_random` (0.4
            for the best score, else 0.1).
        weight_pow: The exponent of `pow`.
    """

    reweight_method: str = "pow"
    weight_pow: float = 2.0


@dataclass(frozen=True)
class AlgorithmConfig:
    """`algorithm.*`: advantage estimation and KL in the reward.

    Attributes:
        adv_estimator: Name in `jaxrl.core_algos`' estimator registry (`gae`, `grpo`, `rloo`,
            ...).
        gamma: Discount factor.
        lam: GAE lambda.
        norm_adv_by_std_in_grpo: Divide GRPO advantages by the group's std (Dr. GRPO: false).
        use_kl_in_reward: Subtract a KL(actor || reference) penalty from the token rewards.
        kl_penalty: KL estimator of that penalty.
        kl_ctrl: Its coefficient controller.
        rollout_correction: Rollout/training mismatch correction.
        gdpo_reward_keys: GDPO: the reward components (keys of the scorer's returned dict)
            normalised separately.
        gdpo_reward_weights: GDPO: their weights (null: equal).
        use_pf_ppo: PF-PPO: after GAE, train on N rows drawn with replacement from the batch
            of N, weighted by their scores (`pf_ppo`); as verl, with `adv_estimator: gae` only.
        pf_ppo: PF-PPO's weighting.
        filter_groups: DAPO's dynamic sampling.
    """

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None
    use_pf_ppo: bool = False
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


# --------------------------------------------------------------------------------------- trainer


@dataclass(frozen=True)
class LoopConfig:
    """The step loop's keys every trainer has (`trainer.*` of the RL and offline configs).

    Attributes:
        project_name: Project name (run directory, loggers).
        experiment_name: Experiment name (run directory, loggers).
        total_epochs: Passes over the training data.
        total_training_steps: Stop after this many steps; null: `total_epochs` worth.
        logger: Any of `console`, `tensorboard`, `wandb`, `file` (`metrics.jsonl`, always written).
        val_before_train: Validate before the first step.
        val_only: Validate and exit.
        test_freq: Validate every this many steps (-1: never).
        save_freq: Checkpoint every this many steps (-1: only at the end, if at all).
        resume_mode: `auto` (latest checkpoint in the run directory), `disable` or
            `resume_path`.
        resume_from_path: Checkpoint to resume with `resume_mode: resume_path`.
        default_local_dir: Run directory: checkpoints, `metrics.jsonl`, the resolved config.
        max_consecutive_nonfinite_steps: *jaxrl*. A step whose gradient norm is non-finite
            skips its optimizer update (as verl does; counted in `*/skipped_steps`); this many
            such steps in a row stop the run with an error naming them. null: never stop.
        nnodes: Hosts the run expects; null: whatever JAX sees. When set together with
            `n_gpus_per_node`, their product must equal the device count.
        n_gpus_per_node: Accelerators per host the run expects; null: whatever JAX sees.
    """

    project_name: str = "jaxrl_examples"
    experiment_name: str = "default"
    total_epochs: int = 30
    total_training_steps: int | None = None
    logger: tuple[str, ...] = ("console",)
    val_before_train: bool = True
    val_only: bool = False
    test_freq: int = -1
    save_freq: int = -1
    resume_mode: str = "auto"
    resume_from_path: str | None = None
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    max_consecutive_nonfinite_steps: int | None = 5
    nnodes: int | None = None
    n_gpus_per_node: int | None = None


@dataclass(frozen=True)
class TrainerConfig(LoopConfig):
    """`trainer.*`: the step loop, logging, validation and checkpoints.

    Attributes:
        balance_batch: Reorder sequences so every data-parallel shard gets equal token counts.
        critic_warmup: Steps that update only the critic.
        log_val_generations: Validation samples printed to the loggers.
        rollout_data_dir: Folder for JSONL dumps of training generations; null: none.
        validation_data_dir: Folder for JSONL dumps of validation generations; null: none.
        max_actor_ckpt_to_keep: Keep only the newest n actor checkpoints; null: all.
        max_critic_ckpt_to_keep: Keep only the newest n critic checkpoints; null: all.
    """

    balance_batch: bool = True
    critic_warmup: int = 0
    log_val_generations: int = 0
    rollout_data_dir: str | None = None
    validation_data_dir: str | None = None
    max_actor_ckpt_to_keep: int | None = None
    max_critic_ckpt_to_keep: int | None = None


# ------------------------------------------------------------------------------------------ mesh


@dataclass(frozen=True)
class RolePlacementConfig:
    """`mesh.placement.<role>.*`: *jaxrl*. One role on its own group of devices.

    Attributes:
        devices: Devices of the role's group; 0: colocated (the role shares the trainer's
            devices, as by default).
        dp: Data-parallel size of the group's mesh (ref, critic, reward: a training-style
            mesh with the axes of `mesh.*`; the rollout's mesh is always dp = the rest x
            `rollout.tensor_model_parallel_size`, so only `devices` applies to it).
        fsdp: Fully-sharded size; -1: the rest of the group.
        ep: Expert-parallel size (a mixture of experts' experts split, batch split).
        tp: Tensor-parallel size.
        sp: Sequence-parallel size.
    """

    devices: int = 0
    dp: int = 1
    fsdp: int = -1
    ep: int = 1
    tp: int = 1
    sp: int = 1


@dataclass(frozen=True)
class PlacementConfig:
    """`mesh.placement.*`: *jaxrl*. Roles on device groups of their own (verl's resource
    pools). The placed roles take their devices from the end of the device list in the order
    rollout, ref, critic, reward, teacher; the actor (and every colocated role) trains on the rest
    with the mesh `mesh.dp/fsdp/tp/sp`. Weights move between groups with the jitted
    reshard; each role's passes take the batch in their own layout. With several processes
    each group takes the same share of every process's devices (the counts must divide by
    the processes), unless `spread` is false.

    Attributes:
        spread: *jaxrl*. With several processes, true: every group takes the same share of
            each process's devices (every process holds part of every role, as one process
            holds all of them); false: each group is a range of the devices in process
            order, as in one process, so a role may sit on some processes' devices only
            (verl's resource pools of whole nodes: a teacher or a reference on a node of its
            own, or the actor on one node and the rollout on another). Streamed dynamic
            sampling needs a rollout on every process; the agent loop runs the
            conversations of a process without rollout devices on one with some.
        rollout: Generation on its own devices (the actor's weights are copied there each step
            and kept between steps).
        ref: The reference policy's log-prob passes.
        critic: The critic's value passes and updates.
        reward: The reward model (also `reward_model.enable_resource_pool`).
        teacher: The distillation teacher's log-prob passes (also `distillation.nnodes` x
            `distillation.n_gpus_per_node`).
    """

    spread: bool = True
    rollout: RolePlacementConfig = field(default_factory=RolePlacementConfig)
    ref: RolePlacementConfig = field(default_factory=RolePlacementConfig)
    critic: RolePlacementConfig = field(default_factory=RolePlacementConfig)
    reward: RolePlacementConfig = field(default_factory=RolePlacementConfig)
    teacher: RolePlacementConfig = field(default_factory=RolePlacementConfig)


@dataclass(frozen=True)
class MeshConfig:
    """`mesh.*`: *jaxrl*. The global device mesh of training (DESIGN §3).

    The product of the five sizes is the trainer's device count (all devices, less those of
    roles placed on their own, `placement`); one of them may be -1 ("the rest"). Generation
    re-factors the same devices as `(dp=rest, tp=rollout.tensor_model_parallel_size)`.

    Attributes:
        dp: Pure data parallelism (parameters replicated).
        fsdp: Fully-sharded data parallelism (ZeRO-3: parameters and optimizer state sharded,
            batch split).
        ep: Expert parallelism: a mixture of experts' experts split over it, each token sent
            to its experts' devices and back; the batch is split over it too (as over `fsdp`).
            With a dense model it acts as more data parallelism.
        tp: Tensor parallelism (heads and MLP columns split).
        sp: Sequence parallelism (ring attention over the sequence).
        train_rules: Training layout: logical axis name -> mesh axis, list of mesh axes, or
            null (replicated). Names: vocab, embed, mlp, heads, kv_heads, head_dim, layers,
            labels, batch, seq, cache_seq, lora_rank, experts.
        rollout_rules: Generation layout over the rollout mesh (axes dp, tp).
        placement: Roles on device groups of their own.
    """

    dp: int = 1
    fsdp: int = -1
    ep: int = 1
    tp: int = 1
    sp: int = 1
    train_rules: dict[str, Any] = field(default_factory=lambda: dict(TRAIN_RULES))
    rollout_rules: dict[str, Any] = field(default_factory=lambda: dict(ROLLOUT_RULES))
    placement: PlacementConfig = field(default_factory=PlacementConfig)


# ---------------------------------------------------------------------------------------- assets


@dataclass(frozen=True)
class AssetsConfig:
    """`assets.*`: *jaxrl*. Files a run makes for itself, offline, when they are missing.

    Attributes:
        quickstart: Write a tiny random Qwen2 policy with jaxrl's synthetic-task tokenizer to
            `actor_rollout_ref.model.path`, and the synthetic task as verl-format parquet to
            `data.train_files` / `data.val_files`, where those do not exist yet (see
            `configs/quickstart.yaml`). Existing files are never overwritten.
        dir: The only folder `quickstart` writes into: a missing path outside it is an error
            naming its key (a typo in a path must not train on made-up data).
        task: The synthetic task: `repeat`, `copy`, `reverse`, or the tool task `add`
            (its own tokenizer; see `jaxrl.data.synthetic`).
        task_length: Digits in each answer.
        train_size: Training rows to write.
        val_size: Validation rows to write.
    """

    quickstart: bool = False
    dir: str = "~/.cache/jaxrl/quickstart"
    task: str = "repeat"
    task_length: int = 4
    train_size: int = 1024
    val_size: int = 64


# ------------------------------------------------------------------------------------------ root


@dataclass(frozen=True)
class DistillationLossConfig:
    """`distillation.distillation_loss.*`: the student's loss against the teacher
    (`jaxrl.core_algos.distillation`; defaults of verl 0.9.1's yaml).

    Attributes:
        loss_mode: The per-token loss: a reverse-KL estimator of `kl_penalty` on the sampled
            tokens (`k1`/`kl`, `abs`, `k2`/`mse`, `k3`/`low_var_kl`), or `forward_kl_topk`,
            the forward KL over the teacher's `topk` most likely tokens.
        topk: k of `forward_kl_topk` (the teacher pass returns its k largest log-probs and
            their ids at every response position).
        use_task_rewards: Keep the PPO loss on the task's rewards and add the distillation
            loss times `distillation_loss_coef`; false: the distillation loss alone.
        distillation_loss_coef: The distillation loss's weight beside the PPO loss.
        loss_max_clamp: Clamp the per-token loss to +-this; null: no clamp.
        log_prob_min_clamp: The top-k loss's floor on both models' log-probs; null: none
            (unused by the estimators).
        use_policy_gradient: Train on the loss as a per-token reward (a vanilla PPO loss with
            advantages = -loss); false: backpropagate the loss itself (k1 is refused there).
        policy_loss_mode: The policy loss of `use_policy_gradient`: `vanilla` only.
        clip_ratio: That loss's PPO clip range.
        clip_ratio_low: Its lower clip range.
        clip_ratio_high: Its upper clip range.
        use_chunked_topk: verl's memory switch of the top-k loss (unused: jaxrl's teacher
            and student passes are chunked like its log-prob passes, by
            `actor.entropy_from_logits_with_chunking` and `entropy_from_logits_chunk_size`).
        chunked_topk_chunk_size: Its chunk size (unused here).
    """

    loss_mode: str = "k3"
    topk: int | None = 32
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    use_chunked_topk: bool = False
    chunked_topk_chunk_size: int = 4096


def _teacher_models() -> dict[str, Any]:
    return {"teacher_model": {"key": None, "model_path": None, "num_replicas": 0}}


@dataclass(frozen=True)
class DistillationConfig:
    """`distillation.*`: on-policy distillation from a frozen teacher (verl 0.9.1). The
    teacher scores every response token the student samples; its log-probs enter the actor's
    loss (`distillation_loss`).

    Attributes:
        enabled: Distil from the teacher.
        distillation_loss: The loss.
        n_gpus_per_node: With `nnodes`, the teacher's own devices (verl's teacher resource
            pool: `nnodes` x `n_gpus_per_node`, the same as `mesh.placement.teacher.devices`);
            0 nodes: colocated with the trainer.
        nnodes: Nodes of that pool.
        teacher_models: The teachers by name, each with `model_path` (an HF causal LM whose
            tokenizer equals the student's), `key`, `num_replicas` and verl's
            `inference.*` (of which jaxrl reads `inference.dtype`: the teacher's dtype,
            default `rollout.dtype`). Several teachers: the default entry `teacher_model`
            is dropped (as verl drops it) and each row goes to the teacher whose `key`
            equals the row's `teacher_key` field.
        teacher_key: The data field that routes rows to teachers (several teachers only):
            `data_source`, `ability`, `index` (`extra_info.index`), or any other column.
    """

    enabled: bool = False
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    n_gpus_per_node: int = 8
    nnodes: int = 0
    teacher_models: dict[str, Any] = field(default_factory=_teacher_models)
    teacher_key: str = "data_source"


@dataclass(frozen=True)
class AsyncTrainingConfig:
    """`async_training.*`: the rollout running ahead of the trainer on devices of its own
    (verl's `one_step_off_policy` and `fully_async_policy` recipes; `docs/async.md`).

    Attributes:
        mode: *jaxrl* (verl picks the recipe by its entry point). `sync`: each step
            generates its batch with the current weights, then trains on it. `one_step_off`:
            the rollout generates batch k+1 with the weights from before update k while the
            trainer updates on batch k (verl's `one_step_off_policy`): the loss sees batches
            one update old, corrected as `algorithm.rollout_correction` says. Needs the
            rollout on devices of its own (`mesh.placement.rollout.devices`); a multi-turn
            agent loop runs ahead on a thread (one process); no dynamic sampling or ReMax
            yet. A step that saves
            a checkpoint, and the last, look no batch ahead: nothing is in flight at a
            checkpoint, and a resumed run computes what an uninterrupted one does.
            `fully_async`: a rollouter thread generates groups continuously into a queue and
            the trainer takes `require_batches` x `ppo_mini_batch_size` finished groups a step
            (verl's `fully_async_policy`; the rollout on one process's devices; multi-turn
            agents' trajectories as groups; dynamic sampling judges groups as they finish).
        staleness_threshold: `fully_async`: the rollouter starts at most (1 + this) x the
            groups the trainer takes between two pushes per weights version (verl's
            `max_required_samples`), so stale groups are mostly never produced; a group whose
            first token is more than ceil(1 + this) pushes behind the trainer is dropped and
            generated again (jaxrl's hard bound; verl has the cap only).
        trigger_parameter_sync_step: `fully_async`: push the actor's weights to the rollout
            every this many steps.
        require_batches: `fully_async`: mini-batches of groups a step takes; the step's batch
            is this x `actor.ppo_mini_batch_size` prompts (`data.train_batch_size` must say
            the same).
        partial_rollout: `fully_async`: a push lands between two decode chunks and the
            running groups continue on the new weights with their KV caches (each token
            records its version); false: the push waits for them to end on the old weights.
        rollout_timeout: *jaxrl*. `fully_async`: seconds the trainer waits for a finished
            group (or a push for the running groups to end) before it stops the run with an
            error naming the rollouter.
    """

    mode: str = "sync"
    staleness_threshold: float = 0.1
    trigger_parameter_sync_step: int = 4
    require_batches: int = 1
    partial_rollout: bool = True
    rollout_timeout: float = 600.0


@dataclass(frozen=True)
class Config:
    """The whole run.

    Attributes:
        data: The prompt dataset.
        actor_rollout_ref: The policy and its actor, reference and rollout roles.
        critic: The value model.
        reward_model: Model-based reward and the reward manager.
        custom_reward_function: A user's scoring function.
        algorithm: Advantage estimator and KL in reward.
        trainer: Step loop, logging, validation and checkpoints.
        mesh: The device mesh (jaxrl).
        assets: Files the run makes for itself (jaxrl).
        distillation: On-policy distillation from a teacher.
        async_training: The rollout running ahead of the trainer (verl's async recipes).
    """

    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(
        default_factory=CustomRewardFunctionConfig
    )
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    assets: AssetsConfig = field(default_factory=AssetsConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)


def is_group(tp: Any) -> bool:
    """Whether a (resolved) field type is a nested config group."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)
