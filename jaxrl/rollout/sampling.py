"""Sampling parameters (vLLM / verl semantics) and the token sampler of the decode loop.

The processed distribution of one step, from the logits z of the next token:

    z' = z / temperature                       (temperature 0, i.e. greedy, uses z)
    top_k:  keep the k largest z'               (-1: off)
    top_p:  keep the smallest set of most likely tokens whose probability reaches top_p,
            always at least one (the HF / vLLM rule: drop tokens whose cumulative
            probability in ascending order is <= 1 - top_p)
    p = softmax(z' over the kept tokens)

`do_sample=True` draws from p by inverse CDF (one uniform per row against the cumulative
probabilities: cheaper on a CPU than Gumbel noise per logit); `do_sample=False` takes the argmax.
The returned log-prob of the chosen token is log p (the processed distribution, as verl's
`logprobs_mode=processed_logprobs`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What to generate (hashable: a static argument of the jitted engine).

    Attributes:
        temperature: Divides the logits; 0 means greedy (requires do_sample=False).
        top_k: Keep the k most likely tokens; -1: off.
        top_p: Nucleus mass in (0, 1]; 1.0: off.
        max_tokens: Response tokens to generate at most.
        n: Responses per prompt, interleaved ([p0, p0, p1, p1] for n = 2), as verl repeats.
        do_sample: Sample (true) or take the argmax (false).
        ignore_eos: Keep generating after EOS; EOS tokens then stay unmasked.
        eos_token_ids: Tokens that end a response (empty: the model config's).
        seed: Base seed when the caller passes no rng (`generate` folds the call count in).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    n: int = 1
    do_sample: bool = True
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        problems = []
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0")
        if self.temperature == 0 and self.do_sample:
            problems.append("temperature=0 means greedy: set do_sample=False")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            problems.append(f"top_k={self.top_k} must be -1 (off) or >= 1")
        if self.n < 1:
            problems.append(f"n={self.n} must be >= 1")
        if self.max_tokens < 1:
            problems.append(f"max_tokens={self.max_tokens} must be >= 1")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @classmethod
    def from_config(cls, rollout, validation: bool = False, **overrides) -> SamplingParams:
        """From `actor_rollout_ref.rollout` (or its `val_kwargs` when `validation`)."""
        source = rollout.val_kwargs if validation else rollout
        return cls(
            temperature=source.temperature,
            top_k=source.top_k,
            top_p=source.top_p,
            n=source.n,
            do_sample=source.do_sample,
            max_tokens=rollout.response_length,
            ignore_eos=getattr(rollout, "ignore_eos", False),
            seed=getattr(rollout, "seed", None),
            **overrides,
        )


_NEG_INF = -jnp.inf


def processed_logits(logits: Float[Array, "b v"], params: SamplingParams) -> Float[Array, "b v"]:
    """float32 logits of the processed distribution; filtered tokens are -inf."""
    z = logits.astype(jnp.float32)
    if params.temperature > 0:
        z = z / params.temperature
    if params.top_k > 0 and params.top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, params.top_k)[0][:, -1:]
        z = jnp.where(z < kth, _NEG_INF, z)
    if params.top_p < 1.0:
        ascending = jnp.sort(z, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        removed = cumulative <= 1.0 - params.top_p
        removed = removed.at[:, -1].set(False)  # the most likely token always stays
        threshold = jnp.min(jnp.where(removed, jnp.inf, ascending), axis=-1, keepdims=True)
        z = jnp.where(z < threshold, _NEG_INF, z)
    return z


def sample(
    logits: Float[Array, "b v"], params: SamplingParams, key: jax.Array
) -> tuple[Int[Array, " b"], Float[Array, " b"]]:
    """(token ids [B], their log-probs under the processed distribution [B])."""
    z = processed_logits(logits, params)
    log_norm = jax.nn.logsumexp(z, axis=-1)
    if params.do_sample:
        probs = jnp.exp(z - log_norm[:, None])
        cdf = jnp.cumsum(probs, axis=-1)
        # u in (0, 1]: u = 0 could select a leading zero-probability (filtered) token.
        u = (1.0 - jax.random.uniform(key, (z.shape[0], 1))) * cdf[:, -1:]
        tokens = jnp.minimum(jnp.sum(cdf < u, axis=-1), z.shape[-1] - 1)
    else:
        tokens = jnp.argmax(z, axis=-1)
    chosen = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), chosen - log_norm
