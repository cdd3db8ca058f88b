"""One RL step with verl's semantics (`RayPPOTrainer.fit`'s body), on the mesh.

    step(prompts) :
      reshard actor -> rollout layout (rollout dtype); generate n responses per prompt; free
      reward        scores on the last valid response token (host)
      old_log_prob  actor pass (skipped on-policy: one mini-batch, one epoch, no KL in reward)
      ref           reference log-probs (KL loss / KL in reward)
      values        critic pass (GAE)
      adv           KL in reward, then the advantage estimator
      update_critic, update_actor (after `critic_warmup` steps)

Every array of the step lives on the host as numpy rows between the jitted passes; the passes
run on global arrays over the train layout's batch axes. With several processes, each generates
(one program over the whole rollout mesh) and scores the responses to its own prompts; then
`gather_processes` gives every process the rows of all of them, in the global batch's order,
and the rest of the step (KL, advantages and their group statistics, the passes, the metrics)
computes on every process exactly what one process holding the whole batch computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxrl.config.checks import critic_enabled
from jaxrl.core_algos import AdvantageEstimator, agg_loss, get_kl_controller
from jaxrl.data.batch import PromptBatch
from jaxrl.models.params import param_shardings
from jaxrl.rollout import SamplingParams, compile_generate, generate
from jaxrl.sharding.layouts import layouts_from_config, placed_abstract
from jaxrl.sharding.processes import allgather_objects, gather_rows
from jaxrl.sharding.reshard import free, reshard
from jaxrl.trainer import losses
from jaxrl.trainer.advantage import apply_kl_penalty, compute_advantage
from jaxrl.trainer.learner import Learner, compile_infer, infer, shardings_of
from jaxrl.trainer.memory import MemoryPlan, memory_plan, worst_case_batch
from jaxrl.trainer.metrics import (
    data_metrics,
    mfu_metrics,
    throughput_metrics,
    timing_metrics,
)
from jaxrl.trainer.optim import learning_rate_schedule, make_optimizer
from jaxrl.trainer.roles import (
    critic_from_policy,
    dtype_name,
    load_model,
    log_prob_fn,
    values_fn,
)
from jaxrl.trainer.update import init_state

CRITIC_FIELDS = ("values", "returns")

# (prompts repeated n times, responses [N, R], response_mask) -> (scores [N, R], metrics, extra)
RewardFn = Callable[[PromptBatch, np.ndarray, np.ndarray], tuple[np.ndarray, dict, dict]]


@contextlib.contextmanager
def timer(name: str, timing: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def uses_reference(cfg) -> bool:
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


class PPOTrainer:
    """The roles of a run on the mesh and its step (`step`) and validation pass (`validate`).

    Args:
        cfg: The run's `jaxrl.config.Config`.
        reward_fn: Scores training responses (see `RewardFn`).
        val_reward_fn: Scores validation responses; default `reward_fn`.
        total_steps: Optimizer-schedule length (steps of the run).
        devices: The mesh's devices; default all.
        abstract: Read only the models' `config.json`: parameters and optimizer states are
            `jax.ShapeDtypeStruct`s in their shardings, nothing is loaded or allocated; such
            a trainer only compiles (`compile_step`, `memory_plan`), it cannot step.
    """

    def __init__(
        self,
        cfg,
        reward_fn: RewardFn,
        *,
        val_reward_fn: RewardFn | None = None,
        total_steps: int,
        devices=None,
        abstract: bool = False,
    ):
        self.cfg, self.reward_fn = cfg, reward_fn
        load = functools.partial(load_model, abstract=abstract)
        self.val_reward_fn = val_reward_fn or reward_fn
        actor_rollout_ref = cfg.actor_rollout_ref
        actor_cfg, rollout_cfg = actor_rollout_ref.actor, actor_rollout_ref.rollout
        if cfg.algorithm.adv_estimator in (
            AdvantageEstimator.OPTIMAL_TOKEN_BASELINE,
            AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE,
        ):
            raise ValueError(
                f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}: the trainer does not "
                "compute sum_pi_squared yet; the estimator itself is in jaxrl.core_algos"
            )
        self.train_layout, self.rollout_layout = layouts_from_config(cfg, devices)
        self.devices = self.train_layout.mesh.devices.size
        remat = (
            actor_rollout_ref.model.remat_policy
            if actor_rollout_ref.model.enable_gradient_checkpointing
            else "none"
        )
        self.actor_config, params = load(
            actor_rollout_ref.model.path,
            param_dtype=dtype_name(actor_cfg.model_dtype, "actor.model_dtype"),
            compute_dtype=dtype_name(actor_cfg.dtype, "actor.dtype"),
            layout=self.train_layout,
            remat=remat,
            override_config=dict(actor_rollout_ref.model.override_config),
            attention_impl=actor_rollout_ref.model.attention_impl,
        )
        self._actor_size = sum(x.size for x in jax.tree.leaves(params))
        policy_cfg = actor_cfg
        self.bypass = bool(cfg.algorithm.rollout_correction.bypass_mode)
        if self.bypass:
            correction = cfg.algorithm.rollout_correction
            loss = dict(loss_mode="bypass_mode", rollout_correction=correction)
            policy_cfg = losses.ConfigView(actor_cfg, policy_loss=loss)
        rows = cfg.data.train_batch_size * rollout_cfg.n
        updates = -(-rows // (actor_cfg.ppo_mini_batch_size * rollout_cfg.n)) * actor_cfg.ppo_epochs
        optimizer = make_optimizer(actor_cfg.optim, total_steps, updates_per_step=updates)
        self._actor_lr = learning_rate_schedule(actor_cfg.optim, total_steps)
        state = init_state(params, optimizer, self.train_layout, shardings_of(params))
        self.temperature = rollout_cfg.temperature if rollout_cfg.do_sample else 1.0
        self.actor = Learner(
            self.actor_config,
            state,
            optimizer,
            functools.partial(
                losses.actor_loss,
                config=self.actor_config,
                actor_cfg=policy_cfg,
                temperature=self.temperature,
            ),
            layout=self.train_layout,
            grad_clip=actor_cfg.grad_clip,
        )
        chunk = (
            actor_cfg.entropy_from_logits_chunk_size
            if actor_cfg.entropy_from_logits_with_chunking
            else None
        )
        self._log_prob = log_prob_fn(
            self.actor_config,
            self.train_layout,
            temperature=self.temperature,
            chunk_size=chunk,
            with_entropy=True,
        )
        self.ref_params = self._ref_config = None
        if uses_reference(cfg):
            self._ref_config, self.ref_params = load(
                actor_rollout_ref.model.path,
                param_dtype=dtype_name(actor_rollout_ref.ref.model_dtype, "ref.model_dtype"),
                compute_dtype=dtype_name(actor_rollout_ref.ref.dtype, "ref.dtype"),
                layout=self.train_layout,
                override_config=dict(actor_rollout_ref.model.override_config),
                attention_impl=actor_rollout_ref.model.attention_impl,
            )
            self._ref_log_prob = log_prob_fn(
                self._ref_config, self.train_layout, temperature=self.temperature, chunk_size=chunk
            )
        self.critic = None
        if critic_enabled(cfg):
            c = cfg.critic
            config, params = load(
                c.model.path,
                param_dtype=dtype_name(c.model_dtype, "critic.model_dtype"),
                compute_dtype=dtype_name(c.dtype, "critic.dtype"),
                layout=self.train_layout,
                remat=c.model.remat_policy if c.model.enable_gradient_checkpointing else "none",
                override_config=dict(c.model.override_config),
                attention_impl=c.model.attention_impl,
            )
            config, params = critic_from_policy(c.model.path, config, params, self.train_layout)
            c_updates = -(-rows // (c.ppo_mini_batch_size * rollout_cfg.n)) * c.ppo_epochs
            optimizer = make_optimizer(c.optim, total_steps, updates_per_step=c_updates)
            state = init_state(params, optimizer, self.train_layout, shardings_of(params))
            self.critic = Learner(
                config,
                state,
                optimizer,
                functools.partial(losses.critic_loss, config=config, critic_cfg=c),
                layout=self.train_layout,
                grad_clip=c.grad_clip,
            )
            self._values = values_fn(config, self.train_layout)
        self.kl_ctrl = (
            get_kl_controller(cfg.algorithm.kl_ctrl) if cfg.algorithm.use_kl_in_reward else None
        )
        self.rollout_config = self.actor_config.replace(  # the rollout mesh has no `sp`
            dtype=dtype_name(rollout_cfg.dtype, "rollout.dtype"),
            remat="none",
            attention_impl="auto"
            if actor_rollout_ref.model.attention_impl == "ring"
            else actor_rollout_ref.model.attention_impl,
        )
        self._rollout_shardings = param_shardings(self.rollout_config, self.rollout_layout)
        self.sampling = SamplingParams.from_config(rollout_cfg)
        self.val_sampling = SamplingParams.from_config(rollout_cfg, validation=True)

    # ----------------------------------------------------------------------------- rollout

    def generate(
        self, prompts: PromptBatch, sampling: SamplingParams, rng: jax.Array
    ) -> dict[str, np.ndarray]:
        """Rows of the generated batch (prompts repeated n times, interleaved): with several
        processes, the rows of this process's `prompts` (every process calls this with its
        own prompts and the same rng: generation is one program over all of them)."""
        rollout_params = reshard(
            self.actor.params, self._rollout_shardings, dtype=self.rollout_config.param_dtype
        )
        try:
            out = generate(
                self.rollout_config,
                rollout_params,
                prompts.input_ids,
                prompts.attention_mask,
                sampling,
                rng,
                layout=self.rollout_layout,
                max_prompt_length=self.cfg.data.max_prompt_length,
                max_num_seqs=self.cfg.actor_rollout_ref.rollout.max_num_seqs,
            )
            out = jax.device_get(out)
        finally:
            free(rollout_params)
        return {
            "prompts": np.repeat(prompts.input_ids, sampling.n, axis=0),
            "prompt_mask": np.repeat(prompts.attention_mask, sampling.n, axis=0),
            "responses": np.asarray(out.responses),
            "response_mask": np.asarray(out.response_mask),
            "rollout_log_probs": np.asarray(out.log_probs),
        }

    # -------------------------------------------------------------------------------- step

    def step(self, prompts: PromptBatch, global_step: int) -> dict[str, float]:
        """One RL step on `prompts` (this process's rows); returns the step's metrics (the
        same on every process: from the reward on, every process holds the global batch)."""
        cfg, actor_rollout_ref = self.cfg, self.cfg.actor_rollout_ref
        actor_cfg, n = actor_rollout_ref.actor, self.sampling.n
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        rng = jax.random.fold_in(jax.random.key(actor_rollout_ref.rollout.seed), global_step)
        with timer("step", timing):
            with timer("gen", timing):
                batch = self.generate(prompts, self.sampling, rng)
            repeated = prompts.repeat(n)
            group_ids = repeated.group_ids
            with timer("reward", timing):
                scores, reward_metrics, extra = self.reward_fn(
                    repeated, batch["responses"], batch["response_mask"]
                )
                batch["token_level_scores"] = scores.astype(np.float32)
            if cfg.algorithm.adv_estimator == AdvantageEstimator.REMAX:
                with timer("gen_max", timing):
                    greedy = dataclasses.replace(self.sampling, do_sample=False, temperature=0.0)
                    base = self.generate(prompts, dataclasses.replace(greedy, n=1), rng)
                    base_scores, _, _ = self.reward_fn(
                        prompts, base["responses"], base["response_mask"]
                    )
                    batch["reward_baselines"] = np.repeat(base_scores.sum(-1), n, axis=0)
            if jax.process_count() > 1:
                with timer("gather", timing):
                    batch, group_ids, extra, reward_metrics = gather_processes(
                        batch, group_ids, extra, reward_metrics
                    )
            metrics.update(reward_metrics)
            on_policy = self._on_policy(len(batch["responses"]))
            micro = self._log_prob_micro()
            if self.bypass:
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif not on_policy:
                with timer("old_log_prob", timing):
                    old, entropy = infer(
                        self._log_prob,
                        self.actor.params,
                        batch,
                        layout=self.train_layout,
                        **micro,
                    )
                    batch["old_log_probs"] = old
                    metrics["actor/entropy"] = float(
                        agg_loss(
                            entropy,
                            batch["response_mask"].astype(np.float32),
                            actor_cfg.loss_agg_mode,
                            loss_scale_factor=actor_cfg.loss_scale_factor,
                        )
                    )
            if self.ref_params is not None:
                with timer("ref", timing):
                    batch["ref_log_probs"] = infer(
                        self._ref_log_prob,
                        self.ref_params,
                        batch,
                        layout=self.train_layout,
                        **micro,
                    )
            if self.critic is not None:
                with timer("values", timing):
                    batch["values"] = infer(
                        self._values,
                        self.critic.params,
                        batch,
                        layout=self.train_layout,
                        **self._values_micro(),
                    )
            with timer("adv", timing):
                if self.kl_ctrl is not None:
                    rewards, kl_metrics = apply_kl_penalty(
                        batch, self.kl_ctrl, cfg.algorithm.kl_penalty
                    )
                    batch["token_level_rewards"] = rewards
                    metrics.update(kl_metrics)
                else:
                    batch["token_level_rewards"] = batch["token_level_scores"]
                adv, ret = compute_advantage(batch, group_ids, cfg.algorithm, extra)
                batch["advantages"], batch["returns"] = adv, ret
            if self.critic is not None:
                with timer("update_critic", timing):
                    critic_metrics = self.critic.update(
                        batch, **self._update_args(cfg.critic, global_step, CRITIC_FIELDS)
                    )
                    metrics.update(_prefixed(critic_metrics, "critic"))
            if global_step >= cfg.trainer.critic_warmup:
                with timer("update_actor", timing):
                    fields = self._actor_fields(batch, on_policy)
                    actor_metrics = self.actor.update(
                        batch, **self._update_args(actor_cfg, global_step, fields)
                    )
                    metrics.update(_prefixed(actor_metrics, "actor"))
                    if "actor/entropy" not in metrics:  # on-policy: no old-log-prob pass
                        metrics["actor/entropy"] = metrics["actor/entropy_loss"]
                    if actor_cfg.use_kl_loss:
                        metrics["actor/kl_coef"] = actor_cfg.kl_loss_coef
                    metrics["actor/lr"] = float(self._actor_lr(global_step - 1))
        metrics.update(data_metrics(batch, use_critic=self.critic is not None))
        metrics.update(timing_metrics(batch, timing))
        metrics.update(throughput_metrics(batch, timing["step"], self.devices))
        metrics.update(
            mfu_metrics(batch, timing, self._actor_size, actor_cfg.ppo_epochs, self.devices)
        )
        metrics["training/global_step"] = global_step
        self.last_batch = batch
        return metrics

    def _on_policy(self, rows: int) -> bool:
        """Whether the actor's old log-probs are the current policy's, so the step skips
        their pass: one mini-batch of all `rows`, one epoch, no KL in the reward, and not
        bypass mode (which trains against the rollout's log-probs)."""
        actor_cfg = self.cfg.actor_rollout_ref.actor
        return (
            actor_cfg.ppo_mini_batch_size * self.sampling.n >= rows
            and actor_cfg.ppo_epochs == 1
            and not self.cfg.algorithm.use_kl_in_reward
            and not self.bypass
        )

    def _update_args(self, role, global_step: int, fields: tuple[str, ...]) -> dict[str, Any]:
        """`Learner.update`'s arguments for the actor or critic config `role` at a step."""
        return {
            "mini_batch_rows": role.ppo_mini_batch_size * self.sampling.n,
            "epochs": role.ppo_epochs,
            "shuffle": role.shuffle,
            "seed": role.data_loader_seed + global_step,
            "micro_rows": role.ppo_micro_batch_size_per_gpu,
            "token_budget": role.ppo_max_token_len_per_gpu if role.use_dynamic_bsz else None,
            "fields": fields,
            "balance": self.cfg.trainer.balance_batch,
        }

    def compile_step(self, val_prompts: int | None = None) -> dict[str, jax.stages.Compiled]:
        """Every program of a step (and of validation, for `val_prompts` prompts), compiled
        for the largest batch the config allows but not run: for their memory analysis
        (`python -m jaxrl.doctor`). Single-process runs.

        Generation takes `train_batch_size` prompts of `max_prompt_length` tokens. The passes
        and updates take `worst_case_batch`: one full-length row among rows of one prompt and
        one response token, which the micro-batch planner packs into its widest micro-batch
        (its rows padded to the full row; with `use_dynamic_bsz` that is as many rows as
        the token budget admits of the short ones, many more than of full rows)."""
        cfg, actor_rollout_ref = self.cfg, self.cfg.actor_rollout_ref
        prompts, n = cfg.data.train_batch_size, self.sampling.n
        p, r = cfg.data.max_prompt_length, self.sampling.max_tokens
        programs = {"generate": self._compile_generate(prompts, self.sampling)}
        if val_prompts:
            programs["validate generate"] = self._compile_generate(val_prompts, self.val_sampling)
        on_policy = self._on_policy(prompts * n)
        fields = ("advantages", "old_log_probs")
        fields += ("ref_log_probs",) if self.ref_params is not None else ()
        fields += CRITIC_FIELDS if self.critic is not None else ()
        batch = worst_case_batch(prompts * n, p, r, fields)
        infer_args = dict(layout=self.train_layout, **self._log_prob_micro())
        if not on_policy and not self.bypass:
            programs["actor log-probs"] = compile_infer(
                self._log_prob, self.actor.params, batch, **infer_args
            )
        if self.ref_params is not None:
            programs["ref log-probs"] = compile_infer(
                self._ref_log_prob, self.ref_params, batch, **infer_args
            )
        if self.critic is not None:
            programs["critic values"] = compile_infer(
                self._values,
                self.critic.params,
                batch,
                layout=self.train_layout,
                **self._values_micro(),
            )
            args = self._update_args(cfg.critic, 1, CRITIC_FIELDS)
            update = self.critic.compile_update(batch, **args)
            programs.update({f"critic {k}": v for k, v in update.items()})
        actor_fields = self._actor_fields(batch, on_policy)
        update = self.actor.compile_update(
            batch, **self._update_args(actor_rollout_ref.actor, 1, actor_fields)
        )
        programs.update({f"actor {k}": v for k, v in update.items()})
        return programs

    def _compile_generate(self, prompts: int, sampling: SamplingParams) -> jax.stages.Compiled:
        """`generate`'s program for `prompts` full-length prompts, on the rollout copy of the
        actor's weights (abstract: `generate` makes that copy, `reshard`, for each call)."""
        p = self.cfg.data.max_prompt_length
        rollout_params = placed_abstract(
            self.actor.params, self._rollout_shardings, self.rollout_config.param_dtype
        )
        return compile_generate(
            self.rollout_config,
            rollout_params,
            np.zeros((prompts, p), np.int32),
            np.ones((prompts, p), np.int32),
            sampling,
            layout=self.rollout_layout,
            max_num_seqs=self.cfg.actor_rollout_ref.rollout.max_num_seqs,
        )

    def memory_plan(self, val_prompts: int | None = None) -> MemoryPlan:
        """The step's device memory estimate from `compile_step`'s programs (see
        `jaxrl.trainer.memory`)."""
        resident: dict[str, Any] = {"actor": self.actor.state}
        arguments = {
            "actor log-probs": self.actor.params,
            "actor micro-batch": self.actor.params,
            "actor optimizer": self.actor.state,
        }
        if self.ref_params is not None:
            resident["ref"] = arguments["ref log-probs"] = self.ref_params
        if self.critic is not None:
            resident["critic"] = self.critic.state
            arguments["critic values"] = arguments["critic micro-batch"] = self.critic.params
            arguments["critic optimizer"] = self.critic.state
        return memory_plan(self.compile_step(val_prompts), resident, arguments)

    def _actor_fields(self, batch, on_policy: bool) -> tuple[str, ...]:
        optional = ("ref_log_probs", "rollout_is_weights")
        fields = ("advantages", *(() if on_policy else ("old_log_probs",)))
        return fields + tuple(name for name in optional if name in batch)

    def _values_micro(self) -> dict[str, Any]:
        c = self.cfg.critic
        return {
            "micro_rows": c.forward_micro_batch_size_per_gpu,
            "token_budget": c.forward_max_token_len_per_gpu if c.use_dynamic_bsz else None,
            "balance": self.cfg.trainer.balance_batch,
        }

    def _log_prob_micro(self) -> dict[str, Any]:
        r = self.cfg.actor_rollout_ref.rollout
        budget = r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None
        return {
            "micro_rows": r.log_prob_micro_batch_size_per_gpu,
            "token_budget": budget,
            "balance": self.cfg.trainer.balance_batch,
        }


def gather_processes(
    batch: dict[str, np.ndarray],
    group_ids: np.ndarray,
    extra: dict[str, list],
    reward_metrics: dict[str, float],
) -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, list], dict[str, float]]:
    """The step's rows of every process, concatenated in process order (process p holds slice
    p of the global batch, so this is the global batch), on every process: the batch's
    arrays, the group ids (positions in the global batch already), the scorer's extra info
    (None for the rows of a process whose scorer did not return a key), and the reward
    manager's metrics (summed: the built-in managers report counts, `reward/errors` and
    `reward/timeouts`)."""
    rows = gather_rows({**batch, "__group_ids": group_ids})
    group_ids = rows.pop("__group_ids")
    every = allgather_objects((len(batch["responses"]), extra, reward_metrics))
    keys = sorted({k for _, e, _ in every for k in e})
    extra = {k: [v for count, e, _ in every for v in e.get(k, [None] * count)] for k in keys}
    names = sorted({k for _, _, m in every for k in m})
    reward_metrics = {k: float(sum(m.get(k, 0.0) for _, _, m in every)) for k in names}
    return rows, group_ids, extra, reward_metrics


def _prefixed(metrics: dict[str, float], role: str) -> dict[str, float]:
    return {k if "/" in k else f"{role}/{k}": v for k, v in metrics.items()}
