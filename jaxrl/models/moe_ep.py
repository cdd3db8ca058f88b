"""Expert parallelism for the routed experts (`jaxrl.models.moe`) as pure functions: the E
experts' weights split over a mesh axis (`ep`, P devices, E/P experts each), the tokens split
over the token axes (which hold `ep`).

    y_td, dropped = experts_parallel(x_td, moe, weights_tk, experts_tk, mesh=mesh,
                                     token_axes=("dp", "fsdp", "ep"))            # exact
    y_td, dropped = experts_parallel(..., capacity_factor=1.25, valid_t=valid_t)  # all-to-all

Both compute, per token t with choices (w_j, e_j), j < k (as `experts_sorted`):

    y_t = sum_j keep_tj w_j W_down[e_j] (silu(W_gate[e_j] x_t) * W_up[e_j] x_t)

Inside `jax.shard_map`, device (i along `ep`) holds T_l = T / |token axes| tokens and the
experts [i E/P, (i+1) E/P).

Gather dispatch (`capacity_factor=None`, exact: keep = valid). The tokens, weights and choices
are all-gathered over `ep` (P T_l tokens, P T_l k pairs). Each device sorts the pairs by
expert, its own experts' pairs first and the rest after the ragged groups (masked to zero, so
they cost no gradient), runs the three grouped matmuls over its E/P experts and adds the weighted
rows back to the gathered tokens: a partial y [P T_l, D] holding its experts' share.
`psum_scatter` over `ep` sums the P shares and returns each device its own T_l rows. Nothing
is dropped; the result is `experts_sorted`'s up to the order of the float sums.

All-to-all dispatch (`capacity_factor=c`, Switch / GShard / Megatron). Each device gives each
expert at most

    C = ceil(c T_l k / E)

of its pairs, first come in token order; valid tokens only (padding takes no capacity). The
kept pair of rank r (< C) with expert e goes to slot (e, r) of a buffer [E, C, D] (empty slots
zero), seen as [P, E/P, C, D]; `all_to_all` over `ep` sends block p to device p, which receives
[P (source), E/P, C, D] for its own experts, runs them as batched einsums over its E/P
experts and sends the [P, E/P, C, D] results back with the inverse `all_to_all`. Each token
reads its kept pairs' rows and weights them: keep_tj = valid_t and rank_tj < C. A dropped
pair contributes 0 (Megatron's drop policy: the token keeps its residual path only).
`dropped` counts the valid pairs with keep 0 over all token shards.

With LoRA on the experts, each device adds its experts' low-rank updates where it runs them
(`moe.swiglu_grouped`; the adapters are split on E as the weights are).

Padding tokens (`valid_t` False) give y = 0 in both dispatches. The weighted rows are summed in
float32 (a token's k pairs lie on up to k devices) and cast to x's dtype at the end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from jaxrl.models.moe import (
    ADAPTERS,
    DOWN_ADAPTER,
    GATE_UP_ADAPTER,
    expert_adapters,
    swiglu_einsum,
    swiglu_grouped,
)

EXPERT_WEIGHTS = ("w_gate_edf", "w_up_edf", "w_down_efd")


def capacity(capacity_factor: float, tokens_local: int, top_k: int, num_experts: int) -> int:
    """C = ceil(c T_l k / E): the pairs each expert takes from one device (module doc)."""
    return max(1, math.ceil(capacity_factor * tokens_local * top_k / num_experts))


def _gather_local(x_td, moe, weights_tk, experts_tk, valid_t, *, expert_axis, lora_scale):
    """One device's gather dispatch (module doc): [T_l, D] -> ([T_l, D] float32, dropped 0)."""
    k = experts_tk.shape[1]
    local_experts = moe["w_gate_edf"].shape[0]
    x_gd = jax.lax.all_gather(x_td, expert_axis, axis=0, tiled=True)  # [P T_l, D]
    weights_gk = jax.lax.all_gather(weights_tk, expert_axis, axis=0, tiled=True)
    experts_gk = jax.lax.all_gather(experts_tk, expert_axis, axis=0, tiled=True)
    valid_g = jax.lax.all_gather(valid_t, expert_axis, axis=0, tiled=True)
    first = jax.lax.axis_index(expert_axis) * local_experts
    local_m = experts_gk.reshape(-1) - first  # [M = P T_l k] pairs, token-major
    mine_m = (local_m >= 0) & (local_m < local_experts) & jnp.repeat(valid_g, k)
    key_m = jnp.where(mine_m, local_m, local_experts)  # the other pairs after the groups
    order = jnp.argsort(key_m, stable=True)
    token = order // k
    sizes_e = jnp.bincount(key_m, length=local_experts).astype(jnp.int32)
    mine_sorted = mine_m[order][:, None]
    # Rows past the groups: zero in, zero out, so no value or gradient leaks from them
    # whatever the grouped matmul leaves there.
    xs_md = jnp.where(mine_sorted, x_gd[token], 0)
    ys_md = jnp.where(mine_sorted, swiglu_grouped(xs_md, moe, sizes_e, lora_scale), 0)
    weighted_md = ys_md.astype(jnp.float32) * weights_gk.reshape(-1)[order][:, None]
    partial_gd = jnp.zeros((x_gd.shape[0], x_gd.shape[1]), jnp.float32).at[token].add(weighted_md)
    y_td = jax.lax.psum_scatter(partial_gd, expert_axis, scatter_dimension=0, tiled=True)
    return y_td, jnp.zeros((), jnp.int32)


def _keep_and_slot(experts_tk, valid_t, num_experts: int, cap: int):
    """(keep [T_l, k], slot [T_l, k]): a pair is kept when its token is valid and fewer than
    C earlier valid pairs (token order) chose its expert; its slot is e C + rank."""
    t_local, k = experts_tk.shape
    flat_e = experts_tk.reshape(-1)
    valid_m = jnp.repeat(valid_t, k)
    key_m = jnp.where(valid_m, flat_e, num_experts)  # padding: a group of its own, last
    order = jnp.argsort(key_m, stable=True)  # token order within each expert
    sizes_e = jnp.bincount(key_m, length=num_experts + 1)
    starts_e = jnp.cumsum(sizes_e) - sizes_e
    rank_sorted = jnp.arange(flat_e.shape[0]) - starts_e[key_m[order]]
    rank_m = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    keep_m = valid_m & (rank_m < cap)
    slot_m = jnp.where(keep_m, flat_e * cap + rank_m, num_experts * cap)
    return keep_m.reshape(t_local, k), slot_m.reshape(t_local, k)


def _all_to_all_local(x_td, moe, weights_tk, experts_tk, valid_t, *, expert_axis, num_experts,
                      cap, token_axes, lora_scale):  # fmt: skip
    """One device's all-to-all dispatch with capacity C (module doc)."""
    t_local, k = experts_tk.shape
    d = x_td.shape[1]
    local_experts = moe["w_gate_edf"].shape[0]
    ep = num_experts // local_experts
    keep_tk, slot_tk = _keep_and_slot(experts_tk, valid_t, num_experts, cap)
    # slot -> token (the dump slot E C collects the dropped pairs and is cut off)
    token_tk = jnp.broadcast_to(jnp.arange(t_local)[:, None], (t_local, k))
    token_s = jnp.zeros(num_experts * cap + 1, jnp.int32).at[slot_tk].set(token_tk)
    filled_s = jnp.zeros(num_experts * cap + 1, bool).at[slot_tk].set(True)
    token_s, filled_s = token_s[:-1], filled_s[:-1]
    send_xd = jnp.where(filled_s[:, None], x_td[token_s], 0)
    send_pecd = send_xd.reshape(ep, local_experts, cap, d)
    recv_pecd = jax.lax.all_to_all(send_pecd, expert_axis, split_axis=0, concat_axis=0)
    out_pecd = swiglu_einsum(recv_pecd, moe, "pecd,edf->pecf", "pecf,efd->pecd", lora_scale)
    back_pecd = jax.lax.all_to_all(out_pecd, expert_axis, split_axis=0, concat_axis=0)
    back_sd = back_pecd.reshape(num_experts * cap, d)
    rows_tkd = back_sd[jnp.minimum(slot_tk, num_experts * cap - 1)]
    rows_tkd = jnp.where(keep_tk[..., None], rows_tkd, 0).astype(jnp.float32)
    y_td = jnp.einsum("tkd,tk->td", rows_tkd, weights_tk.astype(jnp.float32))
    dropped = jnp.sum(jnp.repeat(valid_t, k).reshape(t_local, k) & ~keep_tk, dtype=jnp.int32)
    return y_td, jax.lax.psum(dropped, token_axes)


def experts_parallel(
    x_td: Float[Array, "t d"],
    moe: dict[str, Array],
    weights_tk: Float[Array, "t k"],
    experts_tk: Int[Array, "t k"],
    *,
    mesh: Mesh,
    token_axes: Sequence[str],
    expert_axis: str = "ep",
    capacity_factor: float | None = None,
    valid_t: Bool[Array, " t"] | None = None,
    lora_scale: float | None = None,
) -> tuple[Float[Array, "t d"], Int[Array, ""]]:
    """The routed experts' weighted sum with the experts split over `expert_axis` (module doc).

    Args:
        x_td: The tokens [T, D], split over `token_axes`.
        moe: `w_gate_edf`, `w_up_edf` [E, D, F] and `w_down_efd` [E, F, D], split on E over
            `expert_axis` (other dims replicated).
        weights_tk: The k routing weights of each token [T, k] (split as x_td).
        experts_tk: The k distinct experts of each token [T, k] (split as x_td).
        mesh: The mesh holding `token_axes` and `expert_axis`.
        token_axes: The mesh axes the tokens are split over, `expert_axis` among them.
        expert_axis: The mesh axis the experts are split over (P devices, E % P == 0).
        capacity_factor: None: the exact gather dispatch; c: the all-to-all dispatch, each
            expert taking at most C = ceil(c T_l k / E) pairs from each device.
        valid_t: [T] False on padding tokens (no work, no capacity, y = 0); None: all valid.
        lora_scale: alpha/r of the experts' LoRA adapters `moe` may carry under `lora`
            (`moe.GATE_UP_ADAPTER` a [E, D, r], b [E, r, 2, F]; `moe.DOWN_ADAPTER` a [E, F, r],
            b [E, r, D]; split on E as the weights): each device adds its experts' updates
            (`moe.swiglu_grouped`); None: no adapters.

    Returns:
        (y [T, D] in x's dtype, split as x_td; the dropped valid pairs over all devices, int32,
        0 for the gather dispatch).

    Raises:
        ValueError: when `expert_axis` is not among `token_axes`, E is not divisible by its
            size, or T by the token axes' sizes.
    """
    token_axes = tuple(token_axes)
    if expert_axis not in token_axes:
        raise ValueError(
            f"expert parallelism over {expert_axis!r} needs the tokens split over it too; "
            f"token_axes={token_axes}: add {expert_axis!r}"
        )
    num_experts = moe["w_gate_edf"].shape[0]
    ep = mesh.shape[expert_axis]
    if num_experts % ep:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert axis {expert_axis!r} "
            f"of size {ep}; choose an {expert_axis} size that divides {num_experts}"
        )
    t, k = experts_tk.shape
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if t % shards:
        raise ValueError(
            f"{t} tokens cannot be split over the token axes {token_axes} ({shards} devices); "
            f"pad the tokens to a multiple of {shards}"
        )
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None: no drops)")
    if valid_t is None:
        valid_t = jnp.ones((t,), bool)

    if capacity_factor is None:
        local = _gather_local
        kwargs = {"expert_axis": expert_axis, "lora_scale": lora_scale}
    else:
        local = _all_to_all_local
        cap = capacity(capacity_factor, t // shards, k, num_experts)
        kwargs = {"expert_axis": expert_axis, "num_experts": num_experts, "cap": cap,
                  "token_axes": token_axes, "lora_scale": lora_scale}  # fmt: skip

    def run(x_td, moe, weights_tk, experts_tk, valid_t):
        y_td, dropped = local(x_td, moe, weights_tk, experts_tk, valid_t, **kwargs)
        return y_td.astype(x_td.dtype), dropped

    tokens = PartitionSpec(token_axes)
    # the weights and the experts' adapters (leading E axis), split on E
    gate_up, down = expert_adapters(moe, lora_scale)
    local_moe = {name: moe[name] for name in EXPERT_WEIGHTS}
    adapters = {key: pair for key, pair in ((GATE_UP_ADAPTER, gate_up), (DOWN_ADAPTER, down))
                if pair is not None}  # fmt: skip
    if adapters:
        local_moe[ADAPTERS] = adapters
    experts = jax.tree.map(lambda _: PartitionSpec(expert_axis), local_moe)
    sharded = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(tokens, experts, tokens, tokens, tokens),
        out_specs=(tokens, PartitionSpec()),
    )
    return sharded(x_td, local_moe, weights_tk, experts_tk, valid_t)
