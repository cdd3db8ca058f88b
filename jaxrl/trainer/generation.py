"""The step's generation: batch generation, or (`multi_turn.enable`) the agent loop.

    rollout = StepRollout(cfg, cluster, tokenizer)
    gen = rollout.generate(prompts, sampling, rng)   # Generated: rows, log-probs, metrics
    rollout.stream(batches, sampling, rng, judge, target=16, max_groups=None)
                                                     # streamed dynamic sampling
    with rollout.holding(): ...                      # several generations, one weight copy
    pending = rollout.dispatch(prompts, sampling, rng)   # not waited for (one_step_off) ...
    pending = rollout.dispatch_agent(prompts, sampling, rng)  # ... the agent loop's too
    gen = rollout.collect(pending)
    rollout.close()                                  # stop the tool runner

Either way the rollout gets the actor's weights first and, colocated, frees them after (the
step's passes need that memory); `with rollout.holding():` keeps them over several
generations (a step's generation batches, a validation's), published once per version.
Batch generation is a `Scheduler` batch request over all processes' prompts at once (its
fixed-batch path: the engine's on-device loop). The agent loop runs each of the prompts' n
samples as a conversation (`jaxrl.agent`), as requests of a `Scheduler` over the engine: its
rows carry a `loss_mask` (0 on tool turns) and the rollout's log-probs on the host, and it
reports the agent metrics and the conversations for the dumps; streamed dynamic sampling is
a `Scheduler` client too (`jaxrl.rollout.streaming`). With several processes each runs the
agent loop over its own rows on its own share of the rollout devices (`RolloutEngine.local`)
with its own tools, sampling what one process would (row i's keys, wherever it runs); the
rows join the global batch as batch generation's do (`ExperienceProducer`'s gather).

Dispatched ahead (`async_training.mode=one_step_off`), batch generation is the devices' work
alone, while the agent loop needs the host between turns (tools, the next turn's prompt): it
runs on a thread of its own (`dispatch_agent`) with the weights the rollout holds when it is
dispatched, and nothing else may use the engine or publish weights to it until `collect` has
its rows. The loop gathers across processes (its rows' span, its metrics), which on that
thread would interleave with the update's collectives: one process only (`OneStepOff`
checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl.agent import (
    AgentLoop,
    AgentRequest,
    ChatTokens,
    Limits,
    LoopStats,
    ToolRunner,
    Trajectory,
    agent_metrics,
    agent_requests,
    conversation_rows,
    load_tools,
    trajectory_rows,
)
from jaxrl.config import Config
from jaxrl.data.batch import PromptBatch, object_array
from jaxrl.rewards.inputs import place_scores
from jaxrl.rollout import BatchOutput, SamplingParams, Scheduler
from jaxrl.rollout.streaming import GroupRollout, Share, StreamResult, stream_groups
from jaxrl.serve.external import ExternalAgents, external_metrics
from jaxrl.sharding.processes import allgather_objects, owners, row_span, to_host
from jaxrl.trainer.cluster import Cluster

log = logging.getLogger("jaxrl.train")


@dataclasses.dataclass
class Generated:
    """One generation's results.

    Attributes:
        rows: Host rows (prompts repeated n times, interleaved): `prompts`, `prompt_mask`,
            `responses`, `response_mask` and, from the agent loop, `loss_mask` and
            `rollout_log_probs`; with `rollout.enable_rollout_routing_replay` the routes the
            rollout took, `prompt_routed_experts` and `response_routed_experts`.
        log_probs: The rollout's log-probs [N, R] on the devices (single process), on the host
            (several processes), or None when they are in `rows`.
        metrics: The agent loop's metrics ({} for batch generation).
        conversations: Per row, the agent loop's messages and turns (None for batch
            generation).
        extra_info: Per row, what verl's reward managers add to a multi-turn row's
            `extra_info` before scoring it (`num_turns`, `tool_rewards`, `turn_scores`);
            None for batch generation.
        scores: The rows' scores when they were scored already (fully_async's judge of
            dynamic sampling): (token-level scores [N, R], the reward manager's metrics,
            the extra info per row), what the reward function returns; None: not scored.
    """

    rows: dict[str, np.ndarray]
    log_probs: Any = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    conversations: list[dict[str, Any]] | None = None
    extra_info: list[dict[str, Any]] | None = None
    scores: tuple[np.ndarray, dict[str, float], dict[str, list]] | None = None

    def scored(self, repeated: PromptBatch) -> PromptBatch:
        """`repeated` (the prompts repeated n times) with `extra_info` as the scorer sees it."""
        if self.extra_info is None:
            return repeated
        rows = [{**(e or {}), **x} for e, x in zip(repeated.extra_info, self.extra_info,
                                                    strict=True)]  # fmt: skip
        return dataclasses.replace(repeated, extra_info=object_array(rows))


@dataclasses.dataclass
class PendingBatch:
    """A batch generation on the rollout's devices, dispatched and not waited for
    (`StepRollout.dispatch`; `StepRollout.collect` reads it).

    Attributes:
        prompts: This process's prompts.
        n: Responses per prompt.
        output: The scheduler's batch output (device arrays; `version`: the weights').
    """

    prompts: PromptBatch
    n: int
    output: BatchOutput


class StepRollout:
    """Generation for the trainer (see the module doc).

    Args:
        cfg: The run's config.
        cluster: Its roles (the rollout engine and the actor).
        tokenizer: The actor's tokenizer (the agent loop's chat template; required with
            `multi_turn.enable`).
        tools: The tools by name (loaded once by `fit.build_run`); None: those of
            `multi_turn.tool_config_path`.
    """

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        tokenizer: Any = None,
        tools: dict[str, Any] | None = None,
    ):
        self.cfg, self.cluster = cfg, cluster
        rollout = cfg.actor_rollout_ref.rollout
        self.multi_turn = rollout.multi_turn
        self.runner: ToolRunner | None = None
        self.external: ExternalAgents | None = None  # `agent.external`: the user's episodes
        self._ahead: ThreadPoolExecutor | None = None  # `dispatch_agent`'s thread
        self._warned = False
        self._depth = 0  # `holding` blocks open
        if not self.multi_turn.enable:
            return
        if tokenizer is None:
            raise ValueError(
                "actor_rollout_ref.rollout.multi_turn.enable: the trainer needs the tokenizer "
                "(tokenizer=...) for the chat template of the turns"
            )
        path = self.multi_turn.tool_config_path
        if tools is None:
            tools = load_tools(path) if path else {}
        if tools:
            self.runner = ToolRunner(
                tools, timeout=self.multi_turn.tool_timeout, workers=self.multi_turn.tool_workers
            )
        eos = cluster.actor.config.eos_token_id
        end_ids = SamplingParams.from_config(rollout).end_ids(eos)
        self.chat = ChatTokens(tokenizer, end_ids, cfg.data.apply_chat_template_kwargs)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        agent = rollout.agent
        if agent.external:
            self.external = ExternalAgents(
                agent.external, tokenizer, self.chat, end_ids,
                model=Path(cfg.actor_rollout_ref.model.path).name or "policy",
                timeout=agent.external_timeout,
                # each process its own port: the key's, or one past the previous process's
                port=agent.external_port and agent.external_port + jax.process_index(),
                chunk=self.multi_turn.decode_chunk, error_score=cfg.reward_model.error_score,
            )  # fmt: skip

    def close(self) -> None:
        if self._ahead is not None:  # an agent loop dispatched ahead ends first (its tools)
            self._ahead.shutdown(wait=True, cancel_futures=True)
        if self.runner is not None:
            self.runner.close()
        if self.external is not None:
            self.external.close()

    def generate(self, prompts: PromptBatch, sampling: SamplingParams, rng: jax.Array) -> Generated:
        """The rows of `prompts` (this process's) repeated `sampling.n` times (see the module
        doc); every process calls this with its own prompts and the same rng."""
        with self.holding():
            if self.multi_turn.enable:
                return self._agent(prompts, sampling, rng)
            return self.collect(self.dispatch(prompts, sampling, rng))

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """The actor's weights in the rollout for the block: published when the block
        begins unless the rollout holds their version already, and, colocated, freed when
        the outermost block ends (the passes after generation need that memory). A step's
        or a validation's generations run in one block: one copy however many batches."""
        self.cluster.sync_weights()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self.cluster.rollout_colocated:
                self.cluster.rollout.release()

    def stream(
        self,
        batches: Iterator[tuple[np.ndarray, np.ndarray]],
        sampling: SamplingParams,
        rng: jax.Array,
        judge: Callable[[list[GroupRollout]], list[bool]],
        *,
        target: int,
        max_groups: int | None,
        share: Share,
    ) -> StreamResult:
        """`jaxrl.rollout.streaming.stream_groups` on this process's share of the rollout
        engine (streamed dynamic sampling), with the actor's weights; `share`: where this
        process's prompts sit in each batch. Batch generation only (the config checks refuse
        multi-turn)."""
        with self.holding():
            return stream_groups(
                self.cluster.rollout.local(), batches, sampling, rng, judge,
                target=target, max_groups=max_groups, share=share,
            )  # fmt: skip

    def dispatch(
        self, prompts: PromptBatch, sampling: SamplingParams, rng: jax.Array
    ) -> PendingBatch:
        """Batch generation of `prompts` (this process's rows) dispatched to the rollout's
        devices with the weights it holds, not waited for (`collect` reads it): a
        `Scheduler` batch request on the idle engine (its fixed-batch path, over every
        process's prompts). Call it inside `holding()`."""
        names = prompts.agent_name if prompts.agent_name is not None else ()
        if not self._warned and any(name == "tool_agent" for name in names):
            self._warned = True
            log.warning(
                "rows name agent_name=tool_agent but actor_rollout_ref.rollout.multi_turn."
                "enable is false: they are generated in one turn, without tools"
            )
        out = Scheduler(self.cluster.rollout).generate(
            prompts.input_ids, prompts.attention_mask, sampling, rng
        )  # idle: the fixed-batch path, over every process's prompts
        return PendingBatch(prompts, sampling.n, out)

    def dispatch_agent(
        self, prompts: PromptBatch, sampling: SamplingParams, rng: jax.Array
    ) -> Future[Generated]:
        """The agent loop over `prompts` (this process's rows) on a thread of its own, with
        the weights the rollout holds, not waited for (`collect` reads it; the module doc
        says what must wait for it). Call it inside `holding()`, in a run of one process
        (`OneStepOff` checks)."""
        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-ahead")
        return self._ahead.submit(self._agent, prompts, sampling, rng)

    def collect(self, pending: PendingBatch | Future[Generated] | Generated) -> Generated:
        """The rows of a dispatched generation (waits for the rollout's devices, or for the
        agent loop's thread, raising what it raised); a `Generated` (rows made elsewhere:
        the fully asynchronous rollouter's) as it is."""
        if isinstance(pending, Generated):
            return pending
        if isinstance(pending, Future):
            return pending.result()
        prompts, n, out = pending.prompts, pending.n, pending.output
        if jax.process_count() > 1:  # this process's rows (a collective)
            responses, response_mask, log_probs = out.rows()
        else:
            responses, response_mask = to_host((out.responses, out.response_mask))
            log_probs = jax.block_until_ready(out.log_probs)
        rows = {
            "prompts": np.repeat(prompts.input_ids, n, axis=0),
            "prompt_mask": np.repeat(prompts.attention_mask, n, axis=0),
            "responses": np.asarray(responses),
            "response_mask": np.asarray(response_mask),
        }
        if out.prompt_routes is not None:  # routing replay (R3): one process, fixed batch
            rows["prompt_routed_experts"] = np.asarray(out.prompt_routes)
            rows["response_routed_experts"] = np.asarray(out.response_routes)
        return Generated(rows, log_probs)

    def _agent(self, prompts: PromptBatch, sampling: SamplingParams, rng: jax.Array) -> Generated:
        default = self.cfg.actor_rollout_ref.rollout.agent.default_agent_loop
        requests = agent_requests(prompts.repeat(sampling.n), default)
        p = prompts.input_ids.shape[1]
        first = row_span(len(requests))[0]
        holders = sorted(owners(self.cluster.rollout.layout.mesh.devices.flat))
        if self.external is not None:
            if len(holders) != jax.process_count():
                raise ValueError(
                    "actor_rollout_ref.rollout.agent.external: each process serves its own "
                    "rows, so each needs rollout devices; set mesh.placement.spread=true"
                )
            return self._external(prompts, sampling, rng, first)
        if len(holders) == jax.process_count():
            indices = range(first, first + len(requests))
            trajectories, stats = self._run_agent(requests, indices, sampling, rng, p)
        else:
            trajectories, stats = self._routed(requests, first, holders, sampling, rng, p)
        return self.agent_generated(trajectories, stats, p, sampling.max_tokens)

    def _external(
        self, prompts: PromptBatch, sampling: SamplingParams, rng: jax.Array, first: int
    ) -> Generated:
        """The user's episodes over this process's rows (`jaxrl.serve.external`): their
        rows, the agent metrics with `agent/external/*`, and their rewards as the scores."""
        repeated = prompts.repeat(sampling.n)
        episodes = [
            {"messages": messages, "ground_truth": truth, "data_source": source,
             "extra_info": extra, "prompt_ids": ids[mask > 0]}
            for messages, truth, source, extra, ids, mask in zip(
                repeated.raw_prompt, repeated.ground_truth, repeated.data_source,
                repeated.extra_info, repeated.input_ids, repeated.attention_mask, strict=True)
        ]  # fmt: skip
        p, r = prompts.input_ids.shape[1], sampling.max_tokens
        start = time.perf_counter()
        results = self.external.run(
            self.cluster.rollout.local(), episodes, sampling, rng,
            indices=range(first, first + len(episodes)), prompt_length=p, response_length=r,
        )  # fmt: skip
        stats = LoopStats(seconds=time.perf_counter() - start)
        generated = self.agent_generated([x.trajectory for x in results], stats, p, r)
        generated.metrics.update(external_metrics(results))
        rewards = np.asarray([x.reward for x in results], np.float32)
        names = sorted({k for x in results for k in x.extra})
        extra = {k: [x.extra.get(k) for x in results] for k in names}
        generated.scores = (place_scores(rewards, generated.rows["response_mask"]), {}, extra)
        return generated

    def agent_generated(
        self,
        trajectories: Sequence[Trajectory],
        stats: LoopStats,
        prompt_length: int,
        response_length: int,
    ) -> Generated:
        """Trajectories (this process's rows, in order) as a `Generated`: their rows, the
        agent loop's metrics (over every process's: a collective), conversations and the
        reward managers' extra info."""
        rows = trajectory_rows(
            trajectories, prompt_length=prompt_length, response_length=response_length,
            pad_id=self.pad_id,
        )  # fmt: skip
        return Generated(
            rows,
            metrics=agent_metrics(trajectories, stats),
            conversations=conversation_rows(trajectories),
            extra_info=[
                {"num_turns": t.num_turns, "tool_rewards": t.tool_rewards, "turn_scores": []}
                for t in trajectories
            ],
        )

    def agent_loop(self, prompt_length: int, response_length: int) -> AgentLoop:
        """An agent loop on this process's share of the rollout, with the run's tools."""
        return AgentLoop(
            self.cluster.rollout.local(),  # this process's share: its rows, at its pace
            self.chat,
            self.runner,
            Limits.from_config(self.multi_turn),
            response_length=response_length,
            max_prompt_length=prompt_length,
        )

    def _run_agent(
        self,
        requests: Sequence[AgentRequest],
        indices: Sequence[int],
        sampling: SamplingParams,
        rng: jax.Array,
        prompt_length: int,
    ) -> tuple[list[Trajectory], LoopStats]:
        """The agent loop over `requests` (each sampling as row `indices[i]` of the batch)
        on this process's share of the rollout, with its tools."""
        loop = self.agent_loop(prompt_length, sampling.max_tokens)
        return loop.run(requests, sampling, rng, indices=indices), loop.stats

    def _routed(
        self,
        requests: Sequence[AgentRequest],
        first: int,
        holders: Sequence[int],
        sampling: SamplingParams,
        rng: jax.Array,
        prompt_length: int,
    ) -> tuple[list[Trajectory], LoopStats]:
        """This process's trajectories when the rollout is on some processes only
        (`mesh.placement.spread=false`): every process's requests cross the hosts, each
        process holding rollout devices runs its own and those of the processes `route`
        gives it (each request sampling as its row of the batch, so the rows are one
        process's), and the trajectories go back to the processes whose rows they are (one
        gather). A process without rollout devices runs no tools and reports no loop time."""
        me, every = jax.process_index(), allgather_objects((first, list(requests)))
        runs = [q for q, holder in enumerate(route(holders, len(every))) if holder == me]
        jobs = []  # (origin process, row index in the batch, request)
        for q in runs:
            start, part = every[q]
            jobs += [(q, start + j, r) for j, r in enumerate(part)]
        done, stats = [], LoopStats()
        if jobs:
            mine, rows = [r for _, _, r in jobs], [i for _, i, _ in jobs]
            done, stats = self._run_agent(mine, rows, sampling, rng, prompt_length)
        results: dict[int, list[Trajectory]] = {q: [] for q in runs}
        for (q, _, _), trajectory in zip(jobs, done, strict=True):
            results[q].append(trajectory)
        own = results.pop(me, None)  # a holder's own rows stay here
        back = allgather_objects(results)
        return (own if own is not None else next(p[me] for p in back if me in p)), stats


def route(holders: Sequence[int], processes: int) -> list[int]:
    """The process that runs each process's conversations: itself where it holds rollout
    devices, else the holders in turn."""
    out = list(range(processes))
    for k, q in enumerate(q for q in range(processes) if q not in holders):
        out[q] = holders[k % len(holders)]
    return out
