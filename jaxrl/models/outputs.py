"""What RL needs from a model: token log-probs and entropy, values, reward scores.

Log-probs follow verl's `logprobs_from_logits(logits / temperature, labels)`:

    log p(y_t) = z_t[y_t] - logsumexp(z_t),   z_t = logits_t / temperature
    entropy_t  = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v
    sum_pi2_t  = sum_v softmax(z_t)_v^2 = exp(logsumexp(2 z_t) - 2 logsumexp(z_t))

`token_statistics` computes these (sum_pi2 for verl's optimal-token-baseline estimators, and
TRL's mean logit and top-1 flags) in chunks of the
sequence from the final hidden states, so the [B, T, V] float32 logits never exist at once;
each chunk's logits are recomputed in the backward pass (`jax.checkpoint`), keeping the
gradient's memory at one chunk too. `token_log_probs` is its log-probs and entropy.
"""

from __future__ import annotations

from types import MappingProxyType

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrl.models.config import DecoderConfig
from jaxrl.models.params import Params
from jaxrl.models.transformer import hidden_states, lm_logits, score_head


def log_probs_from_logits(
    logits: Float[Array, "*batch v"], labels: Int[Array, "*batch"]
) -> Float[Array, "*batch"]:
    """log softmax(logits)[labels] in float32 (verl's `logprobs_from_logits`)."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def entropy_from_logits(logits: Float[Array, "*batch v"]) -> Float[Array, "*batch"]:
    """Entropy of softmax(logits) in float32 (verl's `entropy_from_logits`)."""
    logits = logits.astype(jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jax.nn.softmax(logits) * logits, axis=-1)


def sum_pi_squared_from_logits(logits: Float[Array, "*batch v"]) -> Float[Array, "*batch"]:
    """sum_v softmax(logits)_v^2 in float32 (verl's `calculate_sum_pi_squared_from_logits`),
    as exp(logsumexp(2 z) - 2 logsumexp(z)): no [.., V] probabilities squared and summed."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.exp(jax.nn.logsumexp(2 * logits, axis=-1) - 2 * lse)


# Per-position statistics of the logits z [..., V] and targets y [...]: the log-probs and the
# entropy (verl's entropy bonus), sum_v pi_v^2 (verl's optimal token baseline), and TRL's
# `mean_logits` and `is_top1` (its DPO / KTO metrics).
TOKEN_STATISTICS = MappingProxyType({
    "log_probs": log_probs_from_logits,
    "entropy": lambda z, y: entropy_from_logits(z),
    "sum_pi_squared": lambda z, y: sum_pi_squared_from_logits(z),
    "mean_logit": lambda z, y: jnp.mean(z, axis=-1),
    "top1": lambda z, y: (jnp.argmax(z, axis=-1) == y).astype(jnp.float32),
})  # fmt: skip


def log_probs_at(
    logits: Float[Array, "*batch v"], ids: Int[Array, "*batch k"]
) -> Float[Array, "*batch k"]:
    """log softmax(logits) at each of `ids` (k per position), in float32."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return jnp.take_along_axis(logits, ids, axis=-1) - lse


def top_k_log_probs(
    logits: Float[Array, "*batch v"], k: int
) -> tuple[Float[Array, "*batch k"], Int[Array, "*batch k"]]:
    """The k largest log softmax(logits) and their token ids (int32), largest first."""
    logits = logits.astype(jnp.float32)
    values, ids = jax.lax.top_k(logits, k)
    return values - jax.nn.logsumexp(logits, axis=-1, keepdims=True), ids.astype(jnp.int32)


def _chunked(x: Array, n_chunks: int, c: int) -> Array:
    """[B, T, ...] -> [n_chunks, B, c, ...], T zero-padded to n_chunks * c."""
    b, t = x.shape[:2]
    pad = [(0, 0), (0, n_chunks * c - t)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad).reshape(b, n_chunks, c, *x.shape[2:]).swapaxes(0, 1)


def token_statistics(
    config: DecoderConfig,
    params: Params,
    h_btd: Float[Array, "b t d"],
    targets: Int[Array, "b t"],
    names: tuple[str, ...],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    ids: Int[Array, "b t k"] | None = None,
    top_k: int | None = None,
) -> dict[str, Array]:
    """Per-position quantities of z = logits / temperature, in chunks of the sequence.

    Args:
        config: A causal LM.
        params: Its parameters.
        h_btd: Final hidden states, position t predicting `targets[:, t]`.
        targets: Token ids [B, T].
        names: Which of `TOKEN_STATISTICS`: `log_probs` (of the targets), `entropy`,
            `sum_pi_squared`, `mean_logit` (the mean of z over the vocabulary), `top1` (1.0
            where the target is the argmax).
        temperature: Divides the logits (verl applies the rollout temperature here too).
        chunk_size: Sequence positions per chunk; None: the whole sequence at once.
        ids: Token ids [B, T, K] whose log-probs to return as `ids_log_probs` [B, T, K]
            (the distillation teacher's top-k, scored by the student).
        top_k: Also return the k most likely tokens: `top_k_log_probs` [B, T, k] (float32)
            and `top_k_ids` [B, T, k] (int32), largest first.

    Returns:
        {name: [B, T] float32} and the [B, T, K] entries asked for.
    """
    b, t, _ = h_btd.shape
    c = t if chunk_size is None else min(chunk_size, t)
    n_chunks = -(-t // c)
    inputs = {"h": _chunked(h_btd, n_chunks, c), "y": _chunked(targets, n_chunks, c)}
    if ids is not None:
        inputs["ids"] = _chunked(ids, n_chunks, c)

    @jax.checkpoint
    def chunk(x):
        z = lm_logits(config, params, x["h"]).astype(jnp.float32) / temperature
        out = {name: TOKEN_STATISTICS[name](z, x["y"]) for name in names}
        if "ids" in x:
            out["ids_log_probs"] = log_probs_at(z, x["ids"])
        if top_k is not None:
            out["top_k_log_probs"], out["top_k_ids"] = top_k_log_probs(z, top_k)
        return out

    out = jax.lax.map(chunk, inputs)
    return {
        k: v.swapaxes(0, 1).reshape(b, n_chunks * c, *v.shape[3:])[:, :t] for k, v in out.items()
    }


def token_log_probs(
    config: DecoderConfig,
    params: Params,
    h_btd: Float[Array, "b t d"],
    targets: Int[Array, "b t"],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[Float[Array, "b t"], Float[Array, "b t"] | None]:
    """Log-probs of `targets` (and entropy) under softmax(logits / temperature), in chunks
    (`token_statistics`): (log_probs [B, T], entropy [B, T] or None), float32."""
    names = ("log_probs", "entropy") if with_entropy else ("log_probs",)
    out = token_statistics(config, params, h_btd, targets, names, temperature=temperature,
                           chunk_size=chunk_size)  # fmt: skip
    return out["log_probs"], out.get("entropy")


def values(
    config: DecoderConfig,
    params: Params,
    input_ids: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"] | None = None,
    **kwargs,
) -> Float[Array, "b t"]:
    """Per-token values [B, T] (float32) of a critic (a 1-label token-classification head)."""
    if config.head == "causal_lm" or config.num_labels != 1:
        raise ValueError(
            f"values need a 1-label classification head; this model has head={config.head!r} "
            f"with {config.num_labels} labels"
        )
    h = hidden_states(config, params, input_ids, attention_mask, **kwargs)
    return score_head(config, params, h)[..., 0].astype(jnp.float32)


def last_token_index(attention_mask: Int[Array, "b t"]) -> Int[Array, " b"]:
    """Index of the last 1 in each row of the mask (left or right padding)."""
    t = attention_mask.shape[-1]
    return t - 1 - jnp.argmax(attention_mask[:, ::-1] > 0, axis=-1)


def sequence_scores(
    config: DecoderConfig,
    params: Params,
    input_ids: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"],
) -> Float[Array, "b c"]:
    """Classification-head outputs at each row's last valid token [B, C] (reward-model scores)."""
    if config.head == "causal_lm":
        raise ValueError("reward scores need a classification head (score), not a causal LM")
    h = hidden_states(config, params, input_ids, attention_mask)
    idx = last_token_index(attention_mask)
    h_last = jnp.take_along_axis(h, idx[:, None, None], axis=1)
    return score_head(config, params, h_last)[:, 0].astype(jnp.float32)
