"""PPO and its relatives over a cluster: one RL step with verl's semantics
(`RayPPOTrainer.fit`'s body), validation, and the checkpointable state.

    step(prompts) :
      experience    `ExperienceProducer.produce` (`jaxrl.trainer.experience`): the actor's
                    weights to the rollout (once per version), n responses per prompt,
                    scores on the last valid response token (host), dynamic sampling,
                    the process gather; `async_training.mode=one_step_off`: the batch
                    generated during the previous step, the next one dispatched first
                    (`jaxrl.trainer.one_step_off`)
      passes        the plan's (`StepPlan`, `jaxrl.trainer.plan`), dispatched without
                    waiting for each other:
        old_log_prob  actor pass (skipped on-policy: one mini-batch, one epoch, no KL in
                      reward, no optimal token baseline, which reads its sum_pi_squared, no
                      decoupled rollout correction)
        ref           reference log-probs (KL loss / KL in reward)
        teacher       distillation teachers' log-probs (or top-k)
        values        critic pass (GAE)
      adv           KL in reward, decoupled rollout correction (IS weights, rejection), the
                    advantage estimator (jitted); PF-PPO resamples rows
      update_critic, update_actor (after `critic_warmup` steps), dispatched without waiting
                    for each other; their metrics stay on the devices

From the reward on, the step's data is one `RLBatch` on the trainer's devices, its rows split
over the data axes: the passes gather their micro-batches from it and write their results
into it on the devices, and the host reads back only the responses (for the reward) and, once,
the finished batch's rows with the updates' and the passes' device metrics (the step's
metrics are made from a few numbers per row, `row_summaries`; the fingerprints are hashed on
the devices). With several processes, each generates (one program over the whole rollout
mesh) and scores the responses to its own prompts, places its own rows on its own devices
(the ones that hold them in the trainer's layout) and reads back only those; what crosses
the hosts is every row's lengths (the micro-batch plan), the scorer's extra info and the
rows' summaries. KL, the advantages and their group statistics and the passes run over the
split rows on the devices, exactly what one process computes. Where the processes' devices
do not hold their own rows (rows that do not divide by the data shards), and after dynamic
sampling (whose pool is host data), every process gets the rows of all of them
(`gather_processes`) as before.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import Config
from jaxrl.config.checks import critic_enabled
from jaxrl.core_algos import (
    agg_loss,
    compute_rollout_correction_and_rejection_mask,
    get_kl_controller,
    pf_ppo_indices,
)
from jaxrl.data.batch import PromptBatch
from jaxrl.data.iterator import PromptIterator
from jaxrl.models.config import DecoderConfig
from jaxrl.models.lora import split
from jaxrl.rollout import SamplingParams
from jaxrl.sharding.layouts import placed_abstract
from jaxrl.sharding.processes import gather_rows, read_rows, received_bytes, to_host
from jaxrl.trainer import losses
from jaxrl.trainer.advantage import (
    compute_advantage,
    gdpo_components,
    kl_in_reward,
)
from jaxrl.trainer.batch import RLBatch, moved_to, place_rows, rows_sharding
from jaxrl.trainer.cluster import Cluster, Training
from jaxrl.trainer.compiles import compile_totals, compiles_since
from jaxrl.trainer.experience import (
    Experience,
    ExperienceProducer,
    RewardFn,
    step_key,
    timer,
)
from jaxrl.trainer.fingerprint import step_fingerprints
from jaxrl.trainer.fully_async import FullyAsync
from jaxrl.trainer.generation import Generated, StepRollout
from jaxrl.trainer.learner import UpdateMetrics, average, compile_infer, infer
from jaxrl.trainer.memory import MemoryPlan, memory_plan, worst_case_batch
from jaxrl.trainer.metrics import (
    data_metrics,
    mfu_metrics,
    rollout_probs_diff,
    row_summaries,
    throughput_metrics,
    timing_metrics,
    token_counts,
)
from jaxrl.trainer.one_step_off import OneStepOff
from jaxrl.trainer.optim import learning_rate_schedule, make_optimizer
from jaxrl.trainer.plan import StepPlan
from jaxrl.trainer.roles import log_prob_fn, statistics_fn, top_k_fn, values_fn
from jaxrl.trainer.spans import Spans
from jaxrl.trainer.teachers import ROUTE, TeacherRouter
from jaxrl.trainer.validation import generation_rows, validate, write_jsonl

DEVICE_ONLY_FIELDS = (
    "teacher_topk_log_probs",
    "teacher_topk_ids",
    "prompt_routed_experts",
    "response_routed_experts",
)
# what the advantage estimators read of the batch
ADVANTAGE_INPUTS = (
    "token_level_rewards",
    "loss_mask",
    "group_ids",
    "values",
    "reward_baselines",
    "prompt_mask",
    "response_mask",
    "old_log_probs",
    "sum_pi_squared",
    "rollout_is_weights",
)


def _policy_cfg(cfg: Config):
    """The actor's config as the policy loss reads it (bypass mode swaps the loss)."""
    actor_cfg = cfg.actor_rollout_ref.actor
    if not cfg.algorithm.rollout_correction.bypass_mode:
        return actor_cfg
    loss = dict(loss_mode="bypass_mode", rollout_correction=cfg.algorithm.rollout_correction)
    return losses.ConfigView(actor_cfg, policy_loss=loss)


def _temperature(cfg: Config) -> float:
    rollout = cfg.actor_rollout_ref.rollout
    return rollout.temperature if rollout.do_sample else 1.0


def ppo_training(cfg: Config, total_steps: int) -> dict[str, Training]:
    """What PPO trains: the actor with the policy loss and, with a critic, the critic with
    the value loss; each optimizer's schedule counts its updates per step (mini-batches x
    epochs) over `total_steps` steps."""
    actor_cfg, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    rows = cfg.data.train_batch_size * n

    def updates(role) -> int:
        return -(-rows // (role.ppo_mini_batch_size * n)) * role.ppo_epochs

    policy_cfg, temperature = _policy_cfg(cfg), _temperature(cfg)
    distill = cfg.distillation.distillation_loss if cfg.distillation.enabled else None
    training = {
        "actor": Training(
            lambda config: functools.partial(
                losses.actor_loss,
                config=config,
                actor_cfg=policy_cfg,
                temperature=temperature,
                distill_cfg=distill,
            ),
            make_optimizer(actor_cfg.optim, total_steps, updates_per_step=updates(actor_cfg)),
            actor_cfg.grad_clip,
        )
    }
    if critic_enabled(cfg):
        c = cfg.critic
        training["critic"] = Training(
            lambda config: functools.partial(losses.critic_loss, config=config, critic_cfg=c),
            make_optimizer(c.optim, total_steps, updates_per_step=updates(c)),
            c.grad_clip,
        )
    return training


class PPOTrainer:
    """PPO / GRPO (and verl's other estimators) over a cluster: the step (`step`), validation
    (`validate`) and the checkpointable state (`state_items`, `restore`): the `Trainer`
    protocol that `fit` drives.

    Args:
        cfg: The run's `jaxrl.config.Config`.
        cluster: The run's roles (`Cluster.load(cfg, ppo_training(cfg, total_steps))`).
        reward_fn: Scores training responses (see `RewardFn`).
        total_steps: Steps of the run (the learning-rate schedule's length).
        val_reward_fn: Scores validation responses; default `reward_fn`.
        tokenizer: Decodes the rollout and validation dumps (`rollout_data_dir`,
            `validation_data_dir`); None: no dumps.
        tools: The multi-turn run's tools by name; None: those of
            `multi_turn.tool_config_path`.
        prompt_source: The iterator `step`'s prompts come from (the train loader): dynamic
            sampling takes its further generation batches from it, so the loader's saved
            state covers them.

    A cluster loaded with `abstract=True` only compiles (`compile_step`, `memory_plan`).
    """

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        reward_fn: RewardFn,
        *,
        total_steps: int,
        val_reward_fn: RewardFn | None = None,
        tokenizer: Any = None,
        tools: dict[str, Any] | None = None,
        prompt_source: Iterator[PromptBatch] | None = None,
    ):
        dumps = [k for k in ("rollout_data_dir", "validation_data_dir") if getattr(cfg.trainer, k)]
        if dumps and tokenizer is None:
            raise ValueError(
                f"trainer.{dumps[0]} is set: PPOTrainer needs the tokenizer (tokenizer=...) to "
                "decode the dumped generations"
            )
        self.cfg, self.cluster, self.tokenizer = cfg, cluster, tokenizer
        self.prompt_source = prompt_source
        self.reward_fn, self.val_reward_fn = reward_fn, val_reward_fn or reward_fn
        actor_cfg, rollout_cfg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
        self.devices = cluster.num_devices
        self._actor_size = sum(x.size for x in jax.tree.leaves(cluster.actor.params))
        self.sampling = SamplingParams.from_config(rollout_cfg)
        self.val_sampling = SamplingParams.from_config(rollout_cfg, validation=True)
        self.plan = plan = StepPlan.of(cfg, cluster, n=self.sampling.n)
        correction = cfg.algorithm.rollout_correction
        self._correction = jax.jit(
            functools.partial(
                compute_rollout_correction_and_rejection_mask,
                rollout_is=correction.rollout_is,
                rollout_is_threshold=correction.rollout_is_threshold,
                rollout_is_batch_normalize=correction.rollout_is_batch_normalize,
                rollout_rs=correction.rollout_rs,
                rollout_rs_threshold=correction.rollout_rs_threshold,
            )
        )
        self._actor_lr = learning_rate_schedule(actor_cfg.optim, total_steps)
        self.temperature = _temperature(cfg)
        chunk = (
            actor_cfg.entropy_from_logits_chunk_size
            if actor_cfg.entropy_from_logits_with_chunking
            else None
        )
        # the old-log-prob pass: log-probs, entropy and, for the optimal-token-baseline
        # estimators, sum_v pi_v^2 (then the pass runs on-policy too)
        old_names = ("log_probs", "entropy", "sum_pi_squared")
        self._replay = _router_replay(cfg, cluster.actor.config)
        self._log_prob = statistics_fn(
            cluster.actor.config,
            cluster.actor.layout,
            old_names if plan.sum_pi_squared else old_names[:2],
            chunk,
            temperature=self.temperature,
            record_routes=self._replay["actor"] == "R2",
        )
        if cluster.ref is not None:
            self._ref_log_prob = log_prob_fn(
                cluster.ref.config,
                cluster.ref.layout,
                temperature=self.temperature,
                chunk_size=chunk,
            )
        # Each teacher's pass, from its raw logits (vLLM's default `raw_logprobs`, which
        # verl's teacher server returns): the sampled tokens' log-probs, or its top-k. With
        # several teachers each scores the rows routed to it (`jaxrl.trainer.teachers`).
        self._teacher_passes = {
            name: log_prob_fn(teacher.config, teacher.layout, temperature=1.0, chunk_size=chunk)
            if plan.teacher_top_k is None
            else top_k_fn(teacher.config, teacher.layout, plan.teacher_top_k, chunk)
            for name, teacher in cluster.teachers.items()
        }
        self.router = TeacherRouter.from_config(cfg)
        if cluster.critic is not None:
            self._values = values_fn(cluster.critic.config, cluster.critic.layout)
        self.kl_ctrl = (
            get_kl_controller(cfg.algorithm.kl_ctrl) if cfg.algorithm.use_kl_in_reward else None
        )
        self._kl_in_reward = jax.jit(
            functools.partial(kl_in_reward, penalty=cfg.algorithm.kl_penalty)
        )
        self._advantage = jax.jit(functools.partial(compute_advantage, algorithm=cfg.algorithm))
        pf = cfg.algorithm.pf_ppo
        self._pf_ppo_rows = jax.jit(
            lambda key, scores: pf_ppo_indices(
                key, scores.sum(-1), pf.reweight_method, pf.weight_pow
            )
        )
        self._rollout = StepRollout(cfg, cluster, tokenizer, tools)
        self.producer = ExperienceProducer(
            cfg, cluster, self._rollout, self.sampling, reward_fn,
            router=self.router, prompt_source=prompt_source,
        )  # fmt: skip
        # the rollout ahead of the trainer (`docs/async.md`): None, or the schedule that
        # makes each step's experience in place of `producer.produce`
        self.ahead: OneStepOff | FullyAsync | None = None
        if cfg.async_training.mode == "one_step_off":
            self.ahead = OneStepOff(
                self.producer, prompt_source, total_steps=total_steps,
                save_freq=cfg.trainer.save_freq, seed=rollout_cfg.seed,
            )  # fmt: skip
        elif cfg.async_training.mode == "fully_async":
            self.ahead = FullyAsync(cfg, cluster, self.producer, prompt_source, self.sampling)

    @classmethod
    def create(
        cls,
        cfg: Config,
        reward_fn: RewardFn,
        *,
        total_steps: int,
        val_reward_fn: RewardFn | None = None,
        tokenizer: Any = None,
        devices=None,
        abstract: bool = False,
        prompt_source: Iterator[PromptBatch] | None = None,
    ) -> PPOTrainer:
        """A trainer over a freshly loaded cluster (`Cluster.load`; see its `abstract`)."""
        cluster = Cluster.load(
            cfg,
            ppo_training(cfg, total_steps),
            tokenizer=tokenizer,
            devices=devices,
            abstract=abstract,
        )
        return cls(
            cfg,
            cluster,
            reward_fn,
            total_steps=total_steps,
            val_reward_fn=val_reward_fn,
            tokenizer=tokenizer,
            prompt_source=prompt_source,
        )

    # ----------------------------------------------------------------------------- rollout

    def generate(self, prompts: PromptBatch, sampling: SamplingParams, rng: jax.Array) -> Generated:
        """The generated batch (prompts repeated n times, interleaved): host rows for the
        reward and the dumps, the rollout's log-probs, and the agent loop's metrics and
        conversations with `multi_turn.enable` (`jaxrl.trainer.generation`). With several
        processes, the rows of this process's `prompts` (every process calls this with its
        own prompts and the same rng: generation is one program over all of them)."""
        return self._rollout.generate(prompts, sampling, rng)

    def close(self) -> None:
        """Stop the tool runner's threads (multi-turn runs) and the fully asynchronous
        rollouter."""
        if isinstance(self.ahead, FullyAsync):
            self.ahead.stop()
        self._rollout.close()

    # -------------------------------------------------------------------------------- step

    def step(self, prompts: PromptBatch, global_step: int) -> dict[str, float]:
        """One RL step on `prompts` (this process's rows); returns the step's metrics (the
        same on every process: from the reward on, every process holds the global batch),
        with the step's fingerprints (`jaxrl.trainer.fingerprint`).

        The batch (`RLBatch`) lives on the trainer's devices from the reward on; the host
        reads back the responses for the reward and, once, the finished batch with the
        updates' and passes' device metrics, for the step's metrics. The passes
        (`plan.passes`) and the updates are dispatched one after another without waiting
        for each other (on separate device groups they run at once); each phase's timing
        spans from its start to its results' readiness (`Spans`)."""
        cfg, actor_rollout_ref = self.cfg, self.cfg.actor_rollout_ref
        actor_cfg = actor_rollout_ref.actor
        actor, critic = self.cluster.actor, self.cluster.critic
        layout = actor.layout
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        self.spans = spans = Spans()  # the device phases, none waited for on its own
        compiles = compile_totals()  # the whole step's, read-back and fingerprints included
        received = received_bytes()
        rng = step_key(actor_rollout_ref.rollout.seed, global_step)
        version, began = actor.version, time.perf_counter()
        with timer("step", timing):
            if self.ahead is not None:  # generated ahead (`docs/async.md`)
                experience = self.ahead.experience(prompts, global_step, rng)
            else:
                experience = self.producer.produce(prompts, global_step, rng)
            timing.update(experience.timing)
            metrics.update(experience.metrics)
            batch = _batch(experience, layout)
            batch, pass_scalars = self._passes(batch, experience.routes, spans)
            start = time.perf_counter()
            batch, beta, adv_scalars = self._advantages(batch, experience.extra)
            spans.track("adv", start, batch.advantages)
            scalars = {**pass_scalars, **adv_scalars}  # device metrics, read with the batch
            conversations = experience.conversations
            if cfg.algorithm.use_pf_ppo:
                drawn = self._pf_ppo(batch, global_step)
                batch = batch.select(drawn)
                conversations = conversations and [conversations[i] for i in drawn]
            updates = self._updates(batch, global_step, spans)
            timing.update(spans.seconds())  # waits for the devices: the step includes them
        # the step's one batch read-back (not the teacher's top-k: K times a log-prob array,
        # and no metric or dump reads it), with the updates' metrics
        arrays = {k: v for k, v in batch.present().items() if k not in DEVICE_ONLY_FIELDS}
        steps = {role: pending.steps for role, pending in updates.items()}
        fingerprints = step_fingerprints(batch.present(), self.cluster.param_hashes())
        summaries, host = self._read_back(arrays, experience)
        scalars, steps = to_host((scalars, steps))
        for role, role_steps in steps.items():
            metrics.update(_prefixed(average(role_steps), role))
        if "actor" in updates:
            if actor_cfg.use_kl_loss:
                metrics["actor/kl_coef"] = actor_cfg.kl_loss_coef
            metrics["actor/lr"] = float(self._actor_lr(global_step - 1))
        metrics.update({k: float(v) for k, v in scalars.items() if k != "current_kl"})
        if "actor/entropy" not in metrics and "actor/entropy_loss" in metrics:
            metrics["actor/entropy"] = metrics["actor/entropy_loss"]  # on-policy: no old pass
        if self.kl_ctrl is not None:
            current_kl = float(scalars["current_kl"])
            self.kl_ctrl.update(current_kl=current_kl, n_steps=batch.num_rows)
            metrics["actor/reward_kl_penalty"] = current_kl
            metrics["actor/reward_kl_penalty_coeff"] = float(beta)
        widths = (batch.prompts.shape[1], batch.responses.shape[1])
        metrics.update(data_metrics(summaries, widths, use_critic=critic is not None))
        metrics.update(timing_metrics(summaries, timing))
        metrics.update(throughput_metrics(summaries, timing["step"], self.devices))
        metrics.update(
            mfu_metrics(summaries, timing, self._actor_size, actor_cfg.ppo_epochs, self.devices)
        )
        metrics["training/global_step"] = global_step
        metrics.update(fingerprints)
        if cfg.trainer.rollout_data_dir:
            self._dump_rollout(host, global_step, cfg.trainer.rollout_data_dir, conversations)
        metrics.update(compiles_since(compiles))
        metrics["perf/host_bytes_received"] = float(received_bytes() - received)
        if self.ahead is not None:
            window = (began, time.perf_counter())
            metrics.update(self.ahead.metrics(experience, version, token_counts(summaries),
                                              timing, window))  # fmt: skip
        return metrics

    def _read_back(
        self, arrays: dict[str, jax.Array], experience: Experience
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
        """The rows' summaries for the step's metrics (`row_summaries`, of every row) and the
        batch on the host where the rollout dump needs it (`trainer.rollout_data_dir`; else
        None). A process that holds its own rows (`experience.held`) reads only those from
        its devices and gathers the summaries (a few numbers per row); otherwise the batch is
        read whole."""
        use_critic = self.cluster.critic is not None
        held = experience.held()
        if held is None:
            host = to_host(arrays)
            return row_summaries(host, use_critic), host
        first, count = held
        own = read_rows(arrays, first, first + count)
        summaries = gather_rows(row_summaries(own, use_critic))
        host = to_host(arrays) if self.cfg.trainer.rollout_data_dir else None
        return summaries, host

    def _updates(self, batch: RLBatch, global_step: int, spans: Spans) -> dict[str, UpdateMetrics]:
        """The critic's update, then (past `critic_warmup`) the actor's, each dispatched
        without waiting for the other (on separate device groups they run at once; on the
        same devices with offloaded state, the actor's waits for the critic's); their metrics
        stay on the devices, by role."""
        cfg, cluster, plan = self.cfg, self.cluster, self.plan
        updates: dict[str, UpdateMetrics] = {}
        if cluster.critic is not None:
            start = time.perf_counter()
            with cluster.on_device("critic", optimizer=True):
                args = self._update_args(cfg.critic, global_step, plan.critic_fields)
                updates["critic"] = cluster.critic.dispatch_update(batch.without_routes(),
                                                                   **args)  # fmt: skip
            spans.track(
                "update_critic", start, updates["critic"].steps, group=plan.groups["values"]
            )
        if global_step >= cfg.trainer.critic_warmup:
            if "critic" in updates and plan.serial_updates:
                jax.block_until_ready(updates["critic"].steps)
            start, actor_cfg = time.perf_counter(), cfg.actor_rollout_ref.actor
            with cluster.on_device("actor", optimizer=True):
                args = self._update_args(actor_cfg, global_step, plan.actor_fields)
                updates["actor"] = cluster.actor.dispatch_update(batch, **args)
            spans.track("update_actor", start, updates["actor"].steps)
        return updates

    def _passes(
        self, batch: RLBatch, routes: np.ndarray | None, spans: Spans
    ) -> tuple[RLBatch, dict[str, jax.Array]]:
        """The plan's passes over `batch` (old log-probs, reference, teachers, values), each
        dispatched without waiting for those before; their results in the train layout, and
        their device metrics (the old policy's entropy)."""
        plan, cluster = self.plan, self.cluster
        actor, ref, critic = cluster.actor, cluster.ref, cluster.critic
        layout, batching = actor.layout, self._log_prob_batching()
        scalars: dict[str, jax.Array] = {}
        if plan.bypass:
            batch = batch.replace(old_log_probs=batch.rollout_log_probs)
        with_rollout_routes = batch
        if self._replay["actor"] != "R3":  # R2 records its own; disabled: native routes
            batch = batch.without_routes()
        if plan.runs("old_log_prob"):
            start, actor_cfg = time.perf_counter(), self.cfg.actor_rollout_ref.actor
            record = self._replay["actor"] == "R2"
            with cluster.on_device("actor"):
                old, entropy, *rest = infer(self._log_prob, actor.params, batch, layout=layout,
                                            prompt_outputs=int(record), **batching)  # fmt: skip
            spans.track("old_log_prob", start, old, group=plan.groups["old_log_prob"])
            if record:  # R2: the update replays the old policy's routes
                *rest, response_routes, prompt_routes = rest
                batch = batch.replace(prompt_routed_experts=prompt_routes,
                                      response_routed_experts=response_routes)  # fmt: skip
            batch = batch.replace(old_log_probs=old, sum_pi_squared=rest[0] if rest else None)
            if batch.rollout_log_probs is not None:
                scalars.update(rollout_probs_diff(old, batch.rollout_log_probs,
                                                  batch.response_mask))  # fmt: skip
            scalars["actor/entropy"] = agg_loss(
                entropy,
                batch.loss_mask.astype(np.float32),
                actor_cfg.loss_agg_mode,
                loss_scale_factor=actor_cfg.loss_scale_factor,
            )
        if plan.runs("ref"):
            start = time.perf_counter()
            # the reference replays the rollout's routes (R3) or routes natively
            ref_batch = (
                with_rollout_routes if self._replay["ref"] == "R3" else batch.without_routes()
            )
            with cluster.on_device("ref"):
                lp = infer(self._ref_log_prob, ref.params, ref_batch, layout=ref.layout,
                           **batching)  # fmt: skip
                lp = moved_to(lp, layout)
            spans.track("ref", start, lp, group=plan.groups["ref"])
            batch = batch.replace(ref_log_probs=lp)
        if plan.runs("teacher"):
            batch = self._teacher_scores(batch, routes, batching, spans)
        if plan.runs("values"):
            start = time.perf_counter()
            with cluster.on_device("critic"):
                values = infer(self._values, critic.params, batch.without_routes(),
                               layout=critic.layout, **self._values_batching())  # fmt: skip
                values = moved_to(values, layout)
            spans.track("values", start, values, group=plan.groups["values"])
            batch = batch.replace(values=values)
        return batch, scalars

    def _advantages(
        self, batch: RLBatch, extra: dict[str, list]
    ) -> tuple[RLBatch, float | None, dict[str, jax.Array]]:
        """KL in the reward, then the advantage estimator, jitted on the devices; returns the
        batch with rewards, advantages and returns, the KL coefficient used (None without KL
        in the reward), and the device metrics (`current_kl`, `rollout_corr/*`)."""
        beta, scalars = None, {}
        if self.kl_ctrl is not None:
            beta = float(self.kl_ctrl.value)
            rewards, scalars["current_kl"] = self._kl_in_reward(
                batch.token_level_scores,
                batch.old_log_probs,
                batch.ref_log_probs,
                batch.loss_mask,
                jnp.float32(beta),
            )
        else:
            rewards = batch.token_level_scores
        batch = batch.replace(token_level_rewards=rewards)
        if self.plan.correction:
            batch, corr_metrics = self._rollout_correction(batch)
            scalars.update(corr_metrics)
        inputs = {k: v for k, v in batch.present().items() if k in ADVANTAGE_INPUTS}
        components = gdpo_components(self.cfg.algorithm, extra)  # every row's, on each host
        components = {k: place_rows(v, self.cluster.actor.layout) for k, v in components.items()}
        adv, ret = self._advantage(inputs, components)
        return batch.replace(advantages=adv, returns=ret), beta, scalars

    def _rollout_correction(self, batch: RLBatch) -> tuple[RLBatch, dict[str, jax.Array]]:
        """verl's decoupled rollout correction (`algorithm.rollout_correction` without
        `bypass_mode`): importance weights and rejection from the recomputed old log-probs
        against the rollout's (`compute_rollout_correction_and_rejection_mask`); the
        rejection mask replaces the loss mask (advantages and losses skip rejected tokens)
        and the actor's loss multiplies its per-token terms by the weights. Returns the
        batch and the `rollout_corr/*` metrics (on the devices)."""
        if batch.rollout_log_probs is None:
            raise ValueError(
                "algorithm.rollout_correction needs the rollout's log-probs, and this "
                "rollout returned none"
            )
        weights, mask, corr_metrics = self._correction(
            batch.old_log_probs, batch.rollout_log_probs, batch.loss_mask.astype(jnp.float32)
        )
        batch = batch.replace(
            loss_mask=mask.astype(batch.loss_mask.dtype), rollout_is_weights=weights
        )
        return batch, corr_metrics

    def _teacher_scores(
        self, batch: RLBatch, routes: np.ndarray | None, batching: dict[str, Any], spans: Spans
    ) -> RLBatch:
        """The batch with the teachers' log-probs (or top-k) of its response tokens: each
        teacher's pass over the rows `routes` gives it (None: the one teacher, every row),
        the results (zeros on the rows of other teachers) summed into the train layout. The
        passes are the phase "teacher" of `spans`."""
        if self.router is not None and routes is None:  # every teacher would score every row
            raise ValueError(f"several distillation teachers, but the step's rows carry no {ROUTE}")
        total = None
        for name, teacher in self.cluster.teachers.items():
            rows = None if routes is None else np.flatnonzero(routes == self.router.index(name))
            if rows is not None and not len(rows):
                continue
            start = time.perf_counter()
            with self.cluster.on_device(name):
                out = infer(
                    self._teacher_passes[name], teacher.params, batch, layout=teacher.layout,
                    row_ids=rows, **batching,
                )  # fmt: skip
                out = moved_to(out, self.cluster.actor.layout)
            spans.track("teacher", start, out, group=self.cluster.device_group(name))
            total = out if total is None else jax.tree.map(jnp.add, total, out)
        if self.plan.teacher_top_k is None:
            return batch.replace(teacher_log_probs=total)
        return batch.replace(teacher_topk_log_probs=total[0], teacher_topk_ids=total[1])

    def _pf_ppo(self, batch: RLBatch, global_step: int) -> np.ndarray:
        """PF-PPO (`algorithm.use_pf_ppo`): N rows of the batch drawn with replacement by
        their scores' weights (`jaxrl.core_algos.reweight`), host int [N], from the step's
        own key (seed `rollout.seed + 2`; validation draws from + 1), so a resumed run draws
        the same rows."""
        key = jax.random.fold_in(
            jax.random.key(self.cfg.actor_rollout_ref.rollout.seed + 2), global_step
        )
        return np.asarray(to_host(self._pf_ppo_rows(key, batch.token_level_scores)))

    def validate(self, loader: PromptIterator, global_step: int) -> dict[str, float]:
        """One pass over the validation set: verl's `val-core/*`, `val-aux/*` metrics (and
        the generations dumped to `validation_data_dir`)."""
        paused = self.ahead.validation() if self.ahead is not None else nullcontext()
        with paused, self._rollout.holding():  # one weight copy for every batch
            return validate(self, loader, global_step, self.cfg.trainer.validation_data_dir)

    # ----------------------------------------------------------------------- checkpoint state

    def state_items(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The cluster's checkpoint arrays and JSON, with the KL controller's coefficient."""
        items, meta = self.cluster.state_items()
        meta["kl_coef"] = None if self.kl_ctrl is None else float(self.kl_ctrl.value)
        if isinstance(self.ahead, FullyAsync):  # the prompts drawn and not trained
            feed = self.ahead.state_dict()
            meta["data"] = feed.pop("loader")  # the loader's state that goes with them
            meta["async_feed"] = feed
        return items, meta

    def restore(self, items: dict[str, Any], meta: dict[str, Any]) -> None:
        self.cluster.restore(items, meta)
        if isinstance(self.ahead, FullyAsync) and meta.get("async_feed") is not None:
            self.ahead.load_state_dict(meta["async_feed"], meta["data"])
        if self.kl_ctrl is not None and meta.get("kl_coef") is not None:
            self.kl_ctrl.value = meta["kl_coef"]

    def _dump_rollout(
        self,
        batch: dict[str, np.ndarray],
        step: int,
        folder: str,
        conversations: list[dict[str, Any]] | None = None,
    ) -> None:
        """verl's `rollout_data_dir`: the step's generations as JSON lines (process 0: every
        process holds the whole batch), multi-turn ones with their whole conversation."""
        if self.tokenizer is None or jax.process_index() != 0:
            return
        scores = batch["token_level_scores"].sum(-1)
        rows = generation_rows(self.tokenizer, batch, scores, step, conversations=conversations)
        write_jsonl(rows, Path(folder).expanduser() / f"{step}.jsonl")

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
        actor, ref, critic = self.cluster.actor, self.cluster.ref, self.cluster.critic
        prompts, p = cfg.data.train_batch_size, cfg.data.max_prompt_length
        rollout = self.cluster.rollout
        generated = cfg.data.gen_batch_size or prompts  # dynamic sampling's generation batch
        programs = {"generate": rollout.compile(actor.params, generated, p, self.sampling)}
        if val_prompts:
            programs["validate generate"] = rollout.compile(
                actor.params, val_prompts, p, self.val_sampling
            )
        plan = self.plan
        batch = self._worst_batch()
        batching = self._log_prob_batching()
        if plan.runs("old_log_prob"):
            programs["actor log-probs"] = compile_infer(
                self._log_prob, actor.params, batch, layout=actor.layout, **batching
            )
        if plan.runs("ref"):
            programs["ref log-probs"] = compile_infer(
                self._ref_log_prob, ref.params, batch, layout=ref.layout, **batching
            )
        for name, teacher in self.cluster.teachers.items():
            programs[f"{name} log-probs"] = compile_infer(
                self._teacher_passes[name], teacher.params, batch, layout=teacher.layout, **batching
            )
        if plan.runs("values"):
            programs["critic values"] = compile_infer(
                self._values, critic.params, batch, layout=critic.layout, **self._values_batching()
            )
            args = self._update_args(cfg.critic, 1, plan.critic_fields)
            update = critic.compile_update(batch, **args)
            programs.update({f"critic {k}": v for k, v in update.items()})
        update = actor.compile_update(
            batch, **self._update_args(actor_rollout_ref.actor, 1, plan.actor_fields)
        )
        programs.update({f"actor {k}": v for k, v in update.items()})
        return programs

    def _worst_batch(self, held: bool = False) -> RLBatch:
        """The largest step's batch, abstract (`worst_case_batch`): the fields its passes and
        updates take (`held`: every field it holds), with the distillation teacher's top-k
        when there is one, and the routes to replay (R2, R3)."""
        prompts, n = self.cfg.data.train_batch_size, self.sampling.n
        p, r, plan = self.cfg.data.max_prompt_length, self.sampling.max_tokens, self.plan
        batch = worst_case_batch(prompts * n, p, r, plan.held_fields if held else plan.batch_fields)
        if plan.teacher_top_k is not None:
            shape = (prompts * n, r, plan.teacher_top_k)
            batch = batch.replace(
                teacher_topk_log_probs=jax.ShapeDtypeStruct(shape, np.float32),
                teacher_topk_ids=jax.ShapeDtypeStruct(shape, np.int32),
            )
        if self._replay["actor"] != "disabled":
            config = self.cluster.actor.config
            routes = (config.num_layers, config.moe.top_k)
            batch = batch.replace(
                prompt_routed_experts=jax.ShapeDtypeStruct((prompts * n, p, *routes), np.int32),
                response_routed_experts=jax.ShapeDtypeStruct((prompts * n, r, *routes), np.int32),
            )
        return batch

    def memory_plan(self, val_prompts: int | None = None) -> MemoryPlan:
        """The step's device memory estimate from `compile_step`'s programs (see
        `jaxrl.trainer.memory`): each role's resident state, less what it offloads, which
        counts only for the programs that bring it back."""
        cluster = self.cluster
        roles = [*cluster.learners, *cluster.frozen]
        resident = {name: cluster.resident(name) for name in roles}
        passes = {"actor": "actor log-probs", "ref": "ref log-probs", "critic": "critic values"}
        passes.update({name: f"{name} log-probs" for name in cluster.teachers})
        host, arguments, reloaded = {}, {}, {}
        groups = {name: cluster.device_group(name) for name in (*roles, "rollout")}
        for name in roles:
            kept = resident[name]
            model = {k: kept[k] for k in ("params", "base") if k in kept} or None  # LoRA: base
            arguments[passes[name]] = model
            groups[passes[name]] = groups[name]
            if name in cluster.learners:
                state = cluster.learners[name].state
                whole = {"params": state.params, "opt_state": state.opt_state}
                if cluster.learners[name].base is not None:
                    whole["base"] = cluster.learners[name].base
                for program in ("micro-batch", "optimizer"):
                    groups[f"{name} {program}"] = groups[name]
                arguments[f"{name} micro-batch"] = model
                arguments[f"{name} optimizer"] = kept
                if "opt_state" not in kept:  # back on the devices for the whole update
                    reloaded[f"{name} micro-batch"] = state.opt_state
            else:
                whole = {"params": cluster.frozen[name].params}
            if offloaded := {k: v for k, v in whole.items() if k not in kept}:
                host[name] = offloaded
        # The rollout's copy of the weights: made for each generation when colocated, kept
        # between steps on a group of its own. The weight sync holds the copy (colocated) and
        # the actor's offloaded parameters, which it copies from, on the trainer's group.
        if cluster.shared_ref:  # LoRA: the reference pass reads the actor's base
            arguments["ref log-probs"] = resident["actor"].get("base")
            groups["ref log-probs"] = groups["actor"]
        copy = cluster.rollout.copy_of(cluster.actor.params)
        sync = [] if "params" in resident["actor"] else [cluster.actor.params]
        keeps_base = cluster.actor.base is not None and not cluster.specs["actor"].param_offload
        if keeps_base and cluster.rollout_colocated:
            # LoRA: the base copy stays between steps, the adapters are made for each sync
            base_copy, adapters_copy = split(copy)
            resident["rollout"] = {"params": base_copy}
            sync.append(adapters_copy)
        elif cluster.rollout_colocated:
            sync.append(copy)
        else:
            resident["rollout"] = {"params": copy}
        for program in ("generate", "validate generate"):
            groups[program] = groups["rollout"]
            arguments[program] = resident.get("rollout")
        groups["weight sync"] = groups["actor"]
        programs = self.compile_step(val_prompts)
        # The step's batch, its rows split over the trainer's data axes (and copied to a
        # placed role's) from scoring through the updates: not during generation.
        fields = {k: v for k, v in vars(self._worst_batch(held=True)).items()
                  if isinstance(v, jax.ShapeDtypeStruct)}  # fmt: skip
        layout = cluster.actor.layout
        held = fields if layout is None else placed_abstract(
            fields, {k: rows_sharding(layout, v.shape) for k, v in fields.items()}
        )  # fmt: skip
        during = tuple(name for name in programs if "generate" not in name)
        return memory_plan(
            programs,
            resident,
            arguments,
            reloaded,
            host,
            groups=groups,
            phases={"weight sync": sync},
            batch=(held, during),
        )

    def _values_batching(self) -> dict[str, Any]:
        c = self.cfg.critic
        return {
            "micro_rows": c.forward_micro_batch_size_per_gpu,
            "token_budget": c.forward_max_token_len_per_gpu if c.use_dynamic_bsz else None,
            "balance": self.cfg.trainer.balance_batch,
        }

    def _log_prob_batching(self) -> dict[str, Any]:
        r = self.cfg.actor_rollout_ref.rollout
        budget = r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None
        return {
            "micro_rows": r.log_prob_micro_batch_size_per_gpu,
            "token_budget": budget,
            "balance": self.cfg.trainer.balance_batch,
        }


def _router_replay(cfg: Config, config: DecoderConfig) -> dict[str, str]:
    """The actor's and the reference's routing-replay modes (`disabled`, `R2`, `R3`), checked
    against the model: replay needs a mixture of experts."""
    arr = cfg.actor_rollout_ref
    modes = {"actor": arr.actor.router_replay.mode, "ref": arr.ref.router_replay.mode}
    for role, mode in modes.items():
        if mode != "disabled" and config.moe is None:
            raise ValueError(
                f"actor_rollout_ref.{role}.router_replay.mode={mode}: the model "
                f"({arr.model.path}) is not a mixture of experts; set it to disabled"
            )
    if arr.rollout.enable_rollout_routing_replay and config.moe is None:
        raise ValueError(
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true: the model "
            f"({arr.model.path}) is not a mixture of experts; set it to false"
        )
    return modes


def _batch(experience: Experience, layout) -> RLBatch:
    """The step's batch on the trainer's devices from its experience (each process placing
    its own rows when it holds only those)."""
    rows, log_probs = dict(experience.rows), experience.rollout_log_probs
    where = {"span": experience.span, "owners": experience.owners, "lengths": experience.lengths}
    if log_probs is None or isinstance(log_probs, jax.Array):
        return RLBatch.from_host(rows, layout, **where, rollout_log_probs=log_probs)
    return RLBatch.from_host({**rows, "rollout_log_probs": log_probs}, layout, **where)


def _prefixed(metrics: dict[str, float], role: str) -> dict[str, float]:
    return {k if "/" in k else f"{role}/{k}": v for k, v in metrics.items()}
