"""Per-token quantities of the responses in an RL batch: log-probs, entropy, values.

A sequence is a left-padded prompt [P] followed by a right-padded response [R]; the model reads
`input_ids = concat(prompts, responses)` [B, P + R] with `attention_mask` likewise. As in verl,
the response's log-probs and values come from the positions `[-R-1:-1]` (position t predicts
token t + 1):

    log_probs[b, j] = log softmax(logits[b, P - 1 + j] / temperature)[responses[b, j]]
    values[b, j]    = critic_head(h[b, P - 1 + j])

so `values[b, j]` is the value of the state before response token j. A micro-batch of packed
rows (several sequences per row, `jaxrl.data.pack_prompt_response`) carries
`prompt_segment_ids` / `response_segment_ids`: attention stays within a segment and positions
restart at each, so every sequence's results are those of its own row.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrl.models.config import DecoderConfig
from jaxrl.models.moe import Routing
from jaxrl.models.outputs import token_log_probs, token_statistics
from jaxrl.models.params import Params
from jaxrl.models.transformer import hidden_states_and_router, score_head


def _response_hidden(
    config: DecoderConfig, params: Params, mb: dict[str, Int[Array, "b _"]]
) -> Float[Array, "b r d"]:
    return _response_hidden_and_router(config, params, mb)[0]


def _response_hidden_and_router(
    config: DecoderConfig, params: Params, mb: dict[str, Int[Array, "b _"]]
) -> tuple[Float[Array, "b r d"], Routing | None]:
    """The hidden states at the positions predicting each response token, and a mixture of
    experts' routing; with `prompt_routes`/`response_routes` in `mb` (routing replay) the
    experts used are those."""
    input_ids = jnp.concatenate([mb["prompts"], mb["responses"]], axis=1)
    mask = jnp.concatenate([mb["prompt_mask"], mb["response_mask"]], axis=1)
    segments = None
    if "prompt_segment_ids" in mb:
        segments = jnp.concatenate([mb["prompt_segment_ids"], mb["response_segment_ids"]], axis=1)
    routes = None
    if "prompt_routes" in mb:
        routes = jnp.concatenate([mb["prompt_routes"], mb["response_routes"]], axis=1)
    h, router = hidden_states_and_router(config, params, input_ids, mask, segment_ids=segments,
                                         routes=routes)  # fmt: skip
    r = mb["responses"].shape[1]
    return h[:, -r - 1 : -1], router


def response_log_probs(
    config: DecoderConfig,
    params: Params,
    mb: dict[str, Int[Array, "b _"]],
    *,
    temperature: float,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[Float[Array, "b r"], Float[Array, "b r"] | None]:
    """(log-probs [B, R] of the response tokens under logits / temperature, entropy or None)
    of a micro-batch `mb` with `prompts`, `prompt_mask`, `responses`, `response_mask`."""
    h = _response_hidden(config, params, mb)
    return token_log_probs(
        config,
        params,
        h,
        mb["responses"],
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )


def response_statistics(
    config: DecoderConfig,
    params: Params,
    mb: dict[str, Int[Array, "b _"]],
    names: tuple[str, ...],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    ids: Int[Array, "b r k"] | None = None,
    top_k: int | None = None,
    with_router: bool = False,
) -> dict[str, Array]:
    """`token_statistics` of the response tokens of a micro-batch under logits /
    temperature: {name: [B, R]} for `names` among log_probs, entropy, sum_pi_squared,
    mean_logit, top1; with `ids` their log-probs (`ids_log_probs` [B, R, K]), with `top_k`
    the k most likely tokens (`top_k_log_probs`, `top_k_ids` [B, R, k]). `with_router` and a
    mixture of experts: also `router`, the router's sums over the micro-batch's prompt and
    response tokens and the routes taken (`jaxrl.models.moe.Routing`)."""
    h, router = _response_hidden_and_router(config, params, mb)
    stats = token_statistics(config, params, h, mb["responses"], names, temperature=temperature,
                             chunk_size=chunk_size, ids=ids, top_k=top_k)  # fmt: skip
    return {**stats, "router": router} if with_router and router is not None else stats


def response_values(
    config: DecoderConfig, params: Params, mb: dict[str, Int[Array, "b _"]]
) -> Float[Array, "b r"]:
    """Critic values [B, R] (float32) of the states before each response token of `mb`."""
    if config.head != "token_classification" or config.num_labels != 1:
        raise ValueError(
            f"the critic needs a 1-label token-classification head, not {config.head!r} with "
            f"{config.num_labels} labels"
        )
    h = _response_hidden(config, params, mb)
    return score_head(config, params, h)[..., 0].astype(jnp.float32)
