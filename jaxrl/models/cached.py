"""The decoder with a KV cache: prefill prompts, then extend every row a token at a time.

    cache = init_cache(config, batch=S, length=C)
    h_btd, k_lbtkh, v_lbtkh = prefill(config, params, ids_bt, positions_bt, segments_bt)
    cache = cache.write(slots_f, k_lbtkh, v_lbtkh, segments_bt)    # prompts into slots
    weights = decode_weights(config, params)                        # once per generation
    h_bd, cache = decode_step(config, params, weights, tokens_b, positions_b, cache,
                              write_index_b, live, block)
    logits_bv = decode_logits(weights, h_bd)
    h_btd, cache = extend(config, params, ids_bt, positions_bt, cache, write_index_bt)

The cache is an explicit value (passed in, returned, donated by the caller's `jit`): one key
and one value buffer per layer plus [B, C] segment ids (1: a real key, 0: padding or not yet
written). Keys are stored transposed, [B, K, H, C], values as [B, K, C, H], so the decode
attention's two matmuls (q·k over H, p·v over C) read each buffer in place as a plain
(row-major) matmul operand; a stacked [L, ...] cache, or the [B, C, K, H] order, made XLA copy
or transpose every block it read, once per layer and step. `prefill` runs the prompts
(left-padded, rows in lockstep) through the layers and returns their keys and values;
`decode_step` advances each row by one token at its own cache index (rows at different points:
continuous batching) and reads a short cache whole, a long one only up to its live prefix
(`jaxrl.kernels.decode_attention`); `extend` appends several tokens to rows that hold some
already (a conversation's tool output). With `DecodeWeights.cpu_kernels`, each layer of the step is
one call of the C++ kernel `jaxrl.kernels.cpu_decode.layer` (same math, same cache layout; the
cache length C a multiple of 16, as the engine's caches are), and the LM head one
`cpu_decode.matmul`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrl.kernels import NO_WINDOW, attention, cpu_decode
from jaxrl.kernels.decode import decode_attention, extend_attention
from jaxrl.models.config import DecoderConfig
from jaxrl.models.params import Params
from jaxrl.models.rope import apply_rope, rope_cos_sin
from jaxrl.models.transformer import _block, rms_norm
from jaxrl.sharding.layouts import active_layout, shard

# Logical axes of one layer's key and value buffers (KV cache over batch and kv heads).
K_CACHE_AXES = ("batch", "kv_heads", "head_dim", "cache_seq")
V_CACHE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")


@flax.struct.dataclass
class KVCache:
    """Keys, values and key segment ids of every layer.

    Attributes:
        k: Per layer, keys [B, K, H, C] (transposed: C is the cache length).
        v: Per layer, values [B, K, C, H].
        segments: [B, C]: 1 where a real token's key is stored, else 0.
    """

    k: tuple[Float[Array, "b k h c"], ...]
    v: tuple[Float[Array, "b k c h"], ...]
    segments: Int[Array, "b c"]

    @property
    def length(self) -> int:
        return self.segments.shape[1]

    def constrain(self) -> KVCache:
        """The buffers constrained to the active layout (a no-op without one)."""
        return self.replace(
            k=tuple(shard(k, K_CACHE_AXES) for k in self.k),
            v=tuple(shard(v, V_CACHE_AXES) for v in self.v),
        )

    def rows(self, slots: Int[Array, " f"]) -> KVCache:
        """A copy of the rows `slots` (an id >= B reads the last row; `put_rows` drops it)."""
        i = jnp.minimum(slots, self.segments.shape[0] - 1)
        return KVCache(
            k=tuple(k[i] for k in self.k), v=tuple(v[i] for v in self.v), segments=self.segments[i]
        )

    def put_rows(self, slots: Int[Array, " f"], rows: KVCache) -> KVCache:
        """These rows (`rows(slots)`, changed) written back; an id >= B is dropped."""
        return KVCache(
            k=tuple(c.at[slots].set(r, mode="drop") for c, r in zip(self.k, rows.k, strict=True)),
            v=tuple(c.at[slots].set(r, mode="drop") for c, r in zip(self.v, rows.v, strict=True)),
            segments=self.segments.at[slots].set(rows.segments, mode="drop"),
        )

    def write(
        self,
        slots: Int[Array, " f"],
        k: Float[Array, "l f t k h"],
        v: Float[Array, "l f t k h"],
        segments: Int[Array, "f t"],
    ) -> KVCache:
        """Put F prefilled prompts (keys and values of `prefill`) at cache positions [0, T)
        of the given slots, with segment ids 0 past T (older keys there are masked); a slot
        index >= B is dropped."""
        pad = ((0, 0), (0, self.length - segments.shape[1]))
        return KVCache(
            k=tuple(
                ck.at[slots, :, :, : k.shape[2]].set(nk.transpose(0, 2, 3, 1), mode="drop")
                for ck, nk in zip(self.k, k.astype(self.k[0].dtype), strict=True)
            ),
            v=tuple(
                cv.at[slots, :, : v.shape[2]].set(nv.transpose(0, 2, 1, 3), mode="drop")
                for cv, nv in zip(self.v, v.astype(self.v[0].dtype), strict=True)
            ),
            segments=self.segments.at[slots].set(jnp.pad(segments, pad), mode="drop"),
        )


def _embed(config: DecoderConfig, params: Params, ids: Array) -> Array:
    return params["embed"]["tokens_vd"][ids].astype(config.compute_dtype)


def init_cache(config: DecoderConfig, batch: int, length: int, dtype=None) -> KVCache:
    """An empty cache for `batch` rows of up to `length` tokens (in the compute dtype)."""
    dtype = config.compute_dtype if dtype is None else dtype
    kv, h, layers = config.num_kv_heads, config.head_dim, config.num_layers
    return KVCache(
        k=tuple(jnp.zeros((batch, kv, h, length), dtype) for _ in range(layers)),
        v=tuple(jnp.zeros((batch, kv, length, h), dtype) for _ in range(layers)),
        segments=jnp.zeros((batch, length), jnp.int32),
    ).constrain()


def prefill(
    config: DecoderConfig,
    params: Params,
    input_ids: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    segments: Int[Array, "b t"],
) -> tuple[Float[Array, "b t d"], Float[Array, "l b t k h"], Float[Array, "l b t k h"]]:
    """Final-normed hidden states of left-padded prompts, and every layer's keys and values.

    Args:
        config: The model.
        params: Its parameters.
        input_ids: [B, T] prompts (left-padded).
        positions: [B, T] their positions (verl's: count of real tokens before them).
        segments: [B, T] 1 for real tokens, 0 for padding (which no real token attends to).

    Returns:
        (hidden states [B, T, D], keys [L, B, T, K, H], values [L, B, T, K, H]), keys after
        RoPE, in the compute dtype.
    """
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions)
    segments = segments.astype(jnp.int32)
    windowed = any(w is not None for w in config.sliding_windows)

    def body(x_btd, layer):
        p, window = layer
        kv = {}

        def attend(q, k, v, window):
            kv["k"], kv["v"] = k, v
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

        x_btd = _block(config, cos, sin, attend, x_btd, p, window)
        return x_btd, (kv["k"], kv["v"])

    windows = jnp.asarray(config.window_per_layer, jnp.int32)
    x = _embed(config, params, input_ids)
    x, (k, v) = jax.lax.scan(body, x, (params["layers"], windows))
    return rms_norm(x, params["final_norm_d"], config.rms_norm_eps), k, v


def extend(
    config: DecoderConfig,
    params: Params,
    tokens: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    cache: KVCache,
    write_index: Int[Array, "b t"],
) -> tuple[Float[Array, "b t d"], KVCache]:
    """Append T tokens per row to the cache: each token's keys and values go to its own cache
    index, and its query attends to the row's cache up to that index (the tokens before it,
    appended now or earlier). A conversation's appended tool output takes this path: a
    prefill that continues a row instead of starting it.

    Args:
        config: The model.
        params: Its parameters.
        tokens: [B, T] the new tokens (rows may append fewer: see `write_index`).
        positions: [B, T] their positions.
        cache: The cache (rows hold their earlier tokens below `write_index[:, 0]`).
        write_index: [B, T] cache index of each token, consecutive in a row; an index >= the
            cache length marks a padding token (not written, its output meaningless).

    Returns:
        (final-normed hidden states [B, T, D], the updated cache).
    """
    b = tokens.shape[0]
    rows = jnp.arange(b)[:, None]
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions)
    segments = cache.segments.at[rows, write_index].set(1, mode="drop")
    kv_valid = segments > 0
    ks, vs = list(cache.k), list(cache.v)
    windows = config.window_per_layer
    x = _embed(config, params, tokens)
    for i in range(config.num_layers):
        window = None if windows[i] >= NO_WINDOW else windows[i]

        def attend(q, k, v, _window, i=i, window=window):
            # [B, T, K, H] into row b's columns write_index[b, :] of the layer's buffers
            ks[i] = ks[i].at[rows, :, :, write_index].set(k.astype(ks[i].dtype), mode="drop")
            vs[i] = vs[i].at[rows, :, write_index].set(v.astype(vs[i].dtype), mode="drop")
            return extend_attention(q, ks[i], vs[i], kv_valid, write_index, sliding_window=window)

        layer = jax.tree.map(lambda w, i=i: w[i], params["layers"])
        x = _block(config, cos, sin, attend, x, layer, windows[i])
    h = rms_norm(x, params["final_norm_d"], config.rms_norm_eps)
    return h, KVCache(k=tuple(ks), v=tuple(vs), segments=segments).constrain()


@flax.struct.dataclass
class DecodeWeights:
    """The weights as the decode step reads them: built once per `generate` call.

    A decode step multiplies a handful of rows (one token per slot) by every weight, so it is
    bound by reading the weights, and on the CPU by how well the matmul kernel streams them.
    The step therefore carries its activations column-major, x [D, B], and multiplies each
    weight in the output-major [out, in] orientation, y_ob = W_od x_db (PyTorch's own layout
    of a linear layer): a [F, D] x [D, B] product with the long dimension first streams the
    weight ~20% faster than [B, D] x [D, F] on 2 CPU cores (measured on the workload model M's
    shapes: 12.0 vs 14.9 ms for all its matmuls in a step).

    The layers are unstacked: the parameter tree stacks them ([L, ...] arrays for
    `lax.scan`), and slicing a weight out of its stack inside the loop is a copy per step on
    the CPU; here each layer's weights are whole arrays, transposed and cast to the compute
    dtype once (a second copy of the layer weights for the call: 90 MiB for model M in
    float32, 1.3 GiB for model L). The LM head is [V, D]: for tied embeddings the embedding
    table itself, with no copy.

    With `cpu_kernels` (float32 on one CPU device, `jaxrl.kernels.cpu_decode.enabled`), the
    step runs as the C++ kernels of `jaxrl.kernels.cpu_decode`, which read the same [out, in]
    weights cut into panels of 16 rows (`cpu_decode.panels`): the LM head always (a panel
    copy of the embedding table for the call), each layer as one kernel call when
    `cpu_decode.supports(head_dim)` (its weights then stay stacked over the layers, as
    panels, and the kernel takes the layer's index: no layer is sliced out).

    Attributes:
        layers: Per layer: `w_q_ed` [N·H, D], `w_k_ed`, `w_v_ed` [K·H, D], `w_o_de` [D, N·H],
            `w_gate_fd`, `w_up_fd` [F, D], `w_down_df` [D, F], the norm weights, and the
            biases the model has, flattened (`b_q_e` [N·H], `b_k_e`, `b_v_e` [K·H], `b_o_d`,
            `b_gate_f`, `b_up_f`, `b_down_d`; `q_norm_h`, `k_norm_h` as in the tree). For the
            layer kernel, one dict of every layer's weights stacked [L, ...], the
            projections as panels (`cpu_decode.LAYER_WEIGHTS`).
        head: The LM head [V, D]; with `cpu_kernels`, its panels [ceil(V / 16), D, 16].
        vocab: V (static).
        cpu_kernels: Whether the step uses the CPU kernels (static).
    """

    layers: tuple[dict[str, Array], ...] | dict[str, Array]
    head: Float[Array, "v d"] | Float[Array, "p d 16"]
    vocab: int = flax.struct.field(pytree_node=False)
    cpu_kernels: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def layer_kernel(self) -> bool:
        """Whether each layer of the step is one `cpu_decode.layer` call (`layers` is then the
        kernel's stacked weights)."""
        return isinstance(self.layers, dict)


# name in the parameter tree -> (name here, logical axes of the [out, in] weight)
_OUT_MAJOR = {
    "w_q_dnh": ("w_q_ed", ("heads", "embed")),
    "w_k_dkh": ("w_k_ed", ("kv_heads", "embed")),
    "w_v_dkh": ("w_v_ed", ("kv_heads", "embed")),
    "w_gate_df": ("w_gate_fd", ("mlp", "embed")),
    "w_up_df": ("w_up_fd", ("mlp", "embed")),
    "w_down_fd": ("w_down_df", ("embed", "mlp")),
}
_FLAT_BIAS = {"b_q_nh": "b_q_e", "b_k_kh": "b_k_e", "b_v_kh": "b_v_e"}


def decode_weights(
    config: DecoderConfig, params: Params, cpu_kernels: bool = False
) -> DecodeWeights:
    """Unstack, transpose and cast the layer weights, or for the CPU kernels cut them into
    panels, stacked (`DecodeWeights`); call under the rollout
    layout (`use_layout`) inside the generation program. `cpu_kernels`: the caller checked
    `jaxrl.kernels.cpu_decode.enabled` for this computation."""
    dtype = config.compute_dtype
    if config.tie_word_embeddings:
        head_vd = params["embed"]["tokens_vd"].astype(dtype)
    else:
        head_vd = shard(params["lm_head_dv"].astype(dtype).T, ("vocab", "embed"))
    head = cpu_decode.panels(head_vd, in_major=False) if cpu_kernels else head_vd
    if cpu_kernels and cpu_decode.supports(config.head_dim):
        layers = _kernel_layers(config, params["layers"])
    else:
        layers = _xla_layers(config, params["layers"])
    # A barrier keeps XLA from folding the slices and transposes back into the decode loop
    # (where they would be copies again, once per step).
    layers, head = jax.lax.optimization_barrier((layers, head))
    return DecodeWeights(layers, head, vocab=head_vd.shape[0], cpu_kernels=cpu_kernels)


def _xla_layers(config: DecoderConfig, stacked: Params) -> tuple[dict[str, Array], ...]:
    """Per layer, its weights output-major and its biases flat (`DecodeWeights.layers`)."""
    layers = []
    for i in range(config.num_layers):
        p = jax.tree.map(lambda x, i=i: x[i].astype(config.compute_dtype), stacked)
        lw = {}
        for name, w in {**p["attn"], **p["mlp"]}.items():
            if name in _OUT_MAJOR:
                new, axes = _OUT_MAJOR[name]
                lw[new] = shard(w.reshape(w.shape[0], -1).T, axes)  # [in, out...] -> [out, in]
            elif name == "w_o_nhd":
                lw["w_o_de"] = shard(w.reshape(-1, w.shape[-1]).T, ("embed", "heads"))
            else:
                lw[_FLAT_BIAS.get(name, name)] = w.reshape(-1) if name in _FLAT_BIAS else w
        lw["ln_attn_d"], lw["ln_mlp_d"] = p["ln_attn_d"], p["ln_mlp_d"]
        layers.append(lw)
    return tuple(layers)


# weight, its bias (parameter names) -> the layer kernel's panels of the weight, bias there
_KERNEL_PROJECTIONS = {
    ("w_q_dnh", "b_q_nh"): ("w_q_p", "b_q_e"),
    ("w_k_dkh", "b_k_kh"): ("w_k_p", "b_k_e"),
    ("w_v_dkh", "b_v_kh"): ("w_v_p", "b_v_e"),
    ("w_o_nhd", "b_o_d"): ("w_o_p", "b_o_d"),
    ("w_gate_df", "b_gate_f"): ("w_gate_p", "b_gate_f"),
    ("w_up_df", "b_up_f"): ("w_up_p", "b_up_f"),
    ("w_down_fd", "b_down_d"): ("w_down_p", "b_down_d"),
}


def _kernel_layers(config: DecoderConfig, stacked: Params) -> dict[str, Array]:
    """The layer kernel's weights (`cpu_decode.LAYER_WEIGHTS`), stacked over the layers as in
    the parameter tree: no layer is sliced out (a copy), the kernel takes a layer index."""
    n_layers, f32 = config.num_layers, jnp.float32
    tree = {**stacked["attn"], **stacked["mlp"]}
    out = {"ln_attn_d": stacked["ln_attn_d"], "ln_mlp_d": stacked["ln_mlp_d"]}
    for (name, param_bias), (panels, bias) in _KERNEL_PROJECTIONS.items():
        w = tree[name]
        # [L, in, out] (the input axes of w_o_nhd are N, H; of the others, axis 1)
        w_lio = (
            w.reshape(n_layers, -1, w.shape[-1])
            if name == "w_o_nhd"
            else w.reshape(n_layers, w.shape[1], -1)
        )
        out[panels] = cpu_decode.panels(w_lio, in_major=True)
        if param_bias in tree:
            out[bias] = tree[param_bias].reshape(n_layers, -1)
        else:
            out[bias] = jnp.zeros((n_layers, w_lio.shape[2]), f32)
    for name in ("q_norm_h", "k_norm_h"):  # ones where absent (the kernel does not read them)
        out[name] = tree[name] if name in tree else jnp.ones((n_layers, config.head_dim), f32)
    return {name: out[name].astype(f32) for name in cpu_decode.LAYER_WEIGHTS}


def _linear_ob(w_od: Array, x_db: Array, b_o: Array | None) -> Array:
    """W x (+ b) for column-major activations: [O, D] x [D, B] -> [O, B]."""
    y = jnp.matmul(w_od, x_db)
    return y if b_o is None else y + b_o[:, None]


def _decode_layer(
    config: DecoderConfig,
    lw: dict,
    x_db: Array,
    cos: Array,
    sin: Array,
    attend,
) -> Array:
    """One pre-norm layer for one token per row (the math of `transformer._block`) on
    column-major activations [D, B]; `attend(q [B, 1, N, H], k [B, K, H], v [B, K, H])
    -> [B, 1, N, H]` writes and reads the cache. Queries, keys and values are turned
    row-major for RoPE and the attention (a few KiB per step)."""
    eps, h_dim = config.rms_norm_eps, config.head_dim
    b = x_db.shape[1]
    h = rms_norm(x_db, lw["ln_attn_d"], eps, axis=0)
    q = _linear_ob(lw["w_q_ed"], h, lw.get("b_q_e")).T.reshape(b, -1, h_dim)
    k = _linear_ob(lw["w_k_ed"], h, lw.get("b_k_e")).T.reshape(b, -1, h_dim)
    v = _linear_ob(lw["w_v_ed"], h, lw.get("b_v_e")).T.reshape(b, -1, h_dim)
    if config.qk_norm:
        q, k = rms_norm(q, lw["q_norm_h"], eps), rms_norm(k, lw["k_norm_h"], eps)
    q, k = apply_rope(q[:, None], cos, sin), apply_rope(k[:, None], cos, sin)
    o_eb = attend(q, k[:, 0], v).reshape(b, -1).T
    x_db = x_db + _linear_ob(lw["w_o_de"], o_eb, lw.get("b_o_d"))
    h = rms_norm(x_db, lw["ln_mlp_d"], eps, axis=0)
    gate = _linear_ob(lw["w_gate_fd"], h, lw.get("b_gate_f"))
    up = _linear_ob(lw["w_up_fd"], h, lw.get("b_up_f"))
    return x_db + _linear_ob(lw["w_down_df"], jax.nn.silu(gate) * up, lw.get("b_down_d"))


def decode_step(
    config: DecoderConfig,
    params: Params,
    weights: DecodeWeights,
    tokens: Int[Array, " b"],
    positions: Int[Array, " b"],
    cache: KVCache,
    write_index: Int[Array, " b"],
    live: Int[Array, ""],
    block: int,
) -> tuple[Float[Array, "b d"], KVCache]:
    """One token per row, each written at its own cache index, attending to the live prefix.

    Args:
        config: The model.
        params: Its parameters (the embedding and final norm are read from here).
        weights: `decode_weights(config, params)`, built once per generation call.
        tokens: [B] the rows' newest tokens.
        positions: [B] their positions.
        cache: The cache; row b holds its keys below `write_index[b]` (`segments` marks them).
        write_index: [B] cache index for each row's token.
        live: Bound on `write_index + 1` over all rows: cache blocks at or past it are not read.
        block: Key block of the attention (the cache length is a multiple of it; equal to
            it: the whole cache is read at once).

    Returns:
        (final-normed hidden states [B, D], the updated cache).
    """
    rows = jnp.arange(tokens.shape[0])
    # Materialised once per step: left to fusion, XLA recomputes the sines and cosines for
    # every element of every layer's rotated queries and keys.
    cos, sin = jax.lax.optimization_barrier(
        rope_cos_sin(config.rope, config.head_dim, positions[:, None])
    )
    segments = cache.segments.at[rows, write_index].set(1)
    kv_valid = segments > 0
    x_db = _embed(config, params, tokens).T
    ks, vs = list(cache.k), list(cache.v)
    windows = config.window_per_layer
    for i in range(config.num_layers):
        window = None if windows[i] >= NO_WINDOW else windows[i]
        if weights.layer_kernel:
            x_db, ks[i], vs[i] = cpu_decode.layer(
                weights.layers,
                i,
                x_db,
                cos[:, 0],
                sin[:, 0],
                write_index,
                segments,
                ks[i],
                vs[i],
                eps=config.rms_norm_eps,
                window=window or 0,
                qk_norm=config.qk_norm,
            )
            continue

        def attend(q, k, v, i=i, window=window):
            # In place: row b's new key goes to column write_index[b] of its layer buffer.
            ks[i] = ks[i].at[rows, :, :, write_index].set(k.astype(ks[i].dtype))
            vs[i] = vs[i].at[rows, :, write_index].set(v.astype(vs[i].dtype))
            return decode_attention(
                q,
                ks[i],
                vs[i],
                kv_valid,
                write_index,
                live=live,
                sliding_window=window,
                block=block,
            )

        x_db = _decode_layer(config, weights.layers[i], x_db, cos, sin, attend)
    h_db = rms_norm(x_db, params["final_norm_d"], config.rms_norm_eps, axis=0)
    return h_db.T, KVCache(k=tuple(ks), v=tuple(vs), segments=segments).constrain()


def decode_logits(weights: DecodeWeights, h_bd: Array) -> Array:
    """Next-token logits [B, V] (compute dtype) of final hidden states [B, D], computed as
    head [V, D] x h^T [D, B] (the head read output-major, like the layers)."""
    if weights.cpu_kernels:
        logits_vb = cpu_decode.matmul(weights.head, h_bd.T, weights.vocab)
    else:
        logits_vb = jnp.matmul(weights.head, h_bd.T)
    # The barrier keeps XLA from folding the transpose into the matmul (as a [B, D] x [D, V]
    # product with the head's contracting dimension last, which its fast CPU kernels do not
    # take: 3x slower).
    logits_vb = jax.lax.optimization_barrier(logits_vb)
    return shard(logits_vb.T, ("batch", "vocab"))
