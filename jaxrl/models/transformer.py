"""The decoder forward pass as pure functions of (config, params, tokens).

    h_btd = hidden_states(config, params, input_ids_bt, attention_mask_bt)
    logits_btv = forward(config, params, input_ids_bt, attention_mask_bt)

One pre-norm block per layer, scanned over the stacked layer axis:

    x += W_o · attention(rope(W_q · rms(x)), rope(W_k · rms(x)), W_v · rms(x))
    x += W_down · (silu(W_gate · rms(x)) * (W_up · rms(x)))

Gemma 2 / 3 (`config.post_norms`, `norm_unit_offset`, ...) change it in place: each RMSNorm
scales by (1 + w); the attention and MLP outputs are normed before their residual adds,
x += rms(W_o · attention(...)) and x += rms(W_down · (gelu_tanh(...) * ...)); embeddings are
multiplied by sqrt(D); scores are (q·k) / sqrt(query_pre_attn_scalar), Gemma 2's capped to
c · tanh(s / c); the LM logits capped likewise (`lm_logits`); Gemma 3's sliding-window layers
rotate by their own RoPE (`rope_tables`, the table picked per layer inside the scan).

Each projection W adds its LoRA update (alpha/r)·(x A) B when the parameter tree carries an
adapter for it (`jaxrl.models.lora`); the tree without adapters is the plain model.

Positions follow verl: `cumsum(attention_mask) - 1` clipped at 0 (left or right padding), or
restarting at 0 in every segment of a packed row. Padding is its own attention segment, so real
tokens never see it.

Under a layout with `sp > 1` (and `attention_impl` auto or ring) the sequence is split over `sp`
and attention runs as a ring: the tokens, positions and segment ids are permuted into the
zigzag order once at the start (`jaxrl.kernels.ring.zigzag`) and the hidden states permuted
back at the end, so callers see natural order.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrl.kernels import attention
from jaxrl.kernels.ring import unzigzag, zigzag
from jaxrl.models import lora, moe
from jaxrl.models.config import DecoderConfig
from jaxrl.models.moe_ep import experts_parallel
from jaxrl.models.params import Params
from jaxrl.models.rope import apply_rope, rope_cos_sin
from jaxrl.sharding.layouts import active_layout, shard

_ACT = ("batch", "seq", None)  # block-boundary activations [B, T, D]

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def rms_norm(
    x: Array, w_d: Float[Array, " d"], eps: float, axis: int = -1, unit_offset: bool = False
) -> Array:
    """x / sqrt(mean(x^2) + eps) * w over `axis` (the features, D: the last axis, or axis 0
    for column-major activations [D, B]), with the statistics in float32 (as HF): the
    normalised x cast to x's dtype, then times w. With `unit_offset` (Gemma) the scale is
    (1 + w) and the product is taken in float32, then cast (Gemma's order)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
    w_shape = [1] * x.ndim
    w_shape[axis] = -1
    w = w_d.reshape(w_shape)
    if unit_offset:
        return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w.astype(x.dtype) * y.astype(x.dtype)


def norm(config: DecoderConfig, x: Array, w: Array) -> Array:
    """The model's RMSNorm of x over its last axis (`rms_norm`, (1 + w) for Gemma)."""
    return rms_norm(x, w, config.rms_norm_eps, unit_offset=config.norm_unit_offset)


def embed_tokens(config: DecoderConfig, params: Params, ids: Array) -> Array:
    """Token embeddings E[ids] in the compute dtype, times sqrt(D) rounded to that dtype
    under `config.scale_embeddings` (Gemma, whose HF model rounds it to its own dtype)."""
    x = params["embed"]["tokens_vd"][ids].astype(config.compute_dtype)
    if not config.scale_embeddings:
        return x
    return x * jnp.asarray(config.hidden_size**0.5, config.compute_dtype)


def rope_tables(
    config: DecoderConfig, positions: Int[Array, "b t"]
) -> tuple[Float[Array, "r b t h"], Float[Array, "r b t h"]]:
    """cos and sin tables of every RoPE of `config.ropes` (R = 1, or 2 with Gemma 3's
    local one) at the positions; a layer reads `layer_rope(tables, config.rope_per_layer[i])`."""
    pairs = [rope_cos_sin(r, config.head_dim, positions) for r in config.ropes]
    return jnp.stack([c for c, _ in pairs]), jnp.stack([s for _, s in pairs])


def layer_rope(
    tables: tuple[Array, Array], kind: int | Array
) -> tuple[Float[Array, "b t h"], Float[Array, "b t h"]]:
    """The (cos, sin) of RoPE `kind` from `rope_tables` (an int: picked statically; traced,
    as a scan's per-layer value: a dynamic index; one RoPE: no choice)."""
    cos, sin = tables
    if cos.shape[0] == 1:
        return cos[0], sin[0]
    return cos[kind], sin[kind]


def positions_from_mask(attention_mask: Int[Array, "b t"]) -> Int[Array, "b t"]:
    """verl's positions: `cumsum(mask) - 1`, clipped at 0."""
    return jnp.clip(jnp.cumsum(attention_mask, axis=-1) - 1, 0)


def positions_from_segments(segment_ids: Int[Array, "b t"]) -> Int[Array, "b t"]:
    """Positions restarting at 0 at the start of every segment of a packed row."""
    t = segment_ids.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(t), segment_ids.shape)
    starts = segment_ids != jnp.pad(segment_ids, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def _linear(x: Array, w: Array, b: Array | None, eq: str) -> Array:
    y = jnp.einsum(eq, x, w.astype(x.dtype))
    return y if b is None else y + b.astype(x.dtype)


def _project(config: DecoderConfig, x: Array, group: Params, weight: str, bias: str, eq: str):
    """`group[weight]` applied as `einsum(eq, ...)` plus its bias, plus the LoRA update
    (alpha/r)·(x A) B when the tree carries an adapter for it (`jaxrl.models.lora`)."""
    y = _linear(x, group[weight], group.get(bias), eq)
    pair = group.get(lora.ADAPTERS, {}).get(weight)
    return y if pair is None else y + lora.low_rank(x, pair, config.lora.scale, eq)


def _block(
    config: DecoderConfig,
    cos: Array,
    sin: Array,
    attend: Callable[[Array, Array, Array, Array], Array],
    x_btd: Array,
    p: Params,
    window: Array,
    real_t: Array | None = None,
    replay_tk: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """One pre-norm layer; `attend(q, k, v, window)` does the attention (plain or cached).
    Returns the layer's output and, for a mixture of experts, its routing: the router
    `logits_te`, the chosen `experts_tk` of the [B*T] tokens and the pairs `dropped` over
    capacity (else {}). `real_t` [B*T]: the tokens that are not padding (None: all), the
    only ones that take an expert's capacity. `replay_tk` [B*T, k]: routes to replay
    (`moe.route`)."""
    a = p["attn"]
    h = norm(config, x_btd, p["ln_attn_d"])
    q = _project(config, h, a, "w_q_dnh", "b_q_nh", "btd,dnh->btnh")
    k = _project(config, h, a, "w_k_dkh", "b_k_kh", "btd,dkh->btkh")
    v = _project(config, h, a, "w_v_dkh", "b_v_kh", "btd,dkh->btkh")
    if config.qk_norm:
        q, k = norm(config, q, a["q_norm_h"]), norm(config, k, a["k_norm_h"])
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = attend(q, k, v, window)
    o_btd = _project(config, o, a, "w_o_nhd", "b_o_d", "btnh,nhd->btd")
    if config.post_norms:
        o_btd = norm(config, o_btd, p["ln_attn_out_d"])
    x_btd = x_btd + o_btd
    h = norm(config, x_btd, p["ln_mlp_d"])
    routing = {}
    if config.moe is not None:
        y_btd, routing = _moe_mlp(config, h, p["moe"], real_t, replay_tk)
    else:
        y_btd = _swiglu(config, h, p["mlp"])
    if config.post_norms:
        y_btd = norm(config, y_btd, p["ln_mlp_out_d"])
    return x_btd + y_btd, routing


def _gelu_tanh(x: Array) -> Array:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (HF's `gelu_pytorch_tanh`)."""
    return jax.nn.gelu(x, approximate=True)


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": _gelu_tanh}


def _swiglu(config: DecoderConfig, h: Array, m: Params) -> Array:
    """W_down (act(W_gate h) * W_up h) over h's last axis (biases and LoRA where `m` has
    them), act = `config.mlp_activation` (silu: SwiGLU; gelu_tanh: Gemma's GeGLU): the dense
    MLP, and Qwen2-MoE's shared expert."""
    act = _ACTIVATIONS[config.mlp_activation]
    gate = _project(config, h, m, "w_gate_df", "b_gate_f", "...d,df->...f")
    up = _project(config, h, m, "w_up_df", "b_up_f", "...d,df->...f")
    return _project(config, act(gate) * up, m, "w_down_fd", "b_down_d", "...f,fd->...d")


def _moe_mlp(
    config: DecoderConfig,
    h_btd: Array,
    p: Params,
    real_t: Array | None,
    replay_tk: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The mixture of experts over the [B*T] tokens, and the routing (`_block`). Under a
    layout with an `ep` axis > 1 the experts run where their weights are
    (`jaxrl.models.moe_ep`: exact, or with the spec's capacity); else on every device, the
    pairs sorted by expert (`jaxrl.models.moe`)."""
    b, t, d = h_btd.shape
    x_td = h_btd.reshape(b * t, d)
    spec = config.moe
    weights_tk, experts_tk, logits_te = moe.route(x_td, p["router_de"], spec, replay_tk)
    layout = active_layout()
    lora_scale = None if config.lora is None else config.lora.scale
    dropped = jnp.zeros((), jnp.float32)
    if layout is not None and layout.mesh.shape.get("ep", 1) > 1:
        y_td, dropped = experts_parallel(
            x_td, p, weights_tk, experts_tk, mesh=layout.mesh, token_axes=_token_axes(layout),
            capacity_factor=spec.capacity_factor,
            valid_t=None if spec.capacity_factor is None else real_t, lora_scale=lora_scale,
        )  # fmt: skip
    else:
        y_td = moe.experts_sorted(x_td, p, weights_tk, experts_tk, lora_scale=lora_scale)
    if "shared" in p:  # Qwen2-MoE: + sigmoid(x w_g) * SwiGLU_shared(x)
        g_t1 = jax.nn.sigmoid(x_td @ p["shared_gate_d"].astype(x_td.dtype))[:, None]
        y_td = y_td + g_t1 * _swiglu(config, x_td, p["shared"])
    routing = {"logits_te": logits_te, "experts_tk": experts_tk, "dropped": dropped}
    return y_td.reshape(b, t, d), routing


def _token_axes(layout) -> tuple[str, ...]:
    """The mesh axes the flattened [B*T] tokens are split over: the `batch` rule's, then the
    `seq` rule's."""
    axes = []
    for name in ("batch", "seq"):
        rule = layout.rule_map.get(name)
        axes += [rule] if isinstance(rule, str) else list(rule or ())
    return tuple(a for a in axes if a in layout.mesh.shape)


def hidden_states(
    config: DecoderConfig,
    params: Params,
    input_ids: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"] | None = None,
    *,
    segment_ids: Int[Array, "b t"] | None = None,
    positions: Int[Array, "b t"] | None = None,
) -> Float[Array, "b t d"]:
    """The final-normed hidden states [B, T, D] in the compute dtype (the arguments are
    `hidden_states_and_router`'s)."""
    h, _ = hidden_states_and_router(
        config, params, input_ids, attention_mask, segment_ids=segment_ids, positions=positions
    )
    return h


def hidden_states_and_router(
    config: DecoderConfig,
    params: Params,
    input_ids: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"] | None = None,
    *,
    segment_ids: Int[Array, "b t"] | None = None,
    positions: Int[Array, "b t"] | None = None,
    routes: Int[Array, "b t l k"] | None = None,
) -> tuple[Float[Array, "b t d"], moe.Routing | None]:
    """The final-normed hidden states [B, T, D] in the compute dtype, and for a mixture of
    experts its `moe.Routing` (the router's sums over the real tokens of each layer, which
    `moe.load_balancing_loss` and `moe.router_z_loss` read, and the routes taken), else None.

    Args:
        config: The model.
        params: Its parameters (any float dtype; cast to `config.dtype` on use).
        input_ids: Token ids [B, T].
        attention_mask: 1 for tokens, 0 for padding (left or right); None: all tokens.
        segment_ids: Packed rows: a positive id per sequence, 0 for padding. Overrides
            `attention_mask` for masking and positions.
        positions: Explicit positions [B, T]; default derived as described in the module doc.
        routes: Routing replay: the experts each token must use in each layer [B, T, L, k]
            (-1 on a token: its native choice), as `Routing.routes` reports them.
    """
    if segment_ids is not None:
        segments = segment_ids
        default_positions = positions_from_segments(segment_ids)
    elif attention_mask is not None:
        segments = attention_mask.astype(jnp.int32)
        default_positions = positions_from_mask(attention_mask)
    else:
        segments = None
        default_positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
    positions = default_positions if positions is None else positions
    t = input_ids.shape[1]
    sp = _ring_size(config)
    if sp > 1:  # zigzag order for ring attention, undone on the way out
        input_ids, positions, segments = _to_zigzag(input_ids, positions, segments, sp)
        if routes is not None:
            routes = zigzag(jnp.pad(routes, ((0, 0), (0, input_ids.shape[1] - t), (0, 0), (0, 0)),
                                    constant_values=-1), sp)  # fmt: skip
    tables = rope_tables(config, positions)
    x_btd = shard(embed_tokens(config, params, input_ids), _ACT)

    windowed = any(w is not None for w in config.sliding_windows)

    def attend(q, k, v, window):
        return attention(
            q,
            k,
            v,
            causal=True,
            segment_ids=segments,
            sliding_window=window if windowed else None,
            implementation=config.attention_impl,
            layout=active_layout(),
            softmax_scale=config.softmax_scale,
            logit_softcap=config.attn_logit_softcap,
        )

    real_t = None if segments is None else (segments > 0).reshape(-1)

    def body(x, layer):
        p, window, kind, replay_tk = layer
        cos, sin = layer_rope(tables, kind)
        x, routing = _block(config, cos, sin, attend, x, p, window, real_t, replay_tk)
        if not routing:
            return shard(x, _ACT), None
        return shard(x, _ACT), (_router_stats(config, routing, real_t), routing["experts_tk"])

    if config.remat != "none":
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[config.remat], prevent_cse=False)
    windows = jnp.asarray(config.window_per_layer, jnp.int32)
    kinds = jnp.asarray(config.rope_per_layer, jnp.int32)
    replay_ltk = None
    if routes is not None:  # [B, T, L, k] -> [L, B*T, k], scanned with the layers
        b, tz = input_ids.shape
        replay_ltk = jnp.moveaxis(routes, 2, 0).reshape(config.num_layers, b * tz, -1)
    x_btd, ys = jax.lax.scan(body, x_btd, (params["layers"], windows, kinds, replay_ltk))
    routing = None
    if ys is not None:  # [L, B*T, k] -> [B, T, L, k]
        stats, routes_ltk = ys
        out = jnp.moveaxis(routes_ltk.reshape(config.num_layers, *input_ids.shape, -1), 0, 2)
        routing = moe.Routing(stats, unzigzag(out, sp)[:, :t] if sp > 1 else out)
    if sp > 1:
        x_btd = shard(unzigzag(x_btd, sp)[:, :t], _ACT)
    return norm(config, x_btd, params["final_norm_d"]), routing


def _router_stats(
    config: DecoderConfig, routing: dict[str, Array], real_t: Array | None
) -> moe.RouterStats | None:
    """One layer's router sums over the real tokens (None for a dense layer)."""
    if not routing:
        return None
    logits_te = routing["logits_te"]
    mask_t = jnp.ones(logits_te.shape[0]) if real_t is None else real_t
    stats = moe.layer_stats(logits_te, mask_t, config.moe.top_k)
    return stats._replace(dropped=routing["dropped"].astype(jnp.float32))


def _ring_size(config: DecoderConfig) -> int:
    """The `sp` axis size when attention runs as a ring over it, else 1."""
    layout = active_layout()
    sp = 1 if layout is None else layout.mesh.shape.get("sp", 1)
    return sp if sp > 1 and config.attention_impl in ("auto", "ring") else 1


def _to_zigzag(input_ids, positions, segments, sp: int):
    """Pads [B, T] to a multiple of 2·sp (padding is a segment of its own, -1) and permutes the
    tokens, their positions and segment ids into ring attention's zigzag order."""
    t = input_ids.shape[1]
    pad = -t % (2 * sp)
    if segments is None:
        segments = jnp.ones_like(input_ids, jnp.int32)
    widths = ((0, 0), (0, pad))
    input_ids = jnp.pad(input_ids, widths)
    positions = jnp.pad(positions, widths)
    segments = jnp.pad(segments.astype(jnp.int32), widths, constant_values=-1)
    return tuple(shard(zigzag(x, sp), ("batch", "seq")) for x in (input_ids, positions, segments))


def lm_head_weight(config: DecoderConfig, params: Params) -> Float[Array, "d v"]:
    """The [D, V] output projection (the embedding's transpose when tied)."""
    if config.tie_word_embeddings:
        return params["embed"]["tokens_vd"].T
    return params["lm_head_dv"]


def lm_logits(config: DecoderConfig, params: Params, h_btd: Array) -> Float[Array, "b t v"]:
    """Logits [B, T, V] in the compute dtype from final hidden states (soft-capped under
    `config.final_logit_softcap`: `final_softcap`)."""
    logits = jnp.einsum("btd,dv->btv", h_btd, lm_head_weight(config, params).astype(h_btd.dtype))
    return final_softcap(config, shard(logits, ("batch", "seq", "vocab")))


def final_softcap(config: DecoderConfig, logits: Array) -> Array:
    """c · tanh(z / c) with c = `config.final_logit_softcap` (Gemma), else z unchanged:
    every path that makes logits from hidden states ends here."""
    c = config.final_logit_softcap
    return logits if c is None else c * jnp.tanh(logits / c)


def score_head(config: DecoderConfig, params: Params, h_btd: Array) -> Float[Array, "b t c"]:
    """Classification-head outputs [B, T, C] (critic values, reward scores)."""
    s = params["score"]
    return _linear(h_btd, s["w_dc"], s.get("b_c"), "btd,dc->btc")


def forward(
    config: DecoderConfig,
    params: Params,
    input_ids: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"] | None = None,
    *,
    segment_ids: Int[Array, "b t"] | None = None,
    positions: Int[Array, "b t"] | None = None,
) -> Float[Array, "b t v"] | Float[Array, "b t c"]:
    """Logits [B, T, V] of a causal LM, or head outputs [B, T, C] of a classification model."""
    h = hidden_states(
        config, params, input_ids, attention_mask, segment_ids=segment_ids, positions=positions
    )
    if config.head == "causal_lm":
        return lm_logits(config, params, h)
    return score_head(config, params, h)
