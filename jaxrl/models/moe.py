"""The mixture-of-experts MLP as pure functions: Qwen3-MoE's and Qwen2-MoE's routed experts,
Mixtral's (issue 44, step 1: the block and its losses; not wired into the decoder yet).

    spec = MoeSpec(num_experts=8, top_k=2, router="qwen", norm_topk_prob=True)
    weights_tk, experts_tk, logits_te = route(x_td, router_de, spec)
    y_td = experts_sorted(x_td, moe, weights_tk, experts_tk)   # tokens grouped by expert
    y_td = experts_dense(x_td, moe, weights_tk, experts_tk)    # every expert on every token
    stats = jax.vmap(layer_stats, (0, None, None))(logits_lte, mask_t, spec.top_k)  # [L, E]...
    aux = load_balancing_loss(stats)  # HF's, over the MoE layers
    z = router_z_loss(stats)

Router (HF's `Qwen3MoeTopKRouter`, `MixtralTopKRouter`), per token x:

    p = softmax(x W_r) in float32;  (w, e) = top_k(p)
    qwen:    w <- w / sum(w) when `norm_topk_prob`; w cast to x's dtype
    mixtral: w <- w / sum(w) always; w stays float32

Experts (SwiGLU each): y = sum_j w_j * W_down[e_j] (silu(W_gate[e_j] x) * W_up[e_j] x).
With LoRA on the experts (PEFT's `target_parameters`), each expert's weights add their
low-rank update (alpha/r) A[e] B[e] (`swiglu_grouped`).

`experts_sorted` lays the T*k (token, choice) pairs out sorted by expert and runs each
projection as one grouped matmul over the experts' groups (`grouped_matmul`: `ragged_dot` on a
TPU, whole blocks of a group's rows elsewhere), then adds the weighted rows back to their
tokens: T*k rows of work (and a block's padding per expert), as the routed model does.
`experts_dense` runs every expert on every token and weights the outputs by a [T, E] combine
matrix: E/k times the work, the oracle the tests hold the sorted path to.

Losses (HF's `load_balancing_loss_func`; Switch Transformers' z-loss), over layers l and the
unmasked tokens t (mask 1), rows = layers x unmasked tokens:

    c_e = sum_{l,t} [e in top_k(p_lt)],  s_e = sum_{l,t} p_lte
    L_aux = E * sum_e (c_e / rows) (s_e / rows)
    L_z = sum_{l,t} logsumexp(logits_lt)^2 / rows
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

ROUTERS = ("qwen", "mixtral")
# The routed experts' LoRA adapters in the `moe` group, moe["lora"][key] = {a, b}
# (`jaxrl.models.lora`, which imports this module): HF's fused gate_up_proj and its down_proj.
ADAPTERS = "lora"
GATE_UP_ADAPTER = "w_gate_up_edf"  # a [E, D, r], b [E, r, 2, F] (b[:, :, 0] gate, 1 up)
DOWN_ADAPTER = "w_down_efd"  # a [E, F, r], b [E, r, D]


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """A sparse MLP's routing.

    Attributes:
        num_experts: E.
        top_k: k experts per token.
        router: `qwen` (Qwen2/3-MoE: renormalise only with `norm_topk_prob`, weights in the
            activations' dtype) or `mixtral` (always renormalised, weights in float32).
        norm_topk_prob: Qwen's renormalisation of the k weights to sum 1.
        capacity_factor: Under expert parallelism (a layout with an `ep` axis), each expert
            takes at most ceil(c T_l k / E) of a device's pairs and drops the rest
            (`jaxrl.models.moe_ep`); None: dropless, every pair computed.
    """

    num_experts: int
    top_k: int
    router: str = "qwen"
    norm_topk_prob: bool = False
    capacity_factor: float | None = None

    def __post_init__(self):
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(
                f"MoE capacity_factor={self.capacity_factor}: must be > 0, or null (dropless)"
            )
        if self.router not in ROUTERS:
            raise ValueError(f"MoE router {self.router!r}: one of {ROUTERS}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} experts per token of num_experts={self.num_experts}: "
                "must be in [1, num_experts]"
            )


def route(
    x_td: Float[Array, "t d"],
    router_de: Float[Array, "d e"],
    spec: MoeSpec,
    replay_tk: Int[Array, "t k"] | None = None,
) -> tuple[Float[Array, "t k"], Int[Array, "t k"], Float[Array, "t e"]]:
    """(the k weights, the k experts, the router logits) of each token (module doc).

    `replay_tk` (routing replay): the experts to use instead of the native top-k, on the
    tokens whose row is >= 0 (-1: no route recorded, the native choice). The weights are
    then the current probabilities at those experts, renormalised as the native ones are
    (verl's R2/R3: the indices are fixed, the router still gets its gradient)."""
    logits_te = x_td @ router_de.astype(x_td.dtype)
    probs_te = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    weights_tk, experts_tk = jax.lax.top_k(probs_te, spec.top_k)
    if replay_tk is not None:
        replayed_t = replay_tk[:, 0] >= 0
        experts_tk = jnp.where(replayed_t[:, None], replay_tk.astype(experts_tk.dtype), experts_tk)
        weights_tk = jnp.take_along_axis(probs_te, experts_tk, axis=-1)
    if spec.router == "mixtral" or spec.norm_topk_prob:
        weights_tk = weights_tk / weights_tk.sum(-1, keepdims=True)
    if spec.router == "qwen":
        weights_tk = weights_tk.astype(logits_te.dtype)
    return weights_tk, experts_tk, logits_te


def experts_sorted(
    x_td: Float[Array, "t d"],
    moe: dict[str, Array],
    weights_tk: Float[Array, "t k"],
    experts_tk: Int[Array, "t k"],
    *,
    lora_scale: float | None = None,
) -> Float[Array, "t d"]:
    """The routed experts' weighted sum, the (token, choice) pairs grouped by expert (module
    doc). `moe`: `w_gate_edf`, `w_up_edf` [E, D, F] and `w_down_efd` [E, F, D], and the
    experts' LoRA adapters where it carries them (`swiglu_grouped`), scaled by `lora_scale`
    (alpha/r)."""
    k = experts_tk.shape[1]
    num_experts = moe["w_gate_edf"].shape[0]
    flat_e = experts_tk.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # pair i of the sorted layout: order[i]
    token = order // k
    sizes_e = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
    xs_md = x_td[token]
    ys_md = swiglu_grouped(xs_md, moe, sizes_e, lora_scale)
    weighted_md = (ys_md * weights_tk.reshape(-1)[order][:, None]).astype(x_td.dtype)
    return jnp.zeros_like(x_td).at[token].add(weighted_md)


def experts_dense(
    x_td: Float[Array, "t d"],
    moe: dict[str, Array],
    weights_tk: Float[Array, "t k"],
    experts_tk: Int[Array, "t k"],
    *,
    lora_scale: float | None = None,
) -> Float[Array, "t d"]:
    """The same as `experts_sorted`, every expert run on every token (the oracle)."""
    num_experts = moe["w_gate_edf"].shape[0]
    dtype = x_td.dtype
    ys_etd = swiglu_einsum(x_td, moe, "td,edf->etf", "etf,efd->etd", lora_scale)
    onehot_tke = jax.nn.one_hot(experts_tk, num_experts, dtype=weights_tk.dtype)
    combine_te = jnp.einsum("tk,tke->te", weights_tk, onehot_tke)
    return jnp.einsum("etd,te->td", ys_etd, combine_te).astype(dtype)


def expert_adapters(
    moe: dict, lora_scale: float | None
) -> tuple[dict[str, Array] | None, dict[str, Array] | None]:
    """The routed experts' LoRA pairs in `moe` (`GATE_UP_ADAPTER`'s, `DOWN_ADAPTER`'s; None
    where absent).

    Raises:
        ValueError: when `moe` carries adapters but `lora_scale` is None (a config without
            `lora` for a tree with adapters).
    """
    adapters = moe.get(ADAPTERS, {})
    if adapters and lora_scale is None:
        raise ValueError(
            f"the experts carry LoRA adapters ({', '.join(adapters)}) but lora_scale is None: "
            "run them with the config that has the LoRA spec (config.lora)"
        )
    return adapters.get(GATE_UP_ADAPTER), adapters.get(DOWN_ADAPTER)


class Groups(NamedTuple):
    """Rows grouped by expert laid out for `grouped_matmul` (`group_rows`).

    Attributes:
        sizes_e: Rows of each expert, in order (rows past them belong to none).
        position_m: Each row's place in the block layout (`blocks x block` rows: each group
            padded to whole blocks); one past the end for a row of no group.
        source_p: The row at each place of the block layout; one past the rows for padding.
        expert_n: The expert of each block.
        block: Rows per block (static).
    """

    sizes_e: Int[Array, " e"]
    position_m: Int[Array, " m"]
    source_p: Int[Array, " p"]
    expert_n: Int[Array, " n"]
    block: int


def group_rows(sizes_e: Int[Array, " e"], rows: int, block: int | None = None) -> Groups:
    """The block layout of `rows` rows grouped by expert (`sizes_e`): group e padded to
    ceil(s_e / block) blocks, at most ceil(rows / block) + E blocks in all (static). `block`
    defaults to the mean group size rounded down to a power of two in [8, 256]: few padded
    rows for a decode step's handful of pairs, large matmuls for a training batch's (on 2
    CPU cores, MoE-S's 16384 x 256 x 192 projection: blocks of 256 rows 0.045 s, of 128
    0.074 s, one plain matmul of the same rows 0.030 s, `ragged_dot` 0.43 s)."""
    num_experts = sizes_e.shape[0]
    if block is None:
        mean = max(rows // num_experts, 1)
        block = min(256, max(8, 1 << (mean.bit_length() - 1)))
    blocks = -(-rows // block) + num_experts
    ends = jnp.cumsum(sizes_e)
    starts = ends - sizes_e
    padded_ends = jnp.cumsum(-(-sizes_e // block) * block)
    padded_starts = padded_ends - (-(-sizes_e // block) * block)
    r = jnp.arange(rows)
    group = jnp.searchsorted(ends, r, side="right")  # E: past the groups
    g = jnp.minimum(group, num_experts - 1)
    position = jnp.where(group < num_experts, padded_starts[g] + r - starts[g], blocks * block)
    block_starts = jnp.arange(blocks) * block
    expert = jnp.minimum(jnp.searchsorted(padded_ends, block_starts, side="right"),
                         num_experts - 1)  # fmt: skip
    place = jnp.arange(blocks * block)
    e = expert[place // block]
    offset = place - padded_starts[e]
    source = jnp.where(offset < sizes_e[e], starts[e] + offset, rows)
    return Groups(sizes_e, position, source, expert, block)


GROUPED_MATMUL_ENV = "JAXRL_GROUPED_MATMUL"  # `ragged_dot` or `blocks`: `grouped_matmul`'s


def grouped_matmul(x_mi: Array, w_eio: Array, groups: Groups) -> Array:
    """Row r of expert e's group times w_eio[e] ([M, O]; 0 for a row of no group): what
    `jax.lax.ragged_dot` computes. On a TPU it is that; XLA's CPU `ragged_dot` computes
    every expert for every row and masks (E times the work), so elsewhere the rows go to
    their block layout (`group_rows`) and each block is one matmul with its expert's
    weights: (M + E·block)·I·O multiply-adds, a [blocks, I, O] gather of the weights. The
    environment variable `JAXRL_GROUPED_MATMUL` (`ragged_dot` or `blocks`) overrides the
    choice, read when the program is traced (the GPU suite times both)."""
    w_eio = w_eio.astype(x_mi.dtype)
    method = os.environ.get(GROUPED_MATMUL_ENV) or (
        "ragged_dot" if jax.default_backend() == "tpu" else "blocks"
    )
    if method not in ("ragged_dot", "blocks"):
        raise ValueError(f"{GROUPED_MATMUL_ENV}={method!r}: use ragged_dot or blocks")
    if method == "ragged_dot":
        return jax.lax.ragged_dot(x_mi, w_eio, groups.sizes_e)
    n, b = groups.expert_n.shape[0], groups.block
    xp = jnp.take(x_mi, groups.source_p, axis=0, mode="fill", fill_value=0)
    yp = jnp.einsum("nbi,nio->nbo", xp.reshape(n, b, -1), w_eio[groups.expert_n])
    return jnp.take(yp.reshape(n * b, -1), groups.position_m, axis=0, mode="fill", fill_value=0)


def swiglu_grouped(
    xs_md: Float[Array, "m d"],
    moe: dict,
    sizes_e: Int[Array, " e"],
    lora_scale: float | None = None,
) -> Float[Array, "m d"]:
    """The experts' SwiGLU on rows grouped by expert (`sizes_e[e]` rows of expert e, in
    order; rows past the groups come out as 0). With the experts'
    adapters (`GATE_UP_ADAPTER`: A [E, D, r], B [E, r, 2, F]; `DOWN_ADAPTER`: A [E, F, r],
    B [E, r, D]) and s = `lora_scale`, row x of expert e:

        gate = x W_gate[e] + s (x A_gu[e]) B_gu[e, :, 0]
        up   = x W_up[e]   + s (x A_gu[e]) B_gu[e, :, 1]      (one x A_gu for both: HF's fused
        y    = h W_down[e] + s (h A_d[e]) B_d[e],             gate_up_proj, as PEFT adapts it)
        h    = silu(gate) * up

    each product one `grouped_matmul` over the groups (the update costs 3r(D + F) per row
    against the base's 3DF)."""
    dtype = xs_md.dtype
    groups = group_rows(sizes_e, xs_md.shape[0])

    def grouped(x_mi, w_eio):
        return grouped_matmul(x_mi, w_eio, groups)

    gate_up, down = expert_adapters(moe, lora_scale)
    gate_mf = grouped(xs_md, moe["w_gate_edf"])
    up_mf = grouped(xs_md, moe["w_up_edf"])
    if gate_up is not None:
        xa_mr = grouped(xs_md, gate_up["a"]) * jnp.asarray(lora_scale, dtype)
        gate_mf = gate_mf + grouped(xa_mr, gate_up["b"][:, :, 0])
        up_mf = up_mf + grouped(xa_mr, gate_up["b"][:, :, 1])
    h_mf = jax.nn.silu(gate_mf) * up_mf
    ys_md = grouped(h_mf, moe["w_down_efd"])
    if down is not None:
        ha_mr = grouped(h_mf, down["a"]) * jnp.asarray(lora_scale, dtype)
        ys_md = ys_md + grouped(ha_mr, down["b"])
    return ys_md


def _einsum_low_rank(x, a_eir, b_ero, scale, eq: str):
    """s (x A[e]) B[e] for the expert projection `einsum(eq, x, W)`, W [E, in, out] lettered
    `e i o` (e.g. `td,edf->etf`): `x A` takes the output's letters with r in o's place."""
    lhs, out = eq.split("->")
    x_sub, w_sub = lhs.split(",")
    e, i, o = w_sub
    mid = out.replace(o, "r")
    xa = jnp.einsum(f"{x_sub},{e}{i}r->{mid}", x, a_eir.astype(x.dtype))
    return jnp.einsum(f"{mid},{e}r{o}->{out}", xa * jnp.asarray(scale, x.dtype),
                      b_ero.astype(x.dtype))  # fmt: skip


def swiglu_einsum(x, moe: dict, eq_in: str, eq_out: str, lora_scale: float | None = None):
    """The experts' SwiGLU as batched einsums over the E experts' weights (`swiglu_grouped`'s
    formula, adapters included): `eq_in` applies W_gate and W_up ([E, D, F], e.g.
    `td,edf->etf`), `eq_out` W_down ([E, F, D], e.g. `etf,efd->etd`)."""
    dtype = x.dtype
    gate_up, down = expert_adapters(moe, lora_scale)
    gate = jnp.einsum(eq_in, x, moe["w_gate_edf"].astype(dtype))
    up = jnp.einsum(eq_in, x, moe["w_up_edf"].astype(dtype))
    if gate_up is not None:
        a, b = gate_up["a"], gate_up["b"]
        gate = gate + _einsum_low_rank(x, a, b[:, :, 0], lora_scale, eq_in)
        up = up + _einsum_low_rank(x, a, b[:, :, 1], lora_scale, eq_in)
    h = jax.nn.silu(gate) * up
    y = jnp.einsum(eq_out, h, moe["w_down_efd"].astype(dtype))
    if down is not None:
        y = y + _einsum_low_rank(h, down["a"], down["b"], lora_scale, eq_out)
    return y


class RouterStats(NamedTuple):
    """The sums the router losses need, over the unmasked tokens of one layer (shapes [E],
    [E], [], []) or stacked over the MoE layers ([L, E], [L, E], [L], [L]).

    Attributes:
        counts_e: Tokens whose native top-k holds expert e.
        prob_sums_e: The sum of the tokens' router probabilities of e (float32).
        z_sums: The sum of the tokens' logsumexp(logits)^2.
        tokens: The unmasked tokens.
        dropped: The (token, choice) pairs over an expert's capacity (`MoeSpec`), dropped.
    """

    counts_e: Float[Array, "*l e"]
    prob_sums_e: Float[Array, "*l e"]
    z_sums: Float[Array, "*l"]
    tokens: Float[Array, "*l"]
    dropped: Float[Array, "*l"]


class Routing(NamedTuple):
    """What a mixture of experts' forward reports (`transformer.hidden_states_and_router`).

    Attributes:
        stats: The router's sums per layer ([L, E] ...; the losses read them).
        routes: The experts each token used in each layer [B, T, L, k] (int32): the native
            top-k, or the replayed routes where they were given.
    """

    stats: RouterStats
    routes: Int[Array, "b t l k"]


def layer_stats(
    logits_te: Float[Array, "t e"], mask_t: Float[Array, " t"], top_k: int
) -> RouterStats:
    """One layer's `RouterStats` from its router logits; `mask_t`: 1 on the tokens that count
    (HF's flattened attention mask). The counts use the native top-k of the logits (under
    routing replay too, as verl's aux loss)."""
    num_experts = logits_te.shape[-1]
    logits_te = logits_te.astype(jnp.float32)
    probs_te = jax.nn.softmax(logits_te, axis=-1)
    _, chosen_tk = jax.lax.top_k(probs_te, top_k)
    mask_t = mask_t.astype(jnp.float32)
    chosen_te = jnp.sum(jax.nn.one_hot(chosen_tk, num_experts), axis=1)
    log_z_t = jax.nn.logsumexp(logits_te, axis=-1)
    return RouterStats(
        counts_e=mask_t @ chosen_te,
        prob_sums_e=mask_t @ probs_te,
        z_sums=jnp.sum(log_z_t**2 * mask_t),
        tokens=jnp.sum(mask_t),
        dropped=jnp.zeros((), jnp.float32),
    )


def load_balancing_loss(stats: RouterStats) -> Float[Array, ""]:
    """HF's load-balancing loss over the layers of `stats` ([L, E] sums; module doc):
    E * sum_e (c_e / rows)(s_e / rows), rows = layers x unmasked tokens. 0 when no token
    counts."""
    num_experts = stats.counts_e.shape[-1]
    rows = jnp.maximum(jnp.sum(stats.tokens), 1.0)
    counts_e = stats.counts_e.reshape(-1, num_experts).sum(0)
    sums_e = stats.prob_sums_e.reshape(-1, num_experts).sum(0)
    return num_experts * jnp.sum((counts_e / rows) * (sums_e / rows))


def router_z_loss(stats: RouterStats) -> Float[Array, ""]:
    """The mean over layers and unmasked tokens of logsumexp(logits)^2 (module doc)."""
    return jnp.sum(stats.z_sums) / jnp.maximum(jnp.sum(stats.tokens), 1.0)


def dropped_fraction(stats: RouterStats, top_k: int) -> Float[Array, ""]:
    """The share of the real tokens' (token, choice) pairs dropped over capacity."""
    return jnp.sum(stats.dropped) / jnp.maximum(jnp.sum(stats.tokens) * top_k, 1.0)


def expert_load_imbalance(stats: RouterStats) -> Float[Array, ""]:
    """max_e c_e / mean_e c_e of the layers' summed counts: 1 when balanced, E/k at worst."""
    counts_e = stats.counts_e.reshape(-1, stats.counts_e.shape[-1]).sum(0)
    return jnp.max(counts_e) / jnp.maximum(jnp.mean(counts_e), 1e-9)
