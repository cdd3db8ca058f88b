"""PPO and its relatives over a cluster: one RL step with verl's semantics
(`RayPPOTrainer.fit`'s body), validation, and the checkpointable state.

    step(prompts) :
      sync_weights  actor -> rollout (jitted reshard); generate n responses per prompt; free
      reward        scores on the last valid response token (host)
      old_log_prob  actor pass (skipped on-policy: one mini-batch, one epoch, no KL in reward,
                    no optimal token baseline, which reads its sum_pi_squared, no decoupled
                    rollout correction)
      ref           reference log-probs (KL loss / KL in reward)
      values        critic pass (GAE)
      adv           KL in reward, decoupled rollout correction (IS weights, rejection), the
                    advantage estimator (jitted); PF-PPO resamples rows
      update_critic, update_actor (after `critic_warmup` steps)

From the reward on, the step's data is one `RLBatch` on the trainer's devices: the passes
gather their micro-batches from it and write their results into it on the devices, and the
host reads back only the responses (for the reward), each update's metrics and, once, the
finished batch (for the step's metrics, fingerprints and dumps). With several processes, each
generates (one program over the whole rollout mesh) and scores the responses to its own
prompts; then `gather_processes` gives every process the rows of all of them (through the
host), in the global batch's order, and the rest of the step (KL, advantages and their group
statistics, the passes, the metrics) computes on every process exactly what one process
holding the whole batch computes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config.checks import critic_enabled
from jaxrl.core_algos import (
    AdvantageEstimator,
    agg_loss,
    compute_rollout_correction_and_rejection_mask,
    get_kl_controller,
    pf_ppo_indices,
)
from jaxrl.data.batch import PromptBatch
from jaxrl.data.iterator import PromptIterator
from jaxrl.models.lora import split
from jaxrl.rollout import SamplingParams
from jaxrl.sharding.processes import allgather_objects, gather_rows, to_host
from jaxrl.trainer import losses
from jaxrl.trainer.advantage import (
    NEEDS_SUM_PI_SQUARED,
    compute_advantage,
    gdpo_components,
    kl_in_reward,
)
from jaxrl.trainer.batch import RLBatch, moved_to
from jaxrl.trainer.cluster import Cluster, Training
from jaxrl.trainer.compiles import compile_totals, compiles_since
from jaxrl.trainer.dynamic_sampling import (
    NO_MORE_PROMPTS,
    DynamicSamplingError,
    GroupJudge,
    GroupPool,
    metric_values,
    stream_metrics,
    too_many_batches_message,
)
from jaxrl.trainer.fingerprint import step_fingerprints
from jaxrl.trainer.generation import Generated, StepRollout
from jaxrl.trainer.learner import compile_infer, infer
from jaxrl.trainer.memory import MemoryPlan, memory_plan, worst_case_batch
from jaxrl.trainer.metrics import (
    data_metrics,
    mfu_metrics,
    throughput_metrics,
    timing_metrics,
)
from jaxrl.trainer.optim import learning_rate_schedule, make_optimizer
from jaxrl.trainer.roles import log_prob_fn, statistics_fn, top_k_fn, values_fn
from jaxrl.trainer.teachers import ROUTE, TeacherRouter
from jaxrl.trainer.validation import generation_rows, validate, write_jsonl

CRITIC_FIELDS = ("values", "returns")
DEVICE_ONLY_FIELDS = ("teacher_topk_log_probs", "teacher_topk_ids")
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

# (prompts repeated n times, responses [N, R], response_mask) -> (scores [N, R], metrics, extra)
RewardFn = Callable[[PromptBatch, np.ndarray, np.ndarray], tuple[np.ndarray, dict, dict]]


@dataclasses.dataclass
class Scored:
    """A step's generated and scored rows, before the batch is built.

    Attributes:
        rows: The global batch's host arrays (prompts, masks, responses, token_level_scores,
            group_ids, and reward_baselines / rollout_log_probs when there are any).
        device: Fields already on the devices (the rollout's log-probs, one process).
        extra: The reward function's extra info ({name: per-row list}).
        reward_metrics: The reward manager's metrics.
        conversations: The agent loop's conversations per row (None: batch generation).
    """

    rows: dict[str, np.ndarray]
    device: dict[str, jax.Array]
    extra: dict[str, list]
    reward_metrics: dict[str, float]
    conversations: list[dict[str, Any]] | None


@contextlib.contextmanager
def timer(name: str, timing: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _policy_cfg(cfg):
    """The actor's config as the policy loss reads it (bypass mode swaps the loss)."""
    actor_cfg = cfg.actor_rollout_ref.actor
    if not cfg.algorithm.rollout_correction.bypass_mode:
        return actor_cfg
    loss = dict(loss_mode="bypass_mode", rollout_correction=cfg.algorithm.rollout_correction)
    return losses.ConfigView(actor_cfg, policy_loss=loss)


def _temperature(cfg) -> float:
    rollout = cfg.actor_rollout_ref.rollout
    return rollout.temperature if rollout.do_sample else 1.0


def ppo_training(cfg, total_steps: int) -> dict[str, Training]:
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
        cfg,
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
        correction = cfg.algorithm.rollout_correction
        self.bypass = bool(correction.bypass_mode)
        self.decoupled_correction = not self.bypass and bool(
            correction.rollout_is or correction.rollout_rs
        )
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
        self.sum_pi_squared = cfg.algorithm.adv_estimator in NEEDS_SUM_PI_SQUARED
        old_names = ("log_probs", "entropy", "sum_pi_squared")
        self._log_prob = statistics_fn(
            cluster.actor.config,
            cluster.actor.layout,
            old_names if self.sum_pi_squared else old_names[:2],
            chunk,
            temperature=self.temperature,
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
        loss_cfg = cfg.distillation.distillation_loss
        self.teacher_top_k = None
        if cluster.teachers and loss_cfg.loss_mode == "forward_kl_topk":
            self.teacher_top_k = loss_cfg.topk
        self._teacher_passes = {
            name: log_prob_fn(teacher.config, teacher.layout, temperature=1.0, chunk_size=chunk)
            if self.teacher_top_k is None
            else top_k_fn(teacher.config, teacher.layout, self.teacher_top_k, chunk)
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
        self.sampling = SamplingParams.from_config(rollout_cfg)
        self.val_sampling = SamplingParams.from_config(rollout_cfg, validation=True)
        self._rollout = StepRollout(cfg, cluster, tokenizer, tools)

    @classmethod
    def create(
        cls,
        cfg,
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
        """Stop the tool runner's threads (multi-turn runs)."""
        self._rollout.close()

    # -------------------------------------------------------------------------------- step

    def step(self, prompts: PromptBatch, global_step: int) -> dict[str, float]:
        """One RL step on `prompts` (this process's rows); returns the step's metrics (the
        same on every process: from the reward on, every process holds the global batch),
        with the step's fingerprints (`jaxrl.trainer.fingerprint`).

        The batch (`RLBatch`) lives on the trainer's devices from the reward on; the host
        reads back the responses for the reward, each update's metrics, and the finished
        batch once, for the step's metrics. Each phase's timing waits for its results."""
        cfg, actor_rollout_ref = self.cfg, self.cfg.actor_rollout_ref
        actor_cfg = actor_rollout_ref.actor
        actor, ref, critic = self.cluster.actor, self.cluster.ref, self.cluster.critic
        on_device, layout = self.cluster.on_device, actor.layout
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        scalars: dict[str, jax.Array] = {}  # device metrics, read back with the batch
        compiles = compile_totals()  # the whole step's, read-back and fingerprints included
        rng = jax.random.fold_in(jax.random.key(actor_rollout_ref.rollout.seed), global_step)
        with timer("step", timing):
            if cfg.algorithm.filter_groups.enable:
                scored = self._dynamic_sampling(prompts, global_step, rng, timing, metrics)
            else:
                scored = self._scored_rows(prompts, rng, timing, metrics)
            rows = dict(scored.rows)
            routes = rows.pop(ROUTE, None)  # several teachers: each row's (host only)
            batch = RLBatch.from_host(rows, layout, **scored.device)
            metrics.update(scored.reward_metrics)
            on_policy = self._on_policy(batch.rows)
            micro = self._log_prob_micro()
            if self.bypass:
                batch = batch.replace(old_log_probs=batch.rollout_log_probs)
            elif not on_policy or self.sum_pi_squared or self.decoupled_correction:
                with timer("old_log_prob", timing), on_device("actor"):
                    old, entropy, *pi2 = infer(
                        self._log_prob, actor.params, batch, layout=layout, **micro
                    )
                    batch = batch.replace(old_log_probs=old, sum_pi_squared=pi2[0] if pi2 else None)
                    batch = jax.block_until_ready(batch)
                    scalars["actor/entropy"] = agg_loss(
                        entropy,
                        batch.loss_mask.astype(np.float32),
                        actor_cfg.loss_agg_mode,
                        loss_scale_factor=actor_cfg.loss_scale_factor,
                    )
            if ref is not None:
                with timer("ref", timing), on_device("ref"):
                    lp = infer(self._ref_log_prob, ref.params, batch, layout=ref.layout, **micro)
                    lp = moved_to(lp, layout)
                    batch = batch.replace(ref_log_probs=jax.block_until_ready(lp))
            if self._teacher_passes:
                with timer("teacher", timing):
                    batch = self._teacher_scores(batch, routes, micro)
            if critic is not None:
                with timer("values", timing), on_device("critic"):
                    values = infer(
                        self._values,
                        critic.params,
                        batch,
                        layout=critic.layout,
                        **self._values_micro(),
                    )
                    values = moved_to(values, layout)
                    batch = batch.replace(values=jax.block_until_ready(values))
            with timer("adv", timing):
                batch, beta = self._advantages(batch, scored.extra, scalars)
                conversations = scored.conversations
                if cfg.algorithm.use_pf_ppo:
                    drawn = self._pf_ppo(batch, global_step)
                    batch = batch.select(drawn)
                    conversations = conversations and [conversations[i] for i in drawn]
            if critic is not None:
                with timer("update_critic", timing), on_device("critic", optimizer=True):
                    critic_metrics = critic.update(
                        batch, **self._update_args(cfg.critic, global_step, CRITIC_FIELDS)
                    )
                    metrics.update(_prefixed(critic_metrics, "critic"))
            if global_step >= cfg.trainer.critic_warmup:
                with timer("update_actor", timing), on_device("actor", optimizer=True):
                    fields = self._actor_fields(batch, on_policy)
                    actor_metrics = actor.update(
                        batch, **self._update_args(actor_cfg, global_step, fields)
                    )
                    metrics.update(_prefixed(actor_metrics, "actor"))
                    if actor_cfg.use_kl_loss:
                        metrics["actor/kl_coef"] = actor_cfg.kl_loss_coef
                    metrics["actor/lr"] = float(self._actor_lr(global_step - 1))
        # the step's one batch read-back (not the teacher's top-k: K times a log-prob array,
        # and no metric or dump reads it)
        arrays = {k: v for k, v in batch.present().items() if k not in DEVICE_ONLY_FIELDS}
        host, scalars = to_host((arrays, scalars))
        metrics.update({k: float(v) for k, v in scalars.items() if k != "current_kl"})
        if "actor/entropy" not in metrics and "actor/entropy_loss" in metrics:
            metrics["actor/entropy"] = metrics["actor/entropy_loss"]  # on-policy: no old pass
        if self.kl_ctrl is not None:
            current_kl = float(scalars["current_kl"])
            self.kl_ctrl.update(current_kl=current_kl, n_steps=batch.rows)
            metrics["actor/reward_kl_penalty"] = current_kl
            metrics["actor/reward_kl_penalty_coeff"] = float(beta)
        metrics.update(data_metrics(host, use_critic=critic is not None))
        metrics.update(timing_metrics(host, timing))
        metrics.update(throughput_metrics(host, timing["step"], self.devices))
        metrics.update(
            mfu_metrics(host, timing, self._actor_size, actor_cfg.ppo_epochs, self.devices)
        )
        metrics["training/global_step"] = global_step
        metrics.update(step_fingerprints(host, self.cluster.param_hashes()))
        if cfg.trainer.rollout_data_dir:
            self._dump_rollout(host, global_step, cfg.trainer.rollout_data_dir, conversations)
        metrics.update(compiles_since(compiles))
        return metrics

    def _advantages(
        self, batch: RLBatch, extra: dict[str, list], scalars: dict[str, jax.Array]
    ) -> tuple[RLBatch, float | None]:
        """KL in the reward (its current KL into `scalars`), then the advantage estimator,
        jitted on the devices; returns the batch with rewards, advantages and returns, and
        the KL coefficient used (None without KL in the reward)."""
        beta = None
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
        if self.decoupled_correction:
            batch = self._rollout_correction(batch, scalars)
        inputs = {k: v for k, v in batch.present().items() if k in ADVANTAGE_INPUTS}
        components = gdpo_components(self.cfg.algorithm, extra)
        adv, ret = self._advantage(inputs, components)
        return batch.replace(advantages=adv, returns=jax.block_until_ready(ret)), beta

    def _rollout_correction(self, batch: RLBatch, scalars: dict[str, jax.Array]) -> RLBatch:
        """verl's decoupled rollout correction (`algorithm.rollout_correction` without
        `bypass_mode`): importance weights and rejection from the recomputed old log-probs
        against the rollout's (`compute_rollout_correction_and_rejection_mask`); the
        rejection mask replaces the loss mask (advantages and losses skip rejected tokens)
        and the actor's loss multiplies its per-token terms by the weights. Its
        `rollout_corr/*` metrics go to `scalars`."""
        if batch.rollout_log_probs is None:
            raise ValueError(
                "algorithm.rollout_correction needs the rollout's log-probs, and this "
                "rollout returned none"
            )
        weights, mask, corr_metrics = self._correction(
            batch.old_log_probs, batch.rollout_log_probs, batch.loss_mask.astype(jnp.float32)
        )
        scalars.update(corr_metrics)
        return batch.replace(
            loss_mask=mask.astype(batch.loss_mask.dtype), rollout_is_weights=weights
        )

    def _scored_rows(
        self,
        prompts: PromptBatch,
        rng: jax.Array,
        timing: dict[str, float],
        metrics: dict[str, float],
        *,
        on_host: bool = False,
    ) -> Scored:
        """Generate `rollout.n` responses per prompt and score them (and ReMax's greedy
        baselines): the global batch's rows, on every process (`gather_processes`). The
        rollout's log-probs stay on the devices (one process) unless `on_host`."""
        n, layout = self.sampling.n, self.cluster.actor.layout
        with timer("gen", timing):
            generated = self.generate(prompts, self.sampling, rng)
            rows, log_probs = generated.rows, generated.log_probs
            metrics.update(generated.metrics)
        repeated = generated.scored(prompts.repeat(n))
        group_ids = repeated.group_ids
        with timer("reward", timing):
            scores, reward_metrics, extra = self.reward_fn(
                repeated, rows["responses"], rows["response_mask"]
            )
            rows["token_level_scores"] = scores.astype(np.float32)
        rows.update(self._host_fields(repeated))
        if self.cfg.algorithm.adv_estimator == AdvantageEstimator.REMAX:
            with timer("gen_max", timing):
                greedy = dataclasses.replace(
                    self.sampling, do_sample=False, temperature=0.0, n=1, over_sample_rate=0.0
                )  # every prompt's baseline: never aborted
                base = self.generate(prompts, greedy, rng).rows
                base_scores, _, _ = self.reward_fn(
                    prompts, base["responses"], base["response_mask"]
                )
                rows["reward_baselines"] = np.repeat(base_scores.sum(-1), n, axis=0)
        device: dict[str, jax.Array] = {}
        conversations = generated.conversations
        if jax.process_count() > 1:
            with timer("gather", timing):
                if log_probs is not None:
                    rows["rollout_log_probs"] = log_probs
                rows, group_ids, extra, reward_metrics = gather_processes(
                    rows, group_ids, extra, reward_metrics
                )
        elif log_probs is not None and on_host:
            rows["rollout_log_probs"] = np.asarray(to_host(log_probs))
        elif log_probs is not None:
            device["rollout_log_probs"] = moved_to(log_probs, layout)
        rows = {**rows, "group_ids": np.asarray(group_ids, np.int32)}
        return Scored(rows, device, extra, reward_metrics, conversations)

    def _teacher_scores(
        self, batch: RLBatch, routes: np.ndarray | None, micro: dict[str, Any]
    ) -> RLBatch:
        """The batch with the teachers' log-probs (or top-k) of its response tokens: each
        teacher's pass over the rows `routes` gives it (None: the one teacher, every row),
        the results (zeros on the rows of other teachers) summed into the train layout."""
        if self.router is not None and routes is None:  # every teacher would score every row
            raise ValueError(f"several distillation teachers, but the step's rows carry no {ROUTE}")
        total = None
        for name, teacher in self.cluster.teachers.items():
            rows = None if routes is None else np.flatnonzero(routes == self.router.index(name))
            if rows is not None and not len(rows):
                continue
            with self.cluster.on_device(name):
                out = infer(
                    self._teacher_passes[name], teacher.params, batch, layout=teacher.layout,
                    rows=rows, **micro,
                )  # fmt: skip
                out = jax.block_until_ready(moved_to(out, self.cluster.actor.layout))
            total = out if total is None else jax.tree.map(jnp.add, total, out)
        if self.teacher_top_k is None:
            return batch.replace(teacher_log_probs=total)
        return batch.replace(teacher_topk_log_probs=total[0], teacher_topk_ids=total[1])

    def _host_fields(self, prompts: PromptBatch) -> dict[str, np.ndarray]:
        """Per-row host arrays the step's rows carry besides the generation's and the
        reward's: each row's teacher (several teachers)."""
        return self.router.host_fields(prompts) if self.router is not None else {}

    def _dynamic_sampling(
        self,
        prompts: PromptBatch,
        global_step: int,
        rng: jax.Array,
        timing: dict[str, float],
        metrics: dict[str, float],
    ) -> Scored:
        """DAPO's dynamic sampling (`jaxrl.trainer.dynamic_sampling`): generation batches
        from `prompts` on (the next ones from `prompt_source`) until `train_batch_size`
        groups whose `filter_groups.metric` varies (or singletons) exist; their first
        `train_batch_size`. Batch k > 0 samples from `fold_in(key(seed + 3), step)` folded
        with k (batch 0 from the step's key), so a resumed run generates the same."""
        fg, target = self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        if fg.streaming:
            return self._streamed_sampling(prompts, rng, timing, metrics)
        extra_key = jax.random.fold_in(
            jax.random.key(self.cfg.actor_rollout_ref.rollout.seed + 3), global_step
        )
        pool = GroupPool()
        while True:
            key = rng if pool.batches == 0 else jax.random.fold_in(extra_key, pool.batches)
            scored = self._scored_rows(prompts, key, timing, metrics, on_host=True)
            values = metric_values(fg.metric, scored.rows["token_level_scores"], scored.extra)
            conversations = scored.conversations if jax.process_count() == 1 else None
            pool.add(scored.rows, scored.extra, conversations, values)
            if pool.full(target, fg.max_num_gen_batches):
                break
            if self.prompt_source is None:
                raise ValueError(NO_MORE_PROMPTS)
            prompts = next(self.prompt_source)
        rows, extra, conversations = pool.take(target)
        metrics.update(pool.metrics(target))
        return Scored(rows, {}, extra, scored.reward_metrics, conversations)

    def _streamed_sampling(
        self,
        prompts: PromptBatch,
        rng: jax.Array,
        timing: dict[str, float],
        metrics: dict[str, float],
    ) -> Scored:
        """`filter_groups.streaming`: groups through the engine's slots, judged as they end,
        until `train_batch_size` are kept (`jaxrl.trainer.dynamic_sampling`); the step's key
        samples them. `max_num_gen_batches` bounds the groups started (x the generation
        batch's prompts)."""
        fg, target = self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        judge = GroupJudge(self.reward_fn, fg.metric, timing, self._host_fields)
        limit = fg.max_num_gen_batches
        start = time.perf_counter()
        result = self._rollout.stream(
            judge.batches(prompts, self.prompt_source), self.sampling, rng, judge,
            target=target, max_groups=limit * len(prompts) if limit > 0 else None,
        )  # fmt: skip
        timing["gen"] = time.perf_counter() - start - timing.get("reward", 0.0)
        if result.stats.kept < target:
            raise DynamicSamplingError(too_many_batches_message(result.stats.batches, limit))
        rows, extra = judge.take(target)
        metrics.update(stream_metrics(result.stats, target))
        return Scored(rows, {}, extra, judge.reward_metrics, None)

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
        return validate(self, loader, global_step, self.cfg.trainer.validation_data_dir)

    # ----------------------------------------------------------------------- checkpoint state

    def state_items(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The cluster's checkpoint arrays and JSON, with the KL controller's coefficient."""
        items, meta = self.cluster.state_items()
        meta["kl_coef"] = None if self.kl_ctrl is None else float(self.kl_ctrl.value)
        return items, meta

    def restore(self, items: dict[str, Any], meta: dict[str, Any]) -> None:
        self.cluster.restore(items, meta)
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
        actor, ref, critic = self.cluster.actor, self.cluster.ref, self.cluster.critic
        prompts, n = cfg.data.train_batch_size, self.sampling.n
        p, r = cfg.data.max_prompt_length, self.sampling.max_tokens
        rollout = self.cluster.rollout
        generated = cfg.data.gen_batch_size or prompts  # dynamic sampling's generation batch
        programs = {"generate": rollout.compile(actor.params, generated, p, self.sampling)}
        if val_prompts:
            programs["validate generate"] = rollout.compile(
                actor.params, val_prompts, p, self.val_sampling
            )
        on_policy = self._on_policy(prompts * n)
        fields = ("advantages", "old_log_probs")
        fields += ("ref_log_probs",) if ref is not None else ()
        top_k = self.teacher_top_k  # None without a teacher
        fields += ("teacher_log_probs",) if self._teacher_passes and top_k is None else ()
        fields += CRITIC_FIELDS if critic is not None else ()
        batch = worst_case_batch(prompts * n, p, r, fields)
        if top_k is not None:
            shape = (prompts * n, r, top_k)
            batch = batch.replace(
                teacher_topk_log_probs=jax.ShapeDtypeStruct(shape, np.float32),
                teacher_topk_ids=jax.ShapeDtypeStruct(shape, np.int32),
            )
        micro = self._log_prob_micro()
        if (not on_policy or self.sum_pi_squared or self.decoupled_correction) and not self.bypass:
            programs["actor log-probs"] = compile_infer(
                self._log_prob, actor.params, batch, layout=actor.layout, **micro
            )
        if ref is not None:
            programs["ref log-probs"] = compile_infer(
                self._ref_log_prob, ref.params, batch, layout=ref.layout, **micro
            )
        for name, teacher in self.cluster.teachers.items():
            programs[f"{name} log-probs"] = compile_infer(
                self._teacher_passes[name], teacher.params, batch, layout=teacher.layout, **micro
            )
        if critic is not None:
            programs["critic values"] = compile_infer(
                self._values, critic.params, batch, layout=critic.layout, **self._values_micro()
            )
            args = self._update_args(cfg.critic, 1, CRITIC_FIELDS)
            update = critic.compile_update(batch, **args)
            programs.update({f"critic {k}": v for k, v in update.items()})
        actor_fields = self._actor_fields(batch, on_policy)
        update = actor.compile_update(
            batch, **self._update_args(actor_rollout_ref.actor, 1, actor_fields)
        )
        programs.update({f"actor {k}": v for k, v in update.items()})
        return programs

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
                if cluster.learners[name].frozen is not None:
                    whole["base"] = cluster.learners[name].frozen
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
        keeps_base = cluster.actor.frozen is not None and not cluster.specs["actor"].param_offload
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
        return memory_plan(
            self.compile_step(val_prompts),
            resident,
            arguments,
            reloaded,
            host,
            groups=groups,
            phases={"weight sync": sync},
        )

    def _actor_fields(self, batch: RLBatch, on_policy: bool) -> tuple[str, ...]:
        optional = ("ref_log_probs", "teacher_log_probs", "teacher_topk_log_probs",
                    "teacher_topk_ids", "rollout_is_weights")  # fmt: skip
        fields = ("advantages", *(() if on_policy else ("old_log_probs",)))
        return fields + tuple(name for name in optional if getattr(batch, name) is not None)

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
