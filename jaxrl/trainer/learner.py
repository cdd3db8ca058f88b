"""A trained model on the mesh: PPO mini-batches x epochs, gradient accumulation over
micro-batches, and per-token inference passes (old log-probs, values).

    learner = Learner(model_config, state, optimizer, loss_fn, layout=train, grad_clip=1.0)
    metrics = learner.update(batch, mini_batch_rows=..., epochs=..., micro_rows=...)
    old_lp  = learner.infer(log_prob_fn, batch, micro_rows=...)

`batch` is a dict of host arrays: `prompts` [N, P], `prompt_mask`, `responses` [N, R],
`response_mask` and further [N, R] (or [N]) arrays. One optimizer step per mini-batch: the
micro-batches' gradients are summed (each micro-batch loss is normalised by the mini-batch's
global counts, see `losses`), clipped, and applied unless their norm is non-finite.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl.core_algos.aggregation import global_batch_info
from jaxrl.models.config import DecoderConfig
from jaxrl.sharding.layouts import Layout, use_layout
from jaxrl.trainer.microbatch import MicroBatch, plan_micro_batches, take
from jaxrl.trainer.update import UpdateState, apply_gradients, state_shardings

LossFn = Callable[..., tuple[jax.Array, dict[str, Any]]]


def to_device(arrays: dict[str, np.ndarray], layout: Layout | None) -> dict[str, jax.Array]:
    """Host rows to global arrays split over the layout's batch axes (rows of this process)."""
    if layout is None:
        return {k: jnp.asarray(v) for k, v in arrays.items()}
    out = {}
    for k, v in arrays.items():
        sharding = layout.sharding(v.shape, ("batch",) + (None,) * (v.ndim - 1))
        if jax.process_count() == 1:
            out[k] = jax.device_put(v, sharding)
        else:
            out[k] = jax.make_array_from_process_local_data(sharding, v)
    return out


def batch_shards(layout: Layout | None) -> int:
    """Devices the batch axis is split over (micro-batch rows are padded to a multiple)."""
    if layout is None:
        return 1
    spec = layout.spec((1 << 20,), ("batch",))[0]
    axes = () if spec is None else (spec if isinstance(spec, tuple) else (spec,))
    return int(np.prod([layout.mesh.shape[a] for a in axes]))


def plan(
    batch: dict[str, np.ndarray],
    rows: np.ndarray,
    layout: Layout | None,
    micro_rows: int | None,
    token_budget: int | None,
    balance: bool = False,
) -> list[MicroBatch]:
    """Micro-batches of `rows`; `micro_rows` / `token_budget` are per batch-shard device
    (verl's `*_per_gpu` keys); `balance` deals equal work to the shards."""
    return plan_micro_batches(
        rows,
        batch["prompt_mask"].sum(-1),
        batch["response_mask"].sum(-1),
        batch["prompts"].shape[1],
        batch["responses"].shape[1],
        micro_rows=micro_rows,
        token_budget=token_budget,
        shards=batch_shards(layout),
        balance=balance,
    )


SEQUENCE_FIELDS = ("prompts", "prompt_mask", "responses", "response_mask")


def infer(
    fn: Callable[[Any, dict[str, jax.Array]], Any],
    params: Any,
    batch: dict[str, np.ndarray],
    *,
    layout: Layout | None,
    micro_rows: int | None,
    token_budget: int | None,
    balance: bool = False,
) -> Any:
    """`fn(params, micro_batch) -> [m, r]` (or a tuple of them; jitted by the caller) over
    the whole batch, as host [N, R] float32 arrays (zeros past each micro-batch's trimmed
    width)."""
    n, r = batch["responses"].shape
    outs: list[np.ndarray] | None = None
    arrays = {k: batch[k] for k in SEQUENCE_FIELDS}
    single = False
    for mb in plan(batch, np.arange(n), layout, micro_rows, token_budget, balance):
        results = jax.device_get(fn(params, to_device(take(arrays, mb), layout)))
        single = not isinstance(results, tuple)
        results = (results,) if single else results
        if outs is None:
            outs = [np.zeros((n, r), np.float32) for _ in results]
        valid = mb.rows >= 0
        for out, values in zip(outs, results, strict=True):
            out[mb.rows[valid], : mb.response_len] = np.asarray(values)[valid]
    assert outs is not None, "an empty batch"
    return outs[0] if single else tuple(outs)


class Learner:
    """Parameters and optimizer state of one role in the train layout, and its update."""

    def __init__(
        self,
        config: DecoderConfig,
        state: UpdateState,
        optimizer: optax.GradientTransformation,
        loss_fn: LossFn,
        *,
        layout: Layout | None,
        grad_clip: float | None,
    ):
        self.config, self.state, self.optimizer, self.layout = config, state, optimizer, layout
        self.grad_clip = grad_clip

        def accumulate(params, acc, mb, info):
            with use_layout(layout):
                (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb, info)
            return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads), metrics

        def apply(state, grads):
            return apply_gradients(state, grads, optimizer, grad_clip)

        if layout is None:
            self._accumulate = jax.jit(accumulate, donate_argnums=1)
            self._apply = jax.jit(apply, donate_argnums=0)
            self._zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p))
        else:
            shardings = state_shardings(state, optimizer, layout, _shardings(state.params))
            grads_sh = shardings.params
            self._accumulate = jax.jit(accumulate, donate_argnums=1, out_shardings=(grads_sh, None))
            self._apply = jax.jit(apply, donate_argnums=0, out_shardings=(shardings, None))
            self._zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=grads_sh)

    @property
    def params(self) -> Any:
        return self.state.params

    def update(
        self,
        batch: dict[str, np.ndarray],
        *,
        mini_batch_rows: int,
        epochs: int,
        shuffle: bool,
        seed: int,
        micro_rows: int | None,
        token_budget: int | None,
        fields: tuple[str, ...],
        balance: bool = False,
    ) -> dict[str, float]:
        """`epochs` passes over `batch` in mini-batches of `mini_batch_rows`, one optimizer
        step each; `micro_rows` / `token_budget` are per batch-shard device (verl's
        `*_per_gpu`). Returns verl-style metrics averaged over the optimizer steps."""
        n = len(batch["responses"])
        arrays = {k: batch[k] for k in SEQUENCE_FIELDS}
        arrays.update({k: batch[k] for k in fields})
        rng = np.random.RandomState(seed)
        history: dict[str, list[float]] = defaultdict(list)
        for _ in range(epochs):
            order = rng.permutation(n) if shuffle else np.arange(n)
            for start in range(0, n, mini_batch_rows):
                rows = order[start : start + mini_batch_rows]
                info = global_batch_info(jnp.asarray(batch["response_mask"][rows], jnp.float32))
                # seq-mean-token-sum-norm's default divisor: the batch's response length, not a
                # trimmed micro-batch's (as verl's padded tensors have it)
                info["loss_scale_factor"] = batch["responses"].shape[1]
                acc = self._zeros(self.state.params)
                sums: dict[str, float] = defaultdict(float)
                weighted: dict[str, float] = defaultdict(float)
                tokens = 0.0
                for mb in plan(batch, rows, self.layout, micro_rows, token_budget, balance):
                    acc, m = self._accumulate(
                        self.state.params, acc, to_device(take(arrays, mb), self.layout), info
                    )
                    m = jax.device_get(m)
                    t = float(m["tokens"])
                    tokens += t
                    for k, v in m["sum"].items():
                        sums[k] += float(v)
                    for k, v in m["mean"].items():
                        weighted[k] += float(v) * t
                self.state, applied = self._apply(self.state, acc)
                applied = jax.device_get(applied)
                for k, v in sums.items():
                    history[k].append(v)
                for k, v in weighted.items():
                    history[k].append(v / max(tokens, 1.0))
                history["grad_norm"].append(float(applied["grad_norm"]))
                history["skipped"].append(float(applied["skipped"]))
        out = {k: float(np.mean(v)) for k, v in history.items() if k != "skipped"}
        out["skipped_steps"] = float(np.sum(history["skipped"]))
        return out


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)
