"""The step's data as one pytree on the devices, from generation to the update.

    batch = RLBatch.create(prompts, prompt_mask, responses, response_mask, group_ids, layout)
    batch = batch.replace(old_log_probs=...)         # each pass fills its field
    mb = take(batch.fields(names), micro_batch, layout)   # a micro-batch, on the devices

One row per response (prompts repeated `n` times, interleaved). Every array's rows are split
over the data axes of the layout it lives in (`rows_sharding`: the `batch` rule, `dp` x `fsdp`
for the trainer; replicated over `tp` and `sp`, and where the rows do not divide), so each
device holds N / (dp x fsdp) rows of every field. A pass gathers its micro-batches' rows
out of it under `jit` (each device its rows' part, summed over the data axes: a micro-batch's
bytes cross the devices, never the whole batch); a role on other devices gets a
device-to-device copy in its own layout (`moved_to`).
A field that no pass has filled yet is None, never absent. The rows' real prompt and response
lengths ride along on the host (`prompt_lengths`, `response_lengths`, from the masks the reward
read back): the micro-batch planner's only input.

    response_mask  real response tokens: what the model attends to
    loss_mask      tokens trained on (and counted by advantages, KL and losses): the response
                   tokens the policy produced; a tool's output in a multi-turn rollout is
                   attended to but not trained on. Single-turn: equal to response_mask.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxrl.sharding.layouts import Layout
from jaxrl.sharding.processes import allgather_objects, global_array, process_rows
from jaxrl.sharding.reshard import moved
from jaxrl.trainer.microbatch import MicroBatch

PROMPT_FIELDS = ("prompts", "prompt_mask", "prompt_segment_ids", "prompt_routed_experts")
SEQUENCE_FIELDS = ("prompts", "prompt_mask", "responses", "response_mask", "loss_mask")
PACKED_FIELDS = ("prompt_segment_ids", "response_segment_ids")
ROUTE_FIELDS = ("prompt_routed_experts", "response_routed_experts")  # routing replay


@flax.struct.dataclass
class RLBatch:
    """The step's rows (N responses, P prompt and R response columns) on the devices.

    Attributes:
        prompts: Left-padded prompt ids [N, P].
        prompt_mask: 1 on prompt tokens [N, P].
        responses: Right-padded response ids [N, R].
        response_mask: 1 on response tokens (attended to) [N, R].
        loss_mask: 1 on the response tokens trained on [N, R].
        group_ids: The prompt group of every response (verl's uid), int32 [N].
        rollout_log_probs: The rollout's log-probs of its tokens [N, R].
        token_level_scores: The reward, on each response's last token [N, R].
        reward_baselines: ReMax's greedy-response reward [N].
        old_log_probs: The actor's log-probs before the update [N, R].
        sum_pi_squared: sum_v pi_v^2 of the actor's distributions at each response token,
            from the old-log-prob pass [N, R] (the optimal-token-baseline estimators).
        ref_log_probs: The reference policy's log-probs [N, R].
        teacher_log_probs: The distillation teacher's log-probs of the response tokens [N, R].
        teacher_topk_log_probs: The teacher's k largest log-probs at each response position
            [N, R, K] (the top-k distillation loss).
        teacher_topk_ids: Their token ids, int32 [N, R, K].
        values: The critic's values [N, R].
        token_level_rewards: Scores after KL in the reward [N, R].
        advantages: [N, R].
        returns: [N, R].
        rollout_is_weights: Rollout-correction importance weights [N, R].
        ref_sequence_log_probs: The reference's log-prob of each row's trained tokens, summed
            [N] (the offline preference trainers).
        labels: Per-row labels [N] (KTO: 1 desirable, 0 undesirable).
        prompt_segment_ids: Packed rows' segment ids over the prompt columns [N, P] (1, 2, ...
            per sequence of a row, 0 on padding); None: one sequence per row.
        response_segment_ids: The same over the response columns [N, R].
        prompt_routed_experts: Routing replay (a mixture of experts): the experts each prompt
            token used in each layer [N, P, L, k] (the rollout's, R3, or the old-log-prob
            pass's, R2; -1: none, the native route), which the forward passes replay.
        response_routed_experts: The same over the response columns [N, R, L, k].
        prompt_lengths: Real prompt tokens per row (host, static).
        response_lengths: Real response tokens per row (host, static).
    """

    prompts: Int[Array, "n p"]
    prompt_mask: Int[Array, "n p"]
    responses: Int[Array, "n r"]
    response_mask: Int[Array, "n r"]
    loss_mask: Int[Array, "n r"]
    group_ids: Int[Array, " n"]
    rollout_log_probs: Float[Array, "n r"] | None = None
    token_level_scores: Float[Array, "n r"] | None = None
    reward_baselines: Float[Array, " n"] | None = None
    old_log_probs: Float[Array, "n r"] | None = None
    sum_pi_squared: Float[Array, "n r"] | None = None
    ref_log_probs: Float[Array, "n r"] | None = None
    teacher_log_probs: Float[Array, "n r"] | None = None
    teacher_topk_log_probs: Float[Array, "n r k"] | None = None
    teacher_topk_ids: Int[Array, "n r k"] | None = None
    values: Float[Array, "n r"] | None = None
    token_level_rewards: Float[Array, "n r"] | None = None
    advantages: Float[Array, "n r"] | None = None
    returns: Float[Array, "n r"] | None = None
    rollout_is_weights: Float[Array, "n r"] | None = None
    ref_sequence_log_probs: Float[Array, " n"] | None = None
    labels: Float[Array, " n"] | None = None
    prompt_segment_ids: Int[Array, "n p"] | None = None
    response_segment_ids: Int[Array, "n r"] | None = None
    prompt_routed_experts: Int[Array, "n p l k"] | None = None
    response_routed_experts: Int[Array, "n r l k"] | None = None
    prompt_lengths: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    response_lengths: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

    @classmethod
    def from_host(
        cls,
        arrays: dict[str, np.ndarray],
        layout: Layout | None,
        *,
        span: tuple[int, int] | None = None,
        owners: RowOwners | None = None,
        lengths: tuple[np.ndarray, np.ndarray] | None = None,
        **device: jax.Array,
    ) -> RLBatch:
        """A batch of host arrays placed in `layout` (rows split, `rows_sharding`), with
        `device` fields already on the devices; `loss_mask` defaults to the response mask,
        `group_ids` to one group per row.

        Args:
            arrays: The global batch's rows (the same on every process), or with `span`
                this process's own rows.
            layout: The devices' layout (None: one device).
            span: (first, total): `arrays` are rows [first, first + n) of a batch of
                `total`, and this process's devices hold exactly those rows
                (`jaxrl.sharding.processes.holds_rows`): each process places its own.
            owners: `arrays` are this process's own rows, anywhere in the batch: where each
                row of the batch comes from (`place_owned`; `owned_placeable` holds).
            lengths: With `span` or `owners`: every row's (prompt, response) lengths, int
                [total] each.
        """
        n = len(arrays["responses"])
        first, total = span or (0, n)
        arrays = {"loss_mask": arrays["response_mask"], **arrays}
        arrays.setdefault("group_ids", np.arange(first, first + n))
        arrays["group_ids"] = np.asarray(arrays["group_ids"], np.int32)
        if owners is not None:
            placed = place_owned(arrays, layout, owners)
        else:
            placed = {k: place_rows(np.asarray(v), layout, total) for k, v in arrays.items()}
        if lengths is None:
            lengths = tuple(np.asarray(arrays[k]).sum(-1) for k in ("prompt_mask", "response_mask"))
        return cls(
            **placed,
            **device,
            prompt_lengths=tuple(int(x) for x in lengths[0]),
            response_lengths=tuple(int(x) for x in lengths[1]),
        )

    @property
    def num_rows(self) -> int:
        return int(self.responses.shape[0])

    def fields(self, names: Iterable[str]) -> dict[str, jax.Array]:
        """The named arrays; a field no pass has filled is an error naming it."""
        out = {}
        for name in names:
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"RLBatch.{name} is not filled yet (its pass has not run)")
            out[name] = value
        return out

    def forward_fields(self) -> tuple[str, ...]:
        """The fields a forward pass over the rows reads: the sequences, the segment ids of
        packed rows, and the routes to replay (`without_routes` for a pass that routes
        natively)."""
        packed = self.prompt_segment_ids is not None
        routed = self.prompt_routed_experts is not None
        fields = SEQUENCE_FIELDS + (PACKED_FIELDS if packed else ())
        return fields + (ROUTE_FIELDS if routed else ())

    def without_routes(self) -> RLBatch:
        """The batch without routes to replay (a pass that routes natively)."""
        return self.replace(prompt_routed_experts=None, response_routed_experts=None)

    def present(self) -> dict[str, jax.Array]:
        """Every filled array by name."""
        return {k: v for k, v in vars(self).items() if isinstance(v, jax.Array)}

    def select(self, rows: np.ndarray) -> RLBatch:
        """The batch of rows `rows` (host int [N], as many as it has, repeats allowed), in
        that order: every filled array gathered on its devices and left in its own sharding
        (one jitted gather, no host copy), the host lengths with them."""
        rows = np.asarray(rows, np.int32)
        if len(rows) != self.num_rows:
            raise ValueError(f"RLBatch.select takes {self.num_rows} rows, got {len(rows)}")
        arrays = self.present()
        first = next(iter(arrays.values())).sharding
        if isinstance(first, jax.sharding.NamedSharding):  # the indices whole on every device
            first = jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
        shardings = {k: v.sharding for k, v in arrays.items()}
        gathered = jax.jit(_select, out_shardings=shardings)(arrays, global_array(rows, first))
        return self.replace(
            **gathered,
            prompt_lengths=tuple(self.prompt_lengths[i] for i in rows),
            response_lengths=tuple(self.response_lengths[i] for i in rows),
        )

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(prompt, response) real lengths per row, host int64 [N] each."""
        prompt = np.asarray(self.prompt_lengths, np.int64)
        return prompt, np.asarray(self.response_lengths, np.int64)


def _select(arrays: dict[str, jax.Array], rows: Int[Array, " m"]) -> dict[str, jax.Array]:
    return {k: jnp.take(v, rows, axis=0) for k, v in arrays.items()}


def rows_sharding(layout: Layout, shape: tuple[int, ...]) -> jax.sharding.NamedSharding:
    """Where a batch array of `shape` ([N, ...], rows first) lives in `layout`: its rows split
    over the layout's `batch` rule (the data axes), every other dimension whole; replicated
    where N does not divide by the data shards."""
    return layout.sharding(shape, ("batch",) + (None,) * (len(shape) - 1))


def place_rows(x: np.ndarray, layout: Layout | None, total: int | None = None) -> jax.Array:
    """A host batch array on `layout`'s devices, rows split: `x` the whole array (the same on
    every process), or with `total` rows this process's own rows of an array of `total`
    (the ones its devices hold: each process places its own, nothing crosses the hosts)."""
    if layout is None:
        return jnp.asarray(x)
    if total is None or total == len(x):
        return global_array(x, rows_sharding(layout, x.shape))
    shape = (total, *x.shape[1:])
    return jax.make_array_from_process_local_data(rows_sharding(layout, shape), x, shape)


@dataclasses.dataclass(frozen=True)
class RowOwners:
    """Where each row of a batch of N comes from when every process holds some of its rows,
    any of them: row j is row `local[j]` of process `owner[j]`'s own rows (int [N] each)."""

    owner: np.ndarray
    local: np.ndarray

    @property
    def total(self) -> int:
        return len(self.owner)

    def staged(self, layout: Layout) -> int:
        """K: the rows per process of the staging array (`place_owned`): the most any
        process owns, rounded up to whole rows per data shard of a process."""
        processes = jax.process_count()
        per_process = max(layout.batch_shards() // processes, 1)
        most = int(np.bincount(self.owner, minlength=processes).max())
        return -(-max(most, 1) // per_process) * per_process

    def held(self) -> tuple[int, int]:
        """(first, count): the rows of the batch this process's devices hold once placed,
        when `owned_placeable`: its equal share, process after process."""
        count = self.total // jax.process_count()
        return jax.process_index() * count, count


def owned_placeable(layout: Layout | None, owners: RowOwners) -> bool:
    """Whether `place_owned` can place the batch with `layout`: each process's devices hold
    exactly its share of the staging array ([P x K] rows, K per process) and of the batch
    (N / P rows each). One small collective."""
    if layout is None or owners.total % jax.process_count():
        return False
    k, me = owners.staged(layout), jax.process_index()
    staging, batch = (jax.process_count() * k,), (owners.total,)
    first, count = owners.held()
    mine = process_rows(rows_sharding(layout, staging), staging) == (me * k, (me + 1) * k)
    mine &= process_rows(rows_sharding(layout, batch), batch) == (first, first + count)
    return all(allgather_objects(mine))


def place_owned(
    arrays: dict[str, np.ndarray], layout: Layout, owners: RowOwners
) -> dict[str, jax.Array]:
    """The batch of every process's own rows (`arrays`: this process's, each [n_p, ...]; the
    same keys, dtypes and widths everywhere) in `layout`, rows split: each process places its
    rows on its own devices, in a staging array of K rows per process (zeros past its n_p),
    and one jitted gather on the devices puts row j of the batch at its place (XLA moves
    each row between the devices; no row crosses a host)."""
    k = owners.staged(layout)
    staging = {}
    for name, x in arrays.items():
        x = np.asarray(x)
        padded = np.zeros((k, *x.shape[1:]), x.dtype)
        padded[: len(x)] = x
        shape = (jax.process_count() * k, *x.shape[1:])
        sharding = rows_sharding(layout, shape)
        staging[name] = jax.make_array_from_process_local_data(sharding, padded, shape)
    order = (owners.owner * k + owners.local).astype(np.int32)
    shardings = {
        name: rows_sharding(layout, (owners.total, *x.shape[1:])) for name, x in staging.items()
    }
    return jax.jit(_select, out_shardings=shardings)(staging, whole(order, layout))


def whole(x: np.ndarray, layout: Layout | None) -> jax.Array:
    """A small host array (row indices; the same on every process), whole on every device of
    `layout`."""
    if layout is None:
        return jnp.asarray(x)
    return global_array(x, layout.replicated())


def moved_to(tree: Any, layout: Layout | None) -> Any:
    """A tree of batch arrays in `layout` (rows split, `rows_sharding`): a device-to-device
    copy of each array that lives elsewhere (a role on a device group of its own, the
    rollout's layout; `jaxrl.sharding.reshard.moved`: dispatched without waiting for it),
    nothing for one that is there already."""
    if layout is None:
        return tree

    return jax.tree.map(lambda x: moved(x, rows_sharding(layout, x.shape)), tree)


def take(
    arrays: dict[str, jax.Array], mb: MicroBatch, layout: Layout | None
) -> dict[str, jax.Array]:
    """The micro-batch's rows of every array, prompts cut to their last `prompt_len` columns
    and [N, R] arrays to their first `response_len`, rows -1 all zeros; split over the
    layout's batch axes. One jitted gather on the devices, no host copy."""
    rows = np.asarray(mb.row_ids, np.int32)
    return _take(arrays, whole(rows, layout), mb.prompt_len, mb.response_len, layout)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _take(arrays, rows, prompt_len: int, response_len: int, layout: Layout | None):
    valid = rows >= 0
    idx = jnp.where(valid, rows, 0)
    out = {}
    for name, x in arrays.items():
        if name in PROMPT_FIELDS:  # columns first: the rows' gather moves only the kept ones
            x = x[:, x.shape[1] - prompt_len :]
        elif x.ndim >= 2:  # [N, R, ...]
            x = x[:, :response_len]
        x = x[idx]
        x = jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))
        if layout is not None:
            logical = ("batch",) + (None,) * (x.ndim - 1)
            x = jax.lax.with_sharding_constraint(x, layout.sharding(x.shape, logical))
        out[name] = x
    return out


def take_abstract(
    arrays: dict[str, Any], mb: MicroBatch, layout: Layout | None
) -> dict[str, jax.ShapeDtypeStruct]:
    """What `take` returns, as `jax.ShapeDtypeStruct`s in their shardings (the arrays may be
    abstract): for compiling a micro-batch's program without running anything."""
    out = {}
    for name, x in arrays.items():
        if name in PROMPT_FIELDS:
            shape = (len(mb.row_ids), mb.prompt_len, *x.shape[2:])
        elif x.ndim >= 2:
            shape = (len(mb.row_ids), mb.response_len, *x.shape[2:])
        else:
            shape = (len(mb.row_ids), *x.shape[1:])
        logical = ("batch",) + (None,) * (len(shape) - 1)
        sharding = None if layout is None else layout.sharding(shape, logical)
        out[name] = jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)
    return out


def scatter(
    parts: list[jax.Array],
    plans: list[MicroBatch],
    rows: int,
    width: int,
    layout: Layout | None,
    *,
    last_columns: bool = False,
) -> jax.Array:
    """An [rows, width, ...] array in `layout` (rows split, `rows_sharding`), holding each
    micro-batch's [m, r, ...] result at its rows and first r columns (`last_columns`: its
    last r, for prompt-shaped results; zeros elsewhere): float32, or int32 for integer
    results (token ids)."""
    first = parts[0]
    dtype = jnp.int32 if jnp.issubdtype(first.dtype, jnp.integer) else jnp.float32
    shape = (rows, width, *first.shape[2:])
    sharding = None if layout is None else rows_sharding(layout, shape)
    out = _zeros_program(shape, dtype, sharding)()  # on the devices: no host array to agree on
    for part, mb in zip(parts, plans, strict=True):
        idx = np.where(mb.row_ids >= 0, mb.row_ids, rows).astype(np.int32)  # row N: dropped
        out = _scatter(out, part, whole(idx, layout), last_columns)
    return out


@functools.cache
def _zeros_program(shape: tuple[int, ...], dtype, sharding):
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
def _scatter(out, part, idx, last_columns: bool = False):
    r = part.shape[1]
    columns = slice(out.shape[1] - r, None) if last_columns else slice(None, r)
    return out.at[idx, columns].set(part.astype(out.dtype), mode="drop")
