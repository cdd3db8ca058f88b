"""The actor's and the critic's loss on one micro-batch, normalised by global mini-batch counts.

Actor (verl's `ppo_loss`), with lp the new log-probs and `agg` = `agg_loss(..., **info)`:

    loss = pg_loss(old_lp, lp, A) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(KL(lp, ref))

plus, for a mixture of experts, `moe_aux_loss_coeff * L_aux + moe_z_loss_coeff * L_z` (the
router losses, `_router_terms`); and with on-policy distillation (verl's
`distillation_ppo_loss`) that loss combined with the teacher's
(`jaxrl.core_algos.distillation`): `loss + coef * L_distill` with task rewards, else
`L_distill` alone.

Critic (verl's `value_loss`): the clipped value loss of `core_algos.compute_value_loss`.

Losses aggregate over the micro-batch's `loss_mask` (the tokens trained on; the model attends
to `response_mask`). `info` holds the GLOBAL counts of the whole mini-batch
(`core_algos.global_batch_info`), so the mini-batch loss is the sum of its micro-batch losses
in every aggregation mode, and gradient accumulation gives the same update however the
mini-batch is split.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from jaxrl.core_algos import agg_loss, compute_value_loss, get_policy_loss_fn, kl_penalty
from jaxrl.core_algos.common import cfg_get, masked_mean
from jaxrl.core_algos.distillation import (
    combine,
    distillation_loss,
    estimator_metrics,
    forward_kl_topk,
)
from jaxrl.core_algos.kl import kl_penalty_forward
from jaxrl.core_algos.preference import dpo_loss, kto_loss
from jaxrl.models.config import DecoderConfig
from jaxrl.models.moe import (
    RouterStats,
    dropped_fraction,
    expert_load_imbalance,
    load_balancing_loss,
    router_z_loss,
)
from jaxrl.trainer.sequences import response_log_probs, response_statistics, response_values

# The batch fields each loss term reads beyond the tokens and `loss_mask` (the step plan
# gives an update the fields of the terms its config turns on: `StepPlan.actor_fields`).
ACTOR_TERM_FIELDS = MappingProxyType({
    "policy": ("advantages",),
    "off_policy": ("old_log_probs",),  # else the old policy is the current one
    "kl_loss": ("ref_log_probs",),  # use_kl_loss
    "distillation": ("teacher_log_probs",),  # the estimator on the sampled tokens
    "distillation_top_k": ("teacher_topk_log_probs", "teacher_topk_ids"),  # forward_kl_topk
    "rollout_correction": ("rollout_is_weights",),  # decoupled rollout correction
})  # fmt: skip
CRITIC_FIELDS = ("values", "returns")  # `critic_loss`'s


class ConfigView:
    """A frozen config seen with some attributes replaced (what verl does by mutating its
    config in place: `global_batch_info`, bypass mode's `policy_loss`)."""

    def __init__(self, base: Any, **overrides: Any):
        self._base = base
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:  # only called for names not overridden
        return getattr(self._base, name)


def loss_mode(actor_cfg: Any) -> str:
    policy_loss = cfg_get(actor_cfg, "policy_loss")
    return cfg_get(policy_loss, "loss_mode", "vanilla") if policy_loss is not None else "vanilla"


def actor_loss(
    params: Any,
    mb: dict[str, Array],
    info: dict[str, Any],
    *,
    config: DecoderConfig,
    actor_cfg: Any,
    temperature: float,
    distill_cfg: Any = None,
) -> tuple[Array, dict[str, Array]]:
    """(loss, metrics) of one micro-batch; see the module doc. Without `old_log_probs` in the
    micro-batch (on-policy: one mini-batch, one epoch) the old policy is the current one,
    `old_log_probs = stop_gradient(log_probs)`. The entropy is always computed (a metric).
    `distill_cfg` (`distillation.distillation_loss`, with `teacher_log_probs` in the
    micro-batch): add the distillation loss."""
    chunk = actor_cfg.entropy_from_logits_chunk_size
    teacher_ids = mb.get("teacher_topk_ids")
    stats = response_statistics(
        config, params, mb, ("log_probs", "entropy"), temperature=temperature,
        chunk_size=chunk if actor_cfg.entropy_from_logits_with_chunking else None,
        ids=teacher_ids, top_k=None if teacher_ids is None else teacher_ids.shape[-1],
        with_router=True,
    )  # fmt: skip
    lp, entropy = stats["log_probs"], stats["entropy"]
    old_log_probs = mb.get("old_log_probs")
    if old_log_probs is None:
        old_log_probs = jax.lax.stop_gradient(lp)
    mask = mb["loss_mask"].astype(jnp.float32)
    mode = actor_cfg.loss_agg_mode
    if actor_cfg.loss_scale_factor is not None:
        info = {**info, "loss_scale_factor": actor_cfg.loss_scale_factor}
    pg_loss, pg_metrics = get_policy_loss_fn(loss_mode(actor_cfg))(
        old_log_prob=old_log_probs,
        log_prob=lp,
        advantages=mb["advantages"],
        response_mask=mask,
        loss_agg_mode=mode,
        config=ConfigView(actor_cfg, global_batch_info=info),
        rollout_is_weights=mb.get("rollout_is_weights"),
    )
    loss = pg_loss
    sums = {"actor/pg_loss": pg_loss}
    entropy_loss = agg_loss(entropy, mask, mode, **info)
    if actor_cfg.entropy_coeff != 0:
        loss = loss - actor_cfg.entropy_coeff * entropy_loss
    sums["actor/entropy_loss"] = entropy_loss
    if actor_cfg.use_kl_loss:
        kld = kl_penalty(lp, mb["ref_log_probs"], actor_cfg.kl_loss_type)
        kl_loss = agg_loss(kld, mask, mode, **info)
        loss = loss + actor_cfg.kl_loss_coef * kl_loss
        sums["actor/kl_loss"] = kl_loss
    means = {k if k.startswith("actor/") else f"actor/{k}": v for k, v in pg_metrics.items()}
    if "router" in stats:
        loss = loss + _router_terms(stats["router"].stats, jnp.sum(mask), info, actor_cfg, config,
                                    means)  # fmt: skip
    out = {"sum": sums, "mean": means, "tokens": jnp.sum(mask)}
    if distill_cfg is not None:
        losses, kinds = _distillation_terms(stats, mb, mask, distill_cfg)
        distill, pg_kinds = distillation_loss(
            losses, lp, old_log_probs, mask, loss_cfg=distill_cfg, loss_agg_mode=mode,
            info=info, rollout_is_weights=mb.get("rollout_is_weights"),
        )  # fmt: skip
        loss = combine(loss, distill, distill_cfg)
        sums["distillation/loss"] = distill
        for kind in ("mean", "min", "max"):
            out.setdefault(kind, {}).update({**kinds.get(kind, {}), **pg_kinds[kind]})
    return loss, out


def _router_terms(
    router: RouterStats,
    tokens: Array,
    info: dict[str, Any],
    actor_cfg: Any,
    config: DecoderConfig,
    means: dict,
) -> Array:
    """The mixture of experts' router losses of one micro-batch, weighted by its share of the
    mini-batch's trained tokens (the losses are means over the micro-batch, not sums over
    tokens), so the mini-batch adds their token-weighted mean:

        coef_aux * L_aux + coef_z * L_z,  times tokens(mb) / tokens(mini-batch)

    `means` gets the metrics (token-weighted over micro-batches by the learner):
    `actor/load_balancing_loss`, `actor/z_loss`, `actor/moe_expert_load_imbalance` and
    `actor/moe_dropped_token_fraction` (pairs over capacity under `ep`)."""
    aux, z = load_balancing_loss(router), router_z_loss(router)
    means["actor/load_balancing_loss"] = aux
    means["actor/z_loss"] = z
    means["actor/moe_expert_load_imbalance"] = expert_load_imbalance(router)
    means["actor/moe_dropped_token_fraction"] = dropped_fraction(router, config.moe.top_k)
    share = tokens / jnp.maximum(info["batch_num_tokens"], 1.0)
    return share * (actor_cfg.moe_aux_loss_coeff * aux + actor_cfg.moe_z_loss_coeff * z)


def _distillation_terms(stats, mb, mask, distill_cfg) -> tuple[Array, dict]:
    """The per-token distillation losses and their own metrics: the top-k forward KL from the
    student's log-probs at the teacher's top-k ids, else the estimator on the sampled
    tokens."""
    if distill_cfg.loss_mode != "forward_kl_topk":
        mode = distill_cfg.loss_mode
        losses = kl_penalty_forward(stats["log_probs"], mb["teacher_log_probs"], mode)
        return losses, estimator_metrics(losses, mask)
    return forward_kl_topk(
        stats["ids_log_probs"], mb["teacher_topk_log_probs"], stats["top_k_ids"],
        mb["teacher_topk_ids"], mask, log_prob_min_clamp=distill_cfg.log_prob_min_clamp,
    )  # fmt: skip


def critic_loss(
    params: Any,
    mb: dict[str, Array],
    info: dict[str, Any],
    *,
    config: DecoderConfig,
    critic_cfg: Any,
) -> tuple[Array, dict[str, Array]]:
    """(value loss, metrics) of one micro-batch."""
    vpreds = response_values(config, params, mb)
    mask = mb["loss_mask"].astype(jnp.float32)
    if critic_cfg.loss_scale_factor is not None:
        info = {**info, "loss_scale_factor": critic_cfg.loss_scale_factor}
    vf_loss, vf_clipfrac = compute_value_loss(
        vpreds=vpreds,
        returns=mb["returns"],
        values=mb["values"],
        response_mask=mask,
        cliprange_value=critic_cfg.cliprange_value,
        loss_agg_mode=critic_cfg.loss_agg_mode,
        **info,
    )
    means = {"critic/vf_clipfrac": vf_clipfrac, "critic/vpred_mean": masked_mean(vpreds, mask)}
    return vf_loss, {"sum": {"critic/vf_loss": vf_loss}, "mean": means, "tokens": jnp.sum(mask)}


def sft_loss(
    params: Any,
    mb: dict[str, Array],
    info: dict[str, Any],
    *,
    config: DecoderConfig,
    chunk_size: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """verl's SFT loss on one micro-batch: the negative log-likelihood of the trained tokens
    over the whole batch's trained-token count (`info["batch_num_tokens"]`),

        loss = -sum_{t in loss_mask} log pi(y_t | y_<t) / N_batch

    so the micro-batch losses sum to the batch's token mean. `chunk_size`: sequence positions
    whose logits exist at once."""
    lp, _ = response_log_probs(config, params, mb, temperature=1.0, chunk_size=chunk_size)
    mask = mb["loss_mask"].astype(jnp.float32)
    nll = agg_loss(-lp, mask, "token-mean", **info)
    return nll, {"sum": {"train/loss": nll}, "mean": {}, "tokens": jnp.sum(mask)}


# What a preference micro-batch computes per token: the log-probs it is trained on, and what
# TRL logs besides (entropy, the mean logit, whether the token is the greedy prediction).
PREFERENCE_STATISTICS = ("log_probs", "entropy", "mean_logit", "top1")


def sequence_sums(
    config: DecoderConfig,
    params: Any,
    mb: dict[str, Array],
    chunk_size: int | None = None,
    names: tuple[str, ...] = PREFERENCE_STATISTICS,
) -> dict[str, Array]:
    """Per row, float32 [m]: the sum over its trained tokens of each statistic in `names`
    (`response_statistics`: the metrics' statistics carry no gradient) and `tokens`, the
    trained-token count."""
    stats = response_statistics(config, params, mb, names, chunk_size=chunk_size)
    stats = {k: v if k == "log_probs" else jax.lax.stop_gradient(v) for k, v in stats.items()}
    mask = mb["loss_mask"].astype(jnp.float32)
    out = {k: jnp.sum(v * mask, axis=-1) for k, v in stats.items()}
    return {**out, "tokens": jnp.sum(mask, axis=-1)}


# The batch count (`info` key) each token-level metric divides by.
TOKEN_METRIC_COUNTS = MappingProxyType({
    "entropy": "trained_tokens",
    "logits/chosen": "chosen_tokens",
    "logits/rejected": "rejected_tokens",
    "mean_token_accuracy": "chosen_tokens",
})  # fmt: skip


def _token_metrics(rows: dict[str, Array], chosen: Array, rejected: Array, info, accuracy: bool):
    """TRL's token-level metrics from per-row sums: `entropy` over every trained token,
    `logits/chosen|rejected` over the chosen / rejected rows' tokens, `mean_token_accuracy`
    over the chosen rows' tokens (DPO). Each is a sum / the batch's count (at least 1)."""
    sums = {"entropy": jnp.sum(rows["entropy"]),
            "logits/chosen": jnp.sum(rows["mean_logit"] * chosen),
            "logits/rejected": jnp.sum(rows["mean_logit"] * rejected),
            "mean_token_accuracy": jnp.sum(rows["top1"] * chosen)}  # fmt: skip
    if not accuracy:
        del sums["mean_token_accuracy"]
    return {k: v / jnp.maximum(info[TOKEN_METRIC_COUNTS[k]], 1.0) for k, v in sums.items()}


def dpo_terms(
    rows: dict[str, Array], ref: Array, info: dict[str, Any], *, spec: Any
) -> tuple[Array, dict[str, Array]]:
    """The DPO loss of rows laid out as pairs (chosen 2i, rejected 2i + 1) and TRL's metrics,
    each a sum over the pairs (or tokens) / the batch's count (so micro-batches add up).
    `rows`: `sequence_sums` (at least `log_probs` and `tokens`)."""
    seq, lengths = rows["log_probs"], rows["tokens"]
    c, r = seq[0::2], seq[1::2]
    c_len, r_len = lengths[0::2], lengths[1::2]
    pair = (c_len > 0).astype(jnp.float32)
    n = info["num_pairs"]
    loss = dpo_loss(
        c, r, ref[0::2], ref[1::2], loss_types=spec.loss_types, loss_weights=spec.loss_weights,
        beta=spec.beta, label_smoothing=spec.label_smoothing, chosen_lengths=c_len,
        rejected_lengths=r_len, pair_mask=pair, num_pairs=n,
        num_chosen_tokens=info["chosen_tokens"], discopop_tau=spec.discopop_tau,
    )  # fmt: skip
    rc, rr = spec.beta * (c - ref[0::2]), spec.beta * (r - ref[1::2])

    def mean(x):
        return jnp.sum(x * pair) / n

    metrics = {
        "rewards/chosen": mean(rc),
        "rewards/rejected": mean(rr),
        "rewards/accuracies": mean((rc > rr).astype(jnp.float32)),
        "rewards/margins": mean(rc - rr),
        "logps/chosen": mean(c),
        "logps/rejected": mean(r),
    }
    is_chosen = (jnp.arange(seq.shape[0]) % 2 == 0).astype(jnp.float32)
    return loss, metrics | _token_metrics(rows, is_chosen, 1 - is_chosen, info, accuracy=True)


def kto_terms(
    rows: dict[str, Array], ref: Array, labels: Array, info: dict[str, Any], *, spec: Any
) -> tuple[Array, dict[str, Array]]:
    """The KTO loss of labelled rows and TRL's metrics (sums over the batch's counts; a
    class's metrics divide by at least 1, and the trainer drops those of an absent class)."""
    seq, lengths = rows["log_probs"], rows["tokens"]
    row = (lengths > 0).astype(jnp.float32)
    loss = kto_loss(
        seq, ref, labels, info["kl"], loss_type=spec.loss_types[0], beta=spec.beta,
        desirable_weight=spec.desirable_weight, undesirable_weight=spec.undesirable_weight,
        row_mask=row, num_rows=info["num_rows"],
    )  # fmt: skip
    rewards = spec.beta * (seq - ref)
    good, bad = row * labels, row * (1 - labels)
    n_good = jnp.maximum(info["num_desirable"], 1.0)
    n_bad = jnp.maximum(info["num_rows"] - info["num_desirable"], 1.0)
    metrics = {
        "rewards/chosen": jnp.sum(rewards * good) / n_good,
        "rewards/rejected": jnp.sum(rewards * bad) / n_bad,
        "logps/chosen": jnp.sum(seq * good) / n_good,
        "logps/rejected": jnp.sum(seq * bad) / n_bad,
    }
    return loss, metrics | _token_metrics(rows, good, bad, info, accuracy=False)


def preference_loss(
    params: Any,
    mb: dict[str, Array],
    info: dict[str, Any],
    *,
    config: DecoderConfig,
    spec: Any,
    chunk_size: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The DPO (pairs) or KTO (labelled rows) loss of one micro-batch against the reference's
    sequence log-probs in `mb["ref_sequence_log_probs"]` (`jaxrl.core_algos.preference`)."""
    rows = sequence_sums(config, params, mb, chunk_size)
    ref = mb["ref_sequence_log_probs"]
    if spec.kto:
        loss, metrics = kto_terms(rows, ref, mb["labels"], info, spec=spec)
    else:
        loss, metrics = dpo_terms(rows, ref, info, spec=spec)
    return loss, {"sum": {"loss": loss, **metrics}, "mean": {}, "tokens": jnp.sum(rows["tokens"])}
