"""Between the step's prompts and the agent loop: requests in, batch rows and metrics out.

    requests = agent_requests(prompts.repeat(n), default_agent="single_turn_agent")
    trajectories = loop.run(requests, sampling, rng)
    rows = trajectory_rows(trajectories, prompt_length=P, response_length=R, pad_id=0)
    metrics = agent_metrics(trajectories, loop.stats)

A row's agent is its `agent_name` column (verl's), else `rollout.agent.default_agent_loop`;
its tools' `create_kwargs` come from `extra_info.tools_kwargs` (verl's layout:
`{tool name: {"create_kwargs": {...}}}`), and `extra_info.tool_selection` (a list of tool
names) limits the tools it sees and may call, as verl's.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.agent.loop import AgentRequest, LoopStats, Trajectory
from jaxrl.agent.runner import ERRORS
from jaxrl.data.batch import PromptBatch
from jaxrl.data.templates import left_pad
from jaxrl.sharding.processes import allgather_objects


def agent_requests(prompts: PromptBatch, default_agent: str) -> list[AgentRequest]:
    """One request per row of `prompts` (already repeated n times)."""
    names = prompts.agent_name if prompts.agent_name is not None else [None] * len(prompts)
    requests = []
    for messages, name, extra in zip(prompts.raw_prompt, names, prompts.extra_info, strict=True):
        tools_kwargs = (extra or {}).get("tools_kwargs") or {}
        if not isinstance(tools_kwargs, dict):
            raise ValueError(
                f"extra_info.tools_kwargs must map tool names to {{'create_kwargs': {{...}}}}, "
                f"got {tools_kwargs!r}"
            )
        selection = (extra or {}).get("tool_selection")
        names = None if not selection else tuple(str(n) for n in selection)
        requests.append(AgentRequest(list(messages), name or default_agent, tools_kwargs, names))
    return requests


def trajectory_rows(
    trajectories: Sequence[Trajectory], *, prompt_length: int, response_length: int, pad_id: int
) -> dict[str, np.ndarray]:
    """The trajectories as the step's host rows: left-padded `prompts` [N, P], right-padded
    `responses` [N, R], `response_mask` (every response token: attended to), `loss_mask`
    (the sampled ones: trained on) and `rollout_log_probs` (0 on tokens not sampled)."""
    n = len(trajectories)
    prompts, prompt_mask = left_pad([t.prompt for t in trajectories], prompt_length, pad_id)
    responses = np.full((n, response_length), pad_id, np.int32)
    response_mask = np.zeros((n, response_length), np.int32)
    loss_mask = np.zeros((n, response_length), np.int32)
    log_probs = np.zeros((n, response_length), np.float32)
    for i, t in enumerate(trajectories):
        k = len(t.response)
        responses[i, :k] = t.response
        response_mask[i, :k] = 1
        loss_mask[i, :k] = t.sampled
        log_probs[i, :k] = t.log_probs
    return {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
        "loss_mask": loss_mask,
        "rollout_log_probs": log_probs,
    }


@dataclasses.dataclass(frozen=True)
class _Account:
    """What the metrics read of one trajectory (small: it crosses the processes)."""

    num_turns: int
    tool_seconds: float
    tool_calls: int
    policy_tokens: int
    tool_tokens: int
    tool_errors: dict[str, int]
    tool_rewards: tuple[float, ...]
    finish: str

    @classmethod
    def of(cls, t: Trajectory) -> _Account:
        sampled = sum(t.sampled)
        return cls(t.num_turns, t.tool_seconds, t.tool_calls, sampled, len(t.sampled) - sampled,
                   dict(t.tool_errors), tuple(t.tool_rewards), t.finish)  # fmt: skip


def agent_metrics(trajectories: Sequence[Trajectory], stats: LoopStats) -> dict[str, float]:
    """verl's `num_turns/*` and `timing_s/agent_loop/tool_calls/*` (per trajectory), and
    jaxrl's `agent/*`: tool calls and errors (by kind), tool rewards, tokens the policy
    sampled vs tokens the tools' turns added, how trajectories ended, and the fraction of
    the rollout's wall time the decoder waited on tools (`perf/time_tool_wait_fraction`).

    Several processes: each passes its own trajectories and loop stats, and every process
    gets the metrics of all of them (one gather of a few numbers per trajectory; the wait
    fraction is the processes' summed wait over their summed wall time)."""
    every = allgather_objects(([_Account.of(t) for t in trajectories], stats))
    accounts = [a for part, _ in every for a in part]
    wait = sum(s.wait_seconds for _, s in every)
    seconds = sum(s.seconds for _, s in every)
    turns = np.asarray([a.num_turns for a in accounts], np.float64)
    tool_seconds = np.asarray([a.tool_seconds for a in accounts], np.float64)
    calls = np.asarray([a.tool_calls for a in accounts], np.float64)
    sampled = np.asarray([a.policy_tokens for a in accounts], np.float64)
    appended = np.asarray([a.tool_tokens for a in accounts], np.float64)
    errors = collections.Counter()
    for a in accounts:
        errors.update(a.tool_errors)
    rewards = [r for a in accounts for r in a.tool_rewards]
    finish = collections.Counter(a.finish for a in accounts)
    return {
        **_stats("num_turns", turns),
        **_stats("timing_s/agent_loop/tool_calls", tool_seconds),
        "agent/tool_calls/total": float(calls.sum()),
        "agent/tool_calls/mean": float(calls.mean()),
        "agent/tool_errors/total": float(sum(errors.values())),
        **{f"agent/tool_errors/{kind}": float(errors[kind]) for kind in ERRORS},
        "agent/tool_reward/mean": float(np.mean(rewards)) if rewards else 0.0,
        "agent/policy_tokens/mean": float(sampled.mean()),
        "agent/tool_tokens/mean": float(appended.mean()),
        "agent/tool_token_fraction": float(appended.sum() / max(sampled.sum() + appended.sum(), 1)),
        **{
            f"agent/finish/{why}": finish[why] / len(accounts)
            for why in ("stop", "length", "turns")
        },
        "perf/time_tool_wait_fraction": wait / seconds if seconds else 0.0,
    }


def _stats(name: str, values: np.ndarray) -> dict[str, float]:
    return {
        f"{name}/mean": float(values.mean()),
        f"{name}/max": float(values.max()),
        f"{name}/min": float(values.min()),
    }


def conversation_rows(trajectories: Sequence[Trajectory]) -> list[dict[str, Any]]:
    """Per trajectory, what a generation dump adds: its messages, turns and tool calls."""
    return [
        {
            "messages": t.messages,
            "num_turns": t.num_turns,
            "tool_calls": t.tool_calls,
            "finish": t.finish,
        }
        for t in trajectories
    ]
