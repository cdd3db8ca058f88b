"""DPO variants and KTO (`jaxrl.core_algos.preference`) against TRL 1.16's own loss code.

TRL 1.16 computes its losses inline in `DPOTrainer._compute_loss` / `KTOTrainer._compute_loss`
from a model's per-token log-probs; the tests call those methods on a stand-in trainer whose
"model" returns given per-token log-probs, so TRL's own arithmetic (and its autograd) runs on
random inputs (log-probs and the entropy, mean logits and top-1 flags TRL logs), and compare
the loss, every metric TRL logs and the gradient with respect to the sequence log-probs with
jaxrl's `dpo_terms` / `kto_terms` (jaxrl in float64 here, as TRL's inputs; tolerances below).
"""

from __future__ import annotations

import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import offline
from jaxrl.core_algos import preference
from jaxrl.core_algos.preference import dpo_loss, kl_estimate
from jaxrl.testing.reference import import_reference
from jaxrl.trainer.losses import dpo_terms, kto_terms
from jaxrl.trainer.offline import PreferenceSpec, _kto_metrics

torch = import_reference("torch")
trl = import_reference("trl")

PAIRS, LENGTH = 6, 7
# DPO against TRL: both sides run float64, yet some losses (exo_pair) and logged metrics differ
# by up to 5e-8 relative, float32's rounding (ulp 1.2e-7): TRL rounds through float32 there.
# rtol 1e-6 (~8 float32 ulps) leaves a 20x margin over that; atol 1e-9 covers a value that
# cancels to ~0 (measured <= 0.06 of the tolerance).
RTOL, ATOL = 1e-6, 1e-9
# Where both sides stay in float64 (KTO, the sigmoid loss): rounding ~1e-16 relative per
# operation, measured <= 1.2e-15; 1e-12 leaves a 1000x margin and still fails any float32 step.
RTOL64, ATOL64 = 1e-12, 1e-14


class _Accelerator:
    device = "cpu"

    def gather(self, x):
        return x

    gather_for_metrics = gather


class _Model:
    """Returns the per-token log-probs (and entropy, mean logits, top-1 flags) it holds for
    the input ids it is called with."""

    training = True

    def __init__(self, by_input):
        self.by_input = by_input

    def __call__(self, input_ids, **kwargs):
        lp, stats = self.by_input[id(input_ids)]
        entropy, mean_logit, top1 = (torch.tensor(x) for x in stats)
        return types.SimpleNamespace(
            log_probs=lp, entropy=entropy, mean_logits=mean_logit, is_top1=top1.bool()
        )


def _random_stats(seed: int, shape: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Per-token entropy, mean logit and top-1 flags [rows, L-1] (float64)."""
    rng = np.random.default_rng(seed)
    return (
        rng.uniform(0.1, 3.0, shape),
        rng.normal(0.0, 2.0, shape),
        rng.integers(0, 2, shape) * 1.0,
    )


def _rows(lp, stats, mask):
    """jaxrl's per-row sums (`sequence_sums`) of the per-token arrays over the shifted mask."""
    m = mask[:, 1:]
    entropy, mean_logit, top1 = stats
    sums = {"log_probs": lp, "entropy": entropy, "mean_logit": mean_logit, "top1": top1}
    return {k: (v * m).sum(-1) for k, v in sums.items()} | {"tokens": m.sum(-1) * 1.0}


def _spec(loss_types=("sigmoid",), weights=(1.0,), beta=0.1, smoothing=0.0, kto=False, wd=1.0,
          wu=1.0):  # fmt: skip
    return PreferenceSpec(tuple(loss_types), tuple(weights), beta, smoothing, 0.05, kto, wd, wu)


def _trainer(**attrs):
    base = dict(
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        ref_model=None,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None, discopop_tau=0.05),
    )
    return types.SimpleNamespace(**{**base, **attrs})


def _random_batch(seed: int, rows: int):
    """completion masks [rows, L] (each row's completion a random suffix) and per-token
    log-probs [rows, L-1] on the shifted positions, zero outside the completion."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 4, rows)
    length = rng.integers(1, LENGTH - 1, rows)
    cols = np.arange(LENGTH)
    mask = ((cols >= prompt[:, None]) & (cols < (prompt + length)[:, None])).astype(np.int64)
    lp = -rng.uniform(0.05, 2.0, (rows, LENGTH - 1)) * mask[:, 1:]
    return mask, lp


def _trl_dpo(loss_types, weights, beta, smoothing, lp, mask, ref_c, ref_r, stats=None):
    token_lp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    input_ids = torch.zeros(mask.shape, dtype=torch.long)
    stats = stats if stats is not None else _random_stats(0, lp.shape)
    model = _Model({id(input_ids): (token_lp, stats)})
    trainer = _trainer(
        model=model, beta=beta, label_smoothing=smoothing, loss_types=list(loss_types),
        loss_weights=list(weights), f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5,
        ld_alpha=None, use_weighting=False, router_aux_loss_coef=0.0,
    )  # fmt: skip
    inputs = dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        completion_mask=torch.tensor(mask),
        ref_chosen_logps=torch.tensor(ref_c, dtype=torch.float64),
        ref_rejected_logps=torch.tensor(ref_r, dtype=torch.float64),
    )
    loss = trl.DPOTrainer._compute_loss(trainer, model, inputs, False)
    loss.backward()
    # d loss / d (sequence log-prob): every completion token of a row has the same gradient
    grad = token_lp.grad.numpy()
    seq_grad = np.array([g[m > 0][0] for g, m in zip(grad, mask[:, 1:], strict=True)])
    return float(loss.detach()), seq_grad, {k: v[0] for k, v in trainer._metrics["train"].items()}


def _jax_dpo(loss_types, weights, beta, smoothing, lp, mask, ref_c, ref_r, stats=None):
    """jaxrl's `dpo_terms` (float64) on the same rows, laid out as pairs (chosen 2i,
    rejected 2i + 1): (loss, d loss / d sequence log-prob in TRL's row order, metrics)."""
    stats = stats if stats is not None else _random_stats(0, lp.shape)
    rows = _rows(lp, stats, mask)
    p = len(lp) // 2
    order = np.stack([np.arange(p), np.arange(p) + p], axis=1).ravel()  # TRL's rows, paired
    m = mask[:, 1:]
    info = {"num_pairs": float(p), "chosen_tokens": m[:p].sum() * 1.0,
            "rejected_tokens": m[p:].sum() * 1.0, "trained_tokens": m.sum() * 1.0}  # fmt: skip
    ref = np.stack([ref_c, ref_r], axis=1).ravel()
    spec = _spec(loss_types, weights, beta, smoothing)
    with jax.enable_x64(True):

        def loss(seq):
            paired = {k: jnp.asarray(v[order]) for k, v in rows.items()} | {"log_probs": seq}
            return dpo_terms(paired, jnp.asarray(ref), info, spec=spec)

        (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(
            jnp.asarray(rows["log_probs"][order])
        )
        back = np.empty(2 * p)
        back[order] = np.asarray(grad)
        return float(value), back, {k: float(v) for k, v in metrics.items()}


CASES = [
    (("sigmoid",), (1.0,), 0.0),
    (("hinge",), (1.0,), 0.0),
    (("ipo",), (1.0,), 0.0),
    (("sigmoid_norm",), (1.0,), 0.0),
    (("robust",), (1.0,), 0.2),
    (("exo_pair",), (1.0,), 0.1),
    (("nca_pair",), (1.0,), 0.0),
    (("bco_pair",), (1.0,), 0.0),
    (("sppo_hard",), (1.0,), 0.0),
    (("apo_zero",), (1.0,), 0.0),
    (("apo_down",), (1.0,), 0.0),
    (("discopop",), (1.0,), 0.0),
    (("sigmoid", "sft"), (1.0, 0.7), 0.0),  # older TRL's rpo_alpha=0.7
    (("sigmoid", "ipo", "bco_pair"), (0.5, 1.0, 2.0), 0.0),
]


@pytest.mark.parametrize(("loss_types", "weights", "smoothing"), CASES)
def test_dpo_losses_equal_trl(loss_types, weights, smoothing):
    """The loss, its gradient and every metric TRL logs (rewards, log-probs, entropy, mean
    logits, chosen token accuracy) equal TRL's (RTOL, ATOL)."""
    mask, lp = _random_batch(CASES.index((loss_types, weights, smoothing)), 2 * PAIRS)
    rng = np.random.default_rng(1)
    ref_c, ref_r = -rng.uniform(0.5, 6.0, PAIRS), -rng.uniform(0.5, 6.0, PAIRS)
    args = (loss_types, weights, 0.3, smoothing, lp, mask, ref_c, ref_r)
    want, want_grad, logged = _trl_dpo(*args)
    got, got_grad, metrics = _jax_dpo(*args)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got_grad, want_grad, rtol=RTOL, atol=ATOL)
    compared = set(logged) - {"num_tokens"}  # the trainer's running count (test_offline)
    assert compared == set(metrics)
    for key in compared:
        np.testing.assert_allclose(metrics[key], logged[key], rtol=RTOL, atol=ATOL, err_msg=key)


def test_sigmoid_label_smoothing_is_conservative_dpo():
    """TRL 1.16 ignores `label_smoothing` for `sigmoid`; jaxrl smooths it as TRL did before
    (cDPO): (1 - e) L(d) + e L(-d), L TRL's own sigmoid loss and L(-d) the pairs swapped."""
    mask, lp = _random_batch(3, 2 * PAIRS)
    rng = np.random.default_rng(2)
    ref_c, ref_r = -rng.uniform(0.5, 6.0, PAIRS), -rng.uniform(0.5, 6.0, PAIRS)
    e = 0.15
    plain = _trl_dpo(("sigmoid",), (1.0,), 0.2, 0.0, lp, mask, ref_c, ref_r)[0]
    swapped_lp = np.concatenate([lp[PAIRS:], lp[:PAIRS]])
    swapped_mask = np.concatenate([mask[PAIRS:], mask[:PAIRS]])
    flipped = _trl_dpo(("sigmoid",), (1.0,), 0.2, 0.0, swapped_lp, swapped_mask, ref_r, ref_c)[0]
    got = _jax_dpo(("sigmoid",), (1.0,), 0.2, e, lp, mask, ref_c, ref_r)[0]
    np.testing.assert_allclose(got, (1 - e) * plain + e * flipped, rtol=RTOL64, atol=ATOL64)


def test_reference_free_is_a_zero_reference():
    """Older TRL's `reference_free`: the reference log-probs are 0 (TRL 1.16, given zeros)."""
    mask, lp = _random_batch(4, 2 * PAIRS)
    zeros = np.zeros(PAIRS)
    want = _trl_dpo(("sigmoid",), (1.0,), 0.1, 0.0, lp, mask, zeros, zeros)[0]
    got = _jax_dpo(("sigmoid",), (1.0,), 0.1, 0.0, lp, mask, zeros, zeros)[0]
    np.testing.assert_allclose(got, want, rtol=RTOL64, atol=ATOL64)


def test_global_counts_make_micro_batches_add_up():
    """Given the mini-batch's pair and token counts, the losses of its parts sum to its loss."""
    mask, lp = _random_batch(5, 2 * PAIRS)
    seq = jnp.asarray(lp.sum(-1), jnp.float32)
    lengths = jnp.asarray(mask.sum(-1), jnp.float32)
    ref = jnp.asarray(-np.random.default_rng(6).uniform(0.5, 6.0, 2 * PAIRS), jnp.float32)
    kw = dict(loss_types=("sigmoid", "ipo", "sft"), loss_weights=(1.0, 0.5, 0.3), beta=0.2)
    c, r = slice(0, PAIRS), slice(PAIRS, None)
    whole = dpo_loss(seq[c], seq[r], ref[c], ref[r], chosen_lengths=lengths[c],
                     rejected_lengths=lengths[r], **kw)  # fmt: skip
    counts = dict(num_pairs=PAIRS, num_chosen_tokens=jnp.sum(lengths[c]))
    parts = 0.0
    for part in (slice(0, 2), slice(2, PAIRS)):
        cc = np.arange(PAIRS)[part]
        parts += dpo_loss(seq[cc], seq[cc + PAIRS], ref[cc], ref[cc + PAIRS],
                          chosen_lengths=lengths[cc], rejected_lengths=lengths[cc + PAIRS],
                          **counts, **kw)  # fmt: skip
    # float32, the same per-pair terms grouped otherwise: a mean over 6 pairs per loss, the
    # weighted sum of 3 losses and of 2 parts, all terms >= 0 (no cancellation), so the orders
    # differ by at most ~9 u = 5.4e-7 relative (u = 2^-24, Higham's bound); measured 6.8e-8.
    np.testing.assert_allclose(parts, whole, rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_equals_trl(loss_type):
    """The loss, its gradient and every metric TRL logs (the KL estimate, rewards and
    log-probs per class, margins, entropy, mean logits) equal TRL's (float64: RTOL64, ATOL64)."""
    rows = 8
    mask, lp = _random_batch(7, rows)
    kl_mask, kl_lp = _random_batch(8, rows)
    stats = _random_stats(10, lp.shape)
    rng = np.random.default_rng(9)
    ref, ref_kl = -rng.uniform(0.5, 6.0, rows), -rng.uniform(0.5, 6.0, rows) - 3.0
    labels = np.array([1, 0, 1, 1, 0, 0, 1, 0], bool)
    beta, wd, wu = 0.2, 1.3, 0.7
    token_lp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    kl_token_lp = torch.tensor(kl_lp, dtype=torch.float64)
    ids, kl_ids = (
        torch.zeros(mask.shape, dtype=torch.long),
        torch.ones(mask.shape, dtype=torch.long),
    )
    model = _Model(
        {id(ids): (token_lp, stats), id(kl_ids): (kl_token_lp, _random_stats(11, lp.shape))}
    )
    trainer = _trainer(
        model=model, beta=beta, loss_type=loss_type, desirable_weight=wd,
        undesirable_weight=wu, calculate_KL=loss_type == "kto", router_aux_loss_coef=0.0,
    )  # fmt: skip
    trainer._compute_kl_logps = types.MethodType(trl.KTOTrainer._compute_kl_logps, trainer)
    batch = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        completion_mask=torch.tensor(mask),
        KL_input_ids=kl_ids,
        KL_attention_mask=torch.ones_like(kl_ids),
        KL_completion_mask=torch.tensor(kl_mask),
        label=torch.tensor(labels),
        ref_logps=torch.tensor(ref, dtype=torch.float64),
        ref_KL_logps=torch.tensor(ref_kl, dtype=torch.float64),
    )
    want = trl.KTOTrainer._compute_loss(trainer, model, batch, False)
    want.backward()
    want = want.detach()
    grad = token_lp.grad.numpy()
    want_grad = np.array([g[m > 0][0] for g, m in zip(grad, mask[:, 1:], strict=True)])
    logged = {k: v[0] for k, v in trainer._metrics["train"].items()}

    # jaxrl's loss is a sum over rows / the row count, in any order (TRL's: chosen first)
    sums = _rows(lp, stats, mask)
    m = mask[:, 1:]
    info = {"num_rows": float(rows), "num_desirable": float(labels.sum()),
            "chosen_tokens": m[labels].sum() * 1.0, "rejected_tokens": m[~labels].sum() * 1.0,
            "trained_tokens": m.sum() * 1.0}  # fmt: skip
    spec = _spec((loss_type,), (1.0,), beta, kto=True, wd=wd, wu=wu)
    with jax.enable_x64(True):
        kl = kl_estimate(jnp.asarray(kl_lp.sum(-1)), jnp.asarray(ref_kl), jnp.ones(rows))
        info["kl"] = kl if loss_type == "kto" else jnp.zeros(())

        def loss(seq):
            rows_ = {k: jnp.asarray(v) for k, v in sums.items()} | {"log_probs": seq}
            return kto_terms(rows_, jnp.asarray(ref), jnp.asarray(labels * 1.0), info, spec=spec)

        (got, metrics), got_grad = jax.value_and_grad(loss, has_aux=True)(
            jnp.asarray(sums["log_probs"])
        )
        metrics = {k: float(v) for k, v in metrics.items()} | {"kl": float(info["kl"])}
    metrics = _kto_metrics(metrics, {"chosen": labels.sum(), "rejected": (~labels).sum()})
    np.testing.assert_allclose(float(got), float(want), rtol=RTOL64, atol=ATOL64)
    np.testing.assert_allclose(np.asarray(got_grad), want_grad, rtol=RTOL64, atol=ATOL64)
    compared = set(logged) - {"num_tokens"}  # the trainer's running count (test_offline)
    assert compared == set(metrics)
    for key in compared:
        np.testing.assert_allclose(metrics[key], logged[key], rtol=RTOL64, atol=ATOL64, err_msg=key)


def test_config_lists_the_loss_types():
    assert offline.DPO_LOSS_TYPES == preference.DPO_LOSS_TYPES
    assert offline.KTO_LOSS_TYPES == preference.KTO_LOSS_TYPES
    assert offline.SMOOTHED == preference.SMOOTHED
