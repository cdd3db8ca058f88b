"""`generate`: jitted prefill and a `lax.while_loop` decode over an explicit KV cache.

    out = generate(config, params, input_ids, attention_mask, SamplingParams(...), rng)
    out.responses [B*n, R], out.response_mask, out.log_probs, out.lengths

Prompts come left-padded (verl's layout). Each prompt is repeated `n` times (interleaved), the
batch and prompt length are padded up to buckets (so a run compiles a bounded number of
programs; every new program is logged), one jitted program prefills the prompts and then
decodes until every row has produced EOS or `max_tokens` tokens. Finished rows emit padding and
are masked; `response_mask` covers the tokens up to and including EOS (with `ignore_eos`, all
`max_tokens`).

With a `layout` (the rollout layout), parameters are expected in it, the batch is split over
its `dp` axis and the KV cache over batch and kv heads.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxrl.models.cached import KVCache, forward_cached, init_cache
from jaxrl.models.config import DecoderConfig
from jaxrl.models.transformer import lm_logits, positions_from_mask
from jaxrl.rollout.sampling import SamplingParams, sample
from jaxrl.sharding.layouts import KV_CACHE_AXES, Layout, use_layout

log = logging.getLogger("jaxrl.rollout")


@flax.struct.dataclass
class GenerationOutput:
    """Right-padded responses of a `generate` call (rows in the order prompt_i, copy_j).

    Attributes:
        responses: Token ids [B*n, R]; padding after the response.
        response_mask: 1 on response tokens (EOS included), 0 after.
        log_probs: Log-probs of the tokens under the processed distribution (0 on padding).
        lengths: Response lengths [B*n].
    """

    responses: Int[Array, "b r"]
    response_mask: Int[Array, "b r"]
    log_probs: Float[Array, "b r"]
    lengths: Int[Array, " b"]


@flax.struct.dataclass
class _LoopState:
    step: Int[Array, ""]
    last: Int[Array, " b"]
    tokens: Int[Array, "b r"]
    log_probs: Float[Array, "b r"]
    done: Array
    lengths: Int[Array, " b"]
    cache: KVCache
    key: jax.Array


def bucket(n: int, minimum: int = 8) -> int:
    """The smallest size >= n among minimum * {1, 1.5, 2, 3, 4, 6, ...} (at most 1.5x padding,
    a handful of distinct sizes, so a handful of compiled programs)."""
    size = minimum
    while size < n:
        if size * 3 // 2 >= n and size * 3 // 2 > size:
            return size * 3 // 2
        size *= 2
    return size


def _is_eos(tokens: Array, eos_ids: tuple[int, ...]) -> Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def _generate(
    config: DecoderConfig,
    sp: SamplingParams,
    layout: Layout | None,
    params: Any,
    input_ids: Int[Array, "b p"],
    attention_mask: Int[Array, "b p"],
    key: jax.Array,
) -> GenerationOutput:
    b, p = input_ids.shape
    r = sp.max_tokens
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    eos_ids = () if sp.ignore_eos else (sp.eos_token_ids or config.eos_token_id)
    with use_layout(layout):
        cache = init_cache(config, b, p + r)
        if layout is not None:
            cache = KVCache(
                k=jax.lax.with_sharding_constraint(
                    cache.k, layout.sharding(cache.k.shape, KV_CACHE_AXES)
                ),
                v=jax.lax.with_sharding_constraint(
                    cache.v, layout.sharding(cache.v.shape, KV_CACHE_AXES)
                ),
                segments=cache.segments,
            )
        positions = positions_from_mask(attention_mask)
        h, cache = forward_cached(config, params, input_ids, positions, attention_mask, cache, 0)
        key, sub = jax.random.split(key)
        first, first_lp = sample(lm_logits(config, params, h[:, -1:])[:, 0], sp, sub)
        done = _is_eos(first, eos_ids)
        state = _LoopState(
            step=jnp.int32(1),
            last=first,
            tokens=jnp.full((b, r), pad_id, jnp.int32).at[:, 0].set(first),
            log_probs=jnp.zeros((b, r), jnp.float32).at[:, 0].set(first_lp),
            done=done,
            lengths=jnp.where(done, 1, r).astype(jnp.int32),
            cache=cache,
            key=key,
        )
        next_position = jnp.sum(attention_mask, axis=-1).astype(jnp.int32)  # real prompt tokens

        def cond(s: _LoopState):
            return (s.step < r) & ~jnp.all(s.done)

        def body(s: _LoopState):
            ones = jnp.ones((b, 1), jnp.int32)
            pos = (next_position + s.step - 1)[:, None]
            h, cache = forward_cached(
                config, params, s.last[:, None], pos, ones, s.cache, p + s.step - 1
            )
            key, sub = jax.random.split(s.key)
            tok, lp = sample(lm_logits(config, params, h)[:, 0], sp, sub)
            tok = jnp.where(s.done, pad_id, tok)
            lp = jnp.where(s.done, 0.0, lp)
            ended = ~s.done & _is_eos(tok, eos_ids)
            return _LoopState(
                step=s.step + 1,
                last=tok,
                tokens=jax.lax.dynamic_update_index_in_dim(s.tokens, tok, s.step, 1),
                log_probs=jax.lax.dynamic_update_index_in_dim(s.log_probs, lp, s.step, 1),
                done=s.done | ended,
                lengths=jnp.where(ended, s.step + 1, s.lengths),
                cache=cache,
                key=key,
            )

        state = jax.lax.while_loop(cond, body, state)
    mask = (jnp.arange(r)[None, :] < state.lengths[:, None]).astype(jnp.int32)
    return GenerationOutput(
        responses=jnp.where(mask > 0, state.tokens, pad_id),
        response_mask=mask,
        log_probs=state.log_probs * mask,
        lengths=state.lengths,
    )


def idle_fraction(out: GenerationOutput) -> float:
    """Share of the decode loop's row-steps spent on rows that had already finished (the
    long tail that continuous batching would refill): sum(steps - length) / (rows * steps)."""
    lengths = np.asarray(out.lengths)
    steps = int(lengths.max()) if lengths.size else 0
    return float((steps - lengths).sum() / max(lengths.size * steps, 1))


@functools.lru_cache(maxsize=64)
def _compiled(config: DecoderConfig, sp: SamplingParams, layout: Layout | None, b: int, p: int):
    log.info(
        "compiling generate: batch %d, prompt %d, max_tokens %d (%s)",
        b,
        p,
        sp.max_tokens,
        "greedy" if not sp.do_sample else f"T={sp.temperature} k={sp.top_k} p={sp.top_p}",
    )
    fn = functools.partial(_generate, config, sp, layout)
    if layout is None:
        return jax.jit(fn)
    tokens = layout.tokens((b, p))
    return jax.jit(fn, in_shardings=(None, tokens, tokens, None))


def generate(
    config: DecoderConfig,
    params: Any,
    input_ids: Int[Array, "b p"] | np.ndarray,
    attention_mask: Int[Array, "b p"] | np.ndarray,
    sampling_params: SamplingParams,
    rng: jax.Array | None = None,
    *,
    layout: Layout | None = None,
    max_prompt_length: int | None = None,
) -> GenerationOutput:
    """Generate responses for left-padded prompts.

    Args:
        config: The model.
        params: Its parameters (in `layout` when given).
        input_ids: Left-padded prompt ids [B, P].
        attention_mask: 1 on prompt tokens, 0 on padding [B, P].
        sampling_params: What to generate.
        rng: A fresh PRNG key per call (the caller's responsibility: never reuse one);
            None derives it from `sampling_params.seed`.
        layout: The rollout layout (mesh dp x tp) to generate on; None: one device.
        max_prompt_length: Refuse prompts longer than this (the configured maximum).

    Raises:
        ValueError: for a prompt longer than `max_prompt_length`, or `max_tokens` beyond the
            model's context, naming the parameter and the allowed range.
    """
    sp = sampling_params
    input_ids = np.asarray(input_ids) if not isinstance(input_ids, jax.Array) else input_ids
    attention_mask = (
        np.asarray(attention_mask) if not isinstance(attention_mask, jax.Array) else attention_mask
    )
    b, p = input_ids.shape
    if attention_mask.shape != (b, p):
        raise ValueError(f"attention_mask {attention_mask.shape} does not match input_ids {(b, p)}")
    longest = int(np.asarray(attention_mask).sum(axis=-1).max()) if b else 0
    if max_prompt_length is not None and longest > max_prompt_length:
        raise ValueError(
            f"a prompt has {longest} tokens, more than max_prompt_length={max_prompt_length}"
        )
    context = config.rope.max_position_embeddings
    if longest + sp.max_tokens > context:
        raise ValueError(
            f"max_tokens={sp.max_tokens} with a {longest}-token prompt exceeds the model's context "
            f"of {context}; max_tokens must be <= {max(context - longest, 0)}"
        )
    if rng is None:
        rng = jax.random.key(0 if sp.seed is None else sp.seed)
    ids = jnp.repeat(jnp.asarray(input_ids, jnp.int32), sp.n, axis=0)
    mask = jnp.repeat(jnp.asarray(attention_mask, jnp.int32), sp.n, axis=0)
    rows = b * sp.n
    dp = 1 if layout is None else int(layout.mesh.shape.get("dp", 1))
    padded_rows = -(-bucket(rows, 1) // dp) * dp
    padded_len = bucket(p)
    ids = jnp.pad(ids, ((0, padded_rows - rows), (padded_len - p, 0)))
    mask = jnp.pad(mask, ((0, padded_rows - rows), (padded_len - p, 0)))
    out = _compiled(config, sp, layout, padded_rows, padded_len)(params, ids, mask, rng)
    return jax.tree.map(lambda x: x[:rows], out)
