"""The tool demo's starting policy: a tiny model that knows the tool-call format, but not how
to use the tool (`configs/quickstart_tools.yaml`).

A real policy comes to agentic RL knowing its chat format and how to write a tool call; a random
100k-parameter model does not, and RL from scratch spends its budget discovering the dozen
tokens of a call (a random policy writes one with probability ~1e-20). So the quickstart's
`add` model is first fitted, by next-token cross-entropy on the policy's tokens only, to
demonstrations that have the format right and the content mostly wrong:

    user       add: 123 + 456
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "A+B"}}</tool_call>
    tool       A+B's value
    assistant  C

where (A, B) is the question's numbers with probability `copy_operands` and random numbers
otherwise, and C is the tool's answer with probability `copy_answer` and otherwise the
question's first number (a wrong habit, the policy's most likely answer). Starting from it the
greedy validation accuracy is near 0; RL with the calculator has to learn to pass the question's
numbers and to answer with the tool's result, and without the tool (calls answered "unknown
tool") there is no result to answer with.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl.agent.chat import ChatTokens
from jaxrl.data.synthetic import CALL_CLOSE, CALL_OPEN
from jaxrl.models import DecoderConfig, forward


def demonstrations(
    tokenizer: Any,
    count: int,
    *,
    copy_operands: float = 0.5,
    copy_answer: float = 0.3,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`count` demonstration trajectories (see the module doc) as right-padded (ids, attention
    mask, loss mask) [count, T]; the loss mask is 1 on the assistant's tokens (its turns and
    their end tokens)."""
    rng = np.random.default_rng(seed)
    chat = ChatTokens(tokenizer, [tokenizer.eos_token_id])
    eos = tokenizer.eos_token_id
    rows = []
    for _ in range(count):
        question = _operands(rng)
        a, b = question if rng.random() < copy_operands else _operands(rng)
        answer = a + b if rng.random() < copy_answer else question[0]
        messages = [{"role": "user", "content": "add: {} + {}".format(*question)}]
        ids = chat.prompt(messages, None)
        mask = [0] * len(ids)
        call = f"<tool_call>{CALL_OPEN}{a}+{b}{CALL_CLOSE}</tool_call>"
        for text, tool in ((call, str(a + b)), (str(answer), None)):
            turn = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            ids, mask = ids + turn, mask + [1] * len(turn)
            messages.append({"role": "assistant", "content": text})
            if tool is not None:
                after = chat.after_turn(messages, [{"role": "tool", "content": tool}], None)
                messages.append({"role": "tool", "content": tool})
                ids, mask = ids + after, mask + [0] * len(after)
        rows.append((ids, mask))
    width = max(len(ids) for ids, _ in rows)
    out = np.zeros((3, count, width), np.int32)
    for i, (ids, mask) in enumerate(rows):
        out[0, i, : len(ids)], out[1, i, : len(ids)], out[2, i, : len(ids)] = ids, 1, mask
    return out[0], out[1], out[2]


def _operands(rng: np.random.Generator) -> tuple[int, int]:
    """Two 3-digit numbers whose sum has 3 digits (as `synthetic`'s `add` rows)."""
    a = int(rng.integers(100, 900))
    return a, int(rng.integers(100, 1000 - a))


def imitate(
    config: DecoderConfig,
    params: Any,
    data: tuple[np.ndarray, np.ndarray, np.ndarray],
    *,
    steps: int = 600,
    batch: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> Any:
    """`params` fitted to `data` (ids, attention mask, loss mask) by `steps` Adam steps on
    the mean next-token cross-entropy over the loss mask."""
    optimizer = optax.adam(lr)
    state = optimizer.init(params)
    update = jax.jit(functools.partial(_step, config, optimizer))
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows = rng.integers(0, len(data[0]), batch)
        params, state = update(params, state, *(jnp.asarray(x[rows]) for x in data))
    return params


def _step(config, optimizer, params, state, ids, attention, loss_mask):
    def loss(p):
        logits = forward(config, p, ids, attention)[:, :-1].astype(jnp.float32)
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1)[..., 0]
        weight = loss_mask[:, 1:].astype(jnp.float32)
        return -(lp * weight).sum() / jnp.maximum(weight.sum(), 1.0)

    grads = jax.grad(loss)(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state
