"""Chat templates, prompt truncation and left padding.

A prompt's token ids are the tokenizer's chat template applied to its messages with the
generation prompt appended (`apply_chat_template(messages, add_generation_prompt=True)` plus
`data.apply_chat_template_kwargs`), tokenized without extra special tokens, as verl does.
Prompts longer than `data.max_prompt_length` are truncated by `data.truncation`:

    error   raise (the default): the message names the row and the two fixes
    left    keep the last `max_prompt_length` tokens
    right   keep the first `max_prompt_length` tokens
    middle  keep the first `max_prompt_length // 2` and the last `max_prompt_length - that`

Batches are left-padded to `max_prompt_length`, so every prompt ends at the same column and
generation starts there.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.data.rows import DataError

log = logging.getLogger("jaxrl.data")

TRUNCATIONS = ("error", "left", "right", "middle")
# `tokenizer_class` values of a plain `tokenizer.json` tokenizer (transformers 5 and 4).
_PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Arguments that would change what `apply_chat_template` returns; jaxrl sets them itself.
_RESERVED_KWARGS = ("tokenize", "return_dict", "return_tensors", "add_generation_prompt")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def tokenizer_problems(path: str) -> list[str]:
    """What keeps a local folder from holding a tokenizer (empty: nothing, or not a local
    folder: a hub id is left to transformers and its cache)."""
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        return []
    if any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        return []
    return [f"no tokenizer files ({', '.join(TOKENIZER_FILES)})"]


def load_tokenizer(
    path: str, trust_remote_code: bool = False, custom_chat_template: str | None = None
) -> Any:
    """An HF tokenizer from a local folder (or a hub id already in the HF cache).

    Args:
        path: The tokenizer folder (`data.tokenizer`, else the model's).
        trust_remote_code: Allow tokenizers with custom code.
        custom_chat_template: A Jinja template (or the path of a `.jinja` file) that replaces
            the tokenizer's (`actor_rollout_ref.model.custom_chat_template`).

    A folder whose `tokenizer_config.json` names a plain `tokenizer.json` tokenizer
    (`_PLAIN_TOKENIZER_CLASSES`) is loaded as exactly that: transformers 5's `AutoTokenizer`
    would pick the tokenizer class from `config.json`'s `model_type` instead (`Qwen2Tokenizer`
    for qwen2, byte-level BPE), which silently drops the words of a word-level tokenizer.
    A tokenizer without a pad token pads with its EOS token (as verl's `hf_tokenizer`).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = os.path.expanduser(path)
    if _tokenizer_class(folder) in _PLAIN_TOKENIZER_CLASSES:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    else:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if custom_chat_template:
        set_chat_template(tokenizer, custom_chat_template)
    if tokenizer.pad_token_id is None:
        log.warning("tokenizer %s has no pad token; padding with eos %r", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _tokenizer_class(folder: str) -> str | None:
    """`tokenizer_class` of a local folder's `tokenizer_config.json` (None without one)."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def set_chat_template(tokenizer: Any, template: str) -> None:
    """Replace the tokenizer's chat template by `template` (Jinja text or a `.jinja` file)."""
    expanded = os.path.expanduser(template)
    if "{" not in template and os.path.isfile(expanded):
        with open(expanded) as f:
            template = f.read()
    tokenizer.chat_template = template


def render_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text: the chat template over `messages` with the generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; set "
            "actor_rollout_ref.model.custom_chat_template to a Jinja template"
        )
    kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED_KWARGS}
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=False, **kwargs
    )


def encode_prompts(
    tokenizer: Any,
    messages_list: Sequence[Sequence[Mapping[str, Any]]],
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Token ids of each templated prompt (no truncation, no padding)."""
    if not messages_list:
        return []
    texts = [render_prompt(tokenizer, m, chat_template_kwargs) for m in messages_list]
    # The template already holds the special tokens (BOS included where the template has it).
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def truncate(ids: Sequence[int], max_length: int, truncation: str, where: str = "") -> list[int]:
    """`ids` cut to at most `max_length` tokens by `truncation` (see the module doc).

    Args:
        ids: Token ids of one prompt.
        max_length: `data.max_prompt_length`.
        truncation: `error`, `left`, `right` or `middle`.
        where: Names the row in the error message (`file: row i`).
    """
    if truncation not in TRUNCATIONS:
        raise ValueError(f"data.truncation={truncation!r} is not one of {', '.join(TRUNCATIONS)}")
    ids = list(ids)
    if len(ids) <= max_length:
        return ids
    if truncation == "left":
        return ids[len(ids) - max_length :]
    if truncation == "right":
        return ids[:max_length]
    if truncation == "middle":
        head = max_length // 2
        tail = max_length - head
        return ids[:head] + ids[len(ids) - tail :]
    raise DataError(
        f"{where + ': ' if where else ''}the templated prompt has {len(ids)} tokens, more than "
        f"data.max_prompt_length={max_length}; raise data.max_prompt_length, set "
        "data.filter_overlong_prompts=true to drop such rows, or set data.truncation to "
        "left, right or middle"
    )


def left_pad(
    seqs: Sequence[Sequence[int]], length: int, pad_token_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token id lists into `(input_ids_bt, attention_mask_bt)`, both int32 [B, length].

    Every sequence must already fit in `length` (see `truncate`).
    """
    ids_bt = np.full((len(seqs), length), pad_token_id, np.int32)
    mask_bt = np.zeros((len(seqs), length), np.int32)
    for i, seq in enumerate(seqs):
        n = len(seq)
        if n > length:
            raise ValueError(f"sequence {i} has {n} tokens, more than the padded length {length}")
        if n:
            ids_bt[i, length - n :] = seq
            mask_bt[i, length - n :] = 1
    return ids_bt, mask_bt
