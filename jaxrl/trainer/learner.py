"""A trained model on the mesh: PPO mini-batches x epochs, gradient accumulation over
micro-batches, and per-token inference passes (old log-probs, values).

    learner = Learner(model_config, state, optimizer, loss_fn, layout=train, grad_clip=1.0)
    metrics = learner.update(batch, mini_batch_rows=..., epochs=..., micro_rows=...)
    pending = learner.dispatch_update(batch, ...)   # returns before the devices finish
    metrics = pending.read()                         # (`update` is these two)
    old_lp  = infer(log_prob_fn, learner.params, batch, layout=train, micro_rows=...)

`batch` is the step's `RLBatch` on the devices; micro-batches are gathered from it on the
devices (`batch.take`), and `infer`'s results come back as [N, R] arrays on the devices. One
optimizer step per mini-batch: the micro-batches' gradients are summed (each micro-batch loss
is normalised by the mini-batch's global counts, see `losses`), clipped, and applied unless
their norm is non-finite.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float

from jaxrl.core_algos.aggregation import batch_info
from jaxrl.data.batch import bucket
from jaxrl.models.config import DecoderConfig
from jaxrl.models.lora import merge
from jaxrl.sharding.layouts import Layout, placed_abstract, use_layout
from jaxrl.sharding.processes import to_host
from jaxrl.trainer.batch import RLBatch, moved_to, scatter, take, take_abstract, whole
from jaxrl.trainer.microbatch import MicroBatch, pad_to, plan_micro_batches
from jaxrl.trainer.update import UpdateState, apply_gradients, state_shardings

LossFn = Callable[..., tuple[jax.Array, dict[str, Any]]]


def batch_shards(layout: Layout | None) -> int:
    """Devices the batch axis is split over (micro-batch rows are padded to a multiple)."""
    return 1 if layout is None else layout.batch_shards()


def plan(
    batch: RLBatch,
    row_ids: np.ndarray,
    layout: Layout | None,
    micro_rows: int | None,
    token_budget: int | None,
    balance: bool = False,
) -> list[MicroBatch]:
    """Micro-batches of rows `row_ids`; `micro_rows` / `token_budget` are per batch-shard device
    (verl's `*_per_gpu` keys); `balance` deals equal work to the shards."""
    prompt_lengths, response_lengths = batch.lengths()
    return plan_micro_batches(
        row_ids,
        prompt_lengths,
        response_lengths,
        batch.prompts.shape[1],
        batch.responses.shape[1],
        micro_rows=micro_rows,
        token_budget=token_budget,
        shards=batch_shards(layout),
        balance=balance,
    )


def infer(
    fn: Callable[[Any, dict[str, jax.Array]], Any],
    params: Any,
    batch: RLBatch,
    *,
    layout: Layout | None,
    micro_rows: int | None,
    token_budget: int | None,
    balance: bool = False,
    row_ids: np.ndarray | None = None,
    prompt_outputs: int = 0,
) -> Any:
    """`fn(params, micro_batch) -> [m, r, ...]` (or a tuple of them; jitted by the caller)
    over the batch's rows `row_ids` (None: all), as [N, R, ...] arrays (float32; int32 for integer
    results) in `layout`, rows split (zeros past each micro-batch's trimmed width and on the
    rows not asked for). A subset is padded with empty rows to a bucket size (at most N), so
    subsets of varying sizes share a handful of compiled programs. The last `prompt_outputs`
    results of a tuple are prompt-shaped ([m, p, ...], placed in the last of P columns)."""
    n, r = batch.responses.shape
    arrays = moved_to(batch.fields(batch.forward_fields()), layout)
    if row_ids is None:
        row_ids = np.arange(n)
    else:
        row_ids = pad_to(np.asarray(row_ids), min(bucket(len(row_ids)), n))
    plans = plan(batch, row_ids, layout, micro_rows, token_budget, balance)
    results = [fn(params, take(arrays, mb, layout)) for mb in plans]
    single = not isinstance(results[0], tuple)
    parts = [[x] if single else list(x) for x in results]
    count, p = len(parts[0]), batch.prompts.shape[1]
    outs = [
        scatter([x[k] for x in parts], plans, n, p, layout, last_columns=True)
        if k >= count - prompt_outputs
        else scatter([x[k] for x in parts], plans, n, r, layout)
        for k in range(count)
    ]
    return outs[0] if single else tuple(outs)


@dataclasses.dataclass
class UpdateMetrics:
    """A dispatched update's metrics, on the devices until `read` (or read back with other
    arrays: `to_host(m.steps)`, then `average`).

    Attributes:
        steps: Per optimizer step, its micro-batches' metrics and the step's own (applied,
            gradient norm).
    """

    steps: list[tuple[list[dict], dict]]

    def read(self) -> dict[str, float]:
        """Wait for the update; its metrics averaged over the optimizer steps (`average`)."""
        return average(to_host(self.steps))


class Learner:
    """Parameters and optimizer state of one role in the train layout, and its update.

    With LoRA, `state.params` holds only what is trained (the adapters, and a critic's fresh
    value head) and `base` the rest (frozen): the loss sees their union, gradients and
    optimizer moments exist for the trained part alone, and the base is never copied or cast
    per step.
    """

    def __init__(
        self,
        config: DecoderConfig,
        state: UpdateState,
        optimizer: optax.GradientTransformation,
        loss_fn: LossFn,
        *,
        layout: Layout | None,
        grad_clip: float | None,
        base: Any = None,
    ):
        self.config, self.state, self.optimizer, self.layout = config, state, optimizer, layout
        self.grad_clip, self.base = grad_clip, base
        # The weights' version: optimizer steps taken (host-side; a restore sets it). The
        # rollout is published a version once (`Cluster.sync_weights`).
        self.version = 0

        def accumulate(params, acc, mb, info, base):
            info = _mini_batch_info(info)

            def loss(trained, mb, info):
                return loss_fn(trained if base is None else merge(base, trained), mb, info)

            with use_layout(layout):
                (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, mb, info)
            return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads), metrics

        def apply(state, grads):
            return apply_gradients(state, grads, optimizer, grad_clip)

        if layout is None:
            self._accumulate = jax.jit(accumulate, donate_argnums=1)
            self._apply = jax.jit(apply, donate_argnums=0)
            self._zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p))
            self._counts = jax.jit(mini_batch_counts)
        else:
            shardings = state_shardings(state, optimizer, layout, shardings_of(state.params))
            grads_sh = shardings.params
            self._accumulate = jax.jit(accumulate, donate_argnums=1, out_shardings=(grads_sh, None))
            self._apply = jax.jit(apply, donate_argnums=0, out_shardings=(shardings, None))
            self._zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=grads_sh)
            self._counts = jax.jit(mini_batch_counts, out_shardings=layout.replicated())

    @property
    def params(self) -> Any:
        """The whole model: the trained parameters (and, with LoRA, the frozen base)."""
        if self.base is None:
            return self.state.params
        return merge(self.base, self.state.params)

    def update(self, batch: RLBatch, **kwargs: Any) -> dict[str, float]:
        """`dispatch_update(batch, ...)`, waited for: its verl-style metrics, averaged over
        the optimizer steps."""
        return self.dispatch_update(batch, **kwargs).read()

    def dispatch_update(
        self,
        batch: RLBatch,
        *,
        mini_batch_rows: int,
        epochs: int,
        shuffle: bool,
        seed: int,
        micro_rows: int | None,
        token_budget: int | None,
        fields: tuple[str, ...],
        balance: bool = False,
        info: dict[str, Any] | None = None,
    ) -> UpdateMetrics:
        """`epochs` passes over `batch` in mini-batches of `mini_batch_rows`, one optimizer
        step each; `micro_rows` / `token_budget` are per batch-shard device (verl's
        `*_per_gpu`). `info` adds entries (arrays) to every micro-batch loss's `info`: global
        values of the whole batch, for an algorithm that takes one mini-batch per step (the
        offline trainers' pair counts, KTO's KL estimate). Returns once every program is
        dispatched, before the devices finish: the metrics stay on the devices until read
        (`UpdateMetrics`), so an update on another device group can run meanwhile."""
        n = batch.num_rows
        arrays = moved_to(batch.fields((*batch.forward_fields(), *fields)), self.layout)
        mini_batches = _mini_batches(n, mini_batch_rows, epochs, shuffle, seed)
        # every mini-batch's global counts, in one program (`mini_batch_counts`)
        members = whole(_membership(mini_batches, n), self.layout)
        counts = self._counts(arrays["loss_mask"], members)
        # Device metrics of every micro-batch and optimizer step, read back once at the end:
        # no host sync inside the loop.
        steps: list[tuple[list[dict], dict]] = []
        for i, row_ids in enumerate(mini_batches):
            mb_info = {**_counts_info(counts, i, arrays["loss_mask"].shape[1]), **(info or {})}
            acc = self._zeros(self.state.params)
            micro_metrics = []
            for mb in plan(batch, row_ids, self.layout, micro_rows, token_budget, balance):
                acc, m = self._accumulate(
                    self.state.params, acc, take(arrays, mb, self.layout), mb_info, self.base
                )
                micro_metrics.append(m)
            self.state, applied = self._apply(self.state, acc)
            self.version += 1
            steps.append((micro_metrics, applied))
        return UpdateMetrics(steps)

    def compile_update(
        self,
        batch: RLBatch,
        *,
        mini_batch_rows: int,
        micro_rows: int | None,
        token_budget: int | None,
        fields: tuple[str, ...],
        balance: bool = False,
        epochs: int = 1,
        shuffle: bool = False,
        seed: int = 0,
    ) -> dict[str, jax.stages.Compiled]:
        """The programs `update` (same arguments; `shuffle` and `seed` change no shape) runs
        for `batch`'s first mini-batch, compiled but not run: "micro-batch" (gradients of its
        widest micro-batch) and "optimizer" (clip and apply), for their memory analysis. The
        state and the batch may be abstract (`jax.ShapeDtypeStruct`s)."""
        arrays = batch.fields((*batch.forward_fields(), *fields))
        mini_batches = _mini_batches(batch.num_rows, mini_batch_rows, epochs, shuffle, seed)
        rows = mini_batches[0]
        plans = plan(batch, rows, self.layout, micro_rows, token_budget, balance)
        mb = take_abstract(arrays, _largest(plans), self.layout)
        grads = jax.eval_shape(self._zeros, self.state.params)
        grads = placed_abstract(grads, shardings_of(self.state.params))
        membership = jax.ShapeDtypeStruct((len(mini_batches), batch.num_rows), jnp.bool_)
        counts = jax.eval_shape(mini_batch_counts, arrays["loss_mask"], membership)
        info = _counts_info(counts, 0, arrays["loss_mask"].shape[1])
        return {
            "micro-batch": self._accumulate.lower(
                self.state.params, grads, mb, info, self.base
            ).compile(),
            "optimizer": self._apply.lower(self.state, grads).compile(),
        }


def _mini_batches(
    n: int, mini_batch_rows: int, epochs: int, shuffle: bool, seed: int
) -> list[np.ndarray]:
    """The update's mini-batches in order: `epochs` passes over rows [0, n) (each a fresh
    permutation from `seed` when `shuffle`), cut into runs of `mini_batch_rows`."""
    rng = np.random.RandomState(seed)
    orders = [rng.permutation(n) if shuffle else np.arange(n) for _ in range(epochs)]
    starts = range(0, n, mini_batch_rows)
    return [order[s : s + mini_batch_rows] for order in orders for s in starts]


def _membership(mini_batches: list[np.ndarray], n: int) -> np.ndarray:
    """bool [M, n]: whether row j is in mini-batch i."""
    member = np.zeros((len(mini_batches), n), bool)
    for i, rows in enumerate(mini_batches):
        member[i, rows] = True
    return member


def mini_batch_counts(
    loss_mask: Float[Array, "n r"], membership: Bool[Array, "m n"]
) -> dict[str, Float[Array, " m"]]:
    """Each mini-batch's global counts (`global_batch_info`): its tokens, sum of the loss mask
    over its rows, and its rows with a token. Sums of selected rows, not a matmul: exact in
    float32 on any backend (a matmul may run at reduced precision on an accelerator)."""
    tokens = jnp.sum(loss_mask.astype(jnp.float32), axis=-1)  # [n]
    return {
        "batch_num_tokens": jnp.sum(jnp.where(membership, tokens, 0.0), axis=-1),
        "global_batch_size": jnp.sum(membership & (tokens > 0), axis=-1).astype(jnp.float32),
    }


def _counts_info(counts: dict[str, Any], index: int, width: int) -> dict[str, Any]:
    """A micro-batch loss's `info` entries for mini-batch `index` of the update's `counts`,
    picked inside the jitted program (`_mini_batch_info`)."""
    # seq-mean-token-sum-norm's default divisor: the batch's response length, not a trimmed
    # micro-batch's (as verl's padded tensors have it)
    return {"mini_batch_counts": counts, "mini_batch": np.int32(index), "loss_scale_factor": width}


def _mini_batch_info(info: dict[str, Any]) -> dict[str, Any]:
    """`info` with the update's counts replaced by its mini-batch's `global_batch_info`."""
    info = dict(info)
    counts, i = info.pop("mini_batch_counts"), info.pop("mini_batch")
    own = batch_info(
        counts["batch_num_tokens"][i], counts["global_batch_size"][i], info.pop("loss_scale_factor")
    )
    return {**own, **info}


def compile_infer(
    fn: Any,
    params: Any,
    batch: RLBatch,
    *,
    layout: Layout | None,
    micro_rows: int | None,
    token_budget: int | None,
    balance: bool = False,
) -> jax.stages.Compiled:
    """The program `infer` runs for `batch`'s largest micro-batch, compiled but not run."""
    plans = plan(batch, np.arange(batch.num_rows), layout, micro_rows, token_budget, balance)
    mb = take_abstract(batch.fields(batch.forward_fields()), _largest(plans), layout)
    return fn.lower(params, mb).compile()


def _largest(plans: list[MicroBatch]) -> MicroBatch:
    """The micro-batch of the most token slots (the one a program's memory is sized by)."""
    return max(plans, key=lambda mb: len(mb.row_ids) * (mb.prompt_len + mb.response_len))


def average(steps: list[tuple[list[dict], dict]]) -> dict[str, float]:
    """verl-style update metrics: per optimizer step, loss terms summed over micro-batches
    (each is normalised by the mini-batch's global counts) and ratios token-weighted; then
    the mean over steps, and the count of skipped (non-finite) steps. A loss's `min` / `max`
    metrics are the extremes over every micro-batch of the update (verl's MIN / MAX)."""
    history: dict[str, list[float]] = defaultdict(list)
    extremes: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in ("min", "max")}
    for micro_metrics, applied in steps:
        tokens = max(sum(float(m["tokens"]) for m in micro_metrics), 1.0)
        for k in micro_metrics[0]["sum"]:
            history[k].append(sum(float(m["sum"][k]) for m in micro_metrics))
        for k in micro_metrics[0]["mean"]:
            history[k].append(
                sum(float(m["mean"][k]) * float(m["tokens"]) for m in micro_metrics) / tokens
            )
        for kind, values in extremes.items():
            for k in micro_metrics[0].get(kind, {}):
                values[k] += [float(m[kind][k]) for m in micro_metrics]
        history["grad_norm"].append(float(applied["grad_norm"]))
    out = {k: float(np.mean(v)) for k, v in history.items()}
    for kind, pick in (("min", min), ("max", max)):
        for k, values in extremes[kind].items():
            finite = [v for v in values if np.isfinite(v)]  # a micro-batch of no tokens: +-inf
            if finite:
                out[k] = float(pick(finite))
    out["skipped_steps"] = float(sum(float(a["skipped"]) for _, a in steps))
    return out


def shardings_of(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)
