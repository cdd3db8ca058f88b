"""A scripted policy for agent-loop tests and benchmarks: a real model whose next token is
(mostly) a fixed function of the current one.

    config, params = scripted_policy(tokenizer, calculator_chain(), weight=30.0)

Embeddings are one-hot (hidden size = vocabulary), the LM head maps token t to `script[t]`
with logit `weight` and every other token to 0 (the final RMSNorm scales a one-hot vector by
sqrt(hidden); the head divides it back). With the attention and MLP outputs zeroed
(`live=0`) the model is a pure lookup: a large `weight` makes every sampled turn the script;
a small one leaves the other tokens some mass (turns of different lengths and calls).
`live > 0` keeps the attention and MLP weights at `live` times their random init, so the
outputs also depend on the context (and the cached keys and values matter). It runs through
the engine like any Llama checkpoint.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from transformers import LlamaConfig

from jaxrl.data.synthetic import CALL_CLOSE, CALL_OPEN
from jaxrl.models import DecoderConfig, from_hf_config, init_params


def calculator_chain(digits: str = "7") -> list[str]:
    """The token strings of a turn that calls the calculator on `digits` (tool tokenizer of
    `jaxrl.data.synthetic`), from the generation prompt's last token to the end token."""
    return ["assistant", "<tool_call>", CALL_OPEN, *digits, CALL_CLOSE, "</tool_call>",
            "<|im_end|>"]  # fmt: skip


def scripted_policy(
    tokenizer: Any,
    chain: Sequence[str],
    *,
    weight: float = 30.0,
    live: float = 0.0,
    seed: int = 0,
) -> tuple[DecoderConfig, Any]:
    """(config, params) of a Llama-shaped model that continues each token of `chain` with
    the next (tokens not in the chain with the EOS token); see the module doc."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in chain]
    script = dict(itertools.pairwise(ids))
    if len(script) != len(ids) - 1:
        raise ValueError(f"a scripted chain must not repeat a token: {chain}")
    vocab = -(-len(tokenizer) // 8) * 8
    end = tokenizer.eos_token_id
    hf = LlamaConfig(vocab_size=vocab, hidden_size=vocab, intermediate_size=16,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     max_position_embeddings=512, tie_word_embeddings=False,
                     eos_token_id=end, pad_token_id=tokenizer.pad_token_id or 0)  # fmt: skip
    config = from_hf_config(hf)
    params = jax.tree.map(np.asarray, init_params(config, jax.random.key(seed)))
    params["embed"]["tokens_vd"] = np.eye(vocab, dtype=np.float32)
    attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
    attn["w_o_nhd"] = attn["w_o_nhd"] * live
    mlp["w_down_fd"] = mlp["w_down_fd"] * live
    head = np.zeros((vocab, vocab), np.float32)
    for t in range(vocab):
        head[t, script.get(t, end)] = weight / np.sqrt(vocab)
    params["lm_head_dv"] = head
    return config, jax.tree.map(jnp.asarray, params)
