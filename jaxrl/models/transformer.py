"""The decoder forward pass as pure functions of (config, params, tokens).

    h_btd = hidden_states(config, params, input_ids_bt, attention_mask_bt)
    logits_btv = forward(config, params, input_ids_bt, attention_mask_bt)

One pre-norm block per layer, scanned over the stacked layer axis:

    x += W_o · attention(rope(W_q · rms(x)), rope(W_k · rms(x)), W_v · rms(x))
    x += W_down · (silu(W_gate · rms(x)) * (W_up · rms(x)))

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
from jaxrl.models.params import Params
from jaxrl.models.rope import apply_rope, rope_cos_sin
from jaxrl.sharding.layouts import active_layout, shard

_ACT = ("batch", "seq", None)  # block-boundary activations [B, T, D]

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def rms_norm(x: Array, w_d: Float[Array, " d"], eps: float, axis: int = -1) -> Array:
    """x / sqrt(mean(x^2) + eps) * w over `axis` (the features, D: the last axis, or axis 0
    for column-major activations [D, B]), with the statistics in float32 (as HF)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
    w_shape = [1] * x.ndim
    w_shape[axis] = -1
    return w_d.reshape(w_shape).astype(x.dtype) * y.astype(x.dtype)


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
) -> Array:
    """One pre-norm layer; `attend(q, k, v, window)` does the attention (plain or cached)."""
    a, eps = p["attn"], config.rms_norm_eps
    h = rms_norm(x_btd, p["ln_attn_d"], eps)
    q = _project(config, h, a, "w_q_dnh", "b_q_nh", "btd,dnh->btnh")
    k = _project(config, h, a, "w_k_dkh", "b_k_kh", "btd,dkh->btkh")
    v = _project(config, h, a, "w_v_dkh", "b_v_kh", "btd,dkh->btkh")
    if config.qk_norm:
        q, k = rms_norm(q, a["q_norm_h"], eps), rms_norm(k, a["k_norm_h"], eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = attend(q, k, v, window)
    x_btd = x_btd + _project(config, o, a, "w_o_nhd", "b_o_d", "btnh,nhd->btd")
    h = rms_norm(x_btd, p["ln_mlp_d"], eps)
    if config.moe is not None:
        return x_btd + _moe_mlp(config, h, p["moe"])
    return x_btd + _swiglu(config, h, p["mlp"])


def _swiglu(config: DecoderConfig, h: Array, m: Params) -> Array:
    """W_down (silu(W_gate h) * W_up h) over h's last axis (biases and LoRA where `m` has
    them): the dense MLP, and Qwen2-MoE's shared expert."""
    gate = _project(config, h, m, "w_gate_df", "b_gate_f", "...d,df->...f")
    up = _project(config, h, m, "w_up_df", "b_up_f", "...d,df->...f")
    return _project(config, jax.nn.silu(gate) * up, m, "w_down_fd", "b_down_d", "...f,fd->...d")


def _moe_mlp(config: DecoderConfig, h_btd: Array, p: Params) -> Array:
    """The mixture of experts over the [B*T] tokens (`jaxrl.models.moe`: routed, the pairs
    sorted by expert)."""
    b, t, d = h_btd.shape
    x_td = h_btd.reshape(b * t, d)
    weights_tk, experts_tk, _ = moe.route(x_td, p["router_de"], config.moe)
    y_td = moe.experts_sorted(x_td, p, weights_tk, experts_tk)
    if "shared" in p:  # Qwen2-MoE: + sigmoid(x w_g) * SwiGLU_shared(x)
        g_t1 = jax.nn.sigmoid(x_td @ p["shared_gate_d"].astype(x_td.dtype))[:, None]
        y_td = y_td + g_t1 * _swiglu(config, x_td, p["shared"])
    return y_td.reshape(b, t, d)


def hidden_states(
    config: DecoderConfig,
    params: Params,
    input_ids: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"] | None = None,
    *,
    segment_ids: Int[Array, "b t"] | None = None,
    positions: Int[Array, "b t"] | None = None,
) -> Float[Array, "b t d"]:
    """The final-normed hidden states [B, T, D] in the compute dtype.

    Args:
        config: The model.
        params: Its parameters (any float dtype; cast to `config.dtype` on use).
        input_ids: Token ids [B, T].
        attention_mask: 1 for tokens, 0 for padding (left or right); None: all tokens.
        segment_ids: Packed rows: a positive id per sequence, 0 for padding. Overrides
            `attention_mask` for masking and positions.
        positions: Explicit positions [B, T]; default derived as described in the module doc.
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
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions)
    x_btd = shard(params["embed"]["tokens_vd"][input_ids].astype(config.compute_dtype), _ACT)

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
        )

    def body(x, layer):
        p, window = layer
        return shard(_block(config, cos, sin, attend, x, p, window), _ACT), None

    if config.remat != "none":
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[config.remat], prevent_cse=False)
    windows = jnp.asarray(config.window_per_layer, jnp.int32)
    x_btd, _ = jax.lax.scan(body, x_btd, (params["layers"], windows))
    if sp > 1:
        x_btd = shard(unzigzag(x_btd, sp)[:, :t], _ACT)
    return rms_norm(x_btd, params["final_norm_d"], config.rms_norm_eps)


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
    """Logits [B, T, V] in the compute dtype from final hidden states."""
    logits = jnp.einsum("btd,dv->btv", h_btd, lm_head_weight(config, params).astype(h_btd.dtype))
    return shard(logits, ("batch", "seq", "vocab"))


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
