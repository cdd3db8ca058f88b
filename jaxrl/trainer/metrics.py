"""Step metrics with verl's names (`verl.trainer.ppo.metric_utils`), from host arrays.

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

The figures are computed from the step's global batch, which every process holds from the reward
on (`experience.gather_processes`); timings are each process's own.
"""

from __future__ import annotations

import os

import jax
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


def _stats(prefix: str, x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {f"{prefix}/mean": float("nan"), f"{prefix}/max": float("nan"),
                f"{prefix}/min": float("nan")}  # fmt: skip
    return {
        f"{prefix}/mean": float(x.mean()),
        f"{prefix}/max": float(x.max()),
        f"{prefix}/min": float(x.min()),
    }


def data_metrics(batch: dict[str, np.ndarray], use_critic: bool) -> dict[str, float]:
    """verl's `compute_data_metrics` for a batch of host arrays: lengths over the attended
    response tokens, advantages, returns and values over the trained ones (`loss_mask`:
    verl's multi-turn `response_mask`)."""
    mask = batch["response_mask"] > 0
    trained = batch.get("loss_mask", batch["response_mask"]) > 0
    response_length = mask.sum(-1).astype(np.float64)
    prompt_length = batch["prompt_mask"].sum(-1).astype(np.float64)
    max_response = batch["responses"].shape[-1]
    max_prompt = batch["prompts"].shape[-1]
    alive = response_length > 0
    score = batch["token_level_scores"].sum(-1)[alive]
    reward = batch["token_level_rewards"].sum(-1)[alive]
    out = {
        **_stats("critic/score", score),
        **_stats("critic/rewards", reward),
        **_stats("critic/advantages", batch["advantages"][trained]),
        **_stats("critic/returns", batch["returns"][trained]),
    }
    if use_critic:
        values, returns = batch["values"][trained], batch["returns"][trained]
        out.update(_stats("critic/values", values))
        explained = 1.0 - np.var(returns - values, ddof=1) / (np.var(returns, ddof=1) + 1e-5)
        out["critic/vf_explained_var"] = float(explained) if values.size > 1 else float("nan")
    out.update(_stats("response_length", response_length))
    out["response_length/clip_ratio"] = float(np.mean(response_length == max_response))
    out.update(_stats("response_length_non_aborted", response_length[alive]))
    clipped = response_length[alive] == max_response
    out["response_length_non_aborted/clip_ratio"] = (
        float(np.mean(clipped)) if clipped.size else float("nan")
    )
    out["response/aborted_ratio"] = float(np.mean(~alive))
    out.update(_stats("prompt_length", prompt_length))
    out["prompt_length/clip_ratio"] = float(np.mean(prompt_length == max_prompt))
    return out


def timing_metrics(batch: dict[str, np.ndarray], timing: dict[str, float]) -> dict[str, float]:
    """`timing_s/*` and `timing_per_token_ms/*` (verl's `compute_timing_metrics`)."""
    response_tokens = float(batch["response_mask"].sum())
    all_tokens = response_tokens + float(batch["prompt_mask"].sum())
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
    batch: dict[str, np.ndarray], step_seconds: float, devices: int
) -> dict[str, float]:
    """`perf/*` (verl's `compute_throughout_metrics`)."""
    tokens = float(batch["response_mask"].sum() + batch["prompt_mask"].sum())
    return {
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": step_seconds,
        "perf/throughput": tokens / (step_seconds * devices),
    }


def mfu_metrics(
    batch: dict[str, np.ndarray], timing: dict[str, float], params: int, epochs: int, devices: int
) -> dict[str, float]:
    """`perf/mfu/actor` (and `perf/mfu/actor_infer` for the old-log-prob pass) where the
    device peak is known."""
    peak = device_peak_flops()
    if peak is None:
        return {}
    tokens = float(batch["response_mask"].sum() + batch["prompt_mask"].sum())
    out = {}
    if timing.get("update_actor"):
        out["perf/mfu/actor"] = 6 * params * tokens * epochs / timing["update_actor"]
    if timing.get("old_log_prob"):
        out["perf/mfu/actor_infer"] = 2 * params * tokens / timing["old_log_prob"]
    return {k: v / (devices * peak) for k, v in out.items()}
