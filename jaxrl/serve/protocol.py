"""The OpenAI API's shapes: requests read into what the engine takes, errors and responses.

    request = chat_request(body, model="tiny")        # or completion_request(...)
    request.messages, request.tools, request.sampling, request.n, request.stream
    error = ApiError(400, "temperature=-1 must be >= 0", param="temperature")
    error.body()    # {"error": {"message", "type", "param", "code"}}: OpenAI's error object

Only what the engine can do is accepted; anything else is refused with a 400 naming the
parameter, never ignored: a sampled token's log-prob is returned (`logprobs`) but not the
other candidates' (`top_logprobs` > 0 is refused); penalties, `logit_bias`, `echo` and
`suffix` are refused unless they are their no-op defaults, as are `response_format` other
than text, `best_of` > 1 and `parallel_tool_calls: false`. Sampling follows vLLM's reading
of OpenAI's parameters: `temperature` 0 is greedy, `max_tokens` (or `max_completion_tokens`)
defaults to what the context leaves after the prompt, `seed` fixes the request's samples.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.rollout.sampling import SamplingParams

# OpenAI's error types by HTTP status
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    401: "authentication_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """An error answered as OpenAI answers it: the HTTP status and `{"error": {...}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


@dataclasses.dataclass(frozen=True)
class Request:
    """One chat or text completion request, read.

    Attributes:
        messages: The chat's messages (None for a text completion).
        tools: The chat's tools in OpenAI's schema (None: none).
        prompt: A text completion's prompt: a string or token ids (None for a chat).
        sampling: The engine's settings (`n` 1: `n` copies are submitted).
        n: Choices to return.
        stream: Answer as server-sent events.
        logprobs: Return each sampled token's log-prob.
        max_tokens: The client's bound on the response (None: what the context leaves).
        include_usage: Streaming: a last chunk with the token counts.
    """

    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    sampling: SamplingParams
    n: int
    stream: bool
    logprobs: bool
    max_tokens: int | None
    include_usage: bool = False


def chat_request(body: Any, model: str) -> Request:
    """A `/v1/chat/completions` body read (raises `ApiError` naming what is wrong)."""
    body = _object(body)
    _model(body, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise ApiError(
                400, f"messages[{i}] must be an object with a role in {sorted(_ROLES)}",
                param=f"messages[{i}]",
            )  # fmt: skip
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or
                              not all(_is_function_tool(t) for t in tools)):  # fmt: skip
        raise ApiError(400, 'tools must be a list of {"type": "function", "function": {...}}',
                       param="tools")  # fmt: skip
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        tools = None
    elif choice not in ("auto", None) and tools:
        raise ApiError(
            400, f"tool_choice={choice!r}: only 'auto' and 'none' (the model decides whether "
            "to call a tool; forcing one is not built)", param="tool_choice",
        )  # fmt: skip
    top = body.get("top_logprobs") or 0
    if top:
        raise ApiError(400, "top_logprobs > 0: the engine returns the sampled token's log-prob "
                       "only (logprobs=true)", param="top_logprobs")  # fmt: skip
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    stream_options = body.get("stream_options") or {}
    return Request(
        messages=[_text_content(m, i) for i, m in enumerate(messages)], tools=tools or None,
        prompt=None,
        sampling=_sampling(body, limit), n=_n(body), stream=bool(body.get("stream")),
        logprobs=bool(body.get("logprobs")), max_tokens=limit,
        include_usage=bool(stream_options.get("include_usage")),
    )  # fmt: skip


def completion_request(body: Any, model: str) -> Request:
    """A `/v1/completions` body read: one prompt, a string or a list of token ids."""
    body = _object(body)
    _model(body, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ids = isinstance(prompt, list) and all(_is_int(t) and 0 <= t < 2**31 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not (ids and prompt):
        raise ApiError(400, "prompt must be one non-empty string or list of token ids in "
                       "[0, 2**31) (send several prompts as several requests)",
                       param="prompt")  # fmt: skip
    for name in ("echo", "suffix"):
        if body.get(name):
            raise ApiError(400, f"{name} is not supported", param=name)
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1):
        raise ApiError(400, f"logprobs={logprobs}: the engine returns the sampled token's "
                       "log-prob only (logprobs=1)", param="logprobs")  # fmt: skip
    limit = body.get("max_tokens", 16)  # OpenAI's default for completions
    stream_options = body.get("stream_options") or {}
    return Request(
        messages=None, tools=None, prompt=prompt, sampling=_sampling(body, limit), n=_n(body),
        stream=bool(body.get("stream")), logprobs=logprobs == 1, max_tokens=limit,
        include_usage=bool(stream_options.get("include_usage")),
    )  # fmt: skip


def with_max_tokens(request: Request, prompt_tokens: int, room: int, max_model_len: int) -> Request:
    """`request` with its response bound set: the client's, or the `room` the context leaves
    after the prompt (the engine's: after the prompt padded to its length bucket); 413 when
    the prompt leaves no room, or the client asks for more than it leaves."""
    if room < 1 or (request.max_tokens is not None and request.max_tokens > room):
        asked = "" if request.max_tokens is None else f" + max_tokens {request.max_tokens}"
        raise ApiError(
            413, f"the prompt's {prompt_tokens} tokens{asked} exceed the model's context of "
            f"{max_model_len} tokens ({room} left after the prompt, padded to its bucket): "
            "shorten the prompt or lower max_tokens",
            param="messages" if request.messages is not None else "prompt",
            code="context_length_exceeded",
        )  # fmt: skip
    limit = room if request.max_tokens is None else request.max_tokens
    return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling,
                                                                     max_tokens=limit))  # fmt: skip


def finish_reason(engine_reason: str | None, tool_calls: Sequence[Any]) -> str | None:
    """OpenAI's finish reason of a choice: `tool_calls` when the turn called tools."""
    if engine_reason == "stop" and tool_calls:
        return "tool_calls"
    return engine_reason


def tool_call_objects(calls: Sequence[Any], request_id: str, choice: int) -> list[dict]:
    """OpenAI's `tool_calls` of parsed hermes calls (`jaxrl.agent.parser.ToolCall`)."""
    return [
        {
            "id": f"call_{request_id}_{choice}_{i}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for i, call in enumerate(calls)
    ]


# ----------------------------------------------------------------------------------- reading

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_NO_OPS = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "user": None}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: only {\"type\": \"text\"} (structured outputs are "
                       "not built)", param="response_format")  # fmt: skip
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "best_of > 1 is not supported (ask for n choices)", param="best_of")
    if body.get("parallel_tool_calls") is False:
        raise ApiError(400, "parallel_tool_calls=false is not supported: the model may write "
                       "several calls in a turn", param="parallel_tool_calls")  # fmt: skip
    for name, default in _NO_OPS.items():
        value = body.get(name, default)
        if name != "user" and value not in (default, None, {}):
            raise ApiError(400, f"{name}={value!r} is not supported (only its default)",
                           param=name)  # fmt: skip
    return body


def _model(body: Mapping[str, Any], model: str) -> None:
    asked = body.get("model")
    if asked != model:
        raise ApiError(404, f"The model `{asked}` does not exist: this server serves "
                       f"`{model}` (GET /v1/models)", param="model",
                       code="model_not_found")  # fmt: skip


def _text_content(message: dict[str, Any], index: int) -> dict[str, Any]:
    """The message with content given as parts (`[{"type": "text", "text": ...}]`) joined
    into one string; parts other than text are refused."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in content):  # fmt: skip
        raise ApiError(400, f"messages[{index}].content: only text parts are supported",
                       param=f"messages[{index}].content")  # fmt: skip
    return {**message, "content": "".join(p["text"] for p in content)}


def _is_function_tool(tool: Any) -> bool:
    return (isinstance(tool, dict) and tool.get("type") == "function"
            and isinstance(tool.get("function"), dict) and "name" in tool["function"])  # fmt: skip


def _n(body: Mapping[str, Any]) -> int:
    n = body.get("n", 1)
    if not _is_int(n) or n < 1:
        raise ApiError(400, f"n={n!r} must be an integer >= 1", param="n")
    return n


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or not low <= value <= high:  # fmt: skip
        raise ApiError(400, f"{name}={value!r} must be a number in [{low}, {high}]", param=name)
    return float(value)


def _sampling(body: Mapping[str, Any], limit: Any) -> SamplingParams:
    """The engine's settings of a request (`max_tokens` filled in later, from the prompt)."""
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise ApiError(400, f"max_tokens={limit!r} must be an integer >= 1", param="max_tokens")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "top_p=0 keeps no token: use temperature=0 for greedy", param="top_p")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) \
            or len(stop) > 4:  # fmt: skip
        raise ApiError(400, "stop must be a string or a list of at most 4 non-empty strings",
                       param="stop")  # fmt: skip
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and -(2**63) <= seed < 2**63):
        raise ApiError(400, f"seed={seed!r} must be a 64-bit integer", param="seed")
    top_k = body.get("top_k", -1)  # vLLM's extension
    if not _is_int(top_k) or not (top_k == -1 or 1 <= top_k < 2**31):
        raise ApiError(400, f"top_k={top_k!r} must be -1 (off) or in [1, 2**31)", param="top_k")
    ignore_eos = body.get("ignore_eos", False)  # vLLM's extension
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, f"ignore_eos={ignore_eos!r} must be true or false", param="ignore_eos")
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=limit or 1,
        do_sample=temperature > 0, stop=tuple(stop), seed=seed, ignore_eos=ignore_eos,
    )  # fmt: skip
