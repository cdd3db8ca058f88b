"""optax optimizers and learning-rate schedules from the `*.optim` config, as verl builds them.

Schedules (step s counted from 0, W warm-up steps, S total steps, r = min_lr_ratio):

    constant:  lr * min(1, s / max(1, W))
    cosine:    warm-up as above, then lr * max(r, (1 - r)/2 * cos(2 pi c p) + (1 + r)/2),
               p = (s - W) / max(1, S - W), c = num_cycles
    linear:    warm-up as above, then lr * max(0, (S - s) / max(1, S - W))   (HF / TRL's)

W = `lr_warmup_steps`, or `lr_warmup_steps_ratio * S` (truncated) when that is -1.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import optax

from jaxrl.core_algos.common import cfg_get


def warmup_steps(optim: Any, total_steps: int) -> int:
    steps = cfg_get(optim, "lr_warmup_steps", -1)
    if steps is None or steps < 0:
        steps = int(cfg_get(optim, "lr_warmup_steps_ratio", 0.0) * total_steps)
    return steps


def learning_rate_schedule(optim: Any, total_steps: int) -> optax.Schedule:
    """The learning rate as a function of the optimizer step (verl's LambdaLR schedules)."""
    lr = cfg_get(optim, "lr")
    kind = cfg_get(optim, "lr_scheduler_type", "constant")
    total = cfg_get(optim, "total_training_steps", -1)
    total = total_steps if total is None or total < 0 else total
    warmup = warmup_steps(optim, total)
    min_ratio = cfg_get(optim, "min_lr_ratio", 0.0) or 0.0
    cycles = cfg_get(optim, "num_cycles", 0.5)
    if kind not in ("constant", "cosine", "linear"):
        raise ValueError(f"lr_scheduler_type {kind!r}; use constant, cosine or linear")

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        ramp = step / max(1.0, warmup)
        if kind == "constant":
            factor = jnp.where(step < warmup, ramp, 1.0)
        elif kind == "linear":
            factor = jnp.where(
                step < warmup, ramp, jnp.maximum(0.0, (total - step) / max(1, total - warmup))
            )
        else:
            progress = (step - warmup) / max(1, total - warmup)
            cosine = jnp.cos(math.pi * cycles * 2.0 * progress)
            decay = jnp.maximum(min_ratio, cosine * (1 - min_ratio) * 0.5 + (1 + min_ratio) * 0.5)
            factor = jnp.where(step < warmup, ramp, decay)
        return lr * factor

    return schedule


def make_optimizer(
    optim: Any, total_steps: int, updates_per_step: int = 1
) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay, as torch.optim.AdamW) or Adam with the schedule.

    The schedule advances once per RL step, as verl steps its LR scheduler after the last
    mini-batch of a step: the optimizer's k-th update (k from 0) uses
    `schedule(k // updates_per_step)`, with `updates_per_step` = mini-batches x epochs.
    Gradient clipping and the non-finite-gradient skip are done by the update step (with
    torch's `clip_grad_norm_` arithmetic), not here.
    """
    name = str(cfg_get(optim, "optimizer", "AdamW")).lower()
    b1, b2 = cfg_get(optim, "betas", (0.9, 0.999))
    eps = cfg_get(optim, "eps", 1e-8)
    per_step = learning_rate_schedule(optim, total_steps)

    def schedule(count):
        return per_step(count // updates_per_step)

    if name == "adamw":
        weight_decay = cfg_get(optim, "weight_decay", 0.01)
        return optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if name == "adam":
        return optax.adam(schedule, b1=b1, b2=b2, eps=eps)
    raise ValueError(f"optimizer {name!r}; use AdamW or Adam")
