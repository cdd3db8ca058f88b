"""`async_training.mode=fully_async`: the rollout generates groups continuously on devices of
its own while the trainer trains on those that have finished (verl's `fully_async_policy`).

    run = FullyAsync(cfg, cluster, producer, train_loader, sampling)
    experience = run.experience(prompts, global_step, rng)   # in place of producer.produce
    run.metrics(experience, actor_version, tokens, timing, window)   # async/*
    with run.validation(): ...        # validation: the rollouter paused, the weights pushed
    run.state_dict() / run.load_state_dict(state, loader)   # the prompts drawn, not trained
    run.stop()

The rollouter thread (`jaxrl.trainer.rollouter`) keeps the engine's slots full of groups from
the feed (`jaxrl.trainer.prompt_feed`), as the staleness gate (`jaxrl.trainer.staleness`)
lets it, and queues each finished group. Step k:

    1. (the loop's batch is not used: the feed reads the loader's batches, a view of its own)
    2. every `trigger_parameter_sync_step` steps (not the first): push the actor's weights
       to the rollout between two decode chunks (the jitted reshard; LoRA: the adapters),
       the running groups continuing on them (`partial_rollout`) or, without it, ending on
       the old ones first; groups the push makes too stale are aborted and generated again
    3. take R = `require_batches` x `ppo_mini_batch_size` groups from the queue in the order
       they finished, dropping (and generating again) any past the gate's bound; score them
       on the host and train on them (the passes, the advantages, the update), while the
       rollouter goes on

The loss sees tokens up to `bound` pushes old (module doc of `jaxrl.trainer.staleness`):
the old-log-prob pass recomputes the log-probs under the current weights and
`algorithm.rollout_correction` corrects for the sampler (IS weights per token, AReaL's
decoupled objective), each token's own version recorded (`async/staleness/*`).

Not deterministic: which weights version samples which token depends on the two sides'
speeds. What is guaranteed: no trained token is more than `bound` pushes behind the weights
it is trained at, and each prompt the loader gives is trained once: a checkpoint records the
prompts drawn and not trained (running, queued, to generate again, not started), and a
resumed run generates them first.

Several processes: the rollout's devices are one process's (the rollout's "home"; e.g.
`mesh.placement.spread=false`). Its rollouter draws from a global view of the loader (every
process's rows) and makes every step's choice of groups; it posts each other process its
share of them (its slice of the global batch, as a loader gives it), with the step's staleness
summary, its feed's state and its own figures, to the coordination service's key-value store
(`jaxrl.distributed.post`), and every process trains on its share. The push is the jitted
reshard every process takes part in, the home's rollouter paused for it. A checkpoint's feed
state is the message's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.agent import LoopStats
from jaxrl.config import Config
from jaxrl.data.batch import PromptBatch
from jaxrl.rollout import SamplingParams
from jaxrl.sharding.processes import owners
from jaxrl.trainer.cluster import Cluster
from jaxrl.trainer.dynamic_sampling import (
    DynamicSamplingError,
    kept_rows,
    merged_extra,
    metric_values,
    too_many_batches_message,
)
from jaxrl.trainer.experience import Experience, ExperienceProducer, Launched
from jaxrl.trainer.generation import Generated
from jaxrl.trainer.prompt_feed import PromptFeed
from jaxrl.trainer.rollouter import FinishedGroup, Rollouter, RolloutError
from jaxrl.trainer.staleness import StalenessGate

SEED_OFFSET = 4  # the groups sample from key(rollout.seed + 4): apart from the steps' keys
_MESSAGES = distributed.StepMessages("jaxrl/fully_async/step/")  # the home's, to each process
_NO_COUNTS = {"dropped": 0, "aborted": 0, "evicted": 0}  # the rollouter's, since the last step


@dataclasses.dataclass
class StepGroups:
    """What the rollout's process hands a process for a step.

    Attributes:
        first: Where `groups` start among the step's R groups.
        groups: The process's share of the step's groups (all R with one process), in the
            order they finished.
        versions: The weights versions of every trained token of the step's R groups:
            (count, mean, min).
        feed: The feed's state once they are trained (`PromptFeed.state_dict`): a
            checkpoint's.
        rollout: The rollouter's figures: `busy_s` and `tokens` (totals), `queue_depth`,
            `running`, `dropped`, `aborted` and `evicted` (groups, since the last step).
        evicted_metrics: The reward manager's metrics of the groups dynamic sampling's
            judge evicted this step (summed).
    """

    first: int
    groups: list[FinishedGroup]
    versions: tuple[int, float, int]
    feed: dict[str, Any]
    rollout: dict[str, float]
    evicted_metrics: dict[str, float] = dataclasses.field(default_factory=dict)


class FullyAsync:
    """The fully asynchronous schedule (module doc).

    Args:
        cfg: The run's config (`async_training.*`).
        cluster: The roles (the actor's weights, the rollout engine).
        producer: Scores the groups into the step's `Experience`.
        source: The train loader (its `global_view()` is the feed's).
        sampling: The training rollout's settings.
    """

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        producer: ExperienceProducer,
        source: Any,
        sampling: SamplingParams,
    ):
        if not hasattr(source, "global_view"):
            raise ValueError(
                "async_training.mode=fully_async draws prompts from the train loader: the "
                "trainer needs it as prompt_source=... (a PromptIterator)"
            )
        homes = owners(cluster.rollout.layout.mesh.devices.flat)
        if len(homes) > 1:
            raise ValueError(
                f"async_training.mode=fully_async over several processes runs its rollouter "
                f"on one process's devices, and the rollout's are processes {sorted(homes)}'s: "
                "place the rollout on one process (mesh.placement.spread=false, "
                "mesh.placement.rollout.devices=<at most one process's devices>), or use "
                "async_training.mode=one_step_off"
            )
        processes = jax.process_count()
        if cfg.data.train_batch_size % processes:
            raise ValueError(
                f"async_training.mode=fully_async gives each of the {processes} processes an "
                f"equal share of a step's groups: data.train_batch_size="
                f"{cfg.data.train_batch_size} must be a multiple of {processes}"
            )
        if processes > 1 and cfg.algorithm.filter_groups.enable and cfg.reward_model.enable:
            raise ValueError(
                "async_training.mode=fully_async with algorithm.filter_groups over several "
                "processes judges each group on the rollout's process alone, and a reward "
                "model's pass is a program of every process: not built; use "
                "async_training.mode=sync, or a rule reward"
            )
        at = cfg.async_training
        self.cluster, self.producer, self.sampling = cluster, producer, sampling
        self.per_step = cfg.data.train_batch_size
        self.trigger, self.partial, self.timeout = (
            at.trigger_parameter_sync_step,
            at.partial_rollout,
            at.rollout_timeout,
        )
        self.home, self.processes = homes.pop(), processes
        self.here = jax.process_index() == self.home
        fg = cfg.algorithm.filter_groups
        self.metric = fg.metric if fg.enable else None  # dynamic sampling's judge
        # verl's limit counts generation batches of gen_batch_size prompts; <= 0: none
        self.gen_batch = cfg.data.gen_batch_size or self.per_step
        self.max_judged = fg.max_num_gen_batches * self.gen_batch
        self.seed = cfg.actor_rollout_ref.rollout.seed + SEED_OFFSET
        rollout = cfg.actor_rollout_ref.rollout
        self.multi_turn = rollout.multi_turn.enable  # groups of the agent loop's trajectories
        self.default_agent = rollout.agent.default_agent_loop
        self.prompt_length = cfg.data.max_prompt_length
        self._tool_wait = (time.perf_counter(), 0.0)  # at the last step: (when, tool wait s)
        self.gate = StalenessGate(self.per_step, self.trigger, at.staleness_threshold)
        self.feed = PromptFeed(source.global_view())
        self.rollouter: Rollouter | None = None
        self._started = False
        self._counts = dict(_NO_COUNTS)
        self._evicted_metrics: dict[str, float] = {}  # the reward manager's, evicted groups'
        self._state = self.feed.state_dict()  # the last step's feed state (a checkpoint's)
        self._seen = (0.0, 0)  # the rollouter's busy seconds and tokens at the last metrics
        self._step: StepGroups | None = None  # this step's message

    # ------------------------------------------------------------------------------ a step

    def experience(self, prompts: PromptBatch, global_step: int, rng) -> Experience:
        """Step `global_step`'s experience (the module doc's 1.-3.); `prompts` (the loop's
        batch) is not used: the feed reads the loader's batches itself."""
        del prompts
        if not self._started:
            self._start()
        elif (global_step - 1) % self.trigger == 0:
            self._push()
        start = time.perf_counter()
        self._step = step = self._take_step(global_step)
        waited = time.perf_counter() - start
        self._state, mine = step.feed, step.groups
        batch = self.feed.dataset.batch([g.prompt.row for g in mine], group_offset=step.first,
                                        uid_prefix=f"{global_step}-")  # fmt: skip
        version = step.versions[2]
        if self.multi_turn:  # the trajectories' rows, the agent loop's metrics (a collective)
            generated = self._agent_generated(mine)
        else:
            generated = self._generated(mine, batch, step)
        ready = Launched(batch, generated, version, start)
        experience = self.producer.produce(batch, global_step, rng, launched=ready)
        experience.timing["gen"] = waited  # the trainer's wait for the groups
        return experience

    def metrics(
        self,
        experience: Experience,
        actor_version: int,
        tokens: tuple[float, float],
        timing: dict[str, float],
        window: tuple[float, float],
    ) -> dict[str, float]:
        """`async/*` of a step (see `docs/async.md`): the tokens' staleness in weight versions
        (the trainer's at the update less each token's), the gate's pushes and the groups
        dropped or aborted as too stale since the last step, the queue, each side's idle
        share of the step and tokens per second while busy (the rollout's as its process
        measured them)."""
        step = self._step
        _, mean_version, oldest = step.versions
        seconds = max(window[1] - window[0], 1e-9)
        figures = step.rollout
        busy, sampled = figures["busy_s"] - self._seen[0], figures["tokens"] - self._seen[1]
        self._seen = (figures["busy_s"], figures["tokens"])
        judged = {}
        if self.metric is not None:
            judged["training/filter_groups/evicted_samples"] = figures["evicted"]
        return judged | {
            "async/staleness/mean": float(actor_version - mean_version),
            "async/staleness/max": float(actor_version - oldest),
            "async/pushes": float(figures["pushes"]),
            "async/dropped_stale_groups": float(figures["dropped"]),
            "async/aborted_stale_groups": float(figures["aborted"]),
            "async/queue_depth": float(figures["queue_depth"]),
            "async/groups_running": float(figures["running"]),
            "async/trainer/idle_ratio": timing.get("gen", 0.0) / seconds,
            "async/rollout/idle_ratio": max(0.0, 1.0 - busy / seconds),
            "async/rollout/tokens_per_second": sampled / max(busy, 1e-9),
            "async/trainer/tokens_per_second": tokens[1] / max(seconds - timing["gen"], 1e-9),
        }

    # ---------------------------------------------------------------------- the other uses

    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        """The block (validation's generation on the same engine) with the rollouter paused
        between two chunks (with the agent loop, after its running groups have ended: their
        trajectories hold their slots between turns) and the current weights pushed (a push
        the gate counts)."""
        if not self._started:
            yield
            return
        # the agent loop's trajectories hold their slots between turns: they end first
        with self._paused(drain=self.multi_turn):
            self._publish()
            yield

    def state_dict(self) -> dict[str, Any]:
        """The feed's pending prompts and the loader's state with them (module doc), as of
        the last step."""
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any], loader: dict[str, Any]) -> None:
        """A resumed run's feed: `state` (`state_dict` less its "loader") and the loader's
        state (the checkpoint's `data`)."""
        self.feed.loader.load_state_dict(loader)
        self.feed.load_state_dict(state)
        self._state = self.feed.state_dict()

    def stop(self) -> None:
        if self.rollouter is not None:
            self.rollouter.stop(timeout=min(10.0, self.timeout))

    # ------------------------------------------------------------------------------ helpers

    def _start(self) -> None:
        """The first weights to the rollout (every process), the rollouter (its home)."""
        self.cluster.sync_weights()
        self._started = True
        if self.here:
            agent = None
            if self.multi_turn:  # its prompts are the dataset's rows, padded to its width
                agent = self.producer.rollout.agent_loop(self.prompt_length,
                                                         self.sampling.max_tokens)  # fmt: skip
            self.rollouter = Rollouter(
                self.cluster.rollout.local(), self.feed, self.gate, self.sampling, self.seed,
                partial=self.partial, agent=agent, default_agent=self.default_agent,
            )  # fmt: skip
            self.rollouter.start()

    def _paused(self, *, drain: bool):
        """The rollouter paused between two chunks (its home; elsewhere nothing to pause)."""
        if self.rollouter is None:
            return contextlib.nullcontext()
        return self.rollouter.paused(drain=drain, timeout=self.timeout)

    def _push(self) -> None:
        """The weights to the rollout between two decode chunks (after the running groups,
        without partial rollouts)."""
        with self._paused(drain=not self.partial):
            self._publish()

    def _publish(self) -> None:
        """Under `_paused`: sync the weights (every process), count the push and regenerate
        what it made stale (the home)."""
        self.cluster.sync_weights()
        if self.rollouter is None:
            return
        for prompt in self.rollouter.pushed():
            self.feed.requeue(prompt)
            self._counts["aborted"] += 1

    def _take_step(self, global_step: int) -> StepGroups:
        """This process's share of the step's groups: taken by the home (`_take`), which
        posts each other process its own (a message of its slice: the step's rows are
        never all in one message) with the step's summary."""
        if not self.here:
            # the home waits up to the timeout for each group and for a push's drain; its
            # own failure reaches this process sooner, through the health monitor
            patience = self.timeout * (self.per_step + 2)
            data = _MESSAGES.receive(global_step, patience, to=jax.process_index())
            if data is None:
                raise RolloutError(
                    f"no groups for step {global_step} from the rollouter on process "
                    f"{self.home} in {patience:.0f} s: it is stuck or far too slow (see its "
                    "log); raise async_training.rollout_timeout if it is only slow"
                )
            return pickle.loads(data)
        groups = self._take()
        self.feed.trained([g.prompt for g in groups])
        evicted, self._evicted_metrics = self._evicted_metrics, {}
        versions = np.concatenate([g.versions[g.versions >= 0] for g in groups])  # sampled
        summary = (versions.size, float(versions.mean()), int(versions.min())) if versions.size \
            else (0, -1.0, -1)  # fmt: skip
        feed, figures = self.feed.state_dict(), self._figures()
        per = self.per_step // self.processes
        shares = [StepGroups(p * per, groups[p * per : (p + 1) * per], summary, feed, figures,
                             evicted) for p in range(self.processes)]  # fmt: skip
        for p, share in enumerate(shares):
            if p != jax.process_index():
                data = pickle.dumps(share, protocol=pickle.HIGHEST_PROTOCOL)
                _MESSAGES.send(global_step, data, to=p)
        return shares[jax.process_index()]

    def _generated(
        self, groups: list[FinishedGroup], batch: PromptBatch, step: StepGroups
    ) -> Generated:
        """This process's groups' responses as the step's rows, with dynamic sampling's
        scores when its judge scored them."""
        n = self.sampling.n
        rows = {
            "prompts": np.repeat(batch.input_ids, n, axis=0),
            "prompt_mask": np.repeat(batch.attention_mask, n, axis=0),
            "responses": np.concatenate([g.responses for g in groups]),
            "response_mask": np.concatenate([g.response_mask for g in groups]),
            "rollout_log_probs": np.concatenate([g.log_probs for g in groups]),
        }
        scores = None
        if self.metric is not None:  # scored by the judge: this process's groups' scores,
            # the evicted groups' reward metrics on process 0's (the processes' are summed)
            scores = (np.concatenate([g.scored[0] for g in groups]),
                      _summed([g.scored[1] for g in groups]
                              + ([step.evicted_metrics] if jax.process_index() == 0 else [])),
                      merged_extra([n] * len(groups), [g.scored[2] for g in groups]))  # fmt: skip
        return Generated(rows, scores=scores)

    def _agent_generated(self, groups: list[FinishedGroup]) -> Generated:
        """This process's groups' trajectories as the step's rows, with the agent loop's
        metrics; its tool-wait share is of the wall time since the last step (the rollouter's
        figures: the home's, the others' count nothing)."""
        trajectories = [t for g in groups for t in g.trajectories]
        now, waited = time.perf_counter(), self._step.rollout["tool_wait_s"]
        stats = LoopStats()
        if self.here:
            (then, before), self._tool_wait = self._tool_wait, (now, waited)
            stats = LoopStats(seconds=now - then, wait_seconds=waited - before)
        return self.producer.rollout.agent_generated(
            trajectories, stats, self.prompt_length, self.sampling.max_tokens
        )

    def _figures(self) -> dict[str, float]:
        """The rollouter's figures for `StepGroups.rollout` (its counts since the last)."""
        rollouter = self.rollouter
        figures = {
            "tool_wait_s": rollouter.tool_wait_s,
            "busy_s": rollouter.busy_s,
            "tokens": float(rollouter.tokens),
            "queue_depth": float(rollouter.queue.qsize()),
            "running": float(len(rollouter.running)),
            "pushes": float(self.gate.pushes),
            **{k: float(v) for k, v in self._counts.items()},
        }
        self._counts = dict(_NO_COUNTS)
        return figures

    def _take(self) -> list[FinishedGroup]:
        """R finished groups within the gate's bound, in the order they finished; those past
        it go back to the feed (their starts released). With dynamic sampling each is
        judged as it comes (`_judged`): an evicted group's prompt is used up (as DAPO's) and
        its start released, so the rollouter makes another in its place."""
        groups: list[FinishedGroup] = []
        judged = 0
        while len(groups) < self.per_step:
            group = self.rollouter.get(self.timeout)
            stale = self.gate.too_stale(group.push)
            evicted = not stale and self.metric is not None and not self._judged(group)
            if stale or evicted:
                self.rollouter.give_back()
            if stale:
                self.feed.requeue(group.prompt)
                self._counts["dropped"] += 1
                continue
            judged += self.metric is not None
            if evicted:
                self.feed.trained([group.prompt])
                self._counts["evicted"] += 1
                if 0 < self.max_judged <= judged:
                    raise DynamicSamplingError(
                        too_many_batches_message(-(-judged // self.gen_batch),
                                                 self.max_judged // self.gen_batch)
                    )  # fmt: skip
                continue
            groups.append(group)
        return groups

    def _judged(self, group: FinishedGroup) -> bool:
        """Score `group` with the trainer's reward function (kept in `group.scored`) and
        judge it by DAPO's rule (`jaxrl.trainer.dynamic_sampling`: kept when its responses'
        `filter_groups.metric` varies); an evicted group's reward metrics are summed in."""
        n = len(group.responses)
        prompts = self.feed.dataset.batch([group.prompt.row]).repeat(n)
        scores, reward_metrics, extra = self.producer.reward_fn(
            prompts, group.responses, group.response_mask
        )
        scores = np.asarray(scores, np.float32)
        _, kept = kept_rows(np.zeros(n, np.int32), metric_values(self.metric, scores, extra))
        if kept:
            extra = {k: list(v) for k, v in extra.items()}
            group.scored = (scores, dict(reward_metrics), extra)
        else:
            self._evicted_metrics = _summed([self._evicted_metrics, reward_metrics])
        return bool(kept)


def _summed(parts: list[dict[str, float]]) -> dict[str, float]:
    """The reward manager's metrics of several parts, summed (they are counts)."""
    names = sorted({k for part in parts for k in part})
    return {k: float(sum(part.get(k, 0.0) for part in parts)) for k in names}
