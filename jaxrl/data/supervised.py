"""Token sequences of the offline trainers: a prompt, a completion and which completion tokens
carry the loss.

    seq = sft_sequence(tokenizer, "What is 2+2?", "4", max_length=64, truncation="error")
    seq = multiturn_sequence(tokenizer, messages, max_length=64, truncation="error")
    prompt_ids, bodies = prompt_and_bodies(tokenizer, prompt, [chosen, rejected], limits)
    chosen, rejected = (cut_sequence(prompt_ids, body, limits) for body in bodies)

A `TokenSeq`'s prompt is what the model reads before the first token trained on; the
completion's `loss_mask` is 1 on the tokens whose prediction is trained (position t - 1
predicts token t, so the prompt's last token predicts the completion's first).

- SFT, prompt/response (verl's SFT dataset): the prompt string is one user message through the
  chat template with the generation prompt (a list of messages is templated as it is); the
  response is its text plus the tokenizer's EOS token, every token trained on. The whole
  sequence is cut to `max_length` by `truncation`: `left` drops its first tokens, `right` its
  last, `error` refuses the row.
- SFT, conversations (verl 0.9.1's `MultiTurnSFTDataset`): each message is rendered by the chat
  template on its own (the system prompt the template adds by itself is stripped from every
  message after the first); an assistant message's tokens are trained on except its role
  header (the template's generation prompt), so its end-of-turn tokens are trained on; other
  roles are not. The concatenation must equal the template over the whole conversation (else
  the row is refused, as verl's sanity check). The prompt is everything before the first
  trained token.
- Preference (TRL 1.16's `DPOTrainer` / `KTOTrainer`): a string prompt and completions are
  tokenized as `prompt` and `prompt + completion` (EOS appended to a completion that lacks
  it; the tokenizer's own special tokens, e.g. BOS, kept); message lists through the chat
  template (the prompt with the generation prompt). The prompt is the common prefix of the
  prompt's ids and every prompt + completion's ids. `max_prompt_length` /
  `max_completion_length` (TRL < 0.29) keep the prompt's last and the completion's first
  tokens; then each whole sequence is cut to `max_length` (`keep_start`: its end; a prompt
  that alone fills `max_length` drops the example, as TRL; `keep_end`: its start);
  `truncation_mode: error` refuses instead.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.data.rows import DataError

log = logging.getLogger("jaxrl.data")


@dataclasses.dataclass(frozen=True)
class TokenSeq:
    """One training sequence.

    Attributes:
        prompt: Token ids read before the first trained token.
        completion: Token ids from the first trained token on.
        loss_mask: 1 where a completion token is trained on (same length as `completion`).
    """

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    loss_mask: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.completion)


def _template(tokenizer: Any, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; set "
            "model.custom_chat_template to a Jinja template"
        )
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=True, return_dict=True, **kwargs
    )
    return list(out["input_ids"])


def _split(ids: Sequence[int], mask: Sequence[int], where: str, cut: bool = False) -> TokenSeq:
    """A sequence with a per-token loss mask as (prompt, completion, completion mask). A
    first token that is trained on (a left cut inside a response) becomes the prompt: nothing
    before it predicts it."""
    first = next((i for i, m in enumerate(mask) if m), None)
    if first is None:
        if cut:
            raise DataError(
                f"{where}: truncation to data.max_length left no token that is trained on; "
                "raise data.max_length or change data.truncation"
            )
        raise DataError(f"{where}: no token is trained on (empty response or no assistant turn)")
    first = max(first, 1)
    if first >= len(ids):
        raise DataError(f"{where}: one token is left after truncation; raise data.max_length")
    return TokenSeq(tuple(ids[:first]), tuple(ids[first:]), tuple(mask[first:]))


def _cut(ids: list[int], mask: list[int], max_length: int, truncation: str, where: str):
    """(ids, mask) cut to `max_length` by `truncation`."""
    if len(ids) <= max_length:
        return ids, mask
    if truncation == "left":
        return ids[-max_length:], mask[-max_length:]
    if truncation == "right":
        return ids[:max_length], mask[:max_length]
    raise DataError(
        f"{where}: the sequence has {len(ids)} tokens, more than data.max_length={max_length}; "
        "raise data.max_length, or set data.truncation to left or right"
    )


def sft_sequence(
    tokenizer: Any,
    prompt: str | Sequence[Mapping[str, Any]],
    response: str,
    *,
    max_length: int,
    truncation: str,
    template_kwargs: Mapping[str, Any] | None = None,
    where: str = "",
) -> TokenSeq:
    """The SFT sequence of a prompt (a string or chat messages) and a response string."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    prompt_ids = _template(
        tokenizer, messages, add_generation_prompt=True, **(template_kwargs or {})
    )
    text = response + (tokenizer.eos_token or "")
    response_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = prompt_ids + response_ids
    mask = [0] * len(prompt_ids) + [1] * len(response_ids)
    return _split(*_cut(ids, mask, max_length, truncation, where), where, len(ids) > max_length)


def _generation_prompt(tokenizer: Any, kwargs: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """(the system prompt the template adds by itself, the generation prompt) as token ids
    (verl's `extract_system_prompt_and_generation`)."""
    empty = [{"role": "user", "content": ""}]
    one = _template(tokenizer, empty, add_generation_prompt=False, **kwargs)
    two = _template(tokenizer, empty * 2, add_generation_prompt=False, **kwargs)
    with_prompt = _template(tokenizer, empty, add_generation_prompt=True, **kwargs)
    system = one[: len(one) - (len(two) - len(one))]
    return system, with_prompt[len(one) :]


def multiturn_sequence(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    max_length: int,
    truncation: str,
    tools: Any = None,
    template_kwargs: Mapping[str, Any] | None = None,
    header_kwargs: Mapping[str, Any] | None = None,
    where: str = "",
    allow_mismatch: bool = False,
) -> TokenSeq:
    """The SFT sequence of a conversation: loss on the assistant turns (module doc).
    `template_kwargs` render the messages (the row's `enable_thinking` included);
    `header_kwargs` (the config's, as verl: not the row's) find the system prompt and the
    role header. A conversation the template renders differently as a whole is refused, or
    with `allow_mismatch` trained as its messages' concatenation (logged once)."""
    kwargs = dict(template_kwargs or {})
    system, header = _generation_prompt(tokenizer, dict(header_kwargs or {}))
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        part = _template(
            tokenizer, [message], add_generation_prompt=False,
            tools=tools if i == 0 else None, **kwargs,
        )  # fmt: skip
        if i != 0 and message.get("role") != "system" and part[: len(system)] == system:
            part = part[len(system) :]
        ids += part
        if message.get("role") == "assistant":
            skip = min(len(header), len(part))
            mask += [0] * skip + [1] * (len(part) - skip)
        else:
            mask += [0] * len(part)
    whole = _template(tokenizer, messages, add_generation_prompt=False, tools=tools, **kwargs)
    if whole != ids and not allow_mismatch:
        raise DataError(
            f"{where}: the chat template renders the conversation differently from its "
            "messages one by one, so the assistant tokens cannot be located; use a template "
            "that renders each message independently, or set "
            "data.multiturn.ignore_input_ids_mismatch=true to train on the concatenation"
        )
    if whole != ids:
        _warn_mismatch()
    return _split(*_cut(ids, mask, max_length, truncation, where), where, len(ids) > max_length)


@functools.cache  # once per process: the warning names no row
def _warn_mismatch() -> None:
    log.warning(
        "the chat template renders some conversations differently from their messages one by "
        "one; training on the concatenation (data.multiturn.ignore_input_ids_mismatch)"
    )


@dataclasses.dataclass(frozen=True)
class PreferenceLimits:
    """TRL's length keys (`dpo.*`): see the module doc."""

    max_length: int | None = 1024
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    truncation_mode: str = "keep_start"


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _tokenize_pair(tokenizer: Any, prompt: Any, completion: Any, kwargs) -> tuple[list, list]:
    """(prompt ids, prompt + completion ids), strings or chat messages (TRL's rules)."""
    if isinstance(prompt, str) != isinstance(completion, str):
        raise DataError("the prompt and the completions must all be strings or all messages")
    if isinstance(prompt, str):
        eos = tokenizer.eos_token or ""
        if eos and not completion.endswith(eos):
            completion = completion + eos
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        return prompt_ids, list(tokenizer(prompt + completion)["input_ids"])
    prompt_ids = _template(tokenizer, prompt, add_generation_prompt=True, **kwargs)
    whole = _template(tokenizer, [*prompt, *completion], add_generation_prompt=False, **kwargs)
    return prompt_ids, whole


def prompt_and_bodies(
    tokenizer: Any,
    prompt: Any,
    completions: Sequence[Any],
    limits: PreferenceLimits,
    *,
    template_kwargs: Mapping[str, Any] | None = None,
    where: str = "",
) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, each completion's ids) before the `max_length` cut: the common-prefix
    split, then `max_prompt_length` (the prompt's last tokens kept, as TRL < 0.29 always did;
    `error` refuses) and `max_completion_length` (the completion's first tokens kept)."""
    kwargs = dict(template_kwargs or {})
    pairs = [_tokenize_pair(tokenizer, prompt, c, kwargs) for c in completions]
    prompt_ids = pairs[0][0]
    n = min(_common_prefix(prompt_ids, whole) for _, whole in pairs)
    prompt_ids, bodies = prompt_ids[:n], [whole[n:] for _, whole in pairs]
    for body, completion in zip(bodies, completions, strict=True):
        if not body:
            raise DataError(f"{where}: an empty completion ({completion!r})")
    if limits.max_prompt_length is not None and len(prompt_ids) > limits.max_prompt_length:
        if limits.truncation_mode == "error":
            raise DataError(
                f"{where}: the prompt has {len(prompt_ids)} tokens, more than "
                f"dpo.max_prompt_length={limits.max_prompt_length}; raise it, or set "
                "dpo.truncation_mode to keep_end or keep_start (the prompt's end is kept)"
            )
        prompt_ids = prompt_ids[-limits.max_prompt_length :]
    if limits.max_completion_length is not None:
        bodies = [b[: limits.max_completion_length] for b in bodies]
    return prompt_ids, bodies


def cut_sequence(
    prompt_ids: Sequence[int], body: Sequence[int], limits: PreferenceLimits, where: str = ""
) -> TokenSeq | None:
    """Prompt + completion cut to `max_length` by `truncation_mode` (module doc); None when
    TRL drops it (`keep_start` with a prompt that alone fills `max_length`). Under `keep_end`
    a completion that fills `max_length` keeps its first remaining token as the prompt
    (nothing before it predicts it, as in TRL)."""
    ids, p, limit = [*prompt_ids, *body], len(prompt_ids), limits.max_length
    if limit is not None and len(ids) > limit:
        if limits.truncation_mode == "error":
            raise DataError(
                f"{where}: a sequence has {len(ids)} tokens, more than dpo.max_length={limit}; "
                "raise it, or set dpo.truncation_mode to keep_start or keep_end"
            )
        if limits.truncation_mode == "keep_start":
            if p >= limit:
                return None
            ids = ids[:limit]
        else:
            p = max(p - (len(ids) - limit), 1)
            ids = ids[-limit:]
    return TokenSeq(tuple(ids[:p]), tuple(ids[p:]), (1,) * (len(ids) - p))
