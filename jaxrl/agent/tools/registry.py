"""Tools from a tool YAML in verl's format (`multi_turn.tool_config_path`).

    tools:
      - class_name: jaxrl.agent.tools.calculator.Calculator
        config: {type: native}
        tool_schema:            # optional for jaxrl's tools (each has its own)
          type: function
          function: {name: calculator, description: ..., parameters: {...}}

    tools = load_tools("tools.yaml")     # {name: tool}

`class_name` is a dotted path, imported as written: a tool's code is loaded only from the
module the file names. verl's class paths of the tools jaxrl ships (`VERL_ALIASES`) load
jaxrl's version, so a verl tool YAML works unchanged. Only `type: native` tools exist (verl's
MCP tools are not supported). Problems name the file, the entry and the fix.
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from typing import Any

import yaml

from jaxrl.agent.tools.base import schema_dict

log = logging.getLogger("jaxrl.agent")

SHIPPED = {
    "calculator": "jaxrl.agent.tools.calculator.Calculator",
    "gsm8k": "jaxrl.agent.tools.gsm8k.Gsm8kTool",
    "code": "jaxrl.agent.tools.code.CodeInterpreter",
}
VERL_ALIASES = {
    "verl.tools.gsm8k_tool.Gsm8kTool": SHIPPED["gsm8k"],
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": SHIPPED["code"],
}


class ToolConfigError(ValueError):
    """A tool YAML that cannot be loaded (the message names the file and entry)."""


def tool_class(class_name: str, where: str) -> type:
    """The class at dotted path `class_name` (verl's paths of shipped tools mapped)."""
    dotted = VERL_ALIASES.get(class_name, class_name)
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise ToolConfigError(f"{where}: class_name {class_name!r} is not a dotted path "
                              "(module.Class)")  # fmt: skip
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ToolConfigError(f"{where}: cannot import {module_name!r} ({e})") from e
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ToolConfigError(f"{where}: {module_name} has no class {attr!r}")
    return cls


def load_tools(path: str | os.PathLike) -> dict[str, Any]:
    """Every tool of the YAML at `path`, by name."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ToolConfigError(
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}: no such file"
        )
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ToolConfigError(f"{path}: not valid YAML ({e})") from e
    entries = (doc or {}).get("tools") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ToolConfigError(f"{path}: expected a top-level `tools:` list of tool entries")
    tools: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        tool = _make_tool(entry, where)
        if tool.name in tools:
            raise ToolConfigError(f"{where}: a second tool named {tool.name!r}; names are unique")
        tools[tool.name] = tool
    return tools


def _verl_schema(cls: type, schema: dict[str, Any]) -> Any:
    """The schema as the tool's class takes it: verl's `BaseTool` reads a pydantic
    `OpenAIFunctionToolSchema` (attribute access), jaxrl's a dict."""
    if not any(c.__module__ == "verl.tools.base_tool" for c in cls.__mro__):
        return schema
    schemas = importlib.import_module("verl.tools.schemas")  # installed: the class is verl's
    return schemas.OpenAIFunctionToolSchema.model_validate(schema)


def _make_tool(entry: Any, where: str) -> Any:
    if not isinstance(entry, dict) or "class_name" not in entry:
        raise ToolConfigError(f"{where}: each entry needs class_name (and config, tool_schema)")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}: config must be a mapping")
    kind = config.get("type", "native")
    if kind != "native":
        raise ToolConfigError(f"{where}: config.type={kind!r}; jaxrl runs `native` tools only")
    cls = tool_class(str(entry["class_name"]), where)
    if VERL_ALIASES.get(str(entry["class_name"])) == SHIPPED["code"] and any(
        k in config for k in ("sandbox_fusion_url", "memory_limit_mb_remote")
    ):
        log.warning(
            "%s: verl's SandboxFusionTool runs code on a remote service (sandbox_fusion_url); "
            "jaxrl runs it locally in its subprocess sandbox (docs/sandbox.md)",
            where,
        )
    schema = entry.get("tool_schema")
    try:
        if schema is not None:
            schema = _verl_schema(cls, schema_dict(schema))
        tool = cls(config=config, tool_schema=schema)
    except (TypeError, ValueError, AttributeError) as e:
        raise ToolConfigError(f"{where} ({entry['class_name']}): {e}") from e
    for method in ("create", "execute", "release"):
        if not callable(getattr(tool, method, None)):
            raise ToolConfigError(f"{where}: {cls.__name__} has no {method}() method")
    if not isinstance(getattr(tool, "name", None), str):
        raise ToolConfigError(f"{where}: {cls.__name__} has no name (give a tool_schema)")
    return tool
