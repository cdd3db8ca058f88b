"""A synthetic digit task that a tiny random model learns in a few dozen GRPO steps, offline.

Each prompt is one user message `"<task>: d d ..."` and the answer is a digit string:

    repeat   "repeat: 7"       -> "7 7 7 7"    the digit `length` times (easiest: one lookup)
    copy     "copy: 3 1 4 1"   -> "3 1 4 1"    the digits as given
    reverse  "reverse: 3 1 4"  -> "4 1 3"      the digits reversed

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

TASKS = ("repeat", "copy", "reverse")
DATA_SOURCE_PREFIX = "jaxrl/synthetic_"
DATA_SOURCES = tuple(DATA_SOURCE_PREFIX + t for t in TASKS)

SPECIAL_TOKENS = ("<pad>", "<|im_start|>", "<|im_end|>", "<unk>")
TOKENIZER_WORDS = (
    *SPECIAL_TOKENS, "user", "assistant", "system", ":", *TASKS, *"0123456789",
)  # fmt: skip
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


def write_tokenizer(folder: str | os.PathLike) -> Path:
    """Write a word-level HF tokenizer for the synthetic tasks (ChatML chat template, pad
    `<pad>` = 0, eos `<|im_end|>`, one token per digit) to `folder`; load it with
    `jaxrl.data.load_tokenizer`, or with transformers' `AutoTokenizer` next to a llama
    `config.json` (next to a qwen2 one, transformers 5 substitutes a byte-level BPE
    `Qwen2Tokenizer`, which drops the words).
    Its vocabulary is `TOKENIZER_WORDS` (a tiny model needs `vocab_size >= len(...)`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(TOKENIZER_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
        ]
    )
    tok.decoder = decoders.WordPiece()  # joins tokens with spaces
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    fast.chat_template = CHATML_TEMPLATE
    folder = Path(folder)
    fast.save_pretrained(str(folder))
    return folder
