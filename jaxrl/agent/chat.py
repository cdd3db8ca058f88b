"""Token ids of a conversation, turn by turn, that add up to the chat template's own.

    chat = ChatTokens(tokenizer, end_ids)
    prompt = chat.prompt(messages, tools)                 # the template + generation prompt
    ... the policy samples its turn, ending with an end token (EOS) ...
    messages.append({"role": "assistant", "content": chat.text(turn_tokens)})
    after = chat.after_turn(messages, tool_messages, tools)    # appended, not sampled

`after_turn` is what the template puts after the assistant's end token (ChatML's newline),
the tool messages, and the next generation prompt, as the template tokenizes them: the ids of
`messages + tool_messages` rendered whole, past those of `messages`. So a finished trajectory
(prompt + sampled turns + appended tool turns) is token for token the chat template applied to
its final message list, as long as the policy's sampled tokens are the tokenizer's own
encoding of their text (no drift from re-tokenizing a turn, verl's
`tokenization_sanity_check`). The assistant message keeps the turn's text as the policy wrote
it, tool calls included, so the template renders exactly what was sampled.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("jaxrl.agent")

Message = Mapping[str, Any]


class ChatTokens:
    """A tokenizer's chat template, tokenized turn by turn.

    Args:
        tokenizer: An HF tokenizer with a chat template.
        end_ids: The tokens that end a turn (EOS and stop tokens).
        chat_template_kwargs: Extra `apply_chat_template` arguments (`data.
            apply_chat_template_kwargs`).
    """

    def __init__(
        self,
        tokenizer: Any,
        end_ids: Sequence[int],
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "multi-turn rollouts need a chat template: set "
                "actor_rollout_ref.model.custom_chat_template"
            )
        self.tokenizer, self.end_ids = tokenizer, frozenset(int(t) for t in end_ids)
        self.kwargs = dict(chat_template_kwargs or {})
        self._warned = False

    def ids(
        self, messages: Sequence[Message], tools: Sequence[dict] | None, generation: bool
    ) -> list[int]:
        """The template over `messages` (with `tools`; with the generation prompt), tokenized
        as the dataset tokenizes prompts (no special tokens added: the template has them)."""
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=generation,
            tokenize=False,
            **self.kwargs,
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[int]:
        return self.ids(messages, tools, generation=True)

    def conversation(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[int]:
        """The ids of a finished trajectory with these final messages: the template over
        them, through the last turn's end token (what follows it, ChatML's newline, the
        policy never sampled)."""
        ids = self.ids(messages, tools, generation=False)
        ends = [i for i, t in enumerate(ids) if t in self.end_ids]
        return ids[: ends[-1] + 1] if ends else ids

    def text(self, turn: Sequence[int]) -> str:
        """A sampled turn's text, its closing end token left out (the template adds it)."""
        turn = list(turn)
        if turn and turn[-1] in self.end_ids:
            turn = turn[:-1]
        return self.tokenizer.decode(turn, skip_special_tokens=False)

    def after_turn(
        self,
        messages: Sequence[Message],
        new: Sequence[Message],
        tools: Sequence[dict] | None,
    ) -> list[int]:
        """The ids after the last assistant turn's end token in `messages` through the
        generation prompt that follows `new` (tool results, a user message).

        Found by counting end tokens: the k-th end token of the whole rendering closes the
        assistant turn when `messages` renders with k. A template that rewrites earlier turns
        once more messages follow (Qwen3 drops an earlier turn's reasoning) still gets the
        right tool turn, but the trajectory then differs from the template over its final
        messages in those turns (a warning says so once; verl's sanity check flags the same).
        """
        before = self.ids(messages, tools, generation=False)
        after = self.ids([*messages, *new], tools, generation=True)
        k = sum(t in self.end_ids for t in before)
        ends = [i for i, t in enumerate(after) if t in self.end_ids]
        if k == 0 or len(ends) < k:
            raise ValueError(
                "the chat template closes the assistant's turn with no end token "
                f"({sorted(self.end_ids)}): its turns cannot be told apart"
            )
        if after[: len(before)] != before and not self._warned:
            self._warned = True
            log.warning(
                "the chat template renders earlier turns differently once messages follow (as "
                "Qwen3's drops reasoning): trajectories keep the tokens as sampled, which then "
                "differ from the template over the final messages"
            )
        return after[ends[k - 1] + 1 :]
