"""`async_training.mode=fully_async`: the rollout generates groups continuously on devices of
its own while the trainer trains on those that have finished (verl's `fully_async_policy`).

    run = FullyAsync(cfg, cluster, producer, train_loader, sampling)
    experience = run.experience(prompts, global_step, rng)   # in place of producer.produce
    run.metrics(experience, actor_version, tokens, timing, window)   # async/*
    with run.validation(): ...        # validation: the rollouter paused, the weights pushed
    run.state_dict() / run.load_state_dict(state)   # the prompts drawn and not trained
    run.stop()

The rollouter thread (`jaxrl.trainer.rollouter`) keeps the engine's slots full of groups from
the feed (`jaxrl.trainer.prompt_feed`), as the staleness gate (`jaxrl.trainer.staleness`)
lets it, and queues each finished group. Step k:

    1. the loop's batch joins the feed's supply (the feed draws more from the loader itself)
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
resumed run generates them first. Several processes are not built yet (refused).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxrl.config import Config
from jaxrl.data.batch import PromptBatch
from jaxrl.rollout import SamplingParams
from jaxrl.trainer.cluster import Cluster
from jaxrl.trainer.experience import Experience, ExperienceProducer, Launched
from jaxrl.trainer.generation import Generated
from jaxrl.trainer.prompt_feed import PromptFeed
from jaxrl.trainer.rollouter import FinishedGroup, Rollouter
from jaxrl.trainer.staleness import StalenessGate

SEED_OFFSET = 4  # the groups sample from key(rollout.seed + 4): apart from the steps' keys


class FullyAsync:
    """The fully asynchronous schedule (module doc).

    Args:
        cfg: The run's config (`async_training.*`).
        cluster: The roles (the actor's weights, the rollout engine).
        producer: Scores the groups into the step's `Experience`.
        source: The train loader.
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
        if not hasattr(source, "dataset"):
            raise ValueError(
                "async_training.mode=fully_async draws prompts from the train loader: the "
                "trainer needs it as prompt_source=... (a PromptIterator)"
            )
        at = cfg.async_training
        self.cluster, self.producer, self.sampling = cluster, producer, sampling
        self.per_step = cfg.data.train_batch_size
        self.trigger, self.partial, self.timeout = (
            at.trigger_parameter_sync_step,
            at.partial_rollout,
            at.rollout_timeout,
        )
        self.seed = cfg.actor_rollout_ref.rollout.seed + SEED_OFFSET
        self.gate = StalenessGate(self.per_step, self.trigger, at.staleness_threshold)
        self.feed = PromptFeed(source)
        self.rollouter: Rollouter | None = None
        self._counts = {"dropped": 0, "aborted": 0}
        self._seen = (0.0, 0)  # the rollouter's busy seconds and tokens at the last metrics
        self._versions: np.ndarray | None = None  # this step's tokens' versions (masked)

    # ------------------------------------------------------------------------------ a step

    def experience(self, prompts: PromptBatch, global_step: int, rng) -> Experience:
        """Step `global_step`'s experience (the module doc's 1.-3.)."""
        self.feed.add(prompts)
        if self.rollouter is None:
            self._start()
        elif (global_step - 1) % self.trigger == 0:
            self._push()
        start = time.perf_counter()
        groups = self._take()
        waited = time.perf_counter() - start
        batch = self.feed.batch([g.prompt for g in groups], uid_prefix=f"{global_step}-")
        mask = np.concatenate([g.response_mask for g in groups])
        versions = np.concatenate([g.versions for g in groups])
        self._versions = versions[mask > 0]
        rows = {
            "prompts": np.repeat(batch.input_ids, self.sampling.n, axis=0),
            "prompt_mask": np.repeat(batch.attention_mask, self.sampling.n, axis=0),
            "responses": np.concatenate([g.responses for g in groups]),
            "response_mask": mask,
            "rollout_log_probs": np.concatenate([g.log_probs for g in groups]),
        }
        version = int(self._versions.min()) if self._versions.size else -1
        ready = Launched(batch, Generated(rows), version, start)
        experience = self.producer.produce(batch, global_step, rng, launched=ready)
        experience.timing["gen"] = waited  # the trainer's wait for the groups
        self.feed.trained([g.prompt for g in groups])
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
        share of the step and tokens per second while busy."""
        rollouter = self.rollouter
        lag = actor_version - self._versions if self._versions.size else np.zeros(1)
        seconds = max(window[1] - window[0], 1e-9)
        busy, sampled = rollouter.busy_s - self._seen[0], rollouter.tokens - self._seen[1]
        self._seen = (rollouter.busy_s, rollouter.tokens)
        out = {
            "async/staleness/mean": float(lag.mean()),
            "async/staleness/max": float(lag.max()),
            "async/pushes": float(self.gate.pushes),
            "async/dropped_stale_groups": float(self._counts["dropped"]),
            "async/aborted_stale_groups": float(self._counts["aborted"]),
            "async/queue_depth": float(rollouter.queue.qsize()),
            "async/groups_running": float(len(rollouter.running)),
            "async/trainer/idle_ratio": timing.get("gen", 0.0) / seconds,
            "async/rollout/idle_ratio": max(0.0, 1.0 - busy / seconds),
            "async/rollout/tokens_per_second": sampled / max(busy, 1e-9),
            "async/trainer/tokens_per_second": tokens[1] / max(seconds - timing["gen"], 1e-9),
        }
        self._counts = {"dropped": 0, "aborted": 0}
        return out

    # ---------------------------------------------------------------------- the other uses

    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        """The block (validation's generation on the same engine) with the rollouter paused
        between two chunks and the current weights pushed (a push the gate counts)."""
        if self.rollouter is None:
            yield
            return
        with self.rollouter.paused(drain=False, timeout=self.timeout):
            self._publish()
            yield

    def state_dict(self) -> dict[str, Any]:
        """The feed's pending prompts (module doc)."""
        return self.feed.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.feed.load_state_dict(state)

    def stop(self) -> None:
        if self.rollouter is not None:
            self.rollouter.stop(timeout=min(10.0, self.timeout))

    # ------------------------------------------------------------------------------ helpers

    def _start(self) -> None:
        self.cluster.sync_weights()
        self.rollouter = Rollouter(
            self.cluster.rollout.local(), self.feed, self.gate, self.sampling, self.seed,
            partial=self.partial,
        )  # fmt: skip
        self.rollouter.start()

    def _push(self) -> None:
        """The weights to the rollout between two decode chunks (after the running groups,
        without partial rollouts)."""
        with self.rollouter.paused(drain=not self.partial, timeout=self.timeout):
            self._publish()

    def _publish(self) -> None:
        """Under `paused`: sync the weights, count the push, regenerate what it made stale."""
        self.cluster.sync_weights()
        for prompt in self.rollouter.pushed():
            self.feed.requeue(prompt)
            self._counts["aborted"] += 1

    def _take(self) -> list[FinishedGroup]:
        """R finished groups within the gate's bound, in the order they finished; those past
        it go back to the feed (their starts released)."""
        groups: list[FinishedGroup] = []
        while len(groups) < self.per_step:
            group = self.rollouter.get(self.timeout)
            if self.gate.too_stale(group.push):
                with self.rollouter.lock:
                    self.gate.release()
                    self.rollouter.lock.notify_all()
                self.feed.requeue(group.prompt)
                self._counts["dropped"] += 1
                continue
            groups.append(group)
        return groups
