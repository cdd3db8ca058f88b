"""The tool quickstart's calculator task as an external agent: plain `openai` client code that
jaxrl trains (`actor_rollout_ref.rollout.agent.external`). Copy it and change the loop, the
tools and the reward: jaxrl records whatever the policy generated for the episode's api key.

    python -m jaxrl.train --config configs/quickstart_external.yaml

Each episode (one row of the data, `rollout.n` episodes a prompt) asks the policy with the
calculator's schema, runs the calls it makes, sends the results back and asks again, at most
three times, as `configs/quickstart_tools.yaml`'s internal agent loop does; then it scores the
episode as that quickstart's reward function scores the whole response: half for the first
call (its pieces against the ideal call's), half for `acc` (the answer after a tool result is
the sum). Nothing here imports jaxrl.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import re
from typing import Any

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression and return its value.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "The expression, e.g. 123 + 456",
                    }
                },
                "required": ["expression"],
            },
        },
    }
]
MAX_TURNS = 3
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.USub: operator.neg, ast.UAdd: operator.pos}  # fmt: skip
_PIECES = re.compile(r"\d+|\+")


async def run(episode: Any) -> dict[str, float]:
    """One episode of a row: the policy's calls with the calculator, then its reward."""
    client, in_flight = _shared(episode.base_url)
    client = client.with_options(api_key=episode.api_key)  # the episode's calls: its key
    messages = list(episode.messages)
    first_call, answered, answer = None, False, ""
    for _ in range(MAX_TURNS):
        async with in_flight:
            response = await client.chat.completions.create(
                model=episode.model, messages=messages, tools=TOOLS
            )
        reply = response.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:  # an answer (or the episode's token budget spent)
            answer = reply.content or ""
            break
        call = reply.tool_calls[0]  # one call a turn, as the quickstart's loop
        expression = _expression(call.function.arguments)
        if first_call is None:
            first_call = expression
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": calculate(expression)})  # fmt: skip
        answered = True
    return score(first_call, answered, answer, episode.ground_truth,
                 episode.extra_info["expression"])  # fmt: skip


IN_FLIGHT = 32  # requests at once per server
_SHARED: dict[tuple[str, Any], tuple[openai.AsyncOpenAI, asyncio.Semaphore]] = {}


def _shared(base_url: str) -> tuple[openai.AsyncOpenAI, asyncio.Semaphore]:
    """One client per server and event loop, shared by the episodes, and a bound on their
    requests in flight. Making a client costs ~30 ms of the event loop (hundreds made at
    once stall every episode's requests), and its connection pool scans every connection
    for each request: hundreds of connections cost more than the requests wait (the
    quickstart's rollout of 256 episodes: ~3.5 s with 32 in flight, ~7 s unbounded)."""
    key = (base_url, asyncio.get_running_loop())
    if key not in _SHARED:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="per-episode")
        _SHARED[key] = client, asyncio.Semaphore(IN_FLIGHT)
    return _SHARED[key]


def score(first_call: str | None, answered: bool, answer: str, ground_truth: Any,
          expression: str) -> dict[str, float]:  # fmt: skip
    """{"score", "acc", "call"}: half for the first call's pieces (the call's 4 fixed pieces
    and its expression's numbers and `+`, position by position, against the ideal call's),
    half for `acc`: the digits of the answer after a tool result are the sum's."""
    ideal = ["open", "name", *_PIECES.findall(expression), "close", "end"]
    got = [] if first_call is None else ["open", "name", *_PIECES.findall(first_call),
                                         "close", "end"]  # fmt: skip
    call = sum(a == b for a, b in zip(got, ideal, strict=False)) / max(len(got), len(ideal))
    digits = re.findall(r"\d", answer) if answered else []
    acc = float(digits == re.findall(r"\d", str(ground_truth)))
    return {"score": 0.5 * call + 0.5 * acc, "acc": acc, "call": call}


def _expression(arguments: str) -> str:
    try:
        return str(json.loads(arguments).get("expression", ""))
    except (json.JSONDecodeError, AttributeError):
        return ""


def calculate(expression: str) -> str:
    """The expression's value (integers, + - *), or the error, as the tool answers."""
    try:
        value = _evaluate(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as error:
        return f"Error: {error}"
    return str(value)


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not an integer expression: {ast.dump(node)}")
