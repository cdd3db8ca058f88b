"""Preference losses on sequence log-probs: DPO and its variants, KTO (TRL 1.16's `DPOTrainer`
and `KTOTrainer` losses, on jax arrays).

A pair is a prompt x with a chosen completion y_w and a rejected one y_l. With log pi(y|x) the
sum of the completion's token log-probs under the policy and log pi_ref(y|x) under the
reference, the log-ratios and their difference are

    c = log pi(y_w|x) - log pi_ref(y_w|x)      r = log pi(y_l|x) - log pi_ref(y_l|x)
    d = c - r

and with beta the temperature and e the label smoothing, the per-pair losses are

    sigmoid      -(1 - e) log s(beta d) - e log s(-beta d)     (e > 0: conservative DPO)
    hinge        relu(1 - beta d)
    ipo          (c/|y_w| - r/|y_l| - 1/(2 beta))^2           (log-ratios per token)
    sigmoid_norm -log s(beta (c/|y_w| - r/|y_l|))
    robust       (-(1 - e) log s(beta d) + e log s(-beta d)) / (1 - 2e)
    exo_pair     s(beta d)(log s(beta d) - log(1 - e)) + s(-beta d)(log s(-beta d) - log e)
    nca_pair     -log s(beta c) - 1/2 log s(-beta c) - 1/2 log s(-beta r)
    bco_pair     -log s(beta c) - log s(-beta r)
    sppo_hard    (c - 1/(2 beta))^2 + (r + 1/(2 beta))^2
    apo_zero     (1 - s(beta c)) + s(beta r)
    apo_down     s(beta c) + (1 - s(beta d))
    discopop     -log s(beta d)(1 - m) + exp(-beta d) m,   m = s(beta d / tau)

(s the logistic function) and the batch loss is sum_k w_k mean_pairs(loss_k) over the
configured loss types. The `sft` type is the negative log-likelihood of the chosen
completions per token: -sum_pairs log pi(y_w|x) / sum_pairs |y_w| (TRL 1.16's `sft` term, and
what older TRL called `rpo_alpha`).

Deliberate difference from TRL 1.16: `label_smoothing` smooths `sigmoid` (conservative DPO, as
TRL did before 0.29); TRL 1.16 ignores it for that type. At e = 0 they agree.

Every mean takes its denominator as an argument (`num_pairs`, `num_chosen_tokens`): given the
global counts of a mini-batch, the loss of a mini-batch is the sum of its micro-batches'
losses, so gradient accumulation gives the same update however the mini-batch is split.

KTO (unpaired rows x, y with a desirable / undesirable label; `kto_loss`): with
lr = log pi(y|x) - log pi_ref(y|x) and z the batch's KL estimate (the mean log-ratio of
mismatched pairs (x_i, y_j), clamped at 0, no gradient),

    desirable    w_d (1 - s(beta (lr - z)))        undesirable   w_u (1 - s(beta (z - lr)))

averaged over all rows (`apo_zero_unpaired`: 1 - s(beta lr) and s(beta lr), no KL).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "sigmoid_norm", "robust", "exo_pair", "nca_pair", "bco_pair",
    "sppo_hard", "apo_zero", "apo_down", "discopop", "sft",
)  # fmt: skip
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
# Types that read the label smoothing e (exo_pair divides by it: e > 0 required).
SMOOTHED = ("sigmoid", "robust", "exo_pair")

Pairs = Float[Array, " p"]


def pair_losses(
    loss_type: str,
    chosen_logratios: Pairs,
    rejected_logratios: Pairs,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    chosen_lengths: Pairs | None = None,
    rejected_lengths: Pairs | None = None,
    discopop_tau: float = 0.05,
) -> Pairs:
    """Per-pair loss [P] of one DPO `loss_type` (not `sft`; see the module doc).

    Args:
        loss_type: One of `DPO_LOSS_TYPES` but `sft`.
        chosen_logratios: c, log pi(y_w|x) - log pi_ref(y_w|x) [P].
        rejected_logratios: r [P].
        beta: The temperature.
        label_smoothing: e, the assumed probability that a pair's label is flipped.
        chosen_lengths: |y_w|, completion tokens [P] (ipo, sigmoid_norm).
        rejected_lengths: |y_l| [P].
        discopop_tau: DiscoPOP's tau.
    """
    c, r, e = chosen_logratios, rejected_logratios, label_smoothing
    z = beta * (c - r)
    logsig = jax.nn.log_sigmoid
    if loss_type == "sigmoid":
        return -(1 - e) * logsig(z) - e * logsig(-z)
    if loss_type == "hinge":
        return jax.nn.relu(1 - z)
    if loss_type in ("ipo", "sigmoid_norm"):
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"loss_type {loss_type!r} needs the completions' token counts")
        per_token = c / jnp.maximum(chosen_lengths, 1.0) - r / jnp.maximum(rejected_lengths, 1.0)
        if loss_type == "ipo":
            return (per_token - 1 / (2 * beta)) ** 2
        return -logsig(beta * per_token)
    if loss_type == "robust":
        return (-(1 - e) * logsig(z) + e * logsig(-z)) / (1 - 2 * e)
    if loss_type == "exo_pair":
        return jax.nn.sigmoid(z) * (logsig(z) - jnp.log1p(-e)) + jax.nn.sigmoid(-z) * (
            logsig(-z) - jnp.log(e)
        )
    if loss_type == "nca_pair":
        return -logsig(beta * c) - 0.5 * logsig(-beta * c) - 0.5 * logsig(-beta * r)
    if loss_type == "bco_pair":
        return -logsig(beta * c) - logsig(-beta * r)
    if loss_type == "sppo_hard":
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return (1 - jax.nn.sigmoid(beta * c)) + jax.nn.sigmoid(beta * r)
    if loss_type == "apo_down":
        return jax.nn.sigmoid(beta * c) + (1 - jax.nn.sigmoid(z))
    if loss_type == "discopop":
        m = jax.nn.sigmoid(z / discopop_tau)
        return -logsig(z) * (1 - m) + jnp.exp(-z) * m
    raise ValueError(f"unknown DPO loss_type {loss_type!r}; use one of {', '.join(DPO_LOSS_TYPES)}")


def dpo_loss(
    chosen_logps: Pairs,
    rejected_logps: Pairs,
    ref_chosen_logps: Pairs,
    ref_rejected_logps: Pairs,
    *,
    loss_types: tuple[str, ...],
    loss_weights: tuple[float, ...],
    beta: float,
    label_smoothing: float = 0.0,
    chosen_lengths: Pairs | None = None,
    rejected_lengths: Pairs | None = None,
    pair_mask: Pairs | None = None,
    num_pairs: float | Array | None = None,
    num_chosen_tokens: float | Array | None = None,
    discopop_tau: float = 0.05,
) -> Float[Array, ""]:
    """sum_k w_k loss_k over the pairs (module doc); `pair_mask` zeroes padding pairs, and the
    means divide by `num_pairs` / `num_chosen_tokens` (default: this batch's)."""
    mask = jnp.ones_like(chosen_logps) if pair_mask is None else pair_mask
    if num_pairs is None:
        num_pairs = jnp.sum(mask)
    c = chosen_logps - ref_chosen_logps
    r = rejected_logps - ref_rejected_logps
    total = jnp.zeros((), chosen_logps.dtype)
    for loss_type, weight in zip(loss_types, loss_weights, strict=True):
        if loss_type == "sft":
            tokens = (
                jnp.sum(chosen_lengths * mask) if num_chosen_tokens is None else num_chosen_tokens
            )
            total = total + weight * jnp.sum(-chosen_logps * mask) / jnp.maximum(tokens, 1.0)
            continue
        losses = pair_losses(
            loss_type, c, r, beta=beta, label_smoothing=label_smoothing,
            chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths,
            discopop_tau=discopop_tau,
        )  # fmt: skip
        total = total + weight * jnp.sum(jnp.where(mask > 0, losses, 0.0)) / num_pairs
    return total


def kto_loss(
    logps: Float[Array, " n"],
    ref_logps: Float[Array, " n"],
    desirable: Float[Array, " n"],
    kl: Float[Array, ""],
    *,
    loss_type: str = "kto",
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    row_mask: Float[Array, " n"] | None = None,
    num_rows: float | Array | None = None,
) -> Float[Array, ""]:
    """The KTO loss (module doc) over rows labelled `desirable` (1) or not (0); `kl` is the
    batch's KL estimate z (already clamped at 0 and without gradient)."""
    mask = jnp.ones_like(logps) if row_mask is None else row_mask
    if num_rows is None:
        num_rows = jnp.sum(mask)
    lr = logps - ref_logps
    if loss_type == "kto":
        good = 1 - jax.nn.sigmoid(beta * (lr - kl))
        bad = 1 - jax.nn.sigmoid(beta * (kl - lr))
    elif loss_type == "apo_zero_unpaired":
        good = 1 - jax.nn.sigmoid(beta * lr)
        bad = jax.nn.sigmoid(beta * lr)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; use one of {KTO_LOSS_TYPES}")
    losses = jnp.where(desirable > 0, desirable_weight * good, undesirable_weight * bad)
    return jnp.sum(jnp.where(mask > 0, losses, 0.0)) / num_rows


def kl_estimate(
    kl_logps: Float[Array, " n"], ref_kl_logps: Float[Array, " n"], row_mask: Float[Array, " n"]
) -> Float[Array, ""]:
    """KTO's z: the mean log-ratio of the mismatched pairs, clamped at 0, without gradient."""
    mean = jnp.sum((kl_logps - ref_kl_logps) * row_mask) / jnp.maximum(jnp.sum(row_mask), 1.0)
    return jax.lax.stop_gradient(jnp.maximum(mean, 0.0))
