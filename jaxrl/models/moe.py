"""The mixture-of-experts MLP as pure functions: Qwen3-MoE's and Qwen2-MoE's routed experts,
Mixtral's (issue 44, step 1: the block and its losses; not wired into the decoder yet).

    spec = MoeSpec(num_experts=8, top_k=2, router="qwen", norm_topk_prob=True)
    weights_tk, experts_tk, logits_te = route(x_td, router_de, spec)
    y_td = experts_sorted(x_td, moe, weights_tk, experts_tk)   # tokens grouped by expert
    y_td = experts_dense(x_td, moe, weights_tk, experts_tk)    # every expert on every token
    aux = load_balancing_loss(logits_lte, mask_t, spec.top_k)  # HF's, over the MoE layers
    z = router_z_loss(logits_lte, mask_t)

Router (HF's `Qwen3MoeTopKRouter`, `MixtralTopKRouter`), per token x:

    p = softmax(x W_r) in float32;  (w, e) = top_k(p)
    qwen:    w <- w / sum(w) when `norm_topk_prob`; w cast to x's dtype
    mixtral: w <- w / sum(w) always; w stays float32

Experts (SwiGLU each): y = sum_j w_j * W_down[e_j] (silu(W_gate[e_j] x) * W_up[e_j] x).

`experts_sorted` lays the T*k (token, choice) pairs out sorted by expert and runs each
projection as one `jax.lax.ragged_dot` over the experts' groups, then adds the weighted rows
back to their tokens: T*k rows of work, as the routed model does. `experts_dense` runs every
expert on every token and weights the outputs by a [T, E] combine matrix: E/k times the work,
the oracle the tests hold the sorted path to.

Losses (HF's `load_balancing_loss_func`; Switch Transformers' z-loss), over layers l and the
unmasked tokens t (mask 1), rows = layers x unmasked tokens:

    c_e = sum_{l,t} [e in top_k(p_lt)],  s_e = sum_{l,t} p_lte
    L_aux = E * sum_e (c_e / rows) (s_e / rows)
    L_z = sum_{l,t} logsumexp(logits_lt)^2 / rows
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

ROUTERS = ("qwen", "mixtral")


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """A sparse MLP's routing.

    Attributes:
        num_experts: E.
        top_k: k experts per token.
        router: `qwen` (Qwen2/3-MoE: renormalise only with `norm_topk_prob`, weights in the
            activations' dtype) or `mixtral` (always renormalised, weights in float32).
        norm_topk_prob: Qwen's renormalisation of the k weights to sum 1.
    """

    num_experts: int
    top_k: int
    router: str = "qwen"
    norm_topk_prob: bool = False

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"MoE router {self.router!r}: one of {ROUTERS}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} experts per token of num_experts={self.num_experts}: "
                "must be in [1, num_experts]"
            )


def route(
    x_td: Float[Array, "t d"], router_de: Float[Array, "d e"], spec: MoeSpec
) -> tuple[Float[Array, "t k"], Int[Array, "t k"], Float[Array, "t e"]]:
    """(the k weights, the k experts, the router logits) of each token (module doc)."""
    logits_te = x_td @ router_de.astype(x_td.dtype)
    probs_te = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    weights_tk, experts_tk = jax.lax.top_k(probs_te, spec.top_k)
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
) -> Float[Array, "t d"]:
    """The routed experts' weighted sum, the (token, choice) pairs grouped by expert (module
    doc). `moe`: `w_gate_edf`, `w_up_edf` [E, D, F] and `w_down_efd` [E, F, D]."""
    k = experts_tk.shape[1]
    num_experts = moe["w_gate_edf"].shape[0]
    flat_e = experts_tk.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # pair i of the sorted layout: order[i]
    token = order // k
    sizes_e = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
    xs_md = x_td[token]
    dtype = x_td.dtype
    gate_mf = jax.lax.ragged_dot(xs_md, moe["w_gate_edf"].astype(dtype), sizes_e)
    up_mf = jax.lax.ragged_dot(xs_md, moe["w_up_edf"].astype(dtype), sizes_e)
    ys_md = jax.lax.ragged_dot(jax.nn.silu(gate_mf) * up_mf, moe["w_down_efd"].astype(dtype),
                               sizes_e)  # fmt: skip
    weighted_md = (ys_md * weights_tk.reshape(-1)[order][:, None]).astype(dtype)
    return jnp.zeros_like(x_td).at[token].add(weighted_md)


def experts_dense(
    x_td: Float[Array, "t d"],
    moe: dict[str, Array],
    weights_tk: Float[Array, "t k"],
    experts_tk: Int[Array, "t k"],
) -> Float[Array, "t d"]:
    """The same as `experts_sorted`, every expert run on every token (the oracle)."""
    num_experts = moe["w_gate_edf"].shape[0]
    dtype = x_td.dtype
    gate_etf = jnp.einsum("td,edf->etf", x_td, moe["w_gate_edf"].astype(dtype))
    up_etf = jnp.einsum("td,edf->etf", x_td, moe["w_up_edf"].astype(dtype))
    ys_etd = jnp.einsum("etf,efd->etd", jax.nn.silu(gate_etf) * up_etf,
                        moe["w_down_efd"].astype(dtype))  # fmt: skip
    onehot_tke = jax.nn.one_hot(experts_tk, num_experts, dtype=weights_tk.dtype)
    combine_te = jnp.einsum("tk,tke->te", weights_tk, onehot_tke)
    return jnp.einsum("etd,te->td", ys_etd, combine_te).astype(dtype)


def load_balancing_loss(
    logits_lte: Float[Array, "l t e"], mask_t: Float[Array, " t"], top_k: int
) -> Float[Array, ""]:
    """HF's load-balancing loss over the MoE layers' router logits (module doc); `mask_t`:
    1 on the tokens that count (HF's flattened attention mask)."""
    num_layers, _, num_experts = logits_lte.shape
    probs_lte = jax.nn.softmax(logits_lte.astype(jnp.float32), axis=-1)
    _, chosen_ltk = jax.lax.top_k(probs_lte, top_k)
    mask_t = mask_t.astype(jnp.float32)
    counts_e = jnp.einsum("ltke,t->e", jax.nn.one_hot(chosen_ltk, num_experts), mask_t)
    sums_e = jnp.einsum("lte,t->e", probs_lte, mask_t)
    rows = num_layers * mask_t.sum()
    return num_experts * jnp.sum((counts_e / rows) * (sums_e / rows))


def router_z_loss(
    logits_lte: Float[Array, "l t e"], mask_t: Float[Array, " t"]
) -> Float[Array, ""]:
    """The mean over layers and unmasked tokens of logsumexp(logits)^2 (module doc)."""
    log_z_lt = jax.nn.logsumexp(logits_lte.astype(jnp.float32), axis=-1)
    mask_t = mask_t.astype(jnp.float32)
    return jnp.sum(log_z_lt**2 * mask_t) / (logits_lte.shape[0] * mask_t.sum())
