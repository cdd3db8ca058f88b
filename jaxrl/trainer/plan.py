"""The step plan: which passes a PPO step runs and which batch fields each update reads,
decided once, from the config and the cluster, for `step`, `compile_step` and `memory_plan`.

    plan = StepPlan.of(cfg, cluster, n=sampling.n)
    plan.passes              # e.g. ("old_log_prob", "ref", "values"), in dispatch order
    plan.actor_fields        # what the actor update reads beyond the rows' tokens
    plan.batch_fields        # every float field of a step's batch (the worst-case batch's)
    plan.held_fields         # those and the rest the batch holds from scoring to the updates

Who needs what (each entry names the config, or the estimator's registered
`EstimatorInputs`, that asks for it):

    pass / field         run or read when
    old_log_prob         the actor's old log-probs are not the current policy's (more than one
      old_log_probs      mini-batch or epoch, KL in the reward, an async mode's older
                         sampler), or the estimator reads `sum_pi_squared` (the optimal
                         token baselines), or decoupled rollout correction compares them
                         with the rollout's; not in bypass mode (the rollout's log-probs are
                         the old ones)
    ref                  a reference model (`use_kl_loss`, `use_kl_in_reward`)
      ref_log_probs      the actor reads them with `use_kl_loss`; KL in the reward reads them
                         before the advantages
    teacher              distillation teachers
      teacher_log_probs  (or the top-k pair with `forward_kl_topk`) the actor's loss
    values               a critic (`critic.enable`; unset, an estimator reading `values`: gae)
      values, returns    the critic update
    rollout_is_weights   decoupled rollout correction: the actor's loss

The fields an update reads are its loss terms' (`losses.ACTOR_TERM_FIELDS`, `CRITIC_FIELDS`):
the plan turns the terms on from the config, the losses module says what each reads.
"""

from __future__ import annotations

import dataclasses

from jaxrl.config import Config
from jaxrl.core_algos import estimator_inputs
from jaxrl.trainer.cluster import Cluster
from jaxrl.trainer.losses import ACTOR_TERM_FIELDS, CRITIC_FIELDS


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A step's passes and fields (module doc).

    Attributes:
        passes: The passes that run, in dispatch order (names are their `timing_s/*`).
        groups: Each pass's device group (`Cluster.device_group` of its role).
        on_policy: The actor's old log-probs are the current policy's (the update
            computes them itself: `stop_gradient` of its own).
        bypass: The rollout's log-probs are the old ones (bypass mode).
        sum_pi_squared: The old-log-prob pass also returns sum_v pi_v^2.
        correction: Decoupled rollout correction (IS weights, rejection) before the
            advantages.
        teacher_top_k: The teachers return their top-k (None: the sampled tokens' log-probs).
        serial_updates: The actor's update waits for the critic's: both on the trainer's
            devices with state offloaded, which would otherwise come back to the devices
            while the other update runs (the memory plan counts one update at a time).
        actor_fields: The actor update's fields beyond the rows' tokens.
        critic_fields: The critic update's.
    """

    passes: tuple[str, ...]
    groups: dict[str, str]
    on_policy: bool
    bypass: bool
    sum_pi_squared: bool
    correction: bool
    teacher_top_k: int | None
    serial_updates: bool
    actor_fields: tuple[str, ...]
    critic_fields: tuple[str, ...]

    @classmethod
    def of(cls, cfg: Config, cluster: Cluster, *, n: int) -> StepPlan:
        """The plan of `cfg`'s steps over `cluster` (`n` responses per prompt)."""
        actor_cfg, algorithm = cfg.actor_rollout_ref.actor, cfg.algorithm
        correction_cfg = algorithm.rollout_correction
        bypass = bool(correction_cfg.bypass_mode)
        correction = not bypass and bool(correction_cfg.rollout_is or correction_cfg.rollout_rs)
        inputs = estimator_inputs(algorithm.adv_estimator)
        if inputs.values and cluster.critic is None:
            raise ValueError(
                f"algorithm.adv_estimator={algorithm.adv_estimator} reads a critic's values "
                "and this run has no critic: set critic.enable=true (verl enables one by "
                "default for gae only)"
            )
        sum_pi_squared = inputs.sum_pi_squared
        on_policy = (
            actor_cfg.ppo_mini_batch_size * n >= cfg.data.train_batch_size * n
            and actor_cfg.ppo_epochs == 1
            and not algorithm.use_kl_in_reward
            and not bypass
            and cfg.async_training.mode == "sync"  # else sampled by an older policy
        )
        loss_cfg = cfg.distillation.distillation_loss
        top_k = None
        if cluster.teachers and loss_cfg.loss_mode == "forward_kl_topk":
            top_k = loss_cfg.topk
        passes = []
        if not bypass and (not on_policy or sum_pi_squared or correction):
            passes.append("old_log_prob")
        if cluster.ref is not None:
            passes.append("ref")
        if cluster.teachers:
            passes.append("teacher")
        if cluster.critic is not None:
            passes.append("values")
        roles = {"old_log_prob": "actor", "ref": "ref", "values": "critic"}
        groups = {p: cluster.device_group(roles[p]) for p in passes if p in roles}
        if cluster.teachers:
            groups["teacher"] = cluster.device_group(next(iter(cluster.teachers)))
        terms = {
            "policy": True,
            "off_policy": not on_policy,
            "kl_loss": actor_cfg.use_kl_loss,
            "distillation": bool(cluster.teachers) and top_k is None,
            "distillation_top_k": bool(cluster.teachers) and top_k is not None,
            "rollout_correction": correction,
        }
        actor_fields = [f for term, on in terms.items() if on for f in ACTOR_TERM_FIELDS[term]]
        serial_updates = (
            cluster.critic is not None
            and groups.get("values") == "train"
            and any(cluster.specs[r].offloads for r in ("actor", "critic"))
        )
        return cls(
            passes=tuple(passes),
            groups=groups,
            on_policy=on_policy,
            bypass=bypass,
            sum_pi_squared=sum_pi_squared,
            correction=correction,
            teacher_top_k=top_k,
            serial_updates=serial_updates,
            actor_fields=tuple(actor_fields),
            critic_fields=CRITIC_FIELDS if cluster.critic is not None else (),
        )

    def runs(self, name: str) -> bool:
        """Whether pass `name` runs."""
        return name in self.passes

    @property
    def held_fields(self) -> tuple[str, ...]:
        """The [N, R] float fields the step's batch holds on the devices from scoring
        through the updates: `batch_fields`, the rollout's log-probs, the scores, the
        rewards and the returns."""
        more = ("rollout_log_probs", "token_level_scores", "token_level_rewards", "returns")
        return tuple(dict.fromkeys((*self.batch_fields, *more)))

    @property
    def batch_fields(self) -> tuple[str, ...]:
        """The [N, R] float fields a step's batch carries for its passes and updates."""
        fields = ["advantages", "old_log_probs"]
        fields += ["ref_log_probs"] if self.runs("ref") else []
        fields += ["sum_pi_squared"] if self.sum_pi_squared else []
        fields += ["rollout_is_weights"] if self.correction else []
        fields += ["teacher_log_probs"] if self.runs("teacher") and not self.teacher_top_k else []
        fields += list(self.critic_fields)
        return tuple(fields)
