"""The optimizer state of a trained role and one optimizer step on it.

    state = init_state(params, optimizer, layout, param_shardings)   # moments like the params
    state, metrics = apply_gradients(state, grads, optimizer, grad_clip=1.0)

`Learner` (trainer/learner.py) jits these with the state donated and its shardings pinned
(`state_shardings`). The gradient is clipped as `torch.nn.utils.clip_grad_norm_` does (scale by
max_norm / (norm + 1e-6) when below 1); a non-finite gradient norm leaves parameters and
optimizer state unchanged and is reported as `skipped = 1`.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxrl.sharding.layouts import Layout, placed_abstract


@flax.struct.dataclass
class UpdateState:
    """Parameters, optimizer state and the number of optimizer steps taken.

    Attributes:
        params: The trained parameter tree.
        opt_state: optax state.
        step: Steps applied (skipped steps not counted).
    """

    params: Any
    opt_state: Any
    step: jax.Array


def apply_gradients(
    state: UpdateState, grads: Any, optimizer: optax.GradientTransformation, grad_clip: float | None
) -> tuple[UpdateState, dict[str, jax.Array]]:
    """Clip, update unless the norm is non-finite; returns the new state and metrics."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm)
    scale = 1.0 if grad_clip is None else jnp.minimum(1.0, grad_clip / (grad_norm + 1e-6))
    grads = jax.tree.map(lambda g: jnp.where(finite, g * scale, 0.0).astype(g.dtype), grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)

    def keep_if_finite(new, old):
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

    new_state = UpdateState(
        params=keep_if_finite(params, state.params),
        opt_state=keep_if_finite(opt_state, state.opt_state),
        step=state.step + finite.astype(state.step.dtype),
    )
    return new_state, {"grad_norm": grad_norm, "skipped": 1 - finite.astype(jnp.int32)}


def init_state(
    params: Any, optimizer: optax.GradientTransformation, layout: Layout | None, param_shardings
) -> UpdateState:
    """Optimizer state created directly in its sharding (moments like the parameters).

    Parameters given as `jax.ShapeDtypeStruct`s give an abstract state: every leaf a
    `ShapeDtypeStruct` in its sharding, nothing allocated."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        return _abstract_state(params, optimizer, layout, param_shardings)
    if layout is None:
        return UpdateState(params, optimizer.init(params), jnp.zeros((), jnp.int32))
    abstract = jax.eval_shape(optimizer.init, params)
    opt_shardings = layout.optimizer_state(optimizer, abstract, param_shardings)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), layout.replicated())
    return UpdateState(params, opt_state, step)


def _abstract_state(params, optimizer, layout: Layout | None, param_shardings) -> UpdateState:
    state = jax.eval_shape(
        lambda p: UpdateState(p, optimizer.init(p), jnp.zeros((), jnp.int32)), params
    )
    if layout is None:
        return state
    shardings = state_shardings(state, optimizer, layout, param_shardings)
    return placed_abstract(state, shardings)


def state_shardings(state: UpdateState, optimizer, layout: Layout, param_shardings) -> UpdateState:
    """The sharding tree of an `UpdateState` under `layout`."""
    abstract = jax.eval_shape(lambda s: s.opt_state, state)
    return UpdateState(
        params=param_shardings,
        opt_state=layout.optimizer_state(optimizer, abstract, param_shardings),
        step=layout.replicated(),
    )
