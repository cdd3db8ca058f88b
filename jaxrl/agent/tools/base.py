"""The tool interface, with verl's method names (`verl.tools.base_tool.BaseTool`).

    tool = Calculator(config={"type": "native"}, tool_schema=None)
    instance_id, _ = await tool.create(create_kwargs=row_tools_kwargs)
    response, step_reward, metrics = await tool.execute(instance_id, {"expression": "2+3"})
    reward = await tool.calc_reward(instance_id)
    await tool.release(instance_id)

A tool is one object shared by every trajectory of a run; `create` opens an instance for one
tool call (its per-row state, from the row's `extra_info.tools_kwargs[name].create_kwargs`),
and `release` closes it. The methods may be coroutines (verl's are) or plain functions
(`jaxrl.agent.runner` runs plain ones on worker threads): a tool written for verl runs as it
is, given a `tool_schema` in its YAML entry.

`tool_schema` is an OpenAI function schema, a dict:

    {"type": "function", "function": {"name": "calculator", "description": "...",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                    "required": ["expression"]}}}
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any


@dataclasses.dataclass
class ToolResponse:
    """What a tool returns to the conversation (verl's `ToolResponse`, text only)."""

    text: str | None = None


# The key order of verl's schema models (`verl.tools.schemas`), which its prompt's tool JSON
# follows whatever order the YAML gave: each level's known keys first, in this order.
SCHEMA_KEY_ORDER = {
    "tool": ("type", "function"),
    "function": ("name", "description", "parameters", "strict"),
    "parameters": ("type", "properties", "required"),
    "property": ("type", "description", "enum"),
}


def _ordered(d: dict[str, Any], level: str) -> dict[str, Any]:
    """`d` with `level`'s known keys first in verl's order, then the others as given."""
    known = SCHEMA_KEY_ORDER[level]
    return {**{k: d[k] for k in known if k in d}, **{k: v for k, v in d.items() if k not in known}}


def schema_dict(schema: Any) -> dict[str, Any]:
    """An OpenAI function schema as a plain dict (a pydantic model of verl's is dumped), its
    keys in verl's order (`SCHEMA_KEY_ORDER`), so the prompt's tool JSON is verl's token for
    token. Keys verl's models do not know (a property's `items`, ...) are kept after them,
    where verl drops them."""
    if hasattr(schema, "model_dump"):
        schema = schema.model_dump(exclude_unset=True, exclude_none=True)
    if not isinstance(schema, dict):
        raise ValueError(f"a tool schema is a dict (OpenAI function format), got {schema!r}")
    function = schema.get("function")
    if schema.get("type") != "function" or not isinstance(function, dict):
        raise ValueError(
            'a tool schema is {"type": "function", "function": {"name": ..., "parameters": '
            f"...}}}}; got {schema!r}"
        )
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"the tool schema's function has no name: {schema!r}")
    function = _ordered(function, "function")
    parameters = function.get("parameters")
    if isinstance(parameters, dict):
        parameters = _ordered(parameters, "parameters")
        properties = parameters.get("properties")
        if isinstance(properties, dict):
            parameters["properties"] = {
                name: _ordered(p, "property") if isinstance(p, dict) else p
                for name, p in properties.items()
            }
        function["parameters"] = parameters
    return _ordered({**schema, "function": function}, "tool")


class BaseTool:
    """A tool the policy can call (subclass it and override `execute`).

    Args:
        config: The tool's `config` mapping from the tool YAML (`type: native` and the
            tool's own options).
        tool_schema: Its OpenAI function schema; None: `default_schema()`.
    """

    def __init__(self, config: dict[str, Any] | None, tool_schema: Any = None):
        self.config = dict(config or {})
        self.tool_schema = schema_dict(
            tool_schema if tool_schema is not None else self.default_schema()
        )
        self.name: str = self.tool_schema["function"]["name"]

    def default_schema(self) -> dict[str, Any] | None:
        """The schema used when the YAML entry gives none (a shipped tool's own)."""
        raise ValueError(f"{type(self).__name__} has no default schema: give tool_schema")

    def get_openai_tool_schema(self) -> dict[str, Any]:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Open an instance (kwargs: `create_kwargs`, the row's); returns its id."""
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[ToolResponse, float, dict]:
        """Run the call: (the response, a step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The instance's reward from its state."""
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Close the instance."""
