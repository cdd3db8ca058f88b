"""`jaxrl.serve.external`: a user's async function runs episodes with the real `openai`
client against the trainer's server. Episodes sample as the internal agent loop samples the
same rows (turn t of row i with `fold_in(fold_in(rng, i), t)`), their calls numbered per
episode; and the server is attacked from the agent's side: a key that is no episode's (401),
a first prompt past `max_prompt_length` (400), a call past the episode's token budget (an
empty `length` answer, streamed or not, nothing recorded), a function that raises, returns no
number or never ends (reward `error_score`, counted), a phase where every episode fails (the
step fails naming the error), and a request between phases (503)."""

import asyncio
import dataclasses
import time

import jax
import numpy as np
import pytest
from _serving import make_engine

from jaxrl.agent import AgentLoop, AgentRequest, ChatTokens, Limits
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.scheduler import Scheduler
from jaxrl.serve import external
from jaxrl.serve.external import ExternalAgents, external_metrics, load_agent
from jaxrl.serve.protocol import ApiError
from jaxrl.serve.recorder import Call, Recorder

openai = pytest.importorskip("openai")

P, R = 16, 24  # the trainer's prompt and response lengths
SAMPLING = SamplingParams(temperature=1.0, max_tokens=R)


def _rows(tokenizer, chat, n):
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"add: {i} + 2"}]
        ids = chat.prompt(messages, None)
        rows.append({"messages": messages, "ground_truth": str(i + 2), "data_source": "t",
                     "extra_info": {"i": i}, "prompt_ids": ids})  # fmt: skip
    return rows


def _client(episode, key=None):
    return openai.AsyncOpenAI(base_url=episode.base_url, api_key=key or episode.api_key,
                              max_retries=0)  # fmt: skip


def _agents(policy, fn, **kwargs):
    tokenizer = policy[0]
    chat = ChatTokens(tokenizer, [tokenizer.eos_token_id])
    return ExternalAgents(fn, tokenizer, chat, [tokenizer.eos_token_id], model="scripted",
                          chunk=4, **kwargs), chat  # fmt: skip


async def _two_calls(episode):
    """Call, then send the reply back with a user turn and call again."""
    async with _client(episode) as client:
        first = await client.chat.completions.create(model=episode.model,
                                                     messages=episode.messages)  # fmt: skip
        messages = [*episode.messages, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "again"}]  # fmt: skip
        await client.chat.completions.create(model=episode.model, messages=messages)
    return 1.0


def test_episodes_sample_as_the_agent_loop(policy):
    """Call 0 of row i is the internal loop's turn 0 of row i (the same prompt, tokens and
    log-probs at temperature 1, rows sampling differently); call 1 samples with the
    episode's key numbered 1, as turn 1 does; a number returned is the reward and `acc`."""
    tokenizer = policy[0]
    engine = make_engine(policy, slots=8)
    rng = jax.random.key(3)
    agents, chat = _agents(policy, _two_calls)
    rows = _rows(tokenizer, chat, 6)
    first = 10  # this process's rows are 10..15 of the batch
    try:
        results = agents.run(engine, rows, SAMPLING, rng, indices=range(first, first + 6),
                             prompt_length=P, response_length=R)  # fmt: skip
    finally:
        agents.close()
    loop = AgentLoop(engine, chat, None, Limits(decode_chunk=4), response_length=R,
                     max_prompt_length=P)  # fmt: skip
    requests = [AgentRequest(r["messages"], "single_turn_agent") for r in rows]
    want = loop.run(requests, SAMPLING, rng, first=first)
    assert len({tuple(t.response) for t in want}) > 1  # the keys matter
    scheduler = Scheduler(engine, chunk=4)
    for i, (result, turn0) in enumerate(zip(results, want, strict=True)):
        call0, call1 = result.calls
        assert call0.prompt == turn0.prompt == list(rows[i]["prompt_ids"])
        assert call0.tokens == turn0.response
        # the same programs on the same tokens: equal up to float32 summation order
        np.testing.assert_allclose(call0.log_probs, turn0.log_probs, rtol=1e-5, atol=1e-5)
        used = len(call1.prompt) - len(call0.prompt)
        turn = dataclasses.replace(SAMPLING, max_tokens=min(R - used, 96 - len(call1.prompt)))
        key = jax.random.fold_in(rng, first + i)
        [handle] = scheduler.submit(call1.prompt, turn, key, first_copy=1)
        while not handle.done:
            scheduler.step()
        assert call1.tokens == handle.tokens
        assert result.reward == 1.0 and result.extra == {"acc": 1.0} and result.error is None
        assert result.trajectory.prompt == call0.prompt
        assert result.trajectory.response[: len(call0.tokens)] == call0.tokens
    metrics = external_metrics(results)
    assert metrics["agent/external/calls/mean"] == 2.0 and metrics["agent/external/errors"] == 0


def test_the_server_refuses_what_no_episode_may_do(policy):
    """One phase of six episodes, each attacking from the agent's side (module doc)."""
    seen = {}

    async def attack(episode):
        i = episode.index
        async with _client(episode) as client:
            ask = dict(model=episode.model, messages=episode.messages)
            if i == 0:  # another key
                with pytest.raises(openai.AuthenticationError) as error:
                    await _client(episode, "not-an-episode").chat.completions.create(**ask)
                seen[0] = error.value.status_code
                await client.chat.completions.create(**ask)
                return {"score": 0.5, "acc": 1.0}
            if i == 1:  # a first prompt past max_prompt_length
                long = [{"role": "user", "content": " ".join(["add: 1 + 2"] * 12)}]
                with pytest.raises(openai.BadRequestError, match="max_prompt_length"):
                    await client.chat.completions.create(model=episode.model, messages=long)
                return 0.0
            if i == 2:  # past the episode's budget: empty, for length, not recorded
                reply = await client.chat.completions.create(**ask)
                over = [*episode.messages, {"role": "assistant", "content": "x"},
                        {"role": "user", "content": " ".join(["add: 1 + 2"] * 12)}]  # fmt: skip
                done = await client.chat.completions.create(model=episode.model, messages=over)
                stream = await client.chat.completions.create(
                    model=episode.model, messages=over, stream=True)  # fmt: skip
                chunks = [c async for c in stream]
                seen[2] = (
                    reply.choices[0].finish_reason,
                    done.choices[0].finish_reason,
                    done.choices[0].message.content,
                    chunks[-1].choices[0].finish_reason,
                )
                return 1.0
            if i == 3:
                raise RuntimeError("the agent's own bug")
            if i == 4:
                return "not a number"
            if i == 5:
                raise TimeoutError("the agent's own timeout")  # an error, not the episode's
            await asyncio.sleep(60)  # i == 6: never ends within the timeout

    tokenizer = policy[0]
    agents, chat = _agents(policy, attack, timeout=4.0, error_score=-1.0)
    engine = make_engine(policy, slots=4)
    rows = _rows(tokenizer, chat, 7)
    try:
        results = agents.run(engine, rows, SAMPLING, jax.random.key(0), indices=range(7),
                             prompt_length=P, response_length=R)  # fmt: skip
        between = openai.OpenAI(base_url=agents.base_url, api_key="any", max_retries=0)
        with pytest.raises(openai.APIStatusError) as error:  # between phases
            between.chat.completions.create(model="scripted", messages=rows[0]["messages"])
        assert error.value.status_code == 503
    finally:
        agents.close()
    assert seen[0] == 401
    assert seen[2][0] in ("stop", "length") and seen[2][1:] == ("length", "", "length")
    assert [len(r.calls) for r in results] == [1, 0, 1, 0, 0, 0, 0]
    assert [r.reward for r in results] == [0.5, 0.0, 1.0, -1.0, -1.0, -1.0, -1.0]
    assert results[0].extra == {"score": 0.5, "acc": 1.0}
    assert "the agent's own bug" in results[3].error and "not a number" in results[4].error
    assert "the agent's own timeout" in results[5].error and not results[5].timed_out
    assert results[6].timed_out and results[6].error is None
    empty = results[1].trajectory  # no call: the row's prompt, no response
    assert empty.prompt == list(rows[1]["prompt_ids"]) and empty.response == []
    metrics = external_metrics(results)
    assert metrics["agent/external/errors"] == 3 and metrics["agent/external/timeouts"] == 1
    assert metrics["agent/external/no_calls"] == 5


def test_a_phase_fails_when_every_episode_fails_or_one_blocks_its_loop(policy, monkeypatch):
    """Every episode raising fails the step with the error; an episode that blocks the
    event loop (a synchronous sleep: its cancellation cannot run) fails it naming that."""

    async def broken(episode):
        raise KeyError("ground_truth_typo")

    async def blocking(episode):
        time.sleep(3)  # not awaited: the loop stalls
        return 1.0

    tokenizer = policy[0]
    engine = make_engine(policy)
    monkeypatch.setattr(external, "CANCEL_GRACE_S", 0.5)
    for fn, match in ((broken, r"every episode(.|\n)*ground_truth_typo"),
                      (blocking, "blocks its event loop")):  # fmt: skip
        agents, chat = _agents(policy, fn, timeout=1.0)
        try:
            with pytest.raises(RuntimeError, match=match):
                agents.run(engine, _rows(tokenizer, chat, 2), SAMPLING, jax.random.key(0),
                           indices=[0, 1], prompt_length=P, response_length=R)  # fmt: skip
        finally:
            agents.close()
    with pytest.raises(ValueError, match="async function"):
        load_agent(lambda episode: 1.0)
    with pytest.raises(ValueError, match="no such file"):
        load_agent("missing/agent.py:run")
    with pytest.raises(ValueError, match="has no 'nothing'"):
        load_agent("json:nothing")


def test_an_episodes_budget_runs_from_the_root_its_call_continues():
    """`Recorder.turn`: response tokens left count from the root a prompt continues (a side
    call with another prompt is a root with a budget of its own); past the budget: exhausted,
    no key number used; a root past `max_prompt_length` is refused; keys number the copies."""
    recorder = Recorder(exclusive=True)
    recorder.open("e", sampling=SAMPLING, rng=jax.random.key(0), response_length=10,
                  max_prompt_length=4)  # fmt: skip
    first = recorder.turn("e", [1, 2, 3], copies=2)
    assert (first.left, first.first_copy, first.exhausted) == (10, 0, False)
    later = recorder.turn("e", [1, 2, 3, 4, 5, 6], copies=1)
    assert (later.left, later.first_copy) == (7, 2)
    side = recorder.turn("e", [9, 8], copies=1)  # another root: its own budget
    assert (side.left, side.first_copy) == (10, 3)
    assert recorder.turn("e", [1, 2, 3, *range(10)], copies=1).exhausted
    assert recorder.turn("e", [9, 8, 7], copies=1).first_copy == 4  # exhausted took none
    with pytest.raises(ApiError, match="max_prompt_length=4"):
        recorder.turn("e", [5, 5, 5, 5, 5], copies=1)
    asked = dataclasses.replace(SAMPLING, temperature=0.3, max_tokens=50, stop=("x",))
    run = later.sampling(asked)  # the trainer's distribution, the episode's budget
    assert (run.temperature, run.max_tokens, run.stop) == (1.0, 7, ("x",))
    assert recorder.turn("other", [1], copies=1).sampling(asked) == asked


def test_a_row_is_the_chain_with_most_policy_tokens_cut_at_the_response_length():
    """Of an episode's chains the row is the one with the most sampled tokens whose prompt
    fits the prompt length, cut at the response length (calls beginning past the cut are not
    its turns); an episode without a call is the row's own prompt, empty."""
    a = Call([1, 2], [3, 4], [-0.1, -0.2], "stop", tool_calls=1)
    side = Call([8], [6], [-0.6], "stop")
    b = Call([1, 2, 3, 4, 9], [5, 6, 7], [-0.3, -0.4, -0.5], "stop")
    row = {"messages": [{"role": "user", "content": "q"}], "prompt_ids": [1, 2]}
    whole, members = external._trajectory([a, side, b], row, prompt_length=4, response_length=8)
    assert members == [0, 2] and (whole.prompt, whole.response) == ([1, 2], [3, 4, 9, 5, 6, 7])
    assert whole.sampled == [1, 1, 0, 1, 1, 1] and whole.log_probs[2] == 0.0
    assert (whole.assistant_turns, whole.user_turns, whole.tool_calls) == (2, 1, 1)
    assert whole.finish == "stop"
    cut, _ = external._trajectory([a, side, b], row, prompt_length=4, response_length=3)
    assert (cut.response, cut.sampled, cut.finish) == ([3, 4, 9], [1, 1, 0], "length")
    assert (cut.assistant_turns, cut.user_turns) == (1, 1)  # b begins past the cut
    short, members = external._trajectory([a, side, b], row, prompt_length=1, response_length=8)
    assert members == [1] and (short.prompt, short.response) == ([8], [6])
    empty, members = external._trajectory([], row, prompt_length=4, response_length=8)
    assert members == [] and (empty.prompt, empty.response, empty.finish) == ([1, 2], [], "empty")
