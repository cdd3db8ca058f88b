"""The agent loop: many multi-turn trajectories over the engine's conversation slots.

    loop = AgentLoop(engine, chat, runner, limits, response_length=256)
    trajectories = loop.run(requests, sampling, rng)    # one per request, in order

Each request (a prompt's messages, its agent, its row's `tools_kwargs`) becomes a trajectory:

    start      its prompt (the chat template with the tools' schemas) into a free slot
    decode     its turn, `decode_chunk` tokens at a time alongside every other decoding slot
    turn over  end, or parse its tool calls (hermes) and submit them to the `ToolRunner`
    tools done append the tool turn (the template's tokens, not sampled) and decode again

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
(see `RolloutEngine.decode`), whatever the tools' timing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxrl.agent.chat import ChatTokens
from jaxrl.agent.parser import parse_hermes
from jaxrl.agent.runner import ToolResult, ToolRunner
from jaxrl.config.checks import AGENT_LOOPS as AGENTS
from jaxrl.data.templates import left_pad
from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.sampling import SamplingParams, nested_keys

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
class Trajectory:
    """A finished trajectory.

    Attributes:
        prompt_ids: The prompt's tokens.
        response_ids: Every token after the prompt (at most `response_length`).
        loss_mask: 1 on the tokens the policy sampled, 0 on appended (tool turn) tokens.
        log_probs: The rollout's log-prob of each sampled token, 0.0 elsewhere.
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

    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tool_seconds: float = 0.0
    tool_rewards: list[float] = dataclasses.field(default_factory=list)
    finish: str = ""

    def add_turn(self, tokens: Sequence[int], log_probs: Sequence[float]) -> None:
        """The policy's sampled turn (trained on)."""
        self.response_ids += list(tokens)
        self.loss_mask += [1] * len(tokens)
        self.log_probs += list(log_probs)
        self.assistant_turns += 1

    def add_tool_turn(self, ids: Sequence[int]) -> None:
        """A tool turn's template tokens (attended to, not trained on)."""
        self.response_ids += list(ids)
        self.loss_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
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
    """A trajectory in a slot: its request index, record, and outstanding tool calls."""

    index: int
    request: AgentRequest
    record: Trajectory
    tools: list[dict[str, Any]] | None
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
        self._active_runner = runner  # run() makes an empty one when there are no tools

    def run(
        self, requests: Sequence[AgentRequest], sampling: SamplingParams, rng: jax.Array
    ) -> list[Trajectory]:
        """Every request's trajectory, in order (see the module doc)."""
        for i, request in enumerate(requests):
            if request.agent_name not in AGENTS:
                raise ValueError(
                    f"request {i}: agent_name={request.agent_name!r}; jaxrl's agent loops are "
                    f"{', '.join(AGENTS)} (the row's agent_name column, or "
                    "actor_rollout_ref.rollout.agent.default_agent_loop)"
                )
        sampling = dataclasses.replace(sampling, n=1, max_tokens=self.response_length)
        self.stats = stats = LoopStats()
        start = time.perf_counter()
        queue = collections.deque(range(len(requests)))
        running: dict[int, _Running] = {}
        decoding: list[int] = []
        done: dict[int, Trajectory] = {}
        # Without tools an empty runner answers every call ("unknown tool", or the parse error).
        self._active_runner = self.runner or ToolRunner({})
        try:
            while queue or running:
                ready = [s for s in running if running[s].calls and
                         all(f.done() for f in running[s].calls)]  # fmt: skip
                if ready:
                    decoding += self._append_tool_turns(ready, running, done)
                if queue and self.engine.free_slots:
                    decoding += self._admit(queue, requests, running)
                if decoding:
                    decoding = self._decode(decoding, running, done, sampling, rng)
                elif running:
                    self._wait_for_tools([f for r in running.values() for f in r.calls])
        finally:  # an engine error has ended the slots it touched already
            if still_open := [s for s in running if self.engine.is_open(s)]:
                self.engine.end(still_open)
            if self.runner is None:
                self._active_runner.close()
        stats.seconds = time.perf_counter() - start
        return [done[i] for i in range(len(requests))]

    # ---- the loop's steps ------------------------------------------------------------------

    def _wait_for_tools(self, futures: list[concurrent.futures.Future]) -> None:
        """Wait for the first call to finish; the runner answers every call within its
        timeout, so one that does not (a tool blocking the runner's event loop) is an error,
        never a hang."""
        limit = (self.runner.timeout if self.runner is not None else 0.0) + STALL_GRACE_S
        waited = time.perf_counter()
        done, _ = concurrent.futures.wait(futures, timeout=limit, return_when="FIRST_COMPLETED")
        self.stats.wait_seconds += time.perf_counter() - waited
        if not done:
            raise RuntimeError(
                f"no tool call returned within {limit:g} s (the tool timeout + "
                f"{STALL_GRACE_S:g} s): a tool is blocking the runner's event loop (an async "
                "method that never awaits?); make it await, or make its methods plain functions"
            )

    def _admit(self, queue: collections.deque, requests, running: dict[int, _Running]) -> list[int]:
        """Start as many queued requests as there are free slots; returns their slots."""
        take = [queue.popleft() for _ in range(min(len(queue), self.engine.free_slots))]
        tools = [self._tools_of(requests[i]) for i in take]
        prompts = []
        for i, schemas in zip(take, tools, strict=True):
            ids = self.chat.prompt(requests[i].messages, schemas)
            if len(ids) > self.max_prompt_length:
                raise ValueError(
                    f"request {i}: its prompt is {len(ids)} tokens with the tools' schemas, "
                    f"more than data.max_prompt_length={self.max_prompt_length}: raise it, or "
                    "shorten the tool descriptions"
                )
            prompts.append(ids)
        ids, mask = left_pad(prompts, max(len(p) for p in prompts), 0)
        slots = self._timed(self.engine.start, ids, mask)
        if (room := self.engine.room(int(slots[0]))) < self.response_length:
            self.engine.end(slots)
            raise ValueError(
                f"a conversation has room for {room} response tokens after its prompt (padded "
                f"to {ids.shape[1]}), fewer than response_length={self.response_length}: raise "
                f"actor_rollout_ref.rollout.max_model_len (now {self.engine.max_model_len})"
            )
        for slot, i, schemas, prompt in zip(slots, take, tools, prompts, strict=True):
            record = Trajectory(prompt_ids=prompt, messages=[dict(m) for m in requests[i].messages])
            running[int(slot)] = _Running(i, requests[i], record, schemas)
        return [int(s) for s in slots]

    def _tools_of(self, request: AgentRequest) -> list[dict[str, Any]] | None:
        """The schemas a request's prompt shows (None: no tools)."""
        if request.agent_name != "tool_agent":
            return None
        names = self._schemas if request.tool_names is None else request.tool_names
        return [self._schemas[n] for n in names if n in self._schemas] or None

    def _decode(
        self,
        decoding: list[int],
        running: dict[int, _Running],
        done: dict[int, Trajectory],
        sampling: SamplingParams,
        rng: jax.Array,
    ) -> list[int]:
        """One chunk of every decoding slot; returns the slots still decoding."""
        index = [running[s].index for s in decoding]
        turn = [running[s].record.assistant_turns for s in decoding]
        keys = nested_keys(rng, index, turn, self.engine.slots)
        out = self._timed(
            self.engine.decode, decoding, sampling, keys, max_steps=self.limits.decode_chunk
        )
        self.stats.decode_calls += 1
        still = []
        for slot, tokens, log_probs, reason in zip(
            decoding, out.tokens, out.log_probs, out.finish_reasons, strict=True
        ):
            state = running[slot]
            record = state.record
            over_budget = len(record.response_ids) + len(tokens) >= self.response_length
            if reason is None and not over_budget:
                still.append(slot)
                continue
            record.add_turn(tokens.tolist(), log_probs.tolist())
            finish = self._after_turn(state, tokens, reason, over_budget)
            if finish:
                self._finish(slot, running, done, finish)
        return still

    def _after_turn(
        self, state: _Running, tokens: np.ndarray, reason: str | None, over_budget: bool
    ) -> str | None:
        """After a finished turn: submit its tool calls and return None, or return why the
        trajectory ends."""
        record, limits = state.record, self.limits
        text = self.chat.text(tokens.tolist())
        record.messages.append({"role": "assistant", "content": text})
        if over_budget or reason != "stop":
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
        runner = self._active_runner
        kwargs = state.request.tools_kwargs or {}
        allowed = state.request.tool_names
        state.calls = [
            runner.submit(c, (kwargs.get(c.name) or {}).get("create_kwargs"), allowed=allowed)
            for c in calls
        ]
        return None

    def _append_tool_turns(
        self, ready: list[int], running: dict[int, _Running], done: dict[int, Trajectory]
    ) -> list[int]:
        """Append the finished calls' answers to their slots; returns the slots that decode
        on (the others end: no room)."""
        appended, token_lists = [], []
        for slot in ready:
            state = running[slot]
            results: list[ToolResult] = [f.result() for f in state.calls]
            state.calls = []
            record = state.record
            messages = [{"role": "tool", "content": self._truncated(r.text)} for r in results]
            record.tool_seconds += max(r.seconds for r in results)  # they ran at once
            for r in results:
                record.tool_rewards.append(r.reward)
                if r.error:
                    record.tool_errors[r.error] += 1
            ids = self.chat.after_turn(record.messages, messages, state.tools)
            record.messages += messages
            room = self.engine.room(slot)
            if len(record.response_ids) + len(ids) >= self.response_length or len(ids) > room:
                self._finish(slot, running, done, "length")
                continue
            record.add_tool_turn(ids)
            appended.append(slot)
            token_lists.append(ids)
        if appended:
            self._timed(self.engine.append, appended, token_lists)
        return appended

    def _finish(
        self, slot: int, running: dict[int, _Running], done: dict[int, Trajectory], why: str
    ) -> None:
        state = running.pop(slot)
        self.engine.end([slot])
        record = state.record
        record.finish = why
        n = self.response_length
        record.response_ids, record.loss_mask = record.response_ids[:n], record.loss_mask[:n]
        record.log_probs = record.log_probs[:n]
        done[state.index] = record

    def _truncated(self, text: str) -> str:
        """verl's cut of a long tool answer to `max_tool_response_length` characters."""
        n, side = self.limits.max_tool_response_length, self.limits.tool_response_truncate_side
        if len(text) <= n:
            return text
        if side == "left":
            return "(truncated)..." + text[len(text) - n :]
        if side == "right":
            return text[:n] + "...(truncated)"
        return text[: n // 2] + "...(truncated)..." + text[len(text) - n // 2 :]

    def _timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.stats.decode_seconds += time.perf_counter() - start
