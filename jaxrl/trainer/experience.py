"""The experience producer: a step's scored rows, made apart from the step that trains on them.

    producer = ExperienceProducer(cfg, cluster, rollout, sampling, reward_fn, router=...,
                                  prompt_source=...)
    experience = producer.produce(prompts, global_step, rng)
    experience.rows              # host arrays: this process's rows (`span`), or the batch's
    experience.rollout_log_probs # the rollout's log-probs: their one home (devices or host)
    experience.timing            # gen, reward, gen_max, gather (seconds)
    experience.metrics           # the agent loop's, dynamic sampling's, the reward manager's
    launched = producer.launch(prompts, rng)   # the generation only, dispatched, not waited for
    producer.produce(prompts, global_step, rng, launched=launched)   # ... read and scored later

`produce`:

    generate  `rollout.n` responses per prompt (`StepRollout`: batch generation, or the agent
              loop) with the actor's weights, published once for all of the call's
              generations (one `StepRollout.holding` block)
    score     the reward function on the host; ReMax's greedy baselines
    filter    DAPO's dynamic sampling (`algorithm.filter_groups`): further generation batches
              from the train loader until enough groups' metric varies, or the groups
              streamed through the engine's scheduler, judged as they end
    gather    several processes: every row's lengths (and teacher), the scorer's extra info
              and metrics; each process keeps its own rows when its devices hold exactly
              those of the step's batch (`span`), or, after dynamic sampling, its own kept
              groups' rows, which the devices put in their places (`owners`); else every
              process gets the rows of all of them (`gather_processes`)

The trainer's step consumes an `Experience` and only runs passes and updates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np

from jaxrl.config import Config
from jaxrl.core_algos import estimator_inputs
from jaxrl.data.batch import PromptBatch
from jaxrl.rollout import SamplingParams
from jaxrl.rollout.streaming import Share
from jaxrl.sharding.processes import (
    allgather_objects,
    gather_rows,
    holds_rows,
    row_span,
    to_host,
)
from jaxrl.trainer.batch import RowOwners, moved_to, owned_placeable, rows_sharding
from jaxrl.trainer.cluster import Cluster
from jaxrl.trainer.dynamic_sampling import (
    NO_MORE_PROMPTS,
    DynamicSamplingError,
    GroupJudge,
    GroupPool,
    KeptRows,
    metric_values,
    stream_metrics,
    too_many_batches_message,
)
from jaxrl.trainer.generation import Generated, PendingBatch, StepRollout
from jaxrl.trainer.teachers import ROUTE, TeacherRouter

log = logging.getLogger("jaxrl.train")

# (prompts repeated n times, responses [N, R], response_mask) -> (scores [N, R], metrics, extra)
RewardFn = Callable[[PromptBatch, np.ndarray, np.ndarray], tuple[np.ndarray, dict, dict]]


@dataclasses.dataclass
class Experience:
    """What one step trains on: the global batch's generated and scored rows.

    Attributes:
        rows: Host arrays: `prompts`, `prompt_mask`, `responses`, `response_mask`,
            `token_level_scores`, `group_ids`, and `loss_mask` (the agent loop's) and
            `reward_baselines` (ReMax) when there are; the global batch's (the same on every
            process), or this process's own rows (`span`, `owners`).
        rollout_log_probs: The rollout's log-probs [N, R]: on the devices in the actor's
            layout (one process, no filtering), on the host otherwise; None when the
            rollout returned none.
        extra: The reward function's extra info ({name: per-row list}).
        routes: Each row's distillation teacher (several teachers), else None.
        conversations: The agent loop's conversations per row (None: batch generation, or
            several processes without a rollout dump).
        policy_version: The actor's weights version (`Learner.version`) that sampled it.
        timing: Seconds of its phases (`gen`, `reward`, `gen_max`, `gather`).
        metrics: The agent loop's, dynamic sampling's and the reward manager's metrics.
        span: (first, total) when `rows` are this process's own rows [first, first + n) of
            the global batch of `total` (several processes, whose devices each hold their
            own rows of the step's batch); None when `rows` are the global batch.
        owners: After dynamic sampling over several processes, when `rows` are this
            process's own kept rows: where each row of the batch comes from (its devices
            hold `owners.held()` of the batch once placed); else None.
        lengths: With `span` or `owners`: every row's (prompt, response) lengths, int
            [total] each.
    """

    rows: dict[str, np.ndarray]
    rollout_log_probs: Any
    extra: dict[str, list]
    routes: np.ndarray | None
    conversations: list[dict[str, Any]] | None
    policy_version: int
    timing: dict[str, float]
    metrics: dict[str, float]
    span: tuple[int, int] | None = None
    owners: RowOwners | None = None
    lengths: tuple[np.ndarray, np.ndarray] | None = None

    def held(self) -> tuple[int, int] | None:
        """(first, count): the rows of the batch this process's devices hold, when they are
        its own share (`span` or `owners`); None when every process holds the batch."""
        if self.owners is not None:
            return self.owners.held()
        return None if self.span is None else (self.span[0], len(self.rows["responses"]))


@dataclasses.dataclass
class Launched:
    """A step's generation dispatched ahead of the step (`ExperienceProducer.launch`).

    Attributes:
        prompts: This process's prompts.
        pending: The generation on the rollout's devices, the agent loop's on its thread
            (a `Future`), or its rows (`Generated`) when they were made elsewhere (the fully
            asynchronous rollouter's groups).
        version: The weights version (`Learner.version`) it samples with.
        dispatched: When its dispatch began (`time.perf_counter()`; a first call's
            compilation counts as the rollout's time).
    """

    prompts: PromptBatch
    pending: PendingBatch | Future[Generated] | Generated
    version: int
    dispatched: float


def step_key(seed: int, global_step: int) -> jax.Array:
    """The sampling key of step `global_step` (its generation's, wherever it runs)."""
    return jax.random.fold_in(jax.random.key(seed), global_step)


@contextlib.contextmanager
def timer(name: str, timing: dict[str, float]) -> Iterator[None]:
    """Add the block's wall time to `timing[name]`."""
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


class ExperienceProducer:
    """Makes the step's `Experience` (module doc).

    Args:
        cfg: The run's config.
        cluster: Its roles (the actor's weights version, its layout).
        rollout: The step's generation.
        sampling: The training rollout's sampling settings.
        reward_fn: Scores training responses.
        router: Routes rows to distillation teachers (several teachers), else None.
        prompt_source: Where dynamic sampling's further generation batches come from (the
            train loader, so its saved state covers them); None: no more than one.
    """

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        rollout: StepRollout,
        sampling: SamplingParams,
        reward_fn: RewardFn,
        *,
        router: TeacherRouter | None = None,
        prompt_source: Iterator[PromptBatch] | None = None,
    ):
        self.cfg, self.cluster, self.rollout, self.reward_fn = cfg, cluster, rollout, reward_fn
        self.sampling, self.router, self.prompt_source = sampling, router, prompt_source
        self._told = False  # where the step's batch lives, logged once

    def launch(self, prompts: PromptBatch, rng: jax.Array) -> Launched:
        """Batch generation of `prompts` (this process's rows) with `rng`, dispatched to
        the rollout's devices with the actor's current weights (published first unless the
        rollout holds them) and not waited for: `produce(..., launched=)` scores it. With
        `multi_turn.enable`, the agent loop on a thread of its own (`dispatch_agent`). Not
        dynamic sampling or ReMax (the config checks refuse them with the async modes)."""
        with self.rollout.holding():
            version, start = self.cluster.actor.version, time.perf_counter()
            if self.rollout.multi_turn.enable:
                pending = self.rollout.dispatch_agent(prompts, self.sampling, rng)
            else:
                pending = self.rollout.dispatch(prompts, self.sampling, rng)
        return Launched(prompts, pending, version, start)

    def produce(
        self,
        prompts: PromptBatch,
        global_step: int,
        rng: jax.Array,
        *,
        launched: Launched | None = None,
    ) -> Experience:
        """The step's experience from `prompts` (this process's rows) and the step's key;
        `launched`: their generation, dispatched before (`launch`: with the weights of
        then), is read and scored instead of generating now."""
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        if launched is not None:
            if not np.array_equal(launched.prompts.uid, prompts.uid):
                raise ValueError(
                    "produce(launched=...): the launched generation is of other prompts "
                    f"({launched.prompts.uid[:2]}...) than this step's ({prompts.uid[:2]}...)"
                )
            version = launched.version
            scored = self._scored_rows(prompts, rng, timing, metrics, launched=launched)
        else:
            with self.rollout.holding():  # one weight copy for every generation batch
                version = self.cluster.actor.version
                if self.cfg.algorithm.filter_groups.enable:
                    scored = self._dynamic_sampling(prompts, global_step, rng, timing, metrics)
                else:
                    scored = self._scored_rows(prompts, rng, timing, metrics)
        metrics.update(scored.reward_metrics)
        rows = dict(scored.rows)
        routes = rows.pop(ROUTE, None)
        if scored.index is not None:
            routes = scored.index.get(ROUTE)
        log_probs = rows.pop("rollout_log_probs", scored.device_log_probs)
        lengths = None if scored.index is None else scored.index["lengths"]
        return Experience(
            rows, log_probs, scored.extra, routes, scored.conversations, version, timing,
            metrics, scored.span, scored.owners, lengths,
        )  # fmt: skip

    # ---- the ways a step's rows are made -------------------------------------------------

    def _scored_rows(
        self,
        prompts: PromptBatch,
        rng: jax.Array,
        timing: dict[str, float],
        metrics: dict[str, float],
        *,
        own: bool = False,
        launched: Launched | None = None,
    ) -> _Scored:
        """Generate `rollout.n` responses per prompt and score them (and ReMax's greedy
        baselines): the global batch's rows, on every process (`gather_processes`), or each
        process's own rows where its devices hold them (`span`). The rollout's log-probs
        stay on the devices (one process). `own` (dynamic sampling's pool): this process's
        rows, log-probs and scorer output as they are, all on the host, nothing gathered."""
        n = self.sampling.n
        with timer("gen", timing):  # launched: the wait for its devices
            if launched is None:
                generated = self.rollout.generate(prompts, self.sampling, rng)
            else:
                generated = self.rollout.collect(launched.pending)
            rows, log_probs = generated.rows, generated.log_probs
            metrics.update(generated.metrics)
        repeated = generated.scored(prompts.repeat(n))
        group_ids = repeated.group_ids
        with timer("reward", timing):
            if generated.scores is not None:  # scored as they finished (fully_async's judge)
                scores, reward_metrics, extra = generated.scores
            else:
                scores, reward_metrics, extra = self.reward_fn(
                    repeated, rows["responses"], rows["response_mask"]
                )
            rows["token_level_scores"] = scores.astype(np.float32)
        rows.update(self._host_fields(repeated))
        if estimator_inputs(self.cfg.algorithm.adv_estimator).reward_baselines:
            with timer("gen_max", timing):
                greedy = dataclasses.replace(
                    self.sampling, do_sample=False, temperature=0.0, n=1, over_sample_rate=0.0
                )  # every prompt's baseline: never aborted
                base = self.rollout.generate(prompts, greedy, rng).rows
                base_scores, _, _ = self.reward_fn(
                    prompts, base["responses"], base["response_mask"]
                )
                rows["reward_baselines"] = np.repeat(base_scores.sum(-1), n, axis=0)
        on_devices = None
        conversations = generated.conversations
        if own:
            if log_probs is not None:
                rows["rollout_log_probs"] = np.asarray(to_host(log_probs))
            rows = {**rows, "group_ids": np.asarray(group_ids, np.int32)}
            return _Scored(rows, None, extra, reward_metrics, conversations)
        if jax.process_count() > 1:
            with timer("gather", timing):
                if log_probs is not None:
                    rows["rollout_log_probs"] = log_probs
                rows = {**rows, "group_ids": np.asarray(group_ids, np.int32)}
                conversations = self._gathered(conversations)
                span = row_span(len(group_ids))
                if self._holds_own_rows(span, len(group_ids)):
                    index = _row_index(rows)  # every row's lengths (and teacher), not the rows
                    extra, reward_metrics = gather_scorer_info(len(group_ids), extra,
                                                               reward_metrics)  # fmt: skip
                    return _Scored(rows, None, extra, reward_metrics, conversations, span,
                                   index=index)  # fmt: skip
                rows, group_ids, extra, reward_metrics = gather_processes(
                    rows, group_ids, extra, reward_metrics
                )
        elif log_probs is not None:
            on_devices = moved_to(log_probs, self.cluster.actor.layout)
        rows = {**rows, "group_ids": np.asarray(group_ids, np.int32)}
        return _Scored(rows, on_devices, extra, reward_metrics, conversations)

    def _holds_own_rows(self, span: tuple[int, int], count: int) -> bool:
        """Whether every process's devices hold exactly its own rows of the step's batch in
        the trainer's layout (its rows split over the data axes, process after process): then
        each places and reads its rows alone. A collective."""
        layout = self.cluster.actor.layout
        if layout is None:
            return False
        first, total = span
        own = holds_rows(rows_sharding(layout, (total,)), (total,), first, first + count)
        if not self._told:
            self._told = True
            log.info(
                "the step's batch: %s", f"each process holds its own {count} of {total} rows"
                if own else f"gathered to every process ({total} rows; the processes' devices "
                "do not hold their own rows)",
            )  # fmt: skip
        return own

    def _gathered(self, conversations: list | None) -> list | None:
        """Several processes: the agent loop's conversations of every process's rows when
        the rollout dump needs them (`trainer.rollout_data_dir`; process 0 writes it),
        else None (no host traffic for them)."""
        if conversations is None or not self.cfg.trainer.rollout_data_dir:
            return None
        return [c for part in allgather_objects(conversations) for c in part]

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
    ) -> _Scored:
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
            scored = self._scored_rows(prompts, key, timing, metrics, own=True)
            values = metric_values(fg.metric, scored.rows["token_level_scores"], scored.extra)
            pool.add(scored.rows, scored.extra, scored.conversations, values)
            if pool.full(target, fg.max_num_gen_batches):
                break
            if self.prompt_source is None:
                raise ValueError(NO_MORE_PROMPTS)
            prompts = next(self.prompt_source)
        metrics.update(pool.metrics(target))
        return self._kept(functools.partial(pool.take, target, metrics=scored.reward_metrics),
                          timing)  # fmt: skip

    def _streamed_sampling(
        self,
        prompts: PromptBatch,
        rng: jax.Array,
        timing: dict[str, float],
        metrics: dict[str, float],
    ) -> _Scored:
        """`filter_groups.streaming`: groups through the engine's slots (each process its
        own prompts on its own share), judged as they end, until the first
        `train_batch_size` kept in prompt order are known (`jaxrl.rollout.streaming`); the
        step's key samples them, and the loader is left after the batches up to the cut.
        `max_num_gen_batches` bounds the prompts (x the generation batch's)."""
        fg, target = self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        judge = GroupJudge(self.reward_fn, fg.metric, timing, self._host_fields)
        limit = fg.max_num_gen_batches
        start = time.perf_counter()
        first, total = row_span(len(prompts))  # this process's slice of every batch
        result = self.rollout.stream(
            judge.batches(prompts, self.prompt_source), self.sampling, rng, judge,
            target=target, max_groups=limit * total if limit > 0 else None,
            share=Share(first, total),
        )  # fmt: skip
        timing["gen"] = time.perf_counter() - start - timing.get("reward", 0.0)
        if result.cut is None:
            raise DynamicSamplingError(too_many_batches_message(result.stats.batches, limit))
        judge.settle(result.stats.batches)
        metrics.update(stream_metrics(result.stats, target))
        return self._kept(functools.partial(judge.take, result.cut), timing)

    def _kept(self, take: Callable[..., KeptRows], timing: dict[str, float]) -> _Scored:
        """Dynamic sampling's kept rows (`take`: the pool's or the judge's, given what
        `assemble` gathers besides the rows' lengths: each row's teacher, and the
        conversations where the rollout dump needs them) as the step's: one process, the
        batch; several, each process's own rows with their places in the batch (`owners`),
        when the trainer's layout lets each place its own (`owned_placeable`), else the
        batch gathered to every process (timed as `gather`)."""
        start = time.perf_counter()
        dump = bool(self.cfg.trainer.rollout_data_dir)
        kept = take(whole_fields=(ROUTE,), conversations=dump)
        if kept.owners is None:
            return _Scored(dict(kept.rows), None, kept.extra, kept.metrics, kept.conversations)
        rows = {k: v for k, v in kept.rows.items() if k != ROUTE}
        index = {"lengths": kept.lengths, **kept.whole}
        own = owned_placeable(self.cluster.actor.layout, kept.owners)
        if not self._told:
            self._told = True
            log.info("the step's batch: %s", "each process places its own kept rows" if own else
                     f"gathered to every process ({kept.owners.total} rows)")  # fmt: skip
        if not own:
            rows = {k: v for k, v in kept.batch_rows().items() if k != ROUTE}
        timing["gather"] = timing.get("gather", 0.0) + time.perf_counter() - start
        return _Scored(rows, None, kept.extra, kept.metrics, kept.conversations,
                       owners=kept.owners if own else None, index=index)  # fmt: skip


@dataclasses.dataclass
class _Scored:
    """Generated and scored rows on their way to an `Experience` (or to the dynamic
    sampling pool): the rollout's log-probs in `rows` on the host, or `device_log_probs`."""

    rows: dict[str, np.ndarray]
    device_log_probs: Any
    extra: dict[str, list]
    reward_metrics: dict[str, float]
    conversations: list[dict[str, Any]] | None
    span: tuple[int, int] | None = None  # `rows` this process's own (Experience.span)
    owners: RowOwners | None = None  # `rows` this process's own kept rows (Experience.owners)
    index: dict[str, Any] | None = None  # with span or owners: every row's lengths, teacher


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
    extra, reward_metrics = gather_scorer_info(len(batch["responses"]), extra, reward_metrics)
    return rows, group_ids, extra, reward_metrics


def gather_scorer_info(
    count: int, extra: dict[str, list], reward_metrics: dict[str, float]
) -> tuple[dict[str, list], dict[str, float]]:
    """The scorer's extra info of every process's rows (process order; None for the rows of
    a process whose scorer did not return a key) and the reward manager's metrics summed,
    on every process (`count`: this process's rows)."""
    every = allgather_objects((count, extra, reward_metrics))
    keys = sorted({k for _, e, _ in every for k in e})
    extra = {k: [v for n, e, _ in every for v in e.get(k, [None] * n)] for k in keys}
    names = sorted({k for _, _, m in every for k in m})
    reward_metrics = {k: float(sum(m.get(k, 0.0) for _, _, m in every)) for k in names}
    return extra, reward_metrics


def _row_index(rows: dict[str, np.ndarray]) -> dict[str, Any]:
    """What the step needs of every process's rows besides its own (one small gather):
    their (prompt, response) lengths, which plan the micro-batches, and their distillation
    teacher (several teachers)."""
    index = {
        "prompt": rows["prompt_mask"].sum(-1).astype(np.int32),
        "response": rows["response_mask"].sum(-1).astype(np.int32),
    }
    if ROUTE in rows:
        index[ROUTE] = np.asarray(rows[ROUTE])
    every = gather_rows(index)
    out: dict[str, Any] = {"lengths": (every["prompt"], every["response"])}
    if ROUTE in every:
        out[ROUTE] = every[ROUTE]
    return out
