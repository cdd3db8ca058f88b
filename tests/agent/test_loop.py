"""The agent loop driven by a scripted policy through the engine's conversation API on a dp=2
rollout mesh: `jaxrl.testing.scripted`'s model, whose next token is a fixed function of the
current one (one-hot embeddings, attention and MLP outputs zeroed, the LM head a lookup
table), so every turn is the calculator call
`<tool_call>{"name": "calculator", "arguments": {"expression": "7"}}</tool_call>`.

Checked: trajectories equal the chat template over their final messages token for token,
loss mask 1 exactly on sampled tokens, log-probs only there, turn and length limits, errors
answered and counted, tools that time out, and calls that run concurrently with decoding."""

import itertools
import threading
import time

import jax
import numpy as np
import pytest

from jaxrl.agent import AgentLoop, AgentRequest, ChatTokens, Limits, ToolRunner, agent_metrics
from jaxrl.agent.tools.base import BaseTool, ToolResponse
from jaxrl.agent.tools.calculator import Calculator
from jaxrl.data import load_tokenizer, synthetic
from jaxrl.rollout import RolloutEngine, SamplingParams
from jaxrl.sharding import ROLLOUT_RULES, Layout, rollout_mesh
from jaxrl.testing.scripted import calculator_chain, scripted_policy

SAMPLED = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools_tokenizer")
    synthetic.write_tokenizer(folder, tools=True)
    return load_tokenizer(str(folder))


@pytest.fixture(scope="module")
def engine(tokenizer):
    config, params = scripted_policy(tokenizer, calculator_chain())
    layout = Layout.create(rollout_mesh(1, jax.devices()[:2]), ROLLOUT_RULES)  # dp=2
    eng = RolloutEngine(config, layout, max_num_seqs=4, max_model_len=128, tokenizer=tokenizer)
    eng.load_weights(params, version=3)  # each sampled token records it
    return eng


def make_loop(engine, tokenizer, runner, response_length=64, **limits):
    limits = dict(max_assistant_turns=3, decode_chunk=4) | limits
    chat = ChatTokens(tokenizer, [tokenizer.eos_token_id])
    return AgentLoop(engine, chat, runner, Limits(**limits), response_length=response_length,
                     max_prompt_length=32)  # fmt: skip


def request(agent="tool_agent", text="add: 123 + 456"):
    return AgentRequest([{"role": "user", "content": text}], agent)


def test_trajectories_are_the_template_over_their_messages(engine, tokenizer):
    """Six requests through four slots (two wait for a slot): tool trajectories take three
    turns (the limit), a single-turn request one; token ids equal the template over the final
    messages, the loss mask marks exactly the sampled turns, log-probs and weights versions
    exist only there."""
    tools = {"calculator": Calculator({})}
    with ToolRunner(tools) as runner:
        loop = make_loop(engine, tokenizer, runner)
        requests = [request(), request(), request("single_turn_agent"), *[request()] * 3]
        out = loop.run(requests, SAMPLED, jax.random.key(0))
    chat = ChatTokens(tokenizer, [tokenizer.eos_token_id])
    schemas = [tools["calculator"].tool_schema]
    call_turn = 6
    for i, (req, t) in enumerate(zip(requests, out, strict=True)):
        tool_agent = req.agent_name == "tool_agent"
        assert t.assistant_turns == (3 if tool_agent else 1), i
        assert t.user_turns == (2 if tool_agent else 0) and t.finish == ("turns" if tool_agent
                                                                          else "stop")  # fmt: skip
        whole = chat.conversation(t.messages, schemas if tool_agent else None)
        assert t.prompt + t.response == whole
        mask = np.asarray(t.sampled)
        assert mask.sum() == call_turn * t.assistant_turns
        starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)
        assert len(starts) == t.assistant_turns  # each turn one run of sampled tokens
        lp = np.asarray(t.log_probs)
        assert np.all(lp[mask == 0] == 0) and np.all(lp[mask == 1] > -1e-3)
        assert t.versions == [3 if m else None for m in mask]
        tool_messages = [m["content"] for m in t.messages if m["role"] == "tool"]
        assert tool_messages == ["7"] * t.user_turns
    metrics = agent_metrics(out, loop.stats)
    assert metrics["num_turns/max"] == 6 and metrics["num_turns/min"] == 2
    assert metrics["agent/tool_calls/total"] == 10 and metrics["agent/tool_errors/total"] == 0
    assert engine.free_slots == engine.slots


def test_length_and_turn_limits(engine, tokenizer):
    """A response is cut at response_length (a tool turn that would pass it is not appended);
    max_user_turns ends a trajectory after that many tool turns."""
    with ToolRunner({"calculator": Calculator({})}) as runner:
        short = make_loop(engine, tokenizer, runner, response_length=16, max_assistant_turns=None)
        (t,) = short.run([request()], SAMPLED, jax.random.key(1))
        assert t.finish == "length" and len(t.response) == 16
        assert t.sampled == [1] * 6 + [0] * 8 + [1] * 2
        tight = make_loop(engine, tokenizer, runner, response_length=19, max_assistant_turns=None)
        (t,) = tight.run([request()], SAMPLED, jax.random.key(1))
        assert t.finish == "length" and t.user_turns == 1 and len(t.response) == 19
        users = make_loop(engine, tokenizer, runner, max_assistant_turns=None, max_user_turns=1)
        (t,) = users.run([request()], SAMPLED, jax.random.key(1))
        assert (t.finish, t.assistant_turns, t.user_turns) == ("turns", 2, 1)


class Broken(BaseTool):
    def default_schema(self):
        return {"type": "function", "function": {"name": "calculator", "parameters": {
            "type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip

    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("the tool broke")


def test_errors_are_answered_and_counted(engine, tokenizer):
    """No tools, or the calculator not in the row's tool_selection: the call is answered
    as verl answers an unknown function; a tool that raises: its error is the answer.
    Either way the trajectory goes on to its turn limit."""
    loop = make_loop(engine, tokenizer, None)
    (t,) = loop.run([request()], SAMPLED, jax.random.key(2))
    assert t.assistant_turns == 3 and t.tool_errors == {"unknown_tool": 2}
    assert t.messages[2]["content"] == "Unknown function 'calculator'. Available tools: []"
    with ToolRunner({"calculator": Calculator({})}) as runner:  # a row's tool_selection
        only = AgentRequest(request().messages, "tool_agent", tool_names=("search",))
        (t,) = make_loop(engine, tokenizer, runner).run([only], SAMPLED, jax.random.key(2))
    assert t.tool_errors == {"unknown_tool": 2}
    assert t.messages[2]["content"] == "Unknown function 'calculator'. Available tools: []"
    with ToolRunner({"calculator": Broken({})}) as runner:
        (t,) = make_loop(engine, tokenizer, runner).run([request()], SAMPLED, jax.random.key(2))
    assert t.tool_errors == {"exception": 2} and "the tool broke" in t.messages[2]["content"]
    metrics = agent_metrics([t], loop.stats)
    assert metrics["agent/tool_errors/exception"] == 2


class Sleepy(Calculator):
    """The calculator after `delay` seconds, in a plain (threaded) method; counts the calls
    running at once."""

    def __init__(self, config, tool_schema=None):
        super().__init__(config, tool_schema)
        self.lock, self.running, self.most = threading.Lock(), 0, 0

    def execute(self, instance_id, parameters, **kwargs):  # plain, not async
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.config["delay"])
        with self.lock:
            self.running -= 1
        return ToolResponse(text="7"), 0.0, {}


class Patient(Sleepy):
    """Sleepy that, after its delay, also waits (up to `patience` s) until some decode has
    started while a call was running, so the overlap is checked by events, not by how fast
    this machine decodes within the delay."""

    def __init__(self, config, tool_schema=None):
        super().__init__(config, tool_schema)
        self.decoded_meanwhile = threading.Event()

    def execute(self, instance_id, parameters, **kwargs):
        out = super().execute(instance_id, parameters, **kwargs)
        with self.lock:
            self.running += 1  # still running while it waits for a decode
        self.decoded_meanwhile.wait(self.config["patience"])
        with self.lock:
            self.running -= 1
        return out


def test_slow_tools_overlap_each_other_and_decoding(engine, tokenizer, monkeypatch):
    """Calls of different trajectories run at once, and other trajectories keep decoding
    while a call runs (single-turn requests queued behind the tool ones take the slots).
    A loop that stopped decoding while a call runs would leave each call waiting its whole
    patience and fail the first check (and the last: it would wait for the tools)."""
    tool = Patient({"delay": 0.5, "patience": 20.0})
    decode = engine.decode

    def watched_decode(*args, **kwargs):
        with tool.lock:
            if tool.running:
                tool.decoded_meanwhile.set()
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine, "decode", watched_decode)
    with ToolRunner({"calculator": tool}, workers=4) as runner:
        loop = make_loop(engine, tokenizer, runner, max_assistant_turns=2, decode_chunk=2)
        requests = [request(), request(), *[request("single_turn_agent")] * 6]
        out = loop.run(requests, SAMPLED, jax.random.key(3))
    assert tool.decoded_meanwhile.is_set()  # the loop went on decoding while a call ran
    assert tool.most >= 2 and [t.user_turns for t in out[:2]] == [1, 1]
    assert loop.stats.wait_seconds < 0.75 * sum(t.tool_seconds for t in out)


def test_a_call_past_the_timeout_is_answered_as_such(engine, tokenizer):
    slow = Sleepy({"delay": 2.0})
    with ToolRunner({"calculator": slow}, timeout=0.2) as runner:
        (t,) = make_loop(engine, tokenizer, runner, max_assistant_turns=2).run(
            [request()], SAMPLED, jax.random.key(3)
        )
    assert t.tool_errors == {"timeout": 1} and "timed out after 0.2 s" in t.messages[2]["content"]
    assert t.assistant_turns == 2


class Jittery(Calculator):
    """The calculator after a delay taken in turn from `delays`."""

    def __init__(self, config, tool_schema=None):
        super().__init__(config, tool_schema)
        self.count = itertools.count()

    def execute(self, instance_id, parameters, **kwargs):
        delays = self.config["delays"]
        time.sleep(delays[next(self.count) % len(delays)])
        return ToolResponse(text="7"), 0.0, {}


def test_sampling_does_not_depend_on_the_tools_timing(tokenizer):
    """A noisy scripted policy with live attention (the script's token at logit 10 against
    ~1000 zeros, plus the context's contribution), on prompts of different lengths, makes
    trajectories of different lengths, turns and calls (some malformed); they are the same,
    token for token, whatever the tools' delays and the order the requests come in (each turn
    samples with its own key, the request's row's: `indices`, as a process running other
    processes' rows passes; which slots are started or appended together does not change a
    row's numbers), so a resumed run reproduces a straight one."""
    config, params = scripted_policy(tokenizer, calculator_chain(), weight=10.0, live=0.15)
    eng = RolloutEngine(config, None, max_num_seqs=3, max_model_len=128, tokenizer=tokenizer)
    eng.load_weights(params)
    requests = [
        request(text=f"add: {a} + {b}" + " 1" * k)  # prompts of different lengths
        for k, (a, b) in enumerate([(100, 200), (345, 21), (7, 8), (450, 450)] * 2)
    ]
    runs = []
    straight, backwards = list(range(len(requests))), list(range(len(requests)))[::-1]
    for delays, order in (((0.0,), straight), ((0.05, 0.2, 0.0, 0.15), backwards)):
        with ToolRunner({"calculator": Jittery({"delays": delays})}) as runner:
            loop = make_loop(eng, tokenizer, runner, response_length=40, decode_chunk=3)
            out = loop.run([requests[i] for i in order], SAMPLED, jax.random.key(4),
                           indices=order)  # fmt: skip
        runs.append([out[order.index(i)] for i in straight])
    assert len({len(t.response) for t in runs[0]}) > 1  # the runs are not all alike
    assert sum(t.tool_calls for t in runs[0]) >= 2
    for a, b in zip(*runs, strict=True):
        assert a.response == b.response and a.sampled == b.sampled
        # the same programs on the same rows; only other slots' contents differ, which a row's
        # values do not depend on (measured exact); 1e-6, a few ulps, should XLA batch otherwise
        np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-6)
