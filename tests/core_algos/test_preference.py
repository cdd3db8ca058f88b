"""DPO variants and KTO (`jaxrl.core_algos.preference`) against TRL 1.16's own loss code.

TRL 1.16 computes its losses inline in `DPOTrainer._compute_loss` / `KTOTrainer._compute_loss`
from a model's per-token log-probs; the tests call those methods on a stand-in trainer whose
"model" returns given per-token log-probs, so TRL's own arithmetic (and its autograd) runs on
random inputs, and compare the loss, the rewards TRL logs and the gradient with respect to the
sequence log-probs with jaxrl's (1e-6).
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
from jaxrl.core_algos.preference import dpo_loss, kl_estimate, kto_loss

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

jax.config.update("jax_enable_x64", False)

PAIRS, LENGTH = 6, 7


class _Accelerator:
    device = "cpu"

    def gather(self, x):
        return x

    gather_for_metrics = gather


class _Model:
    """Returns the per-token log-probs it holds for the input ids it is called with."""

    training = True

    def __init__(self, by_input):
        self.by_input = by_input

    def __call__(self, input_ids, **kwargs):
        lp = self.by_input[id(input_ids)]
        zeros = torch.zeros_like(lp)
        return types.SimpleNamespace(
            log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
        )


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


def _trl_dpo(loss_types, weights, beta, smoothing, lp, mask, ref_c, ref_r):
    token_lp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    input_ids = torch.zeros(mask.shape, dtype=torch.long)
    model = _Model({id(input_ids): token_lp})
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


def _jax_dpo(loss_types, weights, beta, smoothing, lp, mask, ref_c, ref_r):
    seq = lp.sum(-1)
    lengths = mask.sum(-1).astype(np.float64)
    p = len(seq) // 2

    def loss(seq):
        return dpo_loss(
            seq[:p], seq[p:], jnp.asarray(ref_c), jnp.asarray(ref_r),
            loss_types=tuple(loss_types), loss_weights=tuple(weights), beta=beta,
            label_smoothing=smoothing, chosen_lengths=lengths[:p], rejected_lengths=lengths[p:],
        )  # fmt: skip

    value, grad = jax.value_and_grad(loss)(jnp.asarray(seq, jnp.float32))
    return float(value), np.asarray(grad)


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
    mask, lp = _random_batch(CASES.index((loss_types, weights, smoothing)), 2 * PAIRS)
    rng = np.random.default_rng(1)
    ref_c, ref_r = -rng.uniform(0.5, 6.0, PAIRS), -rng.uniform(0.5, 6.0, PAIRS)
    beta = 0.3
    args = (loss_types, weights, beta, smoothing, lp, mask, ref_c, ref_r)
    want, want_grad, metrics = _trl_dpo(*args)
    got, got_grad = _jax_dpo(*args)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    seq = lp.sum(-1)
    rewards_c, rewards_r = beta * (seq[:PAIRS] - ref_c), beta * (seq[PAIRS:] - ref_r)
    np.testing.assert_allclose(metrics["rewards/chosen"], rewards_c.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["rewards/rejected"], rewards_r.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["rewards/accuracies"], (rewards_c > rewards_r).mean())


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
    got, _ = _jax_dpo(("sigmoid",), (1.0,), 0.2, e, lp, mask, ref_c, ref_r)
    np.testing.assert_allclose(got, (1 - e) * plain + e * flipped, rtol=1e-6)


def test_reference_free_is_a_zero_reference():
    """Older TRL's `reference_free`: the reference log-probs are 0 (TRL 1.16, given zeros)."""
    mask, lp = _random_batch(4, 2 * PAIRS)
    zeros = np.zeros(PAIRS)
    want = _trl_dpo(("sigmoid",), (1.0,), 0.1, 0.0, lp, mask, zeros, zeros)[0]
    got, _ = _jax_dpo(("sigmoid",), (1.0,), 0.1, 0.0, lp, mask, zeros, zeros)
    np.testing.assert_allclose(got, want, rtol=1e-6)


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
    np.testing.assert_allclose(parts, whole, rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_equals_trl(loss_type):
    rows = 8
    mask, lp = _random_batch(7, rows)
    kl_mask, kl_lp = _random_batch(8, rows)
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
    model = _Model({id(ids): token_lp, id(kl_ids): kl_token_lp})
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

    # TRL orders the rows chosen first; jaxrl's loss is a mean over rows, in any order
    kl = kl_estimate(jnp.asarray(kl_lp.sum(-1)), jnp.asarray(ref_kl), jnp.ones(rows))
    if loss_type != "kto":
        kl = jnp.zeros(())

    def loss(seq):
        return kto_loss(seq, jnp.asarray(ref), jnp.asarray(labels, jnp.float32), kl,
                        loss_type=loss_type, beta=beta, desirable_weight=wd,
                        undesirable_weight=wu)  # fmt: skip

    got, got_grad = jax.value_and_grad(loss)(jnp.asarray(lp.sum(-1), jnp.float32))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got_grad), want_grad, rtol=1e-5, atol=1e-7)
    metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
    if loss_type == "kto":
        np.testing.assert_allclose(metrics["kl"], float(kl), rtol=1e-6)
    seq = lp.sum(-1)
    rewards = beta * (seq - ref)
    np.testing.assert_allclose(metrics["rewards/chosen"], rewards[labels].mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["rewards/rejected"], rewards[~labels].mean(), rtol=1e-6)


def test_config_lists_the_loss_types():
    assert offline.DPO_LOSS_TYPES == preference.DPO_LOSS_TYPES
    assert offline.KTO_LOSS_TYPES == preference.KTO_LOSS_TYPES
    assert offline.SMOOTHED == preference.SMOOTHED
