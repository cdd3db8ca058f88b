"""The OpenAI-compatible HTTP API over an `EngineLoop` (a Starlette app; `jaxrl.serve`).

    app = make_app(Served(engine_loop, tokenizer, model="tiny", max_model_len=512))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (both streamed as server-sent
events with `stream: true`), `GET /v1/models`, `GET /health`. A request's `n` choices are
copies of one prompt on the engine (prefilled once); concurrent requests share its slots.

A chat's prompt is the tokenizer's chat template over its messages and tools, with the
generation prompt (`jaxrl.agent.chat.ChatTokens`, as the agent loop renders it). With tools,
the reply's text is read for hermes tool calls (`<tool_call>{json}</tool_call>`, the Qwen
format; `jaxrl.agent.parser`): they become the message's `tool_calls` (finish reason
`tool_calls`) and leave its content; a stream sends the text before the first `<tool_call>`
as it comes and the calls at the end. A call the parser cannot read stays in the content.

Errors are OpenAI's error object: 400 (a bad body or parameter), 404 (another model), 413 (the
prompt, or prompt + max_tokens, past the context), 429 (`max_pending` requests pending), 408
(not done within `request_timeout`: the request is aborted), 500 (the engine failed: named;
the server goes on serving). A client that disconnects has its request aborted and its slots
freed at the engine's next chunk.

Recording (a trainer's server, `jaxrl.serve.external`): a request whose bearer key (the
client's `api_key`) is an open episode's is run as its `Recorder` says (the trainer's
sampling settings and keys, the episode's token budget) and each of its choices is recorded
under the key. A recorder that is `exclusive` refuses other keys (401), and between rollout
phases (`engine` None) every request gets 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxrl.agent.chat import ChatTokens
from jaxrl.agent.parser import parse_hermes
from jaxrl.serve.engine_loop import BadRequest, EngineLoop, JobTimeout, QueueFull, Update
from jaxrl.serve.protocol import (
    ApiError,
    Request,
    chat_request,
    completion_request,
    finish_reason,
    tool_call_objects,
    with_max_tokens,
)
from jaxrl.serve.recorder import Call, Recorder, Turn

_TOOL_OPEN = "<tool_call>"


@dataclasses.dataclass
class Served:
    """What the API serves.

    Attributes:
        engine: The engine's thread (None: not serving now, 503).
        tokenizer: The model's HF tokenizer (with a chat template for the chat route).
        model: The name clients ask for (`model` in a request, `GET /v1/models`).
        max_model_len: The engine's context: prompt + response tokens at most.
        end_ids: The tokens that end a response (not part of its text or log-probs).
        request_timeout: Seconds a request may take before it is aborted (408).
        recorder: Records the choices of requests whose api key is an open episode's
            (`jaxrl.serve.recorder`; None: nothing is recorded).
        chat: The chat template's tokens (None: the tokenizer's template with `end_ids`,
            when it has one; a trainer passes its own, its template arguments included).
    """

    engine: EngineLoop | None
    tokenizer: Any
    model: str
    max_model_len: int
    end_ids: frozenset[int]
    request_timeout: float = 600.0
    recorder: Recorder | None = None
    chat: ChatTokens | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        template = getattr(self.tokenizer, "chat_template", None)
        if self.chat is None and template:
            self.chat = ChatTokens(self.tokenizer, self.end_ids)


def make_app(served: Served) -> Starlette:
    """The Starlette app of `served` (module doc)."""

    async def chat(http: HttpRequest) -> Response:
        return await _complete(served, http, chat=True)

    async def completions(http: HttpRequest) -> Response:
        return await _complete(served, http, chat=False)

    async def models(_: HttpRequest) -> Response:
        card = {"id": served.model, "object": "model", "created": served.created,
                "owned_by": "jaxrl", "max_model_len": served.max_model_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def health(_: HttpRequest) -> Response:
        engine = served.engine
        return JSONResponse({"status": "ok", "pending": engine.pending if engine else 0})

    async def unexpected(_: HttpRequest, error: Exception) -> Response:
        return _error(ApiError(500, f"the server failed: {type(error).__name__}: {error}"))

    return Starlette(exception_handlers={Exception: unexpected}, routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ])  # fmt: skip


# ------------------------------------------------------------------------------ a request


@dataclasses.dataclass
class _Choice:
    """One choice as it comes in."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    finish: str | None = None
    versions: list[int | None] = dataclasses.field(default_factory=list)
    streamed: int = 0  # characters of its text sent
    logprobs_sent: int = 0  # tokens whose log-probs were sent

    def add(self, update: Update) -> None:
        self.tokens += update.tokens
        self.log_probs += update.log_probs
        self.versions += update.versions
        self.finish = update.finish_reason


async def _complete(served: Served, http: HttpRequest, *, chat: bool) -> Response:
    try:
        body = json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return _error(ApiError(400, f"the request body is not JSON: {error}"))
    try:
        request = (
            chat_request(body, served.model) if chat else completion_request(body, served.model)
        )
        ids = _prompt_ids(served, request)
    except ApiError as error:
        return _error(error)
    episode, recorder = _api_key(http), served.recorder
    loop = served.engine  # this request's for its whole life (a trainer ends its phase)
    if loop is None:
        return _error(ApiError(503, "the policy is not being served now (between rollout "
                               "phases)", code="unavailable"))  # fmt: skip
    if recorder is not None and recorder.exclusive and not recorder.records(episode):
        return _error(ApiError(401, "this server serves a trainer's episodes: use the api_key "
                               "the trainer gave the episode", code="invalid_api_key"))  # fmt: skip
    engine = loop.scheduler.engine
    vocab = engine.config.vocab_size
    if max(ids) >= vocab:  # refused here, not inside a stream that has begun
        return _error(ApiError(400, f"prompt token id {max(ids)} is past the model's vocabulary "
                               f"of {vocab}", param="prompt"))  # fmt: skip
    slots = engine.slots
    if request.n > slots:
        return _error(ApiError(400, f"n={request.n}: more choices than the server's {slots} "
                               "slots (--max-num-seqs) hold at once", param="n"))  # fmt: skip
    try:
        # an episode's budget first: a call past it ends for length, whatever its context
        turn = recorder.turn(episode, ids, request.n) if recorder is not None else Turn()
        if not turn.exhausted:
            room = engine.room_after_prompt(len(ids))
            request = with_max_tokens(request, len(ids), room, engine.max_model_len)
            request = dataclasses.replace(request, sampling=turn.sampling(request.sampling))
        run = _Run(served, loop, request, ids, chat=chat, episode=episode, turn=turn)
        run.start()
    except ApiError as error:
        return _error(error)
    if request.stream:
        return StreamingResponse(run.events(), media_type="text/event-stream")
    try:
        await run.wait(http)
    except ApiError as error:
        return _error(error)
    return JSONResponse(run.response())


def _prompt_ids(served: Served, request: Request) -> list[int]:
    if request.messages is not None:
        if served.chat is None:
            raise ApiError(400, f"the model {served.model} has no chat template: use "
                           "/v1/completions", param="messages")  # fmt: skip
        try:
            return served.chat.prompt(request.messages, request.tools)
        except Exception as error:  # the template's own complaint (a role it refuses, ...)
            raise ApiError(
                400,
                f"the chat template cannot render these messages: {type(error).__name__}: {error}",
                param="messages",
            ) from error
    if isinstance(request.prompt, str):
        # as vLLM's completions: the tokenizer's special tokens (a BOS) added
        return list(served.tokenizer(request.prompt)["input_ids"])
    return list(request.prompt)


class _Run:
    """One request on the engine: its updates arrive on this event loop."""

    def __init__(self, served: Served, loop: EngineLoop, request: Request, ids: list[int], *,
                 chat: bool, episode: str | None = None, turn: Turn | None = None):  # fmt: skip
        self.served, self.loop, self.request, self.ids = served, loop, request, ids
        self.chat, self.episode, self.turn = chat, episode, turn or Turn()
        self.choices = [_Choice() for _ in range(request.n)]
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.job = None

    def start(self) -> None:
        """Submit the request to the engine (an exhausted episode's: its choices end now,
        empty, for length)."""
        if self.turn.exhausted:
            for choice in self.choices:
                choice.finish = "length"
            return
        loop = asyncio.get_running_loop()
        try:
            self.job = self.loop.submit(
                self.ids, self.request.sampling, copies=self.request.n,
                notify=lambda item: loop.call_soon_threadsafe(self.queue.put_nowait, item),
                timeout=self.served.request_timeout, key=self.turn.key,
                first_copy=self.turn.first_copy,
            )  # fmt: skip
        except QueueFull as error:
            raise ApiError(429, f"the server is busy ({error}): retry later") from error
        except RuntimeError as error:  # its engine thread closed (a trainer's phase ended)
            raise ApiError(
                503, f"the policy is not being served now: {error}", code="unavailable"
            ) from error
        except (ValueError, OverflowError) as error:  # ids the engine cannot hold
            raise ApiError(400, f"the prompt's token ids: {error}") from error

    async def updates(self, gone: asyncio.Event | None = None) -> AsyncIterator[list[Update]]:
        """Each chunk's updates until every choice ended; aborts the job when left early
        (`gone` set: the client disconnected; a timeout; an error)."""
        limit = self.served.request_timeout
        deadline = time.monotonic() + limit
        try:
            while any(c.finish is None for c in self.choices):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _timeout(limit)
                if gone is not None and gone.is_set():
                    return
                try:
                    item = await asyncio.wait_for(self.queue.get(), min(left, 0.25))
                except TimeoutError:
                    continue
                if isinstance(item, JobTimeout):
                    raise _timeout(limit)
                if isinstance(item, BadRequest):
                    raise ApiError(400, str(item))
                if isinstance(item, BaseException):
                    raise ApiError(500, f"the engine failed: {type(item).__name__}: {item}")
                for update in item:
                    self.choices[update.choice].add(update)
                if all(c.finish is not None for c in self.choices):
                    self._record()
                yield item
        finally:
            if any(c.finish is None for c in self.choices):
                self.loop.abort(self.job)

    def _record(self) -> None:
        """Each choice under the request's episode, when its key is one being recorded."""
        recorder = self.served.recorder
        if recorder is None or not recorder.records(self.episode):
            return
        for i, c in enumerate(self.choices):
            calls = 0
            if self.chat and self.request.tools:
                calls = len(self._message(c, i)[0].get("tool_calls", ()))
            call = Call(list(self.ids), list(c.tokens), list(c.log_probs), c.finish, c.versions,
                        calls)  # fmt: skip
            recorder.record(self.episode, call)

    async def wait(self, http: HttpRequest) -> None:
        """Until the answer is complete, or the client disconnects (its body read, the next
        ASGI message it sends is the disconnect: watched beside the updates)."""
        gone = asyncio.Event()

        async def watch() -> None:
            while (await http.receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            async for _ in self.updates(gone):
                pass
        finally:
            watcher.cancel()

    # ---- the answer ----------------------------------------------------------------------

    def _content(self, choice: _Choice) -> list[int]:
        """The choice's tokens without the end token that closed it."""
        tokens = choice.tokens
        if choice.finish == "stop" and tokens and tokens[-1] in self.served.end_ids:
            return tokens[:-1]
        return tokens

    def _text(self, choice: _Choice) -> str:
        """The choice's text, without the stop string that ended it (as OpenAI's)."""
        text = self.served.tokenizer.decode(self._content(choice), skip_special_tokens=True)
        stops = [text.find(s) for s in self.request.sampling.stop if s in text]
        return text[: min(stops)] if choice.finish == "stop" and stops else text

    def _log_probs(self, choice: _Choice, start: int = 0, stop: int | None = None) -> Any:
        tokens = self._content(choice)[start:stop]
        values = choice.log_probs[start : start + len(tokens)]
        pieces = [self.served.tokenizer.decode([t]) for t in tokens]
        if self.chat:
            return {"content": [
                {"token": p, "logprob": v, "bytes": list(p.encode()), "top_logprobs": []}
                for p, v in zip(pieces, values, strict=True)
            ]}  # fmt: skip
        return {"tokens": pieces, "token_logprobs": values, "top_logprobs": None,
                "text_offset": _offsets(pieces)}  # fmt: skip

    def _message(self, choice: _Choice, index: int) -> tuple[dict, str | None]:
        text = self._text(choice)
        calls = []
        if self.request.tools:
            content, parsed = parse_hermes(text)
            if parsed and all(c.error is None for c in parsed):
                text, calls = content.strip(), tool_call_objects(parsed, self.id, index)
        message = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return message, finish_reason(choice.finish, calls)

    def _usage(self) -> dict[str, int]:
        completion = sum(len(self._content(c)) for c in self.choices)
        return {"prompt_tokens": len(self.ids), "completion_tokens": completion,
                "total_tokens": len(self.ids) + completion}  # fmt: skip

    def response(self) -> dict[str, Any]:
        choices = []
        for i, choice in enumerate(self.choices):
            logprobs = self._log_probs(choice) if self.request.logprobs else None
            if self.chat:
                message, reason = self._message(choice, i)
                choices.append({"index": i, "message": message, "logprobs": logprobs,
                                "finish_reason": reason})  # fmt: skip
            else:
                choices.append({"index": i, "text": self._text(choice), "logprobs": logprobs,
                                "finish_reason": choice.finish})  # fmt: skip
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.served.model, "choices": choices, "usage": self._usage()}  # fmt: skip

    # ---- streaming -----------------------------------------------------------------------

    async def events(self) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer (a client gone cancels this, and the
        job is aborted)."""
        stream = self.updates()
        try:
            if self.chat:
                for i in range(self.request.n):
                    yield _event(self._chunk(i, {"role": "assistant", "content": ""}))
            async for updates in stream:
                for update in updates:
                    for event in self._deltas(update.choice):
                        yield event
            if self.turn.exhausted:  # no updates: each choice's end
                for i in range(self.request.n):
                    for event in self._deltas(i):
                        yield event
        except ApiError as error:
            yield _event(error.body())
            yield "data: [DONE]\n\n"
            return
        finally:  # a client gone closes this at a `yield`: abort the job now, not at GC
            await stream.aclose()
            if any(c.finish is None for c in self.choices):
                self.loop.abort(self.job)
        if self.request.include_usage:
            yield _event({**self._chunk(0, None), "choices": [], "usage": self._usage()})
        yield "data: [DONE]\n\n"

    def _chunk(self, index: int, delta: dict | None, reason: str | None = None,
               logprobs: Any = None, text: str | None = None) -> dict:  # fmt: skip
        if self.chat:
            choice = {"index": index, "delta": delta or {}, "logprobs": logprobs,
                      "finish_reason": reason}  # fmt: skip
            kind = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs,
                      "finish_reason": reason}  # fmt: skip
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.served.model, "choices": [choice]}  # fmt: skip

    def _deltas(self, index: int) -> list[str]:
        """The events of choice `index`'s new text (held back from a `<tool_call>` on, and
        while it ends in a partly decoded character), and its end."""
        choice = self.choices[index]
        text = self._text(choice)
        ready = len(text)
        if choice.finish is None and text.endswith("\ufffd"):
            ready = len(text.rstrip("\ufffd"))
        if self.chat and self.request.tools:  # from `<tool_call>` on, or a start of it
            ready = min(ready, _held_from(text, _TOOL_OPEN, choice.finish is not None))
        if choice.finish is None and self.request.sampling.stop:  # maybe a stop string's start
            ready = min(ready, len(text) - max(map(len, self.request.sampling.stop)) + 1)
        events = []
        if ready > choice.streamed:
            piece = text[choice.streamed : ready]
            done_tokens = len(self._content(choice))
            logprobs = self._stream_log_probs(choice, done_tokens)
            delta = {"content": piece} if self.chat else None
            events.append(_event(self._chunk(index, delta, logprobs=logprobs, text=piece)))
            choice.streamed = ready
        if choice.finish is not None:
            if self.chat:
                message, reason = self._message(choice, index)
                delta = {}
                if message.get("tool_calls"):
                    delta["tool_calls"] = [dict(call, index=k) for k, call in
                                           enumerate(message["tool_calls"])]  # fmt: skip
                elif len(text) > choice.streamed:  # a held-back `<tool_call>` that was none
                    delta["content"] = text[choice.streamed :]
                events.append(_event(self._chunk(index, delta, reason)))
            else:
                events.append(_event(self._chunk(index, None, choice.finish)))
        return events

    def _stream_log_probs(self, choice: _Choice, upto: int) -> Any:
        if not self.request.logprobs:
            return None
        start, choice.logprobs_sent = choice.logprobs_sent, upto
        return self._log_probs(choice, start, upto)


def _held_from(text: str, tag: str, finished: bool) -> int:
    """Where a stream holds `text` back: at `tag`, or (while it runs) at a last part of it
    that may begin `tag` (a tag split over several tokens)."""
    if tag in text:
        return text.index(tag)
    if not finished:
        for size in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:size]):
                return len(text) - size
    return len(text)


def _timeout(limit: float) -> ApiError:
    return ApiError(408, f"the request took longer than the server's {limit:g} s "
                    "(--request-timeout); it was aborted", code="timeout")  # fmt: skip


def _api_key(http: HttpRequest) -> str | None:
    """The bearer token of the request (the OpenAI client's `api_key`)."""
    scheme, _, token = http.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _offsets(pieces: Sequence[str]) -> list[int]:
    out, at = [], 0
    for piece in pieces:
        out.append(at)
        at += len(piece)
    return out


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(error: ApiError) -> JSONResponse:
    # a timeout was aborted here: the openai client must not send it again on its own
    headers = {"x-should-retry": "false"} if error.status == 408 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)
