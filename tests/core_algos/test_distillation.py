"""On-policy distillation's loss (`jaxrl.core_algos.distillation`) vs verl 0.9.1's
`verl.trainer.distillation.losses.distillation_loss` (the sampled-token estimators, with and
without the policy gradient, clamped or not): the loss, its gradient in the student's
log-probs, and the metrics.

verl reads the student's and teacher's log-probs packed (no padding, position t predicting
token t + 1, `no_padding_2_padding`); the test packs the same padded rows that way."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl.core_algos.distillation as D
import jaxrl.models.outputs as OUT
from jaxrl.core_algos.kl import kl_penalty_forward
from jaxrl.testing.reference import import_reference

ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# float32 against verl's torch (DESIGN §6, simple ops), elementwise ATOL + RTOL |ref|: a few
# float32 operations and masked means over <= 35 tokens of unit-scale log-probs, ~1e-7 rounding
# of the magnitudes involved. ATOL is 1e-6, not verl_compare's 1e-5, because the gradients are
# ~1/tokens (0.04 to 0.6) and their rows are fixed by `rows`; a metric that cancels to 1e-3
# keeps ~1e-7 absolute. Measured (both XLA CPU configurations): <= 0.12 of the tolerance.
RTOL, ATOL = 1e-5, 1e-6


def rows(seed: int = 0, b: int = 5, p: int = 4, r: int = 7):
    """Padded rows: prompt lengths >= 1 (left-padded), response lengths >= 1, one response
    token masked out of the loss (a tool's output), log-probs of student, old and teacher."""
    rng = np.random.RandomState(seed)
    prompt_len = rng.randint(1, p + 1, b)
    response_len = rng.randint(1, r + 1, b)
    response_len[0] = r
    prompt_mask = (np.arange(p)[None] >= p - prompt_len[:, None]).astype(np.int64)
    response_mask = (np.arange(r)[None] < response_len[:, None]).astype(np.float32)
    loss_mask = response_mask.copy()
    loss_mask[0, 2] = 0.0
    lp = (-np.abs(rng.randn(b, r)) * 2).astype(np.float32) * response_mask
    old = (lp + 0.3 * rng.randn(b, r)).astype(np.float32) * response_mask
    teacher = (-np.abs(rng.randn(b, r)) * 2).astype(np.float32) * response_mask
    return prompt_mask, response_mask, loss_mask, lp, old, teacher


def pack(x_br: np.ndarray, prompt_mask: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """verl's unpadded model output of the rows: per sequence p + r entries, the response
    token j's value at p - 1 + j (the rest zeros)."""
    out = []
    for x, pm, rm in zip(x_br, prompt_mask, response_mask, strict=True):
        p, r = int(pm.sum()), int(rm.sum())
        seq = np.zeros(p + r, np.float32)
        seq[p - 1 : p - 1 + r] = x[:r]
        out.append(seq)
    return np.concatenate(out)


def verl_distillation(loss_cfg, rows_, agg_mode, info):
    """verl's (loss, grad wrt the student's padded log-probs, metrics)."""
    import torch

    losses = import_reference("verl.trainer.distillation.losses")
    prompt_mask, response_mask, loss_mask, lp, old, teacher = rows_
    b, p = prompt_mask.shape
    r = response_mask.shape[1]
    packed = torch.tensor(pack(lp, prompt_mask, response_mask), requires_grad=True)
    teacher_packed = torch.tensor(pack(teacher, prompt_mask, response_mask))[:, None]
    attention = np.concatenate([prompt_mask, response_mask.astype(np.int64)], axis=1)
    data = {
        "prompts": torch.ones(b, p, dtype=torch.long),
        "responses": torch.ones(b, r, dtype=torch.long),
        "attention_mask": torch.tensor(attention),
        "response_mask": torch.tensor(loss_mask),
        "old_log_probs": torch.tensor(old),
        "teacher_logprobs": teacher_packed,
        **info,
    }
    config = types.SimpleNamespace(
        loss_agg_mode=agg_mode, loss_scale_factor=None, global_batch_info={}
    )
    distill = types.SimpleNamespace(distillation_loss=loss_cfg)
    loss, metrics = losses.distillation_loss(config, distill, {"log_probs": packed}, data)
    loss.backward()
    grad = np.zeros((b, r), np.float32)
    offsets = np.cumsum(prompt_mask.sum(1) + response_mask.sum(1).astype(np.int64))
    for i in range(b):
        n = int(response_mask[i].sum())
        end = offsets[i] - 1
        grad[i, :n] = packed.grad.numpy()[end - n : end]
    plain = {k: float(v.values[0] if hasattr(v, "values") else v) for k, v in metrics.items()}
    return float(loss.detach()), grad, plain


@pytest.mark.parametrize("mode", ESTIMATORS)
@pytest.mark.parametrize("policy_gradient", [False, True])
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_loss_gradient_and_metrics_equal_verls(mode, policy_gradient, agg_mode):
    if mode == "k1" and not policy_gradient:
        pytest.skip("verl refuses k1 without the policy gradient (a config check here)")
    config_mod = import_reference("verl.workers.config")
    clamp = 0.8 if mode in ("k1", "k3") else None  # k1 can be negative: clamped both ways
    loss_cfg = config_mod.DistillationLossConfig(
        loss_mode=mode, use_policy_gradient=policy_gradient, loss_max_clamp=clamp,
        clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.3,
    )  # fmt: skip
    rows_ = rows(seed=len(mode) + 3 * policy_gradient)
    _, response_mask, loss_mask, lp, old, teacher = rows_
    info = dict(dp_size=1, batch_num_tokens=float(loss_mask.sum()),
                global_batch_size=float((loss_mask.sum(1) > 0).sum()))  # fmt: skip
    ref_loss, ref_grad, ref_metrics = verl_distillation(loss_cfg, rows_, agg_mode, info)

    def ours(lp_):
        losses = kl_penalty_forward(lp_, jnp.asarray(teacher), mode)
        loss, metrics = D.distillation_loss(
            losses, lp_, jnp.asarray(old), jnp.asarray(loss_mask), loss_cfg=loss_cfg,
            loss_agg_mode=agg_mode, info={**info, "loss_scale_factor": None},
        )  # fmt: skip
        return loss, [metrics, D.estimator_metrics(losses, jnp.asarray(loss_mask))]

    (loss, metrics), grad = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(lp))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(grad) * response_mask, ref_grad, rtol=RTOL, atol=ATOL)
    flat = {k: float(v) for m in metrics for kind in m.values() for k, v in kind.items()}
    assert set(flat) == set(ref_metrics)
    for k, v in ref_metrics.items():
        np.testing.assert_allclose(flat[k], v, rtol=RTOL, atol=ATOL, err_msg=k)


@pytest.mark.parametrize("use_task_rewards", [True, False])
@pytest.mark.parametrize("policy_gradient", [False, True])
def test_combined_with_the_policy_loss_as_verl(monkeypatch, use_task_rewards, policy_gradient):
    """verl's own `distillation_ppo_loss`, its PPO and distillation terms stubbed to 2 and 4:
    the actor's loss is `combine` of the two (ppo + coef * distill with task rewards, else
    distill alone, whichever `use_policy_gradient`)."""
    losses = import_reference("verl.trainer.distillation.losses")
    config_mod = import_reference("verl.workers.config")
    monkeypatch.setattr(losses, "ppo_loss", lambda *a, **k: (2.0, {}))
    monkeypatch.setattr(losses, "distillation_loss", lambda *a, **k: (4.0, {}))
    cfg = config_mod.DistillationLossConfig(
        loss_mode="k1" if policy_gradient else "k3", use_task_rewards=use_task_rewards,
        use_policy_gradient=policy_gradient, distillation_loss_coef=0.25,
    )  # fmt: skip
    want, _ = losses.distillation_ppo_loss(
        None, types.SimpleNamespace(distillation_loss=cfg), model_output={}, data={}
    )
    # exact: 2 + 0.25 * 4 and 4 are exact in float32 and float64
    assert float(D.combine(jnp.float32(2.0), jnp.float32(4.0), cfg)) == float(want)


def packed_logits(logits_brv, prompt_mask, response_mask) -> np.ndarray:
    """[nnz, V]: each sequence's p + r positions, response token j's logits at p - 1 + j."""
    out = []
    for x, pm, rm in zip(logits_brv, prompt_mask, response_mask, strict=True):
        p, r = int(pm.sum()), int(rm.sum())
        seq = np.zeros((p + r, x.shape[-1]), np.float32)
        seq[p - 1 : p - 1 + r] = x[:r]
        out.append(seq)
    return np.concatenate(out)


@pytest.mark.parametrize("clamp", [None, -3.0])
@pytest.mark.parametrize("policy_gradient", [False, True])
def test_forward_kl_topk_equals_verls(clamp, policy_gradient):
    """The top-k forward KL from the student's logits and the teacher's top-k: verl's
    `fsdp.losses.compute_forward_kl_topk` on the packed logits, then its registered loss and
    `distillation_loss`; the loss, its gradient in the student's logits and every metric."""
    import torch

    fsdp = import_reference("verl.trainer.distillation.fsdp.losses")
    losses_mod = import_reference("verl.trainer.distillation.losses")
    config_mod = import_reference("verl.workers.config")
    k, v = 4, 11
    loss_cfg = config_mod.DistillationLossConfig(
        loss_mode="forward_kl_topk", topk=k, use_policy_gradient=policy_gradient,
        log_prob_min_clamp=clamp, loss_max_clamp=None,
    )  # fmt: skip
    prompt_mask, response_mask, loss_mask, _, old, _ = rows(seed=7)
    b, r = response_mask.shape
    rng = np.random.RandomState(1)
    logits = (2 * rng.randn(b, r, v)).astype(np.float32)
    teacher_lp, teacher_ids = D_top_k(3 * rng.randn(b, r, v), k)
    teacher_ids[1, 0] = np.argsort(-logits[1, 0])[:k][::-1]  # a full overlap, reordered
    lengths = response_mask.sum(1).astype(int)
    info = dict(dp_size=1, batch_num_tokens=float(loss_mask.sum()),
                global_batch_size=float((loss_mask.sum(1) > 0).sum()))  # fmt: skip

    # verl: per-token terms on the packed logits, then its loss
    packed = torch.tensor(packed_logits(logits, prompt_mask, response_mask), requires_grad=True)
    t_lp = [packed_logits(teacher_lp[i : i + 1], prompt_mask[i : i + 1], response_mask[i : i + 1])
            for i in range(b)]  # fmt: skip
    t_id = [packed_logits(teacher_ids[i : i + 1].astype(np.float32), prompt_mask[i : i + 1],
                          response_mask[i : i + 1]).astype(np.int64) for i in range(b)]  # fmt: skip
    jagged = lambda xs: torch.nested.nested_tensor([torch.tensor(x) for x in xs],  # noqa: E731
                                                   layout=torch.jagged)  # fmt: skip
    out = fsdp.compute_forward_kl_topk(
        student_logits=packed[None], teacher_topk_log_probs=jagged(t_lp),
        teacher_topk_ids=jagged(t_id), config=types.SimpleNamespace(distillation_loss=loss_cfg),
        data_format="thd",
    )  # fmt: skip
    model_output = {name: x[0] for name, x in out.items()}
    student_lp = torch.log_softmax(packed, -1)  # the sampled tokens' (the policy gradient's)
    responses = rng.randint(0, v, (b, r))
    sampled = packed_logits(np.eye(v, dtype=np.float32)[responses], prompt_mask, response_mask)
    model_output["log_probs"] = (student_lp * torch.tensor(sampled)).sum(-1)
    attention = np.concatenate([prompt_mask, response_mask.astype(np.int64)], axis=1)
    data = {
        "prompts": torch.ones(b, prompt_mask.shape[1], dtype=torch.long),
        "responses": torch.ones(b, r, dtype=torch.long),
        "attention_mask": torch.tensor(attention),
        "response_mask": torch.tensor(loss_mask),
        "old_log_probs": torch.tensor(old),
        **info,
    }
    config = types.SimpleNamespace(loss_agg_mode="token-mean", loss_scale_factor=None,
                                   global_batch_info={})  # fmt: skip
    ref_loss, ref_metrics = losses_mod.distillation_loss(
        config, types.SimpleNamespace(distillation_loss=loss_cfg), model_output, data
    )
    ref_loss.backward()
    ref_grad = np.zeros((b, r, v), np.float32)
    ends = np.cumsum(prompt_mask.sum(1) + lengths) - 1
    for i in range(b):
        ref_grad[i, : lengths[i]] = packed.grad.numpy()[ends[i] - lengths[i] : ends[i]]
    plain = {n: float(m.values[0] if hasattr(m, "values") else m) for n, m in ref_metrics.items()}

    def ours(z):
        mask = jnp.asarray(loss_mask)
        student_topk = OUT.log_probs_at(z, jnp.asarray(teacher_ids))
        _, student_ids = OUT.top_k_log_probs(z, k)
        token_losses, metrics = D.forward_kl_topk(
            student_topk, jnp.asarray(teacher_lp), student_ids, jnp.asarray(teacher_ids), mask,
            log_prob_min_clamp=clamp,
        )  # fmt: skip
        lp = OUT.log_probs_from_logits(z, jnp.asarray(responses))
        loss, pg = D.distillation_loss(
            token_losses, lp, jnp.asarray(old), mask, loss_cfg=loss_cfg,
            loss_agg_mode="token-mean", info={**info, "loss_scale_factor": None},
        )  # fmt: skip
        return loss, [metrics, pg]

    (loss, metrics), grad = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(logits))
    np.testing.assert_allclose(float(loss), float(ref_loss.detach()), rtol=RTOL, atol=ATOL)
    grad = np.asarray(grad) * response_mask[..., None]  # the valid positions' gradients
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=ATOL)
    flat = {n: float(x) for m in metrics for kind in m.values() for n, x in kind.items()}
    assert set(flat) == set(plain)
    for name, value in plain.items():
        np.testing.assert_allclose(flat[name], value, rtol=RTOL, atol=ATOL, err_msg=name)
    assert 0 < plain["distillation/overlap_ratio"] < 1


def D_top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A teacher's top-k log-probs and ids (numpy), largest first."""
    z = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-z, axis=-1)[..., :k]
    return np.take_along_axis(z, ids, -1).astype(np.float32), ids.astype(np.int32)
