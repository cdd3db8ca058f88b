"""Step metrics with verl's names (`verl.trainer.ppo.metric_utils`), from a few numbers per row.

    critic/score/{mean,max,min}       sequence sums of token_level_scores (non-empty responses)
    critic/rewards/{mean,max,min}     the same of token_level_rewards (after KL in reward)
    critic/advantages/..., critic/returns/...   over response tokens
    critic/values/..., critic/vf_explained_var  (with a critic) 1 - Var(G - V) / (Var(G) + 1e-5)
    response_length/{mean,max,min,clip_ratio}, prompt_length/..., response/aborted_ratio
    timing_s/{name}, timing_per_token_ms/{name}   ("gen" per response token, others per token)
    perf/total_num_tokens, perf/time_per_step, perf/throughput (tokens / s / device)
    perf/mfu/actor            6 N T / update time / (devices x peak), with N the actor's
                              parameters and T the batch's tokens x ppo_epochs; the peak is
                              the device kind's dense bf16 FLOP/s (`PEAK_FLOPS`), or the
                              `JAXRL_PEAK_FLOPS` environment variable (CPUs: no default)
    training/rollout_probs_diff_{valid,max,mean,std}, training/rollout_actor_probs_pearson_corr
                              rollout vs old-log-prob pass (`rollout_probs_diff`, on the
                              devices: the rollout/training mismatch routing replay closes)

The figures are computed from every row's summary (`row_summaries`: its sums, counts, maxima and
minima, in float64), which each process makes of its own rows; the summaries of all rows, not
the batch, cross the processes. Timings are each process's own.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

# Dense bf16 FLOP/s per device by `device_kind` prefix (vendor figures, no sparsity).
PEAK_FLOPS = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA A100": 312e12,
    "NVIDIA L4": 121e12,
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5": 197e12,
    "TPU v4": 275e12,
}


def device_peak_flops() -> float | None:
    """Peak FLOP/s of one device of this run (None where unknown, e.g. CPUs)."""
    if "JAXRL_PEAK_FLOPS" in os.environ:
        return float(os.environ["JAXRL_PEAK_FLOPS"])
    kind = jax.devices()[0].device_kind
    for prefix, flops in PEAK_FLOPS.items():
        if kind.startswith(prefix):
            return flops
    return None


def _stats(prefix: str, total: float, count: float, high: float, low: float) -> dict[str, float]:
    if count == 0:
        return {f"{prefix}/mean": float("nan"), f"{prefix}/max": float("nan"),
                f"{prefix}/min": float("nan")}  # fmt: skip
    return {f"{prefix}/mean": total / count, f"{prefix}/max": high, f"{prefix}/min": low}


def _row_stats(prefix: str, x: np.ndarray) -> dict[str, float]:
    """Mean, max and min of one value per row."""
    return _stats(prefix, float(x.sum()), x.size, float(x.max(initial=-np.inf)),
                  float(x.min(initial=np.inf)))  # fmt: skip


def _token_stats(prefix: str, s: dict[str, np.ndarray], name: str) -> dict[str, float]:
    """Mean, max and min over the tokens the rows' summaries of `name` cover."""
    return _stats(prefix, float(s[f"{name}/sum"].sum()), float(s[f"{name}/count"].sum()),
                  float(s[f"{name}/max"].max(initial=-np.inf)),
                  float(s[f"{name}/min"].min(initial=np.inf)))  # fmt: skip


def _masked(name: str, x: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """Per row: the float64 sum, count, max and min of `x` [N, R] over `mask` (-inf and +inf
    for a row with none)."""
    x = x.astype(np.float64)
    return {
        f"{name}/sum": np.where(mask, x, 0.0).sum(-1),
        f"{name}/count": mask.sum(-1).astype(np.float64),
        f"{name}/max": np.where(mask, x, -np.inf).max(-1, initial=-np.inf),
        f"{name}/min": np.where(mask, x, np.inf).min(-1, initial=np.inf),
    }


def row_summaries(batch: dict[str, np.ndarray], use_critic: bool) -> dict[str, np.ndarray]:
    """What the step's metrics need of each row, float64 [N] per name: its score and reward
    sums, prompt and response lengths, the sum, count, max and min of its advantages and
    returns (and values) over its trained tokens, and with a critic the sums of its
    residuals G - V, their squares and the returns' squares. Several processes: each
    summarises its own rows, and the summaries of every row (a few numbers per row, not the
    batch) make the metrics (`data_metrics`)."""
    mask = batch["response_mask"] > 0
    trained = batch.get("loss_mask", batch["response_mask"]) > 0
    out = {
        "score": batch["token_level_scores"].astype(np.float64).sum(-1),
        "reward": batch["token_level_rewards"].astype(np.float64).sum(-1),
        "response_length": mask.sum(-1).astype(np.float64),
        "prompt_length": (batch["prompt_mask"] > 0).sum(-1).astype(np.float64),
        **_masked("advantages", batch["advantages"], trained),
        **_masked("returns", batch["returns"], trained),
    }
    if use_critic:
        returns = batch["returns"].astype(np.float64)
        residual = returns - batch["values"]
        out.update(_masked("values", batch["values"], trained))
        out["residual/sum"] = np.where(trained, residual, 0.0).sum(-1)
        out["residual/squares"] = np.where(trained, residual**2, 0.0).sum(-1)
        out["returns/squares"] = np.where(trained, returns**2, 0.0).sum(-1)
    return out


def _variance(total: float, squares: float, count: float) -> float:
    """The sample variance (ddof 1) of `count` values from their sum and sum of squares."""
    return (squares - total * total / count) / (count - 1)


def data_metrics(
    s: dict[str, np.ndarray], widths: tuple[int, int], use_critic: bool
) -> dict[str, float]:
    """verl's `compute_data_metrics` from the rows' summaries (`row_summaries`) and the
    batch's (prompt, response) columns: lengths over the attended response tokens,
    advantages, returns and values over the trained ones (`loss_mask`: verl's multi-turn
    `response_mask`)."""
    max_prompt, max_response = widths
    response_length, prompt_length = s["response_length"], s["prompt_length"]
    alive = response_length > 0
    out = {
        **_row_stats("critic/score", s["score"][alive]),
        **_row_stats("critic/rewards", s["reward"][alive]),
        **_token_stats("critic/advantages", s, "advantages"),
        **_token_stats("critic/returns", s, "returns"),
    }
    if use_critic:
        out.update(_token_stats("critic/values", s, "values"))
        count = float(s["returns/count"].sum())
        if count > 1:
            residual = _variance(s["residual/sum"].sum(), s["residual/squares"].sum(), count)
            returns = _variance(s["returns/sum"].sum(), s["returns/squares"].sum(), count)
            out["critic/vf_explained_var"] = 1.0 - residual / (returns + 1e-5)
        else:
            out["critic/vf_explained_var"] = float("nan")
    out.update(_row_stats("response_length", response_length))
    out["response_length/clip_ratio"] = float(np.mean(response_length == max_response))
    out.update(_row_stats("response_length_non_aborted", response_length[alive]))
    clipped = response_length[alive] == max_response
    out["response_length_non_aborted/clip_ratio"] = (
        float(np.mean(clipped)) if clipped.size else float("nan")
    )
    out["response/aborted_ratio"] = float(np.mean(~alive))
    out.update(_row_stats("prompt_length", prompt_length))
    out["prompt_length/clip_ratio"] = float(np.mean(prompt_length == max_prompt))
    return out


def token_counts(s: dict[str, np.ndarray]) -> tuple[float, float]:
    """(response tokens, all tokens) of the rows' summaries."""
    response = float(s["response_length"].sum())
    return response, response + float(s["prompt_length"].sum())


def timing_metrics(s: dict[str, np.ndarray], timing: dict[str, float]) -> dict[str, float]:
    """`timing_s/*` and `timing_per_token_ms/*` (verl's `compute_timing_metrics`), from the
    rows' summaries."""
    response_tokens, all_tokens = token_counts(s)
    per_token = {"gen": response_tokens}
    per_token.update(
        {k: all_tokens for k in ("ref", "values", "adv", "update_critic", "update_actor")}
    )
    out = {f"timing_s/{k}": v for k, v in timing.items()}
    for name, tokens in per_token.items():
        if name in timing and tokens > 0:
            out[f"timing_per_token_ms/{name}"] = timing[name] * 1000 / tokens
    return out


def throughput_metrics(
    s: dict[str, np.ndarray], step_seconds: float, devices: int
) -> dict[str, float]:
    """`perf/*` (verl's `compute_throughout_metrics`), from the rows' summaries."""
    tokens = token_counts(s)[1]
    return {
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": step_seconds,
        "perf/throughput": tokens / (step_seconds * devices),
    }


def mfu_metrics(
    s: dict[str, np.ndarray], timing: dict[str, float], params: int, epochs: int, devices: int
) -> dict[str, float]:
    """`perf/mfu/actor` (and `perf/mfu/actor_infer` for the old-log-prob pass) where the
    device peak is known."""
    peak = device_peak_flops()
    if peak is None:
        return {}
    tokens = token_counts(s)[1]
    out = {}
    if timing.get("update_actor"):
        out["perf/mfu/actor"] = 6 * params * tokens * epochs / timing["update_actor"]
    if timing.get("old_log_prob"):
        out["perf/mfu/actor_infer"] = 2 * params * tokens / timing["old_log_prob"]
    return {k: v / (devices * peak) for k, v in out.items()}


@jax.jit
def rollout_probs_diff(
    old_log_probs: jax.Array, rollout_log_probs: jax.Array, response_mask: jax.Array
) -> dict[str, jax.Array]:
    """verl's rollout-vs-actor debug metrics (`calculate_debug_metrics`), on the devices: over
    the response tokens, with p = exp(log-prob) of the old-log-prob pass (actor) and the
    rollout, |p_actor - p_rollout|'s max, mean and (unbiased) std, and the Pearson
    correlation of the two; `training/rollout_probs_diff_valid` 0 (and NaNs) without
    response tokens."""
    mask = response_mask > 0
    count = jnp.sum(mask)
    actor, rollout = jnp.exp(old_log_probs), jnp.exp(rollout_log_probs)
    diff = jnp.where(mask, jnp.abs(actor - rollout), 0.0)
    mean = jnp.sum(diff) / count
    std = jnp.sqrt(jnp.sum(jnp.where(mask, (diff - mean) ** 2, 0.0)) / (count - 1))
    a_mean = jnp.sum(jnp.where(mask, actor, 0.0)) / count
    r_mean = jnp.sum(jnp.where(mask, rollout, 0.0)) / count
    da, dr = jnp.where(mask, actor - a_mean, 0.0), jnp.where(mask, rollout - r_mean, 0.0)
    corr = jnp.sum(da * dr) / jnp.sqrt(jnp.sum(da * da) * jnp.sum(dr * dr))
    valid = count > 0
    nan = jnp.float32(jnp.nan)
    return {
        "training/rollout_probs_diff_valid": valid.astype(jnp.float32),
        "training/rollout_probs_diff_max": jnp.where(valid, jnp.max(diff), nan),
        "training/rollout_probs_diff_mean": jnp.where(valid, mean, nan),
        "training/rollout_probs_diff_std": jnp.where(valid, std, nan),
        "training/rollout_actor_probs_pearson_corr": jnp.where(valid, corr, nan),
    }
