"""Agentic multi-turn rollouts: the policy calls tools and reads their answers over several
turns, on the rollout engine's conversation slots; only the policy's tokens are trained on.

    tools = load_tools(cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path)
    with ToolRunner(tools, timeout=30) as runner:
        loop = AgentLoop(engine, ChatTokens(tokenizer, end_ids), runner, Limits(),
                         response_length=256, max_prompt_length=512)
        trajectories = loop.run(agent_requests(prompts, "tool_agent"), sampling, rng)

`parser` reads hermes tool calls, `runner` runs them on the host concurrently with decoding,
`chat` tokenizes the turns as the chat template does, `loop` drives the engine, `batch` turns
trajectories into the step's rows (`loss_mask` 0 on tool tokens) and metrics, and `tools` has
the tool interface (verl's `BaseTool`), the YAML registry and the shipped tools.
"""

from jaxrl.agent.batch import agent_metrics, agent_requests, conversation_rows, trajectory_rows
from jaxrl.agent.chat import ChatTokens
from jaxrl.agent.loop import AGENTS, AgentLoop, AgentRequest, Limits, LoopStats, Trajectory
from jaxrl.agent.parser import FORMATS, ToolCall, parse_hermes
from jaxrl.agent.runner import ToolResult, ToolRunner
from jaxrl.agent.tools.base import BaseTool, ToolResponse
from jaxrl.agent.tools.registry import load_tools

__all__ = [
    "AGENTS",
    "FORMATS",
    "AgentLoop",
    "AgentRequest",
    "BaseTool",
    "ChatTokens",
    "Limits",
    "LoopStats",
    "ToolCall",
    "ToolResponse",
    "ToolResult",
    "ToolRunner",
    "Trajectory",
    "agent_metrics",
    "agent_requests",
    "conversation_rows",
    "load_tools",
    "parse_hermes",
    "trajectory_rows",
]
