"""PF-PPO's reward-filtered resampling of a batch (verl's `compute_pf_ppo_reweight_data`).

Policy Filtration PPO (Shen et al. 2024) trains on responses whose reward is reliable: verl
draws N rows with replacement from a batch of N, row i with probability w_i / sum_j w_j, where
the weight of a row's score s_i (its token-level scores summed) is

    pow:         w_i = |s_i| ** weight_pow
    max_min:     w_i = 1 if s_i is the batch's max or min score, else 0
    max_random:  w_i = 0.4 if s_i is the batch's max score, else 0.1

each clamped to at least 1e-8 after adding 1e-8 (so every row keeps a tiny chance). verl
draws with torch's global RNG over a DataProto; jaxrl draws the row indices from a jax key
(`pf_ppo_indices`) and the trainer gathers every field of its batch by them
(`RLBatch.select`), so the draw is the same on every process and on resume.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

REWEIGHT_METHODS = ("pow", "max_min", "max_random")


def pf_ppo_weights(
    scores: Float[Array, " n"], reweight_method: str = "pow", weight_pow: float = 2.0
) -> Float[Array, " n"]:
    """The sampling weight of each row from its summed score (module doc), clamped as verl's.

    Raises:
        ValueError: An unknown `reweight_method`.
    """
    scores = jnp.asarray(scores, jnp.float32)
    if reweight_method == "pow":
        weights = jnp.abs(scores) ** weight_pow
    elif reweight_method == "max_min":
        extreme = (scores == scores.max()) | (scores == scores.min())
        weights = extreme.astype(jnp.float32)
    elif reweight_method == "max_random":
        weights = jnp.where(scores == scores.max(), 0.4, 0.1)
    else:
        raise ValueError(
            f"algorithm.pf_ppo.reweight_method={reweight_method!r} is not one of {REWEIGHT_METHODS}"
        )
    return jnp.maximum(weights + 1e-8, 1e-8)


def pf_ppo_indices(
    key: jax.Array,
    scores: Float[Array, " n"],
    reweight_method: str = "pow",
    weight_pow: float = 2.0,
) -> Int[Array, " n"]:
    """N row indices drawn with replacement, row i with probability w_i / sum_j w_j
    (`pf_ppo_weights`): the rows of the resampled batch, in draw order."""
    weights = pf_ppo_weights(scores, reweight_method, weight_pow)
    n = weights.shape[0]
    return jax.random.choice(key, n, (n,), replace=True, p=weights / weights.sum())
