"""Training an external agent: the policy served over the OpenAI API during each rollout while
a user's function runs the episodes; the calls it made become the step's trajectories.

    agents = ExternalAgents("my_agent.py:run", tokenizer, chat, end_ids)
    results = agents.run(engine, episodes, sampling, rng, indices=rows,
                         prompt_length=P, response_length=R)   # one per row, in order
    trajectory = results[0].trajectory                          # the row's sequence
    agents.close()

The user's function (`actor_rollout_ref.rollout.agent.external`) runs one episode of a row:

    async def run(episode: jaxrl.serve.Episode) -> float | dict:
        client = openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key)
        reply = await client.chat.completions.create(model=episode.model,
                                                     messages=episode.messages, tools=TOOLS)
        ...                                  # its tools, its next calls
        return reward                        # or {"score": reward, "acc": ..., ...}

A rollout phase: the engine's own thread (`EngineLoop`) starts over the rollout engine, which
holds the step's weights; every row (the prompts repeated `rollout.n` times: a group is the n
episodes of a prompt) gets an api key of its own, opened in the `Recorder` with the step's
sampling settings, its key `fold_in(rng, row)` and its budgets; the episodes run concurrently
on an event loop of their own (their requests share the engine's slots: continuous batching
across episodes), each cancelled past `external_timeout`; then the keys close and the engine
thread stops (between phases the server answers 503, and any key but an open episode's 401).

An episode's row: its calls chain into one sequence when each call's prompt begins with the
previous call's prompt and sampled tokens (`recorder.episode_chains`): the first prompt, then
the sampled tokens (trained on, their log-probs) and the template's tokens between them (tool
results, user turns: attended to, not trained on), cut at the response length, as the
internal agent loop builds a trajectory; an agent that calls once per turn and sends its
history back unedited samples exactly what the internal loop samples with the same policy,
key and turns. Calls that do not chain (an edited history, a template that renders a reply
differently) make several sequences; the batch has one row per episode (its shapes are the
step's), so the row is the sequence with the most sampled tokens and the other calls are not
trained on (`agent/external/untrained_calls`). An episode without a call has an empty row
(no loss; its reward still counts in its group).

The reward is what the function returns, placed on the row's last token; a dict's values are
extra info as a reward function's are (validation reports `acc` as val-core; a number's
`acc` is the number). A function that raises, times out or returns no finite number gets
`reward_model.error_score` and is counted (`agent/external/errors`, `timeouts`; the first
traceback logged); a phase where every episode failed fails the step with that error, and
so does one whose cancelled episodes do not end (a function blocking its event loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import logging
import secrets
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl.agent import ChatTokens, Trajectory
from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.serve.app import Served, make_app
from jaxrl.serve.background import BackgroundServer
from jaxrl.serve.engine_loop import EngineLoop
from jaxrl.serve.recorder import Call, Recorder, episode_chains
from jaxrl.sharding.processes import allgather_objects

log = logging.getLogger("jaxrl.serve")

KEY = "actor_rollout_ref.rollout.agent.external"
CANCEL_GRACE_S = 20.0  # a cancelled episode's time to unwind before the phase gives up on it


@dataclasses.dataclass(frozen=True)
class Episode:
    """What the user's function gets for one episode.

    Attributes:
        base_url: The server's OpenAI base URL (`http://127.0.0.1:PORT/v1`).
        api_key: The episode's key: the calls made with it are recorded as its own.
        model: The served model's name (any name is accepted).
        messages: The row's prompt messages (verl's `raw_prompt`).
        ground_truth: The row's `reward_model.ground_truth`.
        data_source: The row's `data_source`.
        extra_info: The row's `extra_info` (e.g. `tools_kwargs`, what the reward needs).
        index: The episode's row in the step's batch (prompt i's episodes are rows
            i*n ... i*n + n - 1).
    """

    base_url: str
    api_key: str
    model: str
    messages: list[dict[str, Any]]
    ground_truth: Any = None
    data_source: str = ""
    extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    index: int = 0


@dataclasses.dataclass
class Result:
    """One episode's outcome.

    Attributes:
        trajectory: Its row's sequence (module doc).
        reward: The function's reward (`error_score` when it failed or timed out).
        extra: Its extra info (module doc).
        calls: The calls it made, in the order they were answered.
        untrained: Calls not in the trained sequence.
        chained: Whether every call is in it.
        error: The function's error, formatted (None: it returned).
        timed_out: Whether it was cancelled past the timeout.
        seconds: Its wall time.
    """

    trajectory: Trajectory
    reward: float
    extra: dict[str, Any]
    calls: list[Call]
    untrained: int
    chained: bool
    error: str | None
    timed_out: bool
    seconds: float


AgentFn = Callable[[Episode], Awaitable[Any]]


def load_agent(spec: str | AgentFn) -> AgentFn:
    """The async function `spec` names: `module:function` (an importable module) or
    `path/to/file.py:function`; or the function itself."""
    if callable(spec):
        if not inspect.iscoroutinefunction(spec):
            raise ValueError(f"the external agent {spec!r} must be an async function")
        return spec
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{KEY}={spec!r}: name the function as module:function or "
                         "path/to/file.py:function")  # fmt: skip
    if where.endswith(".py") or "/" in where:
        file = Path(where).expanduser()
        if not file.is_file():
            raise ValueError(f"{KEY}={spec!r}: no such file ({file.resolve()})")
        digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
        name_in_modules = f"jaxrl_agent_{file.stem}_{digest}"  # one module per file
        module_spec = importlib.util.spec_from_file_location(name_in_modules, file)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name_in_modules] = module  # as an import does (dataclasses look it up)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ValueError(f"{KEY}={spec!r}: cannot import {where!r} ({error})") from error
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{KEY}={spec!r}: {where} has no {name!r}")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{KEY}={spec!r}: {name} must be an async function "
                         "(`async def`), given one Episode, returning the reward")  # fmt: skip
    return fn


class ExternalAgents:
    """The trainer's OpenAI server and the episodes' event loop (module doc).

    Args:
        spec: The user's function (`load_agent`).
        tokenizer: The policy's tokenizer.
        chat: The chat template's tokens (the agent loop's: the same prompts).
        end_ids: Tokens that end a response.
        model: The name the server answers to.
        timeout: Seconds an episode may take.
        port: The server's port on 127.0.0.1 (0: a free one).
        chunk: Decode steps per engine pass.
        error_score: The reward of an episode that raised or timed out
            (`reward_model.error_score`, as a reward function's).
    """

    def __init__(self, spec: str | AgentFn, tokenizer: Any, chat: ChatTokens,
                 end_ids: Sequence[int], *, model: str = "policy", timeout: float = 600.0,
                 port: int = 0, chunk: int = 16, error_score: float = 0.0):  # fmt: skip
        self.fn, self.spec = load_agent(spec), spec
        self.timeout, self.chunk, self.error_score = timeout, chunk, error_score
        self.recorder = Recorder(exclusive=True)
        self.served = Served(None, tokenizer, model, 0, frozenset(end_ids), chat=chat,
                             request_timeout=timeout, recorder=self.recorder)  # fmt: skip
        # idle connections stay open between phases: a client's pooled connection closed by
        # the server as the client reuses it fails that request
        self.http = BackgroundServer(make_app(self.served), port=port, keep_alive=3600.0)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxrl-episodes",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        self._phase = 0
        if not renders_tool_calls(tokenizer):
            log.warning(
                "the chat template does not render an assistant message's tool_calls: an "
                "external agent's calls after a tool call will not chain into one sequence "
                "(agent/external/chained_fraction), and only one call of each episode is "
                "trained on; use a template that renders them (Qwen's, Hermes')"
            )

    @property
    def base_url(self) -> str:
        return self.http.url

    def close(self) -> None:
        self.http.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def run(
        self,
        engine: RolloutEngine,
        episodes: Sequence[dict[str, Any]],
        sampling: SamplingParams,
        rng: jax.Array,
        *,
        indices: Sequence[int],
        prompt_length: int,
        response_length: int,
    ) -> list[Result]:
        """One rollout phase (module doc): each episode (a row's `messages`, `ground_truth`,
        `data_source`, `extra_info`) run with its row's key `fold_in(rng, indices[i])`; the
        results in order."""
        self._phase += 1
        secret = secrets.token_hex(8)
        keys = [f"jaxrl-{secret}-{self._phase}-{i}" for i in range(len(episodes))]
        turn = dataclasses.replace(sampling, n=1)
        self.served.max_model_len = engine.max_model_len
        self.served.engine = EngineLoop(engine, chunk=self.chunk,
                                        max_pending=max(256, 4 * len(episodes)))  # fmt: skip
        try:
            for key, index in zip(keys, indices, strict=True):
                self.recorder.open(key, sampling=turn, rng=jax.random.fold_in(rng, index),
                                   response_length=response_length,
                                   max_prompt_length=prompt_length)  # fmt: skip
            jobs = [
                asyncio.run_coroutine_threadsafe(self._episode(Episode(
                    self.base_url, key, self.served.model, list(row["messages"]),
                    row.get("ground_truth"), str(row.get("data_source", "")),
                    dict(row.get("extra_info") or {}), int(index))), self._loop)
                for key, row, index in zip(keys, episodes, indices, strict=True)
            ]  # fmt: skip
            _, stuck = concurrent.futures.wait(jobs, timeout=self.timeout + CANCEL_GRACE_S)
            for job in stuck:
                job.cancel()
            if stuck:  # cancelled at the timeout and still running: the loop is not theirs
                raise RuntimeError(
                    f"{len(stuck)} episodes of the external agent {self.spec} did not end "
                    f"within agent.external_timeout={self.timeout:g} s + {CANCEL_GRACE_S:g} s: "
                    "the function blocks its event loop (a synchronous client, time.sleep or "
                    "long CPU work inside `async def`?); use openai.AsyncOpenAI and await"
                )
            outcomes = [job.result() for job in jobs]
        finally:
            engine_loop, self.served.engine = self.served.engine, None
            calls = [self.recorder.close(key) for key in keys if self.recorder.records(key)]
            engine_loop.close()
        results = [
            _result(c, o, row, prompt_length, response_length, self.error_score)
            for c, o, row in zip(calls, outcomes, episodes, strict=True)
        ]
        failed = [(i, r) for i, r in enumerate(results) if r.error or r.timed_out]
        if failed:
            i, r = failed[0]
            why = r.error or f"timed out (agent.external_timeout={self.timeout:g} s)"
            if len(failed) == len(results):
                raise RuntimeError(f"every episode of the external agent {self.spec} failed; "
                                   f"row {indices[i]}'s:\n{why}")  # fmt: skip
            log.warning("%d of %d external episodes failed (reward_model.error_score=%g); row "
                        "%d's:\n%s", len(failed), len(results), self.error_score, indices[i],
                        why)  # fmt: skip
        return results

    async def _episode(self, episode: Episode) -> tuple[Any, str | None, bool, float]:
        """(the function's return, its formatted error, timed out, seconds)."""
        start = time.perf_counter()
        limit = asyncio.timeout(self.timeout)
        try:
            async with limit:
                out = await self.fn(episode)
        except TimeoutError:
            if limit.expired():  # else the function's own TimeoutError: an error of its
                return None, None, True, time.perf_counter() - start
            return None, traceback.format_exc(), False, time.perf_counter() - start
        except Exception:
            return None, traceback.format_exc(), False, time.perf_counter() - start
        return out, None, False, time.perf_counter() - start


def renders_tool_calls(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes an assistant message's `tool_calls`."""
    call = {"id": "c0", "type": "function",
            "function": {"name": "jaxrl_probe_tool", "arguments": "{}"}}  # fmt: skip
    probe = [{"role": "user", "content": "1"},
             {"role": "assistant", "content": "", "tool_calls": [call]}]  # fmt: skip
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template that refuses the message renders nothing of it
        return False
    return "jaxrl_probe_tool" in text


def _result(calls: list[Call], outcome: tuple, row: dict[str, Any], prompt_length: int,
            response_length: int, error_score: float) -> Result:  # fmt: skip
    out, error, timed_out, seconds = outcome
    reward, extra = error_score, {}
    if error is None and not timed_out:
        try:
            reward, extra = _reward(out)
        except ValueError as bad:
            error = f"{bad}"
    trajectory, members = _trajectory(calls, row, prompt_length, response_length)
    return Result(trajectory, reward, extra, calls, len(calls) - len(members),
                  len(members) == len(calls), error, timed_out, seconds)  # fmt: skip


def _reward(out: Any) -> tuple[float, dict[str, Any]]:
    """The function's return as (reward, extra info), as the reward managers read a scorer's:
    a dict's every key (`score` too) is extra info; a number's is `acc` = the number."""
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"the external agent returned a dict without 'score': {out!r}")
        extra, out = dict(out), out["score"]
    else:
        extra = None
    if (
        isinstance(out, bool)
        or not isinstance(out, (int, float, np.number))
        or not np.isfinite(out)
    ):
        raise ValueError(f"the external agent returned {out!r}: return the reward, a finite "
                         "number (or a dict with 'score')")  # fmt: skip
    return float(out), extra if extra is not None else {"acc": float(out)}


def _trajectory(calls: list[Call], row: dict[str, Any], prompt_length: int,
                response_length: int) -> tuple[Trajectory, list[int]]:  # fmt: skip
    """The episode's row (module doc) and the calls it holds."""
    chains = [c for c in episode_chains(calls) if len(c[0].prompt) <= prompt_length]
    messages = [dict(m) for m in row["messages"]]
    if not chains:  # no call: the row's own prompt, an empty response
        return Trajectory(prompt=list(row["prompt_ids"]), messages=messages, finish="empty"), []
    sequence, members = max(chains, key=lambda c: sum(c[0].sampled))  # the first of the most
    n = response_length
    cut = len(sequence.response) > n
    # the calls whose tokens begin before the cut (a call's begin where its prompt ends)
    kept = [i for i in members if len(calls[i].prompt) - len(sequence.prompt) < n]
    record = Trajectory(
        prompt=sequence.prompt, response=sequence.response[:n], sampled=sequence.sampled[:n],
        log_probs=sequence.log_probs[:n], versions=sequence.versions[:n], messages=messages,
        assistant_turns=len(kept), user_turns=_runs(sequence.sampled[:n], 0),
        tool_calls=sum(calls[i].tool_calls for i in kept),
        finish="length" if cut or calls[members[-1]].finish == "length" else "stop",
    )  # fmt: skip
    return record, members


def _runs(mask: Sequence[int], value: int) -> int:
    """Maximal runs of `value` in `mask`."""
    return sum(1 for i, m in enumerate(mask) if m == value and (i == 0 or mask[i - 1] != value))


def external_metrics(results: Sequence[Result]) -> dict[str, float]:
    """jaxrl's `agent/external/*`: calls per episode, the fraction whose calls all chained
    into one sequence, calls not trained on, errors, timeouts, episodes without a call, and
    their wall times (`timing_s/agent_loop/external`). Several processes: each passes its
    own episodes, every one gets the metrics of all (a gather of a few numbers each)."""
    mine = [(len(r.calls), r.chained, r.untrained, r.error is not None, r.timed_out, r.seconds)
            for r in results]  # fmt: skip
    every = [a for part in allgather_objects(mine) for a in part]
    calls, chained, untrained, errors, timeouts, seconds = (
        np.asarray(column, np.float64) for column in zip(*every, strict=True)
    )
    return {
        "agent/external/calls/mean": float(calls.mean()),
        "agent/external/calls/max": float(calls.max()),
        "agent/external/chained_fraction": float(chained.mean()),
        "agent/external/untrained_calls": float(untrained.sum()),
        "agent/external/errors": float(errors.sum()),
        "agent/external/timeouts": float(timeouts.sum()),
        "agent/external/no_calls": float((calls == 0).sum()),
        "timing_s/agent_loop/external/mean": float(seconds.mean()),
        "timing_s/agent_loop/external/max": float(seconds.max()),
    }
