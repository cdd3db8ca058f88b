"""A synthetic digit task that a tiny random model learns in a few dozen GRPO steps, offline.

Each prompt is one user message `"<task>: d d ..."` and the answer is a digit string:

    repeat   "repeat: 7"       -> "7 7 7 7"    the digit `length` times (easiest: one lookup)
    copy     "copy: 3 1 4 1"   -> "3 1 4 1"    the digits as given
    reverse  "reverse: 3 1 4"  -> "4 1 3"      the digits reversed
    add      "add: 123 + 456"  -> "579"        a tool task: the policy calls the calculator

`add` is the tool-use demo (`configs/quickstart_tools.yaml`): two 3-digit numbers whose sum
has 3 digits, rows with `agent_name: tool_agent`. A tiny policy cannot add, but it can copy:
its best turn is the calculator call

    <tool_call>{"name": "calculator", "arguments": {"expression": "123+456"}}</tool_call>

(`write_tokenizer(tools=True)` has `<tool_call>`, `</tool_call>`, the JSON around the
expression and every number below 1000 as single tokens, and decodes without spaces), then,
after the tool's answer, that answer.

`data_source` is `"jaxrl/synthetic_<task>"`, `reward_model.ground_truth` the answer; the
scorer, with partial credit, is `jaxrl.rewards.scorers.synthetic`. `write_tokenizer` writes a
matching word-level HF tokenizer (ChatML template, about 25 tokens), so a tiny model's random
policy emits digits often.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.data.rows import write_parquet

DIGIT_TASKS = ("repeat", "copy", "reverse")
TASKS = (*DIGIT_TASKS, "add")
DATA_SOURCE_PREFIX = "jaxrl/synthetic_"
DATA_SOURCES = tuple(DATA_SOURCE_PREFIX + t for t in TASKS)

SPECIAL_TOKENS = ("<pad>", "<|im_start|>", "<|im_end|>", "<unk>")
TOKENIZER_WORDS = (
    *SPECIAL_TOKENS, "user", "assistant", "system", ":", *DIGIT_TASKS, *"0123456789",
)  # fmt: skip
# The tool tokenizer's extra words: hermes' tags and the JSON around a calculator expression.
CALL_OPEN = '{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}'
TOOL_WORDS = (
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "add", "+",
    CALL_OPEN, CALL_CLOSE,
)  # fmt: skip
# ChatML with hermes tool turns (consecutive tool messages share one user turn, as Qwen2.5's).
# An assistant message with OpenAI `tool_calls` (an external agent's history) renders each call
# as the policy writes it: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
HERMES_CHATML_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user"
    "{% endif %}\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n"
    "{{ m['content'] or '' }}{% for c in m['tool_calls'] %}<tool_call>{\"name\": \""
    "{{ c['function']['name'] }}\", \"arguments\": {% if c['function']['arguments'] is string %}"
    "{{ c['function']['arguments'] }}{% else %}{{ c['function']['arguments'] | tojson }}"
    "{% endif %}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def answer(task: str, digits: list[int], length: int) -> str:
    """The ground truth of a prompt on `digits` (see the module doc)."""
    if task == "repeat":
        return " ".join([str(digits[0])] * length)
    if task == "copy":
        return " ".join(map(str, digits))
    if task == "reverse":
        return " ".join(map(str, digits[::-1]))
    if task == "add":
        return str(digits[0] + digits[1])
    raise ValueError(f"unknown synthetic task {task!r}; use one of {', '.join(TASKS)}")


def make_records(
    num_rows: int,
    *,
    task: str = "repeat",
    length: int = 4,
    seed: int = 0,
    split: str = "train",
) -> list[dict[str, Any]]:
    """`num_rows` verl-format records of `task`.

    Args:
        num_rows: Rows to make.
        task: `repeat`, `copy` or `reverse`.
        length: Digits in the answer.
        seed: Seed; `(seed, split)` fixes the rows, so train and test differ.
        split: Stored in `extra_info.split`.
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; use one of {', '.join(TASKS)}")
    rng = np.random.default_rng([seed, sum(map(ord, split))])
    if task == "add":
        return [_add_record(rng, split, index) for index in range(num_rows)]
    records = []
    for index in range(num_rows):
        digits = rng.integers(0, 10, size=1 if task == "repeat" else length).tolist()
        records.append(
            {
                "data_source": DATA_SOURCE_PREFIX + task,
                "prompt": [{"role": "user", "content": f"{task}: {' '.join(map(str, digits))}"}],
                "ability": "synthetic",
                "reward_model": {"style": "rule", "ground_truth": answer(task, digits, length)},
                "extra_info": {"split": split, "index": index, "task": task},
            }
        )
    return records


def _add_record(rng: np.random.Generator, split: str, index: int) -> dict[str, Any]:
    """A row of the `add` task: a + b with a, b >= 100 and a + b <= 999."""
    a = int(rng.integers(100, 900))
    b = int(rng.integers(100, 1000 - a))
    return {
        "data_source": DATA_SOURCE_PREFIX + "add",
        "prompt": [{"role": "user", "content": f"add: {a} + {b}"}],
        "ability": "synthetic",
        "reward_model": {"style": "rule", "ground_truth": answer("add", [a, b], 0)},
        "extra_info": {"split": split, "index": index, "task": "add", "expression": f"{a}+{b}"},
        "agent_name": "tool_agent",
    }


def sft_records(
    num_rows: int, *, task: str = "repeat", length: int = 4, seed: int = 0, split: str = "train"
) -> list[dict[str, Any]]:
    """`make_records`' prompts with their answers as SFT rows: `prompt` (the chat messages)
    and `response` (the ground truth), verl's SFT columns."""
    records = make_records(num_rows, task=task, length=length, seed=seed, split=split)
    return [{"prompt": r["prompt"], "response": r["reward_model"]["ground_truth"]} for r in records]


def corrupt(truth: str, rng: np.random.Generator) -> str:
    """A wrong answer close to `truth`: one to all of its digits replaced by other digits."""
    digits = truth.split()
    k = int(rng.integers(1, len(digits) + 1))
    for i in rng.choice(len(digits), size=k, replace=False):
        digits[i] = str((int(digits[i]) + int(rng.integers(1, 10))) % 10)
    return " ".join(digits)


def preference_records(
    num_rows: int, *, task: str = "repeat", length: int = 4, seed: int = 0, split: str = "train"
) -> list[dict[str, Any]]:
    """`make_records`' prompts as TRL's conversational preference rows: `prompt` (messages),
    `chosen` (the right answer as an assistant message) and `rejected` (`corrupt`'s)."""
    records = make_records(num_rows, task=task, length=length, seed=seed, split=split)
    rng = np.random.default_rng([seed, sum(map(ord, split)), 1])
    out = []
    for r in records:
        truth = r["reward_model"]["ground_truth"]
        out.append({
            "prompt": r["prompt"],
            "chosen": [{"role": "assistant", "content": truth}],
            "rejected": [{"role": "assistant", "content": corrupt(truth, rng)}],
        })  # fmt: skip
    return out


def write_dataset(
    output_dir: str | os.PathLike,
    *,
    train_size: int = 1024,
    test_size: int = 128,
    task: str = "repeat",
    length: int = 4,
    seed: int = 0,
) -> dict[str, str]:
    """Write `train.parquet` and `test.parquet` of `task` into `output_dir`; returns the paths."""
    out = {}
    for split, size in (("train", train_size), ("test", test_size)):
        records = make_records(size, task=task, length=length, seed=seed, split=split)
        out[split] = write_parquet(records, Path(output_dir) / f"{split}.parquet")
    return out


def write_tokenizer(folder: str | os.PathLike, tools: bool = False) -> Path:
    """Write a word-level HF tokenizer for the synthetic tasks (ChatML chat template, pad
    `<pad>` = 0, eos `<|im_end|>`, one token per digit) to `folder`. With `tools`, for the
    `add` task: one token per number below 1000 instead of per digit, `TOOL_WORDS` (the JSON
    pieces as added tokens, matched before the pre-tokenizer splits), hermes tool turns in the
    template, and a decoder that joins tokens without spaces (so a call's expression reads
    `123+456`). Load it with
    `jaxrl.data.load_tokenizer`, or with transformers' `AutoTokenizer` next to a llama
    `config.json` (next to a qwen2 one, transformers 5 substitutes a byte-level BPE
    `Qwen2Tokenizer`, which drops the words).
    Its vocabulary is `TOKENIZER_WORDS` (+ `TOOL_WORDS`; a tiny model needs `vocab_size >=
    len(tokenizer)`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    plain = [w for w in TOOL_WORDS if w.isalpha() or w == "+"] if tools else []
    numbers = [str(k) for k in range(10, 1000)] if tools else []  # one word per number
    vocab = {w: i for i, w in enumerate((*TOKENIZER_WORDS, *plain, *numbers))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    digits = [] if tools else [pre_tokenizers.Digits(individual_digits=True)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), *digits, pre_tokenizers.Punctuation()]
    )
    tok.decoder = decoders.Fuse() if tools else decoders.WordPiece()  # WordPiece: spaces
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tools:
        tok.add_tokens([t for t in TOOL_WORDS if t not in vocab])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    fast.chat_template = HERMES_CHATML_TEMPLATE if tools else CHATML_TEMPLATE
    folder = Path(folder)
    fast.save_pretrained(str(folder))
    return folder
