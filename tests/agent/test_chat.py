"""Turn-by-turn tokens add up to the chat template over the final messages: a Qwen2.5-style
hermes template (tests/agent/fixtures; tool schemas in the system turn, consecutive tool
results in one user turn) and SmolLM2's own ChatML (a `tool` role turn), on SmolLM2's BPE
tokenizer, and the tool task's word-level tokenizer."""

import copy
import json
from pathlib import Path

import pytest

from jaxrl.agent import ChatTokens
from jaxrl.agent.tools.calculator import Calculator
from jaxrl.config import load_config
from jaxrl.data import RLDataset, load_tokenizer, synthetic
from jaxrl.data.rows import write_parquet

QWEN25 = (Path(__file__).parent / "fixtures" / "qwen2_5_tools.jinja").read_text()


@pytest.fixture(scope="module")
def smollm2():
    from jaxrl.testing.assets import smollm2_135m_instruct

    return load_tokenizer(str(smollm2_135m_instruct()))


def call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def play(chat: ChatTokens, tokenizer, tools, turns):
    """A trajectory built as the agent loop builds it: the prompt, then per turn the policy's
    tokens (its text's own encoding + EOS) and the template's tool turn; returns its ids and
    the final messages."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    ids = chat.prompt(messages, tools)
    for text, results in turns:
        sampled = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert chat.text(sampled) == text
        ids += sampled
        messages.append({"role": "assistant", "content": text})
        if results:
            tool_messages = [{"role": "tool", "content": r} for r in results]
            ids += chat.after_turn(messages, tool_messages, tools)
            messages += tool_messages
    return ids, messages


TURNS = [
    ("I will add.\n" + call("calculator", expression="2+3"), ["5"]),
    (call("calculator", expression="5*2") + "\n" + call("calculator", expression="(1+2)"),
     ["10", "3"]),  # two calls, two results in one user turn
    ("The answer is 5.", None),
]  # fmt: skip


@pytest.mark.parametrize("template", ["qwen2.5 hermes", "smollm2 chatml"])
def test_turns_add_up_to_the_template(smollm2, template):
    tokenizer = copy.copy(smollm2)
    if template == "qwen2.5 hermes":
        tokenizer.chat_template = QWEN25
    tools = [Calculator({}).tool_schema]
    chat = ChatTokens(tokenizer, [tokenizer.eos_token_id])
    ids, messages = play(chat, tokenizer, tools, TURNS)
    assert ids == chat.conversation(messages, tools)
    text = tokenizer.decode(ids)
    if template == "qwen2.5 hermes":
        assert '"name": "calculator"' in text.split("<|im_end|>")[0]  # schemas in the system turn
        assert "<tool_response>\n10\n</tool_response>\n<tool_response>\n3" in text
    else:
        assert "<|im_start|>tool\n10<|im_end|>" in text


def test_the_tool_task_tokenizer(tmp_path):
    """The quickstart tool task's word-level tokenizer (no spaces between tokens; numbers and
    the call's JSON pieces as single tokens) adds up the same way."""
    synthetic.write_tokenizer(tmp_path, tools=True)
    tokenizer = load_tokenizer(str(tmp_path))
    chat = ChatTokens(tokenizer, [tokenizer.eos_token_id])
    turn = f"<tool_call>{synthetic.CALL_OPEN}123+456{synthetic.CALL_CLOSE}</tool_call>"
    ids, messages = play(chat, tokenizer, None, [(turn, ["579"]), ("579", None)])
    assert ids == chat.conversation(messages, None)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert pieces[-10:] == [
        "<|im_start|>",
        "user",
        "<tool_response>",
        "579",
        "</tool_response>",
        "<|im_end|>",
        "<|im_start|>",
        "assistant",
        "579",
        "<|im_end|>",
    ]
    assert pieces[-16:-11] == ["123", "+", "456", synthetic.CALL_CLOSE, "</tool_call>"]


QWEN3_LIKE = (  # the last assistant turn keeps an (empty) reasoning block, earlier ones not
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n{% elif m['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% if loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_still_gets_the_tool_turn(smollm2, caplog):
    """Qwen3-style: an earlier turn's rendering changes once messages follow; the tool turn's
    tokens are still exactly the template's (found by counting end tokens), with a warning."""
    tokenizer = copy.copy(smollm2)
    tokenizer.chat_template = QWEN3_LIKE
    chat = ChatTokens(tokenizer, [tokenizer.eos_token_id])
    messages = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "ok"}]
    tool = [{"role": "tool", "content": "5"}]
    with caplog.at_level("WARNING", logger="jaxrl.agent"):
        after = chat.after_turn(messages, tool, None)
    expected = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" \
               "<|im_start|>assistant\n"  # fmt: skip
    assert tokenizer.decode(after) == expected
    assert "differently once messages follow" in caplog.text


def test_the_dataset_measures_prompts_with_the_tools_schemas(smollm2, tmp_path):
    """A multi-turn run's dataset renders prompts with the tools (as the agent loop does), so
    data.filter_overlong_prompts and truncation see the lengths the loop will start."""
    tokenizer = copy.copy(smollm2)
    tokenizer.chat_template = QWEN25
    write_parquet(synthetic.make_records(3, task="add"), tmp_path / "t.parquet")
    data = load_config(None, ["actor_rollout_ref.model.path=unused",
                              f"data.train_files={tmp_path}/t.parquet",
                              "data.max_prompt_length=400"]).data  # fmt: skip
    tools = [Calculator({}).tool_schema]
    plain = RLDataset.from_config(data, tokenizer).prompt_lengths()
    with_tools = RLDataset.from_config(data, tokenizer, tools=tools).prompt_lengths()
    chat = ChatTokens(tokenizer, [tokenizer.eos_token_id])
    first = synthetic.make_records(3, task="add")[0]["prompt"]
    assert with_tools[0] == len(chat.prompt(first, tools)) > plain[0] + 50
