"""Optimizer, schedules and gradient clipping equal to verl's torch setup."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl.testing.reference import import_reference
from jaxrl.trainer import learning_rate_schedule, make_optimizer
from jaxrl.trainer.update import UpdateState, apply_gradients


def optim(**kw):
    base = dict(
        optimizer="AdamW",
        lr=1e-3,
        lr_warmup_steps=-1,
        lr_warmup_steps_ratio=0.0,
        total_training_steps=-1,
        weight_decay=0.01,
        betas=(0.9, 0.999),
        eps=1e-8,
        lr_scheduler_type="constant",
        min_lr_ratio=0.0,
        num_cycles=0.5,
    )
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(lr_warmup_steps=5),
        dict(lr_warmup_steps_ratio=0.3),
        dict(lr_scheduler_type="cosine", lr_warmup_steps=3),
        dict(lr_scheduler_type="cosine", lr_warmup_steps=2, min_lr_ratio=0.1, num_cycles=0.5),
        dict(lr_scheduler_type="cosine", total_training_steps=12, min_lr_ratio=0.2),
    ],
)
def test_schedules_match_verl(kw):
    verl_f = import_reference("verl.utils.torch_functional")
    total = 20
    cfg = optim(**kw)
    ours = learning_rate_schedule(cfg, total)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=cfg.lr)
    horizon = total if cfg.total_training_steps < 0 else cfg.total_training_steps
    warmup = (
        cfg.lr_warmup_steps
        if cfg.lr_warmup_steps >= 0
        else int(cfg.lr_warmup_steps_ratio * horizon)
    )
    if cfg.lr_scheduler_type == "constant":
        sched = verl_f.get_constant_schedule_with_warmup(opt, num_warmup_steps=warmup)
    else:
        sched = verl_f.get_cosine_schedule_with_warmup(
            opt, warmup, horizon, min_lr_ratio=cfg.min_lr_ratio, num_cycles=cfg.num_cycles
        )
    for step in range(total):
        # the same formula in float32 (ours) and float64 (torch): float32 rounding, ~1e-7
        assert float(ours(step)) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-6, abs=1e-12)
        opt.step()
        sched.step()


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_optimizer_matches_torch(name):
    rng = np.random.RandomState(0)
    w0 = rng.randn(5, 3).astype(np.float32)
    grads = [rng.randn(5, 3).astype(np.float32) for _ in range(4)]
    cfg = optim(optimizer=name, lr=1e-2, weight_decay=0.1)
    tx = make_optimizer(cfg, total_steps=10)
    params = {"w": jnp.asarray(w0)}
    state = tx.init(params)
    w = torch.nn.Parameter(torch.tensor(w0))
    cls = torch.optim.AdamW if name == "AdamW" else torch.optim.Adam
    kwargs = dict(weight_decay=0.1) if name == "AdamW" else {}
    torch_opt = cls([w], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, **kwargs)
    for g in grads:
        updates, state = tx.update({"w": jnp.asarray(g)}, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        w.grad = torch.tensor(g)
        torch_opt.step()
    # N(0, 1) gradients (none near float32 noise, so Adam's g / (|g| + eps) is well
    # conditioned): the same AdamW arithmetic in optax and torch, ~1e-7 relative apart
    np.testing.assert_allclose(params["w"], w.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clipping_matches_torch(max_norm):
    rng = np.random.RandomState(1)
    grads = {"a": rng.randn(4, 3).astype(np.float32), "b": rng.randn(7).astype(np.float32)}
    tensors = [torch.nn.Parameter(torch.zeros_like(torch.tensor(g))) for g in grads.values()]
    for t, g in zip(tensors, grads.values(), strict=True):
        t.grad = torch.tensor(g)
    norm = torch.nn.utils.clip_grad_norm_(tensors, max_norm)

    class Identity:  # sees the clipped gradient as the update
        def update(self, g, s, p=None):
            return g, s

    params = jax.tree.map(jnp.zeros_like, grads)
    state = UpdateState(params, (), jnp.zeros((), jnp.int32))
    new, metrics = apply_gradients(state, grads, Identity(), max_norm)
    # one float32 norm of 19 values in two libraries: rounding only
    assert float(metrics["grad_norm"]) == pytest.approx(float(norm), rel=1e-6)
    for key, t in zip(grads, tensors, strict=True):
        # the same scaling of the same values: one float32 rounding
        np.testing.assert_allclose(new.params[key], t.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_unknown_optimizer_and_schedule():
    with pytest.raises(ValueError, match="sgd"):
        make_optimizer(optim(optimizer="SGD"), 10)
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        learning_rate_schedule(optim(lr_scheduler_type="wsd"), 10)


def test_schedule_advances_once_per_rl_step():
    """verl steps its LR scheduler after a step's last mini-batch: with 3 updates per step,
    updates 0-2 use the step-0 rate, 3-5 the step-1 rate, ... With constant gradients Adam's
    normalised step is 1, so each update is -lr (a 4-step linear warm-up here)."""
    optim = types.SimpleNamespace(
        optimizer="AdamW", lr=1.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
        lr_scheduler_type="constant", lr_warmup_steps=4, lr_warmup_steps_ratio=0.0,
        min_lr_ratio=0.0, num_cycles=0.5, total_training_steps=-1,
    )  # fmt: skip
    tx = make_optimizer(optim, total_steps=10, updates_per_step=3)
    params = {"w": jnp.zeros(())}
    state = tx.init(params)
    got = []
    for _ in range(9):
        updates, state = tx.update({"w": jnp.ones(())}, state, params)
        got.append(-float(updates["w"]))
    expected = [0.0] * 3 + [0.25] * 3 + [0.5] * 3
    # Adam with a constant gradient: m / (sqrt(v) + eps) = 1 / (1 + 1e-8) up to the float32
    # bias corrections, ~1e-7 relative
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
