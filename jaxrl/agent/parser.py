"""Tool calls out of a turn's text, and their required arguments checked against the schema.

    content, calls = parse_hermes('Let me add. <tool_call>{"name": "calculator", '
                                  '"arguments": {"expression": "2+3"}}</tool_call>')
    # content "Let me add. ", calls [ToolCall(name="calculator", arguments={...})]

`hermes` is the format of Qwen2.5/Qwen3 and NousResearch's Hermes models: each call is one
JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`.
Unlike verl's parser, which drops a call it cannot read, a malformed call (bad JSON, no name,
arguments not an object, an unclosed `<tool_call>`) is kept with its `error`: the loop answers
it with a tool response that names the problem and counts it (`agent/tool_errors/malformed`),
and the trajectory goes on (verl's ends: its turn has no call), so the policy is taught by the
reward rather than by silence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from typing import Any

from jaxrl.config.checks import TOOL_FORMATS

FORMATS = TOOL_FORMATS  # the `multi_turn.format`s parsed here

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the policy wrote.

    Attributes:
        name: The tool's name ("" when it could not be read).
        arguments: The arguments object ({} when it could not be read).
        error: Why the call cannot run (None: well-formed).
        raw: The text between the tags.
    """

    name: str
    arguments: dict[str, Any]
    error: str | None = None
    raw: str = ""


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """(the text without its tool calls, the calls in order) of a hermes-format turn."""
    calls = [_read_call(m.group(1)) for m in _CALL.finditer(text)]
    content = _CALL.sub("", text)
    if _OPEN in content:  # an opening tag left without its closing one
        raw = content[content.index(_OPEN) + len(_OPEN) :]
        calls.append(ToolCall("", {}, f"{_OPEN} without {_CLOSE}", raw))
        content = content[: content.index(_OPEN)]
    return content, calls


def _read_call(raw: str) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at char {e.pos})", raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", {}, 'a tool call needs a "name" string and an "arguments" object', raw)
    name, arguments = obj["name"], obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f'"arguments" of {name} must be a JSON object', raw)
    return ToolCall(name, arguments, None, raw)


def argument_problems(arguments: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """The required parameters of a tool's OpenAI function schema that `arguments` lacks.
    Types and extra keys are the tool's business, as in verl (whose tools convert, e.g. the
    gsm8k tool's `str(answer)`)."""
    parameters = schema["function"].get("parameters") or {}
    return [f"missing required argument {k!r}" for k in parameters.get("required", [])
            if k not in arguments]  # fmt: skip
