"""Rollout correction for `bypass_mode`: IS weights, rejection masks, off-policy diagnostics.

The part of verl 0.9.1's `verl.trainer.ppo.rollout_corr_helper` that
`compute_policy_loss_bypass_mode` uses, with the same names, options, threshold syntax,
metric names and values. With r = pi_train / pi_rollout per token (log r clamped to +-20
before any exponential):

- IS weights (`rollout_is`): `token` w_t = r_t; `sequence` w_t = prod_s r_s for every token of
  the response. A single threshold `u` truncates (TIS, w = min(w, u)); a `"lower_upper"`
  string zeroes weights outside [lower, upper] (IcePop). Optionally divided by their batch
  mean (`rollout_is_batch_normalize`).
- Rejection (`rollout_rs`, comma-separated options, all must pass): token or sequence
  (sum / mean / max) statistics of k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r against
  `rollout_rs_threshold` (k1 options take ratio bounds `"lower_upper"`, or `u` meaning
  [1/u, u]; the others an upper bound).

Config strings are parsed on the host (they are static); everything on arrays is jittable.
Deliberate differences from verl, all forced by `jit`:

- verl raises when `response_mask` has no valid token; here no check is possible and such a
  mask gives meaningless (NaN / inf) metrics.
- When IcePop zeroes every weight, verl fails computing the effective sample size
  (`1.0 / 0.0` in Python: ZeroDivisionError); here that metric is inf.
- The IS weights come back as an array (or None), not wrapped in a `DataProto`.
- Batch normalisation of the weights averages over the local batch; verl averages over all
  data-parallel ranks when `torch.distributed` is initialised.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jaxrl.core_algos.common import masked_mean, masked_sum
from jaxrl.core_algos.policy_losses_common import LOG_RATIO_BOUND

SUPPORTED_ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3")

Metrics = dict[str, Array]


def _as_float(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError as exc:
        raise ValueError(f"invalid {what} {text!r}") from exc


def parse_rollout_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """(upper, lower or None) from `u` (truncation) or `"lower_upper"` (IcePop)."""
    if isinstance(spec, bool):
        raise TypeError("rollout_is_threshold must be a number or a 'lower_upper' string")
    if isinstance(spec, int | float):
        upper, lower = float(spec), None
    elif isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError("rollout_is_threshold must not be an empty string")
        lower_text, sep, upper_text = text.partition("_")
        if sep:
            lower = _as_float(lower_text, "rollout_is_threshold")
            upper = _as_float(upper_text, "rollout_is_threshold")
        else:
            upper, lower = _as_float(text, "rollout_is_threshold"), None
    else:
        raise TypeError("rollout_is_threshold must be a number or a 'lower_upper' string")
    if upper <= 0:
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}")
    if lower is not None and lower <= 0:
        raise ValueError(f"rollout_is_threshold lower bound must be positive, got {lower}")
    if lower is not None and lower > upper:
        raise ValueError("rollout_is_threshold lower bound must be <= upper bound")
    return upper, lower


def parse_rollout_rs_options(rollout_rs: str) -> list[str]:
    """The distinct options of a comma-separated `rollout_rs`, in order."""
    if not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated options)")
    options: list[str] = []
    for option in (part.strip() for part in rollout_rs.split(",")):
        if not option:
            continue
        if option not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"invalid rollout_rs option {option!r}; use {sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}"
            )
        if option not in options:
            options.append(option)
    if not options:
        raise ValueError("rollout_rs must contain at least one valid option")
    return options


def parse_rollout_rs_thresholds(
    options: list[str], spec: str | float | None
) -> dict[str, tuple[float | None, float]]:
    """option -> (lower ratio bound or None, upper bound); one spec shared or one per option."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling")
    if isinstance(spec, int | float):
        specs = [str(spec)]
    elif isinstance(spec, str):
        specs = [part.strip() for part in spec.split(",") if part.strip()]
    else:
        raise TypeError("rollout_rs_threshold must be a string or a number")
    if not specs:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value")
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold needs one threshold shared by all options or {len(options)}"
        )
    if len(specs) == 1:
        specs = specs * len(options)
    thresholds: dict[str, tuple[float | None, float]] = {}
    for option, text in zip(options, specs, strict=True):
        what = f"threshold for rollout_rs option {option!r}"
        if option.endswith("k1"):
            lower_text, sep, upper_text = text.partition("_")
            if sep:
                lower, upper = _as_float(lower_text, what), _as_float(upper_text, what)
            else:
                upper = _as_float(text, what)
                lower = 1.0 / upper
            if lower <= 0 or upper <= 0 or lower > upper:
                raise ValueError(f"{what} must be positive with lower <= upper, got {text!r}")
        else:
            if "_" in text:
                raise ValueError(f"{what} takes a single upper bound, got {text!r}")
            lower, upper = None, _as_float(text, what)
            if upper <= 0:
                raise ValueError(f"{what} must be positive, got {text!r}")
        thresholds[option] = (lower, upper)
    return thresholds


def _masked_max(values: Array, keep: Array, axis: int | None = None) -> Array:
    return jnp.max(jnp.where(keep, values, -jnp.inf), axis=axis)


def _masked_min(values: Array, keep: Array, axis: int | None = None) -> Array:
    return jnp.min(jnp.where(keep, values, jnp.inf), axis=axis)


def _subset_mean(values: Array, keep: Bool[Array, " b"]) -> Array:
    """Mean over the kept entries (verl indexes `values[keep]`, a data-dependent shape)."""
    count = jnp.sum(keep)
    return jnp.sum(jnp.where(keep, values, 0.0)) / jnp.maximum(count, 1)


def _subset_std(values: Array, keep: Bool[Array, " b"]) -> Array:
    """Unbiased std over the kept entries; 0 for fewer than two (as verl)."""
    count = jnp.sum(keep)
    deviation = jnp.where(keep, values - _subset_mean(values, keep), 0.0)
    variance = jnp.sum(jnp.square(deviation)) / jnp.maximum(count - 1, 1)
    return jnp.where(count > 1, jnp.sqrt(variance), 0.0)


def _clamped_std(values: Array, response_mask: Array, low: float, high: float) -> Array:
    """Token-weighted std of `values` clipped to [low, high]; 0 for fewer than two tokens."""
    clipped = jnp.clip(values, low, high)
    mean = masked_mean(clipped, response_mask)
    variance = masked_mean(jnp.square(clipped), response_mask) - jnp.square(mean)
    return jnp.where(jnp.sum(response_mask) > 1, jnp.sqrt(jnp.maximum(variance, 0.0)), 0.0)


def compute_is_metrics(
    rollout_is_weights: Float[Array, "b r"],
    raw_rollout_is_weights: Float[Array, "b r"],
    log_ratio_for_metrics: Float[Array, "b r"] | Float[Array, "b 1"],
    response_mask: Float[Array, "b r"],
    rollout_is: str,
    rollout_is_threshold: float,
    rollout_is_threshold_lower: float | None = None,
) -> Metrics:
    """Statistics of the applied IS weights (and of the raw ones against the bounds)."""
    upper = rollout_is_threshold
    lower = 1.0 / upper if rollout_is_threshold_lower is None else rollout_is_threshold_lower
    valid = response_mask.astype(bool)
    weights, raw = rollout_is_weights, raw_rollout_is_weights
    metrics: Metrics = {"rollout_is_mean": masked_mean(weights, response_mask)}
    if rollout_is == "sequence":
        # Thresholds compared in log space: the sequence log-ratio is not clamped here.
        log_upper = jnp.log(jnp.float32(upper))
        log_lower = jnp.log(jnp.float32(lower))
        metrics["rollout_is_max"] = jnp.exp(jnp.minimum(jnp.max(log_ratio_for_metrics), 20.0))
        metrics["rollout_is_min"] = jnp.exp(jnp.min(log_ratio_for_metrics))
        metrics["rollout_is_ratio_fraction_high"] = jnp.mean(
            (log_ratio_for_metrics > log_upper).astype(jnp.float32)
        )
        metrics["rollout_is_ratio_fraction_low"] = jnp.mean(
            (log_ratio_for_metrics < log_lower).astype(jnp.float32)
        )
    else:
        metrics["rollout_is_ratio_fraction_high"] = masked_mean(
            (raw > upper).astype(jnp.float32), response_mask
        )
        metrics["rollout_is_ratio_fraction_low"] = masked_mean(
            (raw < lower).astype(jnp.float32), response_mask
        )
        metrics["rollout_is_max"] = _masked_max(weights, valid)
        metrics["rollout_is_min"] = _masked_min(weights, valid)

    metrics["rollout_is_std"] = _clamped_std(weights, response_mask, 0.0, upper)
    truncated = jnp.clip(weights, 0.0, upper)
    normalized = truncated / (masked_mean(truncated, response_mask) + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(jnp.square(normalized), response_mask)

    if weights.ndim > 1:
        seq_weights = masked_mean(weights, response_mask, axis=-1)
        n_seqs = seq_weights.shape[0]
        metrics["rollout_is_seq_mean"] = jnp.mean(seq_weights)
        metrics["rollout_is_seq_std"] = (
            jnp.std(seq_weights, ddof=1) if n_seqs > 1 else jnp.zeros((), seq_weights.dtype)
        )
        metrics["rollout_is_seq_max"] = jnp.max(seq_weights)
        metrics["rollout_is_seq_min"] = jnp.min(seq_weights)
        metrics["rollout_is_seq_max_deviation"] = jnp.max(jnp.abs(seq_weights - 1.0))
        # The raw mean: a mean of truncated weights can never exceed the threshold.
        raw_seq_weights = masked_mean(raw, response_mask, axis=-1)
        metrics["rollout_is_seq_fraction_high"] = jnp.mean(
            (raw_seq_weights > upper).astype(jnp.float32)
        )
        metrics["rollout_is_seq_fraction_low"] = jnp.mean(
            (raw_seq_weights < lower).astype(jnp.float32)
        )
    return metrics


def compute_rollout_correction_weights(
    log_ratio: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[Float[Array, "b r"], Metrics]:
    """Truncated (TIS) or band-limited (IcePop) IS weights, zero on padding, no gradient."""
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"invalid rollout_is {rollout_is!r}; use 'token' or 'sequence'")
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    log_ratio = jax.lax.stop_gradient(log_ratio)
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        raw = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    else:
        log_ratio_for_metrics = masked_sum(log_ratio, response_mask, axis=-1)[..., None]
        seq_ratio = jnp.exp(jnp.clip(log_ratio_for_metrics, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        raw = jnp.broadcast_to(seq_ratio, log_ratio.shape)
    raw = raw * response_mask
    if lower is None:
        weights = jnp.minimum(raw, upper)
    else:
        weights = jnp.where((raw >= lower) & (raw <= upper), raw, 0.0)

    metrics = compute_is_metrics(
        weights, raw, log_ratio_for_metrics, response_mask, rollout_is, upper, lower
    )
    if lower is not None:
        out_of_band = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = masked_mean(
            out_of_band.astype(jnp.float32), response_mask
        )

    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, response_mask)
        else:
            seq_weights = masked_mean(weights, response_mask, axis=-1)
            seq_mask = (jnp.sum(response_mask, axis=-1) > 0).astype(weights.dtype)
            mean = jnp.sum(seq_weights * seq_mask) / jnp.maximum(jnp.sum(seq_mask), 1e-8)
        usable = mean > 1e-8
        weights = jnp.where(usable, weights / mean, weights)
        metrics["rollout_is_batch_norm_factor"] = jnp.where(usable, mean, 1.0)
    return weights, metrics


def compute_rs_metrics(
    option_name: str,
    rs_statistic: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    seq_valid_mask: Bool[Array, " b"],
    *,
    level: str,
    per_sequence_values: Float[Array, " b"] | None,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float,
    apply_lower_threshold: bool,
) -> Metrics:
    """Statistics of one rejection criterion, prefixed `rollout_rs_{option_name}_`."""
    prefix = f"rollout_rs_{option_name}"
    valid = response_mask.astype(bool)
    upper, lower = rollout_rs_threshold, rollout_rs_threshold_lower
    if per_sequence_values is None:
        seq_values = masked_mean(rs_statistic, response_mask, axis=-1)
    else:
        seq_values = per_sequence_values
    seq_max = _masked_max(seq_values, seq_valid_mask)
    seq_min = _masked_min(seq_values, seq_valid_mask)
    metrics: Metrics = {f"{prefix}_mean": masked_mean(rs_statistic, response_mask)}
    zero = jnp.zeros((), jnp.float32)

    if level == "sequence":
        metrics[f"{prefix}_max"] = seq_max
        metrics[f"{prefix}_min"] = seq_min
        high = _subset_mean((seq_values > upper).astype(jnp.float32), seq_valid_mask)
        low = _subset_mean((seq_values < lower).astype(jnp.float32), seq_valid_mask)
    else:
        metrics[f"{prefix}_max"] = _masked_max(rs_statistic, valid)
        metrics[f"{prefix}_min"] = _masked_min(rs_statistic, valid)
        high = masked_mean((rs_statistic > upper).astype(jnp.float32), response_mask)
        low = masked_mean((rs_statistic < lower).astype(jnp.float32), response_mask)
    metrics[f"{prefix}_fraction_high"] = high
    metrics[f"{prefix}_fraction_low"] = low if apply_lower_threshold else zero
    std_low = lower if apply_lower_threshold else 0.0
    metrics[f"{prefix}_std"] = _clamped_std(rs_statistic, response_mask, std_low, upper)

    metrics[f"{prefix}_seq_mean"] = _subset_mean(seq_values, seq_valid_mask)
    metrics[f"{prefix}_seq_std"] = _subset_std(seq_values, seq_valid_mask)
    metrics[f"{prefix}_seq_max"] = seq_max
    metrics[f"{prefix}_seq_min"] = seq_min
    metrics[f"{prefix}_seq_max_deviation"] = _masked_max(jnp.abs(seq_values), seq_valid_mask)
    metrics[f"{prefix}_seq_fraction_high"] = _subset_mean(
        (seq_values > upper).astype(jnp.float32), seq_valid_mask
    )
    if apply_lower_threshold:
        metrics[f"{prefix}_seq_fraction_low"] = _subset_mean(
            (seq_values < lower).astype(jnp.float32), seq_valid_mask
        )
    return metrics


def compute_rollout_rejection_mask(
    log_ratio: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[Float[Array, "b r"], Metrics]:
    """`response_mask` with the tokens (or whole sequences) failing any criterion set to 0."""
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated options)")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling")
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    options = parse_rollout_rs_options(rollout_rs)
    thresholds = parse_rollout_rs_thresholds(options, rollout_rs_threshold)

    safe = jnp.clip(jax.lax.stop_gradient(log_ratio), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    token_stats = {"k1": -safe, "k2": 0.5 * safe**2, "k3": jnp.exp(safe) - 1.0 - safe}
    valid = response_mask.astype(bool)
    seq_valid = jnp.sum(response_mask, axis=-1) > 0
    combined = jnp.ones(response_mask.shape, log_ratio.dtype)
    metrics: Metrics = {}

    for option in options:
        lower, upper = thresholds[option]
        is_k1 = option.endswith("k1")
        if is_k1:
            # k1 = -log r is compared with the log of the ratio bounds, as verl does.
            low_bound, high_bound = math.log(lower), math.log(upper)
        else:
            low_bound, high_bound = 0.0, upper

        def passes(stat: Array, is_k1=is_k1, low=low_bound, high=high_bound) -> Array:
            return (stat >= low) & (stat <= high) if is_k1 else stat <= high

        token_stat = token_stats[option[-2:]]
        if option in TOKEN_LEVEL_ROLLOUT_RS_OPTIONS:
            level, seq_stat, per_token_stat = "token", None, token_stat
            keep = passes(token_stat)
        else:
            level = "sequence"
            if option.startswith("seq_sum"):
                seq_stat = masked_sum(token_stat, response_mask, axis=-1)
            elif option.startswith("seq_mean"):
                seq_stat = masked_mean(token_stat, response_mask, axis=-1)
            else:
                seq_max = _masked_max(token_stat, valid, axis=-1)
                seq_stat = jnp.where(seq_max == -jnp.inf, 0.0, seq_max)
            keep = jnp.broadcast_to(passes(seq_stat)[..., None], response_mask.shape)
            per_token_stat = jnp.broadcast_to(seq_stat[..., None], response_mask.shape)

        keep_float = keep.astype(log_ratio.dtype)
        combined = combined * keep_float
        metrics.update(
            compute_rs_metrics(
                option,
                per_token_stat,
                response_mask,
                seq_valid,
                level=level,
                per_sequence_values=seq_stat,
                rollout_rs_threshold=high_bound,
                rollout_rs_threshold_lower=low_bound,
                apply_lower_threshold=is_k1,
            )
        )
        seq_kept = jnp.all(keep | ~valid, axis=-1)
        n_valid_seqs = jnp.sum(seq_valid)
        rejected_seqs = jnp.sum(jnp.where(seq_valid, ~seq_kept, False))
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - keep_float, response_mask)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = jnp.where(
            n_valid_seqs > 0, rejected_seqs / jnp.maximum(n_valid_seqs, 1), 0.0
        ).astype(jnp.float32)

    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - combined, response_mask)
    seq_has_rejected = jnp.any(valid & ~(combined > 0.5), axis=-1)
    metrics["rollout_rs_seq_masked_fraction"] = jnp.mean(seq_has_rejected.astype(jnp.float32))
    return (response_mask * combined).astype(response_mask.dtype), metrics


def compute_offpolicy_metrics(
    old_log_prob: Float[Array, "b r"],
    rollout_log_prob: Float[Array, "b r"] | None,
    response_mask: Float[Array, "b r"],
) -> Metrics:
    """Perplexities, KL (direct and k3) and chi^2 between the training and rollout policies."""
    old_log_prob = jax.lax.stop_gradient(old_log_prob)
    train_mean_log_prob = masked_mean(old_log_prob, response_mask, axis=-1)
    metrics: Metrics = {
        "training_ppl": jnp.mean(jnp.exp(-train_mean_log_prob)),
        "training_log_ppl": jnp.mean(-train_mean_log_prob),
    }
    if rollout_log_prob is None:
        return metrics
    rollout_log_prob = jax.lax.stop_gradient(rollout_log_prob)
    log_ratio = old_log_prob - rollout_log_prob
    metrics["kl"] = masked_mean(rollout_log_prob - old_log_prob, response_mask)
    metrics["k3_kl"] = masked_mean(jnp.exp(log_ratio) - log_ratio - 1, response_mask)
    rollout_mean_log_prob = masked_mean(rollout_log_prob, response_mask, axis=-1)
    metrics["rollout_ppl"] = jnp.mean(jnp.exp(-rollout_mean_log_prob))
    metrics["rollout_log_ppl"] = jnp.mean(-rollout_mean_log_prob)
    log_ppl_diff = rollout_mean_log_prob - train_mean_log_prob
    metrics["log_ppl_diff"] = jnp.mean(log_ppl_diff)
    metrics["log_ppl_abs_diff"] = jnp.mean(jnp.abs(log_ppl_diff))
    metrics["log_ppl_diff_max"] = jnp.max(log_ppl_diff)
    metrics["log_ppl_diff_min"] = jnp.min(log_ppl_diff)
    metrics["ppl_ratio"] = jnp.mean(jnp.exp(log_ppl_diff))
    rho = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    metrics["chi2_token"] = masked_mean(jnp.square(rho), response_mask) - 1.0
    seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1)
    seq_log_ratio = jnp.clip(seq_log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    metrics["chi2_seq"] = jnp.mean(jnp.exp(2.0 * seq_log_ratio)) - 1.0
    return metrics


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: Float[Array, "b r"],
    rollout_log_prob: Float[Array, "b r"],
    response_mask: Float[Array, "b r"],
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[Float[Array, "b r"] | None, Float[Array, "b r"], Metrics]:
    """(IS weights or None, rejection-masked response mask, `rollout_corr/*` metrics).

    `old_log_prob` is the training policy's log-probability (in bypass mode: the current
    policy's), `rollout_log_prob` the rollout engine's. Nothing here carries a gradient.
    """
    if old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(
            f"old_log_prob shape {old_log_prob.shape} != rollout_log_prob shape "
            f"{rollout_log_prob.shape}"
        )
    if old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"log_prob shape {old_log_prob.shape} != response_mask shape {response_mask.shape}"
        )
    old_log_prob = jax.lax.stop_gradient(old_log_prob)
    rollout_log_prob = jax.lax.stop_gradient(rollout_log_prob)
    log_ratio = old_log_prob - rollout_log_prob
    metrics: Metrics = {}

    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio,
            response_mask,
            rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)

    modified_mask = response_mask
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be set when rollout_rs is enabled")
        modified_mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio,
            response_mask,
            rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold,
        )
        metrics.update(rs_metrics)

    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    metrics = {f"rollout_corr/{name}": value for name, value in metrics.items()}
    return weights, modified_mask, metrics
