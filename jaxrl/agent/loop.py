"""The agent loop: many multi-turn trajectories over the engine's conversation slots.

    loop = AgentLoop(engine, chat, runner, limits, response_length=256)
    trajectories = loop.run(requests, sampling, rng)    # one per request, in order

Each request (a prompt's messages, its agent, its row's `tools_kwargs`) becomes a trajectory,
a conversation kept open in a `Scheduler` (`jaxrl.rollout.scheduler`) over the engine:

    start      its prompt (the chat template with the tools' schemas): `submit`
    decode     its turn, `decode_chunk` tokens at a time alongside every other decoding slot
               (`Scheduler.step`); a turn may take the response's tokens left
    turn over  end (`close`), or parse its tool calls (hermes) and submit them to the
               `ToolRunner`
    tools done the tool turn (the template's tokens, not sampled) appended before the next
               turn: `resume`

The host loop never waits on a tool while any slot can decode: it decodes a chunk, collects
the calls that finished meanwhile, appends their answers, admits new requests into freed
slots, and only when nothing can decode does it wait for the first tool to finish. So slow
tools overlap with decoding, and trajectories of different lengths and turn counts share the
slots (continuous batching across turns).

Limits (verl's `multi_turn`): a trajectory ends when a turn has no tool call, at
`max_assistant_turns` or `max_user_turns`, when its response (every token after the prompt,
sampled or appended) reaches `response_length` (cut there; a tool turn that would reach it is
not appended, as verl), or when a turn stops for length. A `single_turn_agent` request ends
after its first turn.

Sampling is reproducible: turn t of request i samples with `fold_in(fold_in(rng, i), t)`
(see `RolloutEngine.decode`), whatever the tools' timing and whichever slot it runs in; i
counts from `run(first=)`, so processes that each run their share of a batch (each on its
own `RolloutEngine.local()`) sample what one process running all of it would.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Hashable, Sequence
from typing import Any

import jax

from jaxrl.agent.chat import ChatTokens
from jaxrl.agent.parser import parse_hermes
from jaxrl.agent.runner import ToolResult, ToolRunner
from jaxrl.config.checks import AGENT_LOOPS as AGENTS
from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.scheduler import Handle, Scheduler
from jaxrl.rollout.slots import Conversation

STALL_GRACE_S = 60.0  # past the tool timeout: the runner's event loop is stuck


@dataclasses.dataclass(frozen=True)
class Limits:
    """verl's `multi_turn` limits (see `jaxrl.config.schema.MultiTurnConfig`)."""

    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    decode_chunk: int = 16

    @classmethod
    def from_config(cls, multi_turn) -> Limits:
        return cls(**{f.name: getattr(multi_turn, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class AgentRequest:
    """One trajectory to run.

    Attributes:
        messages: The prompt's chat messages (verl's `raw_prompt`).
        agent_name: `single_turn_agent` or `tool_agent`.
        tools_kwargs: The row's `extra_info.tools_kwargs` ({tool name: {"create_kwargs":
            {...}}}).
        tool_names: The tools this request may use (verl's `extra_info.tool_selection`);
            None: all of the runner's.
    """

    messages: Sequence[dict[str, Any]]
    agent_name: str = "tool_agent"
    tools_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    tool_names: tuple[str, ...] | None = None


@dataclasses.dataclass
class Trajectory(Conversation):
    """A finished trajectory: its sequence (the rollout's host record, `Conversation`:
    `prompt`, `response` cut to `response_length`, `log_probs`, `sampled` = the loss mask:
    1 on the policy's tokens, 0 on appended tool-turn tokens) and the agent's account of it.

    Attributes:
        messages: The final message list (the assistant's turns as written).
        assistant_turns: Turns the policy took.
        user_turns: Tool turns appended.
        tool_calls: Calls made (run or answered with an error).
        tool_errors: Calls by error kind (`jaxrl.agent.runner.ERRORS`).
        tool_seconds: Wall time of its tool turns (a turn's calls run at once: the slowest).
        tool_rewards: The calls' step rewards.
        finish: Why it ended: "stop" (a turn without a tool call), "length" (the response
            length or the slot's room), or "turns" (a turn limit).
    """

    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tool_seconds: float = 0.0
    tool_rewards: list[float] = dataclasses.field(default_factory=list)
    finish: str = ""

    def add_turn(
        self,
        tokens: Sequence[int],
        log_probs: Sequence[float],
        versions: Sequence[int | None] | None = None,
    ) -> None:
        """The policy's sampled turn (trained on); `versions`: each token's weights version
        (None: unversioned)."""
        self.response += list(tokens)
        self.sampled += [1] * len(tokens)
        self.log_probs += list(log_probs)
        self.versions += list(versions) if versions is not None else [None] * len(tokens)
        self.assistant_turns += 1

    def add_tool_turn(self, ids: Sequence[int]) -> None:
        """A tool turn's template tokens (attended to, not trained on)."""
        self.response += list(ids)
        self.sampled += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.versions += [None] * len(ids)
        self.user_turns += 1

    @property
    def num_turns(self) -> int:
        """verl's `num_turns`: the prompt, the assistant turns and the tool turns."""
        return 1 + self.assistant_turns + self.user_turns


@dataclasses.dataclass
class LoopStats:
    """What one `run` did, for the metrics and the benchmark.

    Attributes:
        seconds: Wall time of the run.
        decode_seconds: Time in the engine (start, decode, append).
        wait_seconds: Time the decoder waited for tools with nothing to decode.
        decode_calls: Engine decode calls.
    """

    seconds: float = 0.0
    decode_seconds: float = 0.0
    wait_seconds: float = 0.0
    decode_calls: int = 0


@dataclasses.dataclass
class _Running:
    """A trajectory in a slot: its id, request, record, the scheduler's handle of its
    current (or last) turn, its outstanding tool calls and its sampling key (turn t samples
    with `fold_in(key, t)`)."""

    id: Hashable
    request: AgentRequest
    record: Trajectory
    tools: list[dict[str, Any]] | None
    handle: Handle
    key: jax.Array
    calls: list[concurrent.futures.Future] = dataclasses.field(default_factory=list)


class AgentLoop:
    """Runs agent requests over a `RolloutEngine`'s conversations (see the module doc).

    Args:
        engine: The rollout engine, weights loaded, with `max_num_seqs` slots.
        chat: The chat template's tokens (`ChatTokens`).
        runner: Runs tool calls; None: no tools (a `tool_agent` request's calls are
            answered "unknown tool").
        limits: Turn and tool-response limits.
        response_length: Tokens after the prompt, sampled and appended together.
        max_prompt_length: The longest prompt (with the tools' schemas) a request may have.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        chat: ChatTokens,
        runner: ToolRunner | None,
        limits: Limits,
        *,
        response_length: int,
        max_prompt_length: int,
    ):
        self.engine, self.chat, self.runner, self.limits = engine, chat, runner, limits
        self.response_length, self.max_prompt_length = response_length, max_prompt_length
        self.stats = LoopStats()
        self._schemas = runner.schemas if runner is not None else {}

    def run(
        self,
        requests: Sequence[AgentRequest],
        sampling: SamplingParams,
        rng: jax.Array,
        *,
        first: int = 0,
        indices: Sequence[int] | None = None,
    ) -> list[Trajectory]:
        """Every request's trajectory, in order (see the module doc). `first`: the index of
        `requests[0]` in the whole batch (its sampling keys'; each process of a multi-process
        run runs its own rows, `first` their offset, and samples as one process would);
        `indices`: each request's index instead (a process running other processes' rows
        too)."""
        if indices is not None and (first or len(indices) != len(requests)):
            raise ValueError(
                f"run(): {len(indices)} indices for {len(requests)} requests (first={first}); "
                "give one index per request, or first alone"
            )
        for i, request in enumerate(requests):  # before any starts
            self.check(i, request)
        self.stats = stats = LoopStats()
        start = time.perf_counter()
        index = list(range(first, first + len(requests)) if indices is None else indices)
        queue = collections.deque(range(len(requests)))
        episodes = self.episodes(sampling)
        scheduler = episodes.scheduler
        try:
            while queue or episodes.running:
                episodes.resume_ready()
                if queue and scheduler.free_slots:
                    take = [queue.popleft() for _ in range(min(len(queue), scheduler.free_slots))]
                    episodes.admit(
                        [(i, requests[i], jax.random.fold_in(rng, index[i])) for i in take]
                    )
                if scheduler.busy:
                    episodes.decode()
                elif episodes.running:
                    episodes.wait_for_tools()
                elif queue:  # nothing runs and no slot is free: another user holds them all
                    raise RuntimeError(
                        f"the agent loop has {len(queue)} requests to start and none of the "
                        f"engine's {self.engine.slots} conversation slots is free"
                    )
        finally:
            episodes.close()
        stats.seconds = time.perf_counter() - start
        return [episodes.done.pop(i) for i in range(len(requests))]

    def episodes(self, sampling: SamplingParams) -> Episodes:
        """Trajectories driven a step at a time over a scheduler of the engine's (`run`'s
        loop; the fully asynchronous rollouter's stream), counted in `stats`."""
        return Episodes(self, Scheduler(self.engine, chunk=self.limits.decode_chunk), sampling)

    def check(self, key: Hashable, request: AgentRequest) -> None:
        """Refuse a request no agent loop runs."""
        if request.agent_name not in AGENTS:
            raise ValueError(
                f"request {key}: agent_name={request.agent_name!r}; jaxrl's agent loops are "
                f"{', '.join(AGENTS)} (the row's agent_name column, or "
                "actor_rollout_ref.rollout.agent.default_agent_loop)"
            )

    def turn_sampling(self, sampling: SamplingParams, used: int) -> SamplingParams:
        """A turn's settings: one sample, at most the response's tokens left after `used`."""
        return dataclasses.replace(sampling, n=1, max_tokens=self.response_length - used)

    def tools_of(self, request: AgentRequest) -> list[dict[str, Any]] | None:
        """The schemas a request's prompt shows (None: no tools)."""
        if request.agent_name != "tool_agent":
            return None
        names = self._schemas if request.tool_names is None else request.tool_names
        return [self._schemas[n] for n in names if n in self._schemas] or None

    def truncated(self, text: str) -> str:
        """verl's cut of a long tool answer to `max_tool_response_length` characters."""
        n, side = self.limits.max_tool_response_length, self.limits.tool_response_truncate_side
        if len(text) <= n:
            return text
        if side == "left":
            return "(truncated)..." + text[len(text) - n :]
        if side == "right":
            return text[:n] + "...(truncated)"
        return text[: n // 2] + "...(truncated)..." + text[len(text) - n // 2 :]


class Episodes:
    """Trajectories in flight over one `Scheduler` (the module doc's loop, a step at a time).

        episodes = loop.episodes(sampling)
        episodes.admit([(id, request, key), ...])   # at most scheduler.free_slots of them
        episodes.resume_ready()     # tool turns whose calls finished, appended
        episodes.decode()           # a chunk of every decoding slot; turns over: end or tools
        episodes.wait_for_tools()   # nothing decodes: wait for the first call
        episodes.done.pop(id)       # a finished trajectory
        episodes.close()            # abort what runs (its slots freed)

    A trajectory's turn t samples with `fold_in(key, t)` (its `admit` key).
    """

    def __init__(self, loop: AgentLoop, scheduler: Scheduler, sampling: SamplingParams):
        self.loop, self.scheduler, self.sampling = loop, scheduler, sampling
        self.running: dict[Hashable, _Running] = {}
        self.done: dict[Hashable, Trajectory] = {}
        self._by_handle: dict[int, Hashable] = {}  # a scheduler request's trajectory
        # Without tools an empty runner answers every call ("unknown tool", or the parse error).
        self._runner = loop.runner or ToolRunner({})

    @property
    def decoding(self) -> bool:
        """Whether a slot has a turn to decode (else every running one waits on tools)."""
        return self.scheduler.busy

    def admit(self, items: Sequence[tuple[Hashable, AgentRequest, jax.Array]]) -> None:
        """Start each (id, request, key) in a free slot (the scheduler starts them together,
        left-padded to the longest)."""
        loop = self.loop
        for key, request, _ in items:
            loop.check(key, request)
        tools = [loop.tools_of(request) for _, request, _ in items]
        prompts = []
        for (key, request, _), schemas in zip(items, tools, strict=True):
            ids = loop.chat.prompt(request.messages, schemas)
            if len(ids) > loop.max_prompt_length:
                raise ValueError(
                    f"request {key}: its prompt is {len(ids)} tokens with the tools' schemas, "
                    f"more than data.max_prompt_length={loop.max_prompt_length}: raise it, or "
                    "shorten the tool descriptions"
                )
            prompts.append(ids)
        width = max(len(p) for p in prompts)
        if (room := loop.engine.room_after_prompt(width)) < loop.response_length:
            raise ValueError(
                f"a conversation has room for {room} response tokens after its prompt (padded "
                f"to {width}), fewer than response_length={loop.response_length}: raise "
                f"actor_rollout_ref.rollout.max_model_len (now {loop.engine.max_model_len})"
            )
        first = loop.turn_sampling(self.sampling, 0)
        for (name, request, key), schemas, prompt in zip(items, tools, prompts, strict=True):
            record = Trajectory(prompt=prompt, messages=[dict(m) for m in request.messages])
            [handle] = self.scheduler.submit(prompt, first, key, keep_open=True)  # turn 0
            self.running[name] = _Running(name, request, record, schemas, handle, key)
            self._by_handle[handle.id] = name

    def resume_ready(self) -> None:
        """Resume the trajectories whose calls finished with their answers as the next turn's
        appended tokens (the others end: no room)."""
        ready = [state for state in self.running.values()
                 if state.calls and all(f.done() for f in state.calls)]  # fmt: skip
        loop = self.loop
        for state in ready:
            results: list[ToolResult] = [f.result() for f in state.calls]
            state.calls = []
            record = state.record
            messages = [{"role": "tool", "content": loop.truncated(r.text)} for r in results]
            record.tool_seconds += max(r.seconds for r in results)  # they ran at once
            for r in results:
                record.tool_rewards.append(r.reward)
                if r.error:
                    record.tool_errors[r.error] += 1
            ids = loop.chat.after_turn(record.messages, messages, state.tools)
            record.messages += messages
            room = loop.engine.room(state.handle.slot)
            if len(record.response) + len(ids) >= loop.response_length or len(ids) > room:
                self._finish(state.id, "length")
                continue
            record.add_tool_turn(ids)
            turn = loop.turn_sampling(self.sampling, len(record.response))
            key = jax.random.fold_in(state.key, record.assistant_turns)
            state.handle = self.scheduler.resume(state.handle, ids, turn, key)
            self._by_handle[state.handle.id] = state.id

    def decode(self) -> None:
        """A chunk of every decoding slot; each turn it finishes is recorded, then its
        trajectory ends or its tool calls go to the runner."""
        start = time.perf_counter()
        try:
            finished = self.scheduler.step()
        finally:
            self.loop.stats.decode_seconds += time.perf_counter() - start
        for handle in finished:
            state = self.running[self._by_handle.pop(handle.id)]
            state.record.add_turn(handle.tokens, handle.log_probs, handle.versions)
            why = self._verdict(state, handle)
            if why:
                self._finish(state.id, why)

    def calls(self) -> list[concurrent.futures.Future]:
        """The running trajectories' outstanding tool calls."""
        return [f for state in self.running.values() for f in state.calls]

    def wait_for_tools(self) -> None:
        """Wait for the first outstanding call to finish. The runner answers every call
        within its timeout, so one that does not (a tool blocking the runner's event loop) is
        an error, never a hang."""
        runner = self.loop.runner
        limit = (runner.timeout if runner is not None else 0.0) + STALL_GRACE_S
        waited = time.perf_counter()
        done, _ = concurrent.futures.wait(self.calls(), timeout=limit,
                                          return_when="FIRST_COMPLETED")  # fmt: skip
        self.loop.stats.wait_seconds += time.perf_counter() - waited
        if not done:
            raise RuntimeError(
                f"no tool call returned within {limit:g} s (the tool timeout + "
                f"{STALL_GRACE_S:g} s): a tool is blocking the runner's event loop (an async "
                "method that never awaits?); make it await, or make its methods plain functions"
            )

    def abort(self, names: Sequence[Hashable]) -> None:
        """End these running trajectories unfinished (their slots freed, their outstanding
        calls cancelled)."""
        for name in names:
            state = self.running.pop(name)
            for call in state.calls:
                call.cancel()
            self._by_handle.pop(state.handle.id, None)
            handle = state.handle
            if handle.slot is None or self.loop.engine.is_open(handle.slot):
                self.scheduler.abort(handle)

    def close(self) -> None:
        """Abort what runs (an engine error has ended the slots it touched already) and
        count the decode calls in the loop's stats."""
        try:
            self.abort(list(self.running))
        finally:
            self.loop.stats.decode_calls += self.scheduler.decode_calls
            if self.loop.runner is None:
                self._runner.close()

    def _verdict(self, state: _Running, handle: Handle) -> str | None:
        """After a finished turn: submit its tool calls and return None, or return why the
        trajectory ends."""
        record, loop = state.record, self.loop
        limits = loop.limits
        text = loop.chat.text(handle.tokens)
        record.messages.append({"role": "assistant", "content": text})
        if len(record.response) >= loop.response_length or handle.finish_reason != "stop":
            return "length"
        if limits.max_assistant_turns and record.assistant_turns >= limits.max_assistant_turns:
            return "turns"
        if limits.max_user_turns and record.user_turns >= limits.max_user_turns:
            return "turns"
        if state.request.agent_name != "tool_agent":
            return "stop"
        _, calls = parse_hermes(text)
        if not calls:
            return "stop"
        calls = calls[: limits.max_parallel_calls]
        record.tool_calls += len(calls)
        kwargs = state.request.tools_kwargs or {}
        allowed = state.request.tool_names
        state.calls = [
            self._runner.submit(c, (kwargs.get(c.name) or {}).get("create_kwargs"),
                                allowed=allowed)
            for c in calls
        ]  # fmt: skip
        return None

    def _finish(self, name: Hashable, why: str) -> None:
        state = self.running.pop(name)
        self._by_handle.pop(state.handle.id, None)
        self.scheduler.close(state.handle)
        record = state.record
        record.finish = why
        n = self.loop.response_length
        record.response, record.sampled = record.response[:n], record.sampled[:n]
        record.log_probs, record.versions = record.log_probs[:n], record.versions[:n]
        self.done[name] = record
