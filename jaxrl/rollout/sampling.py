"""Sampling parameters (vLLM / verl semantics) and the token sampler of the decode loop.

The processed distribution of one step, from the logits z of the next token:

    z' = z / temperature                       (temperature 0, i.e. greedy, uses z)
    top_k:  keep the k largest z'               (-1: off)
    top_p:  keep the smallest set of most likely tokens whose probability reaches top_p,
            always at least one (the HF / vLLM rule: drop tokens whose cumulative
            probability in ascending order is <= 1 - top_p)
    p = softmax(z' over the kept tokens)

`sample` takes one `SamplingParams` for every row, compiled into its program (the batch
`generate` loop); `sample_rows` takes each row's settings as arrays (`RowSampling`), so one
compiled program serves requests with different settings (the engine's slots); for the same
settings the two draw the same tokens.

`do_sample=True` draws from p by inverse CDF (one uniform per row against the cumulative
probabilities: cheaper on a CPU than Gumbel noise per logit); `do_sample=False` takes the argmax.
The returned log-prob of the chosen token is log p (the processed distribution, as verl's
`logprobs_mode=processed_logprobs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


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
        stop_token_ids: More tokens that end a response (kept in it), `ignore_eos` or not.
        stop: Strings that end a response once its text contains one (the conversation API
            of `RolloutEngine`, which has a tokenizer; the response keeps the tokens up to
            the one completing the string).
        seed: The key `generate` uses when the caller passes no rng (the same samples each
            call: pass a fresh rng per call, as the trainer does).
        over_sample_rate: verl's early abort: once int(rows x (1 - over_sample_rate)) rows
            have finished, `generate` stops and the rest (the slowest, and any still queued)
            come back empty (length 0, response mask all 0); 0: every row finishes.
        record_routes: A mixture of experts: `generate` also returns the experts each
            prompt and response token used in each layer (routing replay, verl's
            `enable_rollout_routing_replay`).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    n: int = 1
    do_sample: bool = True
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    over_sample_rate: float = 0.0
    record_routes: bool = False

    def __post_init__(self):
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
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
        if not 0.0 <= self.over_sample_rate < 1.0:
            problems.append(f"over_sample_rate={self.over_sample_rate} must be in [0, 1)")
        if any(not isinstance(text, str) or not text for text in self.stop):
            problems.append(f"stop={self.stop!r} must be non-empty strings")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    def end_ids(self, model_eos: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens that end a response: EOS (these parameters' or else the model's
        `model_eos`; none with `ignore_eos`) and `stop_token_ids`."""
        eos = () if self.ignore_eos else (self.eos_token_ids or tuple(model_eos))
        return tuple(dict.fromkeys((*eos, *self.stop_token_ids)))

    @classmethod
    def from_config(cls, rollout, validation: bool = False, **overrides) -> SamplingParams:
        """From `actor_rollout_ref.rollout` (or its `val_kwargs` when `validation`, which
        never aborts rows: verl over-samples training rollouts only)."""
        source = rollout.val_kwargs if validation else rollout
        if not validation:
            overrides.setdefault("over_sample_rate", getattr(rollout, "over_sample_rate", 0.0))
            overrides.setdefault(
                "record_routes", getattr(rollout, "enable_rollout_routing_replay", False)
            )
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
END_ID_WIDTH = 8  # end tokens a row holds in `RowSampling.end_ids` (-1 pads)


def typed_key(key: jax.Array, what: str) -> jax.Array:
    """`key` as typed PRNG keys. Typed keys (`jax.random.key`) pass as they are; legacy raw
    keys (`jax.random.PRNGKey`: uint32 data [..., 2] for the default threefry) are wrapped,
    keeping their data, so `PRNGKey(s)` samples what `key(s)` samples. Anything else is
    refused, naming `what` received it."""
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return key
    data_shape = jax.random.key_data(jax.random.key(0)).shape  # the default impl's
    shape = tuple(getattr(key, "shape", ()))
    if dtype == np.uint32 and shape[len(shape) - len(data_shape) :] == data_shape:
        return jax.random.wrap_key_data(key)
    raise ValueError(
        f"{what}: expected a PRNG key, jax.random.key(seed) (or the legacy "
        f"jax.random.PRNGKey(seed)); got {dtype} with shape {shape}"
    )


@flax.struct.dataclass
class RowSampling:
    """Each row's sampling settings as arrays: data of the program, not part of it.

    Attributes:
        temperature: [S] divides the row's logits where > 0 (0: the logits as they are).
        top_k: [S] keep the k most likely tokens; -1: off.
        top_p: [S] nucleus mass; 1.0: off.
        greedy: [S] take the argmax (`do_sample=False`) instead of drawing.
        end_ids: [S, END_ID_WIDTH] the tokens that end the row's response
            (`SamplingParams.end_ids`), -1 padding.
    """

    temperature: Float[Array, " s"]
    top_k: Int[Array, " s"]
    top_p: Float[Array, " s"]
    greedy: Bool[Array, " s"]
    end_ids: Int[Array, "s e"]

    @classmethod
    def of(cls, params: Sequence[SamplingParams], model_eos: tuple[int, ...]) -> RowSampling:
        """Host arrays of `params` (row i's settings are `params[i]`); `model_eos`: the
        model config's EOS ids (`SamplingParams.end_ids`)."""
        ends = [sp.end_ids(model_eos) for sp in params]
        if any(len(e) > END_ID_WIDTH for e in ends):
            worst = max(ends, key=len)
            raise ValueError(
                f"{len(worst)} end tokens {worst}: a row holds at most {END_ID_WIDTH} "
                "(eos_token_ids + stop_token_ids); end on stop strings instead"
            )
        end_ids = np.full((len(params), END_ID_WIDTH), -1, np.int32)
        for row, e in enumerate(ends):
            end_ids[row, : len(e)] = e
        return cls(
            temperature=np.asarray([sp.temperature for sp in params], np.float32),
            top_k=np.asarray([sp.top_k for sp in params], np.int32),
            top_p=np.asarray([sp.top_p for sp in params], np.float32),
            greedy=np.asarray([not sp.do_sample for sp in params], bool),
            end_ids=end_ids,
        )

    def set_row(self, row: int, other: RowSampling) -> None:
        """Write `other`'s only row into row `row` (host arrays, in place)."""
        for name in ("temperature", "top_k", "top_p", "greedy", "end_ids"):
            getattr(self, name)[row] = getattr(other, name)[0]


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


_BLOCK = 256


def first_argmax(z: Float[Array, "b v"]) -> Int[Array, " b"]:
    """argmax over the last axis (first index on ties) as two plain reductions; XLA's CPU
    argmax (a variadic reduce) is ~4x slower on [16, 32000]."""
    top = jnp.max(z, axis=-1, keepdims=True)
    iota = jnp.arange(z.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(z == top, iota, z.shape[-1]), axis=-1)


def inverse_cdf(weights: Float[Array, "b v"], key: jax.Array) -> Int[Array, " b"]:
    """A draw proportional to non-negative `weights` per row, by a two-level inverse CDF.

    `key`: one typed key (the rows' uniforms drawn from it) or a typed key per row [B]
    (each row's uniform from its own key: its draw does not depend on the other rows).

    One uniform u per row against the cumulative weights, found block by block: a cumsum over
    V / 256 block totals picks the block, a cumsum over its 256 entries the token. A full
    cumsum over V is a sequential scan on the CPU (~7 ms for [16, 32000]; this is ~0.4 ms).
    """
    b, v = weights.shape
    if jnp.ndim(key) == 0:
        u01 = jax.random.uniform(key, (b, 1))
    else:  # one key per row (typed keys [B])
        u01 = jax.vmap(jax.random.uniform)(key)[:, None]
    pad = -v % _BLOCK
    blocks = jnp.pad(weights, ((0, 0), (0, pad))).reshape(b, -1, _BLOCK)
    block_sums = jnp.sum(blocks, axis=-1)
    block_cdf = jnp.cumsum(block_sums, axis=-1)
    # u in (0, total]: u = 0 could select a leading zero-weight (filtered) token.
    u = (1.0 - u01) * block_cdf[:, -1:]
    last_block = block_cdf.shape[-1] - 1
    block = jnp.minimum(jnp.sum(block_cdf < u, axis=-1), last_block)
    before = jnp.take_along_axis(block_cdf - block_sums, block[:, None], axis=-1)
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    inner_cdf = jnp.cumsum(inner, axis=-1) + before
    # The block totals and the in-block cumsum round differently: u may pass every entry of
    # the block. Clamp onto its last positive weight so a filtered token is never chosen.
    last_positive = jnp.max(jnp.where(inner > 0, jnp.arange(_BLOCK), 0), axis=-1)
    offset = jnp.minimum(jnp.sum(inner_cdf < u, axis=-1), last_positive)
    return (block * _BLOCK + offset).astype(jnp.int32)


def sample(
    logits: Float[Array, "b v"], params: SamplingParams, key: jax.Array
) -> tuple[Int[Array, " b"], Float[Array, " b"]]:
    """(token ids [B], their log-probs under the processed distribution [B]); `key` as
    `inverse_cdf` takes it."""
    z = processed_logits(logits, params)
    top = jnp.max(z, axis=-1, keepdims=True)
    weights = jnp.exp(z - top)  # 0 for filtered tokens
    log_norm = jnp.log(jnp.sum(weights, axis=-1)) + top[:, 0]
    tokens = inverse_cdf(weights, key) if params.do_sample else first_argmax(z)
    chosen = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen - log_norm


def processed_rows(logits: Float[Array, "s v"], rs: RowSampling) -> Float[Array, "s v"]:
    """`processed_logits` with each row's own settings (the same values for the same
    settings). The sort that top-k and top-p need runs only when some row filters."""
    z = logits.astype(jnp.float32)
    z = z / jnp.where(rs.temperature > 0, rs.temperature, 1.0)[:, None]

    def filtered(z: Float[Array, "s v"]) -> Float[Array, "s v"]:
        v = z.shape[-1]
        ascending = jnp.sort(z, axis=-1)
        k = jnp.where((rs.top_k > 0) & (rs.top_k < v), rs.top_k, v)
        kth = jnp.take_along_axis(ascending, (v - k)[:, None], axis=-1)
        z = jnp.where(z < kth, _NEG_INF, z)
        ascending = jnp.where(ascending < kth, _NEG_INF, ascending)  # sort(z), still sorted
        cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        removed = cumulative <= 1.0 - rs.top_p[:, None]
        removed = removed.at[:, -1].set(False)  # the most likely token always stays
        threshold = jnp.min(jnp.where(removed, jnp.inf, ascending), axis=-1, keepdims=True)
        nucleus = jnp.where(z < threshold, _NEG_INF, z)
        return jnp.where((rs.top_p < 1.0)[:, None], nucleus, z)

    any_filter = jnp.any((rs.top_k > 0) | (rs.top_p < 1.0))
    return jax.lax.cond(any_filter, filtered, lambda z: z, z)


def sample_rows(
    logits: Float[Array, "s v"], rs: RowSampling, keys: jax.Array
) -> tuple[Int[Array, " s"], Float[Array, " s"]]:
    """`sample` with each row's own settings `rs` and its own typed key (`keys` [S]): row i
    draws what `sample(logits[i:i+1], params_i, keys[i:i+1])` draws."""
    z = processed_rows(logits, rs)
    top = jnp.max(z, axis=-1, keepdims=True)
    weights = jnp.exp(z - top)
    log_norm = jnp.log(jnp.sum(weights, axis=-1)) + top[:, 0]
    # which rows draw decides the work: all (one inverse CDF), none (one argmax), or a mix
    mode = jnp.where(jnp.all(rs.greedy), 1, jnp.where(jnp.any(rs.greedy), 2, 0))
    tokens = jax.lax.switch(
        mode,
        [
            lambda: inverse_cdf(weights, keys),
            lambda: first_argmax(z),
            lambda: jnp.where(rs.greedy, first_argmax(z), inverse_cdf(weights, keys)),
        ],
    )
    chosen = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen - log_norm


def is_end_row(tokens: Int[Array, " s"], end_ids: Int[Array, "s e"]) -> Bool[Array, " s"]:
    """Whether each row's token is one of the row's end tokens (`RowSampling.end_ids`)."""
    return jnp.any(tokens[:, None] == end_ids, axis=-1)
