"""`jaxrl.serve` on 127.0.0.1 with the real `openai` client: a scripted policy (it answers
every chat with a hermes call of the calculator) behind the OpenAI API. Chat with and without
tools, streamed and not, `n` > 1 with log-probs equal to the engine's own for the same key,
text completions and stop strings, 64 concurrent clients through 4 slots, a client that
disconnects (its request aborted, its slots freed), and each error in OpenAI's shape:
malformed JSON, another model, a prompt past the context, bad parameters, a full queue, a
timeout, and an engine that raises (500 naming it; the next request is served)."""

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from _serving import make_engine

from jaxrl.agent import AgentLoop, AgentRequest, ChatTokens, Limits, ToolRunner
from jaxrl.agent.tools.calculator import Calculator
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.scheduler import Scheduler
from jaxrl.serve import EngineLoop, Served, make_app
from jaxrl.serve.background import BackgroundServer
from jaxrl.serve.recorder import Call, Recorder, episode_sequences

openai = pytest.importorskip("openai")

MODEL = "scripted"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]  # fmt: skip
ASK = [{"role": "user", "content": "add: 1 + 2"}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "7"}}</tool_call>'


_engine = make_engine


class _Server(BackgroundServer):
    """A `Served` behind uvicorn on a free port, with a client."""

    def __init__(self, served: Served):
        super().__init__(make_app(served))
        self.served = served
        self.client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0)

    def close(self):
        super().close()
        self.served.engine.close()


def _served(policy, *, slots=4, chunk=4, **kwargs):
    tokenizer = policy[0]
    loop = EngineLoop(_engine(policy, slots), chunk=chunk,
                      max_pending=kwargs.pop("max_pending", 256))  # fmt: skip
    return Served(loop, tokenizer, MODEL, 96, frozenset([tokenizer.eos_token_id]), **kwargs)


@pytest.fixture(scope="module")
def server(policy):
    server = _Server(_served(policy))
    yield server
    server.close()


def _post(url, raw: bytes):
    request = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_chat_with_tools_answers_tool_calls_streamed_or_not(server):
    client = server.client
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=1,
                                         temperature=0)  # fmt: skip
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "7"}
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 0
    # without tools the same turn is text; streamed, the pieces add up to it
    plain = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0)
    assert plain.choices[0].message.content == CALL
    parts = [{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}]
    same = client.chat.completions.create(model=MODEL, messages=parts, temperature=0)
    assert same.usage.prompt_tokens == plain.usage.prompt_tokens
    assert plain.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == CALL and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # streamed with tools: no call text in the content, the call in the last chunk
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                 temperature=0, stream=True))  # fmt: skip
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    (call,) = chunks[-1].choices[0].delta.tool_calls
    assert call.function.name == "calculator" and chunks[-1].choices[0].finish_reason == (
        "tool_calls"
    )
    health = f"http://127.0.0.1:{server.port}/health"
    with urllib.request.urlopen(health, timeout=30) as response:
        assert json.loads(response.read())["status"] == "ok"


def test_n_choices_with_log_probs_equal_the_engines(server, policy):
    """`n`=3 sampled with `seed`=7: each choice's tokens and log-probs are those of the
    engine's own scheduler given `key(7)` and 3 copies (copy j: `fold_in(key, j)`)."""
    out = server.client.chat.completions.create(model=MODEL, messages=ASK, n=3, seed=7,
                                                logprobs=True, max_tokens=12)  # fmt: skip
    tokenizer = policy[0]
    ids = server.served.chat.prompt(ASK, None)
    scheduler = Scheduler(_engine(policy), chunk=4)
    handles = scheduler.submit(ids, SamplingParams(max_tokens=12), jax.random.key(7), copies=3)
    scheduler.run(handles)
    assert len({c.message.content for c in out.choices}) > 1  # the copies differ
    for choice, handle in zip(out.choices, handles, strict=True):
        tokens = handle.tokens[:-1] if handle.finish_reason == "stop" else handle.tokens
        assert choice.message.content == tokenizer.decode(tokens, skip_special_tokens=True)
        got = [t.logprob for t in choice.logprobs.content]
        # the same program on the same key: equal up to float32 summation order
        np.testing.assert_allclose(got, handle.log_probs[: len(tokens)], rtol=1e-5, atol=1e-5)


def test_text_completions(server, policy):
    tokenizer = policy[0]
    prompt = tokenizer.decode(server.served.chat.prompt(ASK, None))
    out = server.client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                           max_tokens=10, logprobs=1)  # fmt: skip
    assert out.choices[0].text == CALL and len(out.choices[0].logprobs.token_logprobs) == 5
    streamed = server.client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                max_tokens=10, stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == CALL
    # a stop string ends the text before it, streamed or not
    for stream in (False, True):
        out = server.client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=10, stop=["calc"], stream=stream
        )
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == CALL[: CALL.index("calc")]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_64_concurrent_clients_share_4_slots(server):
    async def one(client, i):
        out = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"add: {i} + 1"}],
            temperature=0, stream=i % 2 == 0)  # fmt: skip
        if i % 2:
            return out.choices[0].message.content
        return "".join([c.choices[0].delta.content or "" async for c in out])

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="none",
                                      max_retries=0) as client:  # fmt: skip
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(all_of_them()) == [CALL] * 64
    assert server.served.engine.pending == 0


def test_errors_are_openais(server):
    client = server.client
    status, body = _post(f"{server.url}/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=ASK)
    with pytest.raises(openai.APIStatusError, match="exceed the model's context") as error:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=500)
    assert error.value.status_code == 413
    assert error.value.body["code"] == "context_length_exceeded"
    for bad, param in (({"temperature": 5}, "temperature"), ({"n": 0}, "n"),
                       ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
                       ({"presence_penalty": 1.0}, "presence_penalty"),
                       ({"tool_choice": "required", "tools": TOOLS}, "tool_choice")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=ASK, **bad)
        assert error.value.body["param"] == param, bad
    status, body = _post(f"{server.url}/chat/completions",
                         json.dumps({"model": MODEL, "messages": []}).encode())  # fmt: skip
    assert status == 400 and body["error"]["param"] == "messages"
    # values past what the engine's arrays hold are refused before they reach its thread
    for bad, param in (({"seed": 2**63}, "seed"), ({"extra_body": {"top_k": 2**31}}, "top_k"),
                       ({"n": 5}, "n"), ({"response_format": {"type": "json_object"}},
                                         "response_format")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=ASK, **bad)
        assert error.value.body["param"] == param, bad
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client.completions.create(model=MODEL, prompt=[5, 2**31])
    with pytest.raises(openai.BadRequestError, match="past the model's vocabulary"):
        client.completions.create(model=MODEL, prompt=[5, 2**20], stream=True)
    # 70 tokens fit the context of 96, not once padded to their length bucket (96): refused
    # here, not failing every request in flight inside the engine's thread
    with pytest.raises(openai.APIStatusError, match="padded to its bucket") as error:
        client.completions.create(model=MODEL, prompt=[5] * 70)
    assert error.value.status_code == 413
    out = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0)
    assert out.choices[0].message.content == CALL  # still serving


def test_full_queue_timeout_and_a_failing_engine(policy, monkeypatch):
    """429 past `max_pending`; 408 past `request_timeout` (the request aborted, its slot
    free); an engine chunk that raises answers 500 naming the error, and the server then
    serves the next request."""
    server = _Server(_served(policy, chunk=1, max_pending=1, request_timeout=1.0))
    try:
        step = server.served.engine.scheduler.step
        slow = threading.Event()

        def slow_or_broken():
            if slow.is_set():
                time.sleep(0.5)
            if getattr(server, "broken", False):
                server.broken = False
                raise FloatingPointError("the decode step blew up")
            return step()

        monkeypatch.setattr(server.served.engine.scheduler, "step", slow_or_broken)
        slow.set()
        client = server.client
        statuses = []

        def first_request():
            try:
                client.chat.completions.create(model=MODEL, messages=ASK)
            except openai.APIStatusError as error:
                statuses.append(error.status_code)

        first = threading.Thread(target=first_request)
        first.start()
        began = time.monotonic()
        while not server.served.engine.pending and time.monotonic() - began < 10:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError):  # the first one is pending
            client.chat.completions.create(model=MODEL, messages=ASK)
        first.join(30)
        assert statuses == [408]  # 7 chunks of 0.5 s: past the 1 s timeout
        _settled(server)  # its abort reaches the engine after the chunk running
        with pytest.raises(openai.APIStatusError, match="longer than") as error:
            client.chat.completions.create(model=MODEL, messages=ASK)
        assert error.value.status_code == 408
        assert error.value.response.headers["x-should-retry"] == "false"  # aborted: no retry
        slow.clear()
        _settled(server)
        server.broken = True
        with pytest.raises(openai.InternalServerError, match="FloatingPointError: the decode"):
            client.chat.completions.create(model=MODEL, messages=ASK)
        # a failure while admitting a request: that request fails, the thread lives on
        submit = server.served.engine.scheduler.submit
        monkeypatch.setattr(server.served.engine.scheduler, "submit",
                            lambda *a, **k: {}["no such slot"])  # fmt: skip
        with pytest.raises(openai.InternalServerError, match="KeyError"):
            client.chat.completions.create(model=MODEL, messages=ASK)
        monkeypatch.setattr(server.served.engine.scheduler, "submit", submit)
        out = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0)
        assert out.choices[0].message.content == CALL
    finally:
        server.close()


def _settled(server):
    """Wait (10 s at most: the engine's thread catches up) until no request is pending and
    every slot is free."""
    engine, began = server.served.engine, time.monotonic()
    while (engine.pending, engine.free_slots) != (0, 4):
        assert time.monotonic() - began < 10, (engine.pending, engine.free_slots)
        time.sleep(0.05)


def test_a_client_that_disconnects_frees_its_slot(policy, monkeypatch):
    server = _Server(_served(policy, chunk=1))
    try:
        step = server.served.engine.scheduler.step

        def slow():  # the answer's 6 chunks take 2.4 s: a client gone is noticed well before
            time.sleep(0.4)
            return step()

        monkeypatch.setattr(server.served.engine.scheduler, "step", slow)
        stream = server.client.chat.completions.create(model=MODEL, messages=ASK, n=2,
                                                       temperature=0, stream=True)  # fmt: skip
        next(iter(stream))
        stream.close()  # gone after the first chunk, its two copies still decoding
        _settled(server)
        assert server.served.engine.scheduler.decode_calls < 6  # not decoded to their end
        # a client that gives up on an answer it was not streaming: noticed while tokens come
        impatient = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0,
                                  timeout=0.5)  # fmt: skip
        before = server.served.engine.scheduler.decode_calls
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model=MODEL, messages=ASK, temperature=0)
        _settled(server)
        assert server.served.engine.scheduler.decode_calls - before < 6
    finally:
        server.close()


def test_the_command_serves_a_model_folder(tmp_path):
    """`python -m jaxrl.serve --model DIR` on an HF folder (the quickstart's model): the
    health route, the model listed by the folder's name, and a chat answered."""
    import subprocess
    import sys

    from _env import subprocess_env

    from jaxrl.assets import write_quickstart_model

    write_quickstart_model(tmp_path / "tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "jaxrl.serve", "--model", str(tmp_path / "tiny"),
               "--port", str(port), "--max-num-seqs", "2", "--max-model-len", "128"]  # fmt: skip
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed in finally)
    process = subprocess.Popen(command, env=subprocess_env(1), stdout=log,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0)  # fmt: skip
        began = time.monotonic()
        while True:  # uvicorn binds after the line above
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() - began < 60 and process.poll() is None
                time.sleep(0.1)
        assert [m.id for m in models.data] == ["tiny"]
        out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, seed=0)
        assert out.choices[0].finish_reason in ("stop", "length")
        assert 1 <= out.usage.completion_tokens <= 8
        assert "jaxrl.serve: tiny on" in (tmp_path / "serve.log").read_text()
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def test_the_command_passes_its_arguments(monkeypatch):
    """`--checkpoint` and the engine's settings reach `load`; `--model` and `--checkpoint`
    exclude each other."""
    from jaxrl.serve import __main__ as command

    seen = {}

    class Engine:
        def close(self):
            seen["closed"] = True

    def load(model, **kwargs):
        seen.update(model=model, **kwargs)
        return Served(Engine(), None, "run-step2", 64, frozenset())

    monkeypatch.setattr(command, "load", load)
    monkeypatch.setattr(command, "make_app", lambda served: "app")
    monkeypatch.setattr(command.uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    assert command.main(["--checkpoint", "RUN", "--max-num-seqs", "8", "--seed", "3"]) == 0
    assert seen["model"] is None and seen["checkpoint"] == "RUN" and seen["max_num_seqs"] == 8
    assert seen["seed"] == 3 and seen["app"] == "app" and seen["closed"]
    with pytest.raises(SystemExit):
        command.main(["--checkpoint", "RUN", "--model", "DIR"])


def test_a_two_call_episode_is_the_agent_loops_trajectory(server, policy):
    """An external agent (the openai client, its api_key the episode's) calls the policy,
    runs the calculator on its tool call, sends the result back and calls again: the two
    recorded calls chain into one sequence equal, token by token, to the internal agent
    loop's trajectory of the same two turns (prompt, response, trained mask, log-probs)."""
    tokenizer = policy[0]
    calculator = Calculator({})
    tools = [calculator.get_openai_tool_schema()]
    recorder = server.served.recorder = Recorder()
    recorder.open("episode-0")
    client = openai.OpenAI(base_url=server.url, api_key="episode-0", max_retries=0)
    messages = list(ASK)
    try:
        for _ in range(2):  # the loop's max_assistant_turns
            reply = client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                                   temperature=0).choices[0].message  # fmt: skip
            messages.append(reply.model_dump(exclude_none=True))
            for call in reply.tool_calls:
                arguments = json.loads(call.function.arguments)
                text = asyncio.run(calculator.execute("i", arguments))[0].text
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        server.client.chat.completions.create(model=MODEL, messages=ASK)  # another key
    finally:
        calls = recorder.close("episode-0")
        server.served.recorder = None
    assert len(calls) == 2
    (sequence,) = episode_sequences(calls)

    greedy = SamplingParams(temperature=0.0, do_sample=False)
    with ToolRunner({"calculator": calculator}) as runner:
        loop = AgentLoop(_engine(policy), ChatTokens(tokenizer, [tokenizer.eos_token_id]),
                         runner, Limits(max_assistant_turns=2, decode_chunk=4),
                         response_length=64, max_prompt_length=64)  # fmt: skip
        (want,) = loop.run([AgentRequest(ASK)], greedy, jax.random.key(0))
    assert want.assistant_turns == 2 and want.user_turns == 1
    assert sequence.prompt == want.prompt
    assert sequence.response == want.response
    assert sequence.sampled == want.sampled and 0 < sum(want.sampled) < len(want.sampled)
    # the same programs on the same tokens: equal up to float32 summation order
    np.testing.assert_allclose(sequence.log_probs, want.log_probs, rtol=1e-5, atol=1e-5)


def test_calls_that_do_not_continue_the_sequence_start_another():
    """A call whose prompt is not the sequence so far (history edited) is a sample of its
    own; one that continues it appends the tokens between as untrained."""
    a = Call([1, 2], [3, 4], [-0.1, -0.2], "stop")
    b = Call([1, 2, 3, 4, 9, 9], [5], [-0.3], "stop", [7])
    c = Call([1, 2, 8], [6], [-0.4], "stop")
    first, second = episode_sequences([a, b, c])
    assert (first.prompt, first.response) == ([1, 2], [3, 4, 9, 9, 5])
    assert first.sampled == [1, 1, 0, 0, 1] and first.log_probs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert first.versions == [None, None, None, None, 7]
    assert (second.prompt, second.response, second.sampled) == ([1, 2, 8], [6], [1])
    # two choices of one request, then a call continuing the first: it chains to that one
    a2 = Call([1, 2], [7], [-0.5], "stop")
    first, second = episode_sequences([a, a2, b])
    assert first.response == [3, 4, 9, 9, 5] and second.response == [7]
