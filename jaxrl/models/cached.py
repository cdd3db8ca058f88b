"""The decoder with a KV cache: prefill prompts, then extend every row a token at a time.

    cache = init_cache(config, batch=S, length=C)
    h_btd, k_lbtkh, v_lbtkh, routes = prefill(config, params, ids_bt, positions_bt, segments_bt)
    cache = cache.write(slots_f, k_lbtkh, v_lbtkh, segments_bt)    # prompts into slots
    h_bd, cache, routes = decode_step(config, params, tokens_b, positions_b, cache,
                                      write_index_b, live, block)
    h_btd, cache, routes = extend(config, params, ids_bt, positions_bt, cache, write_index_bt)

Each also returns a mixture of experts' routes, the experts every token used in every layer
([B, T, L, k] int32; decode_step [B, L, k]), which the rollout records for routing replay
(None for a dense model).

The cache is an explicit value (passed in, returned, donated by the caller's `jit`): keys and
values of every layer, stacked as the parameters are ([L, ...]), plus [B, C] segment ids (1: a
real key, 0: padding or not yet written). Keys are stored transposed, [L, B, K, H, C], values
as [L, B, K, C, H], so the attention's two matmuls (q·k over H, p·v over C) read a layer's
buffers as plain (row-major) operands. `prefill` runs the prompts (left-padded, rows in
lockstep) through the layers and returns their keys and values; `decode_step` advances each
row by one token at its own cache index (rows at different points: continuous batching) and
reads a short cache whole, a long one only up to its live prefix
(`jaxrl.kernels.decode_attention`); `extend` appends several tokens to rows that hold some
already (a conversation's tool output).

`decode_step` and `extend` are the model's own layer (`transformer._block`) run over the
layers' parameters as they come: scanned over the stacked [L, ...] parameters of training
(no per-call copy or re-layout), or, where `params["layers"]` is a tuple of per-layer trees
(`unstack_layers`: the rollout engine holds its copy so), one layer after another in a Python
loop. A scan reads layer i's weights as a dynamic slice of the stacks, which XLA's GPU
backend materialises (a copy of every weight at every decode step: on an H200, M's step
0.41 ms scanned against 0.29 ms per-layer, L's 1.72 against 1.09); per-layer arrays are read
where they are. Each layer writes its new keys and values into its slice of the stacked cache
(in place: the cache is the loop's carry) and attends over that slice. Faster decode paths for
one platform (the C++ CPU kernels) are rollout backends (`jaxrl.rollout.backends`), not here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrl.kernels import attention
from jaxrl.kernels.decode import decode_attention, extend_attention
from jaxrl.models.config import DecoderConfig
from jaxrl.models.params import Params
from jaxrl.models.transformer import _block, embed_tokens, layer_rope, norm, rope_tables
from jaxrl.sharding.layouts import active_layout, shard

# Logical axes of the stacked key and value buffers (KV cache over batch and kv heads).
K_CACHE_AXES = (None, "batch", "kv_heads", "head_dim", "cache_seq")
V_CACHE_AXES = (None, "batch", "kv_heads", "cache_seq", "head_dim")


@flax.struct.dataclass
class KVCache:
    """Keys, values and key segment ids of every layer.

    Attributes:
        k: Keys [L, B, K, H, C] (transposed: C is the cache length).
        v: Values [L, B, K, C, H].
        segments: [B, C]: 1 where a real token's key is stored, else 0.
    """

    k: Float[Array, "l b k h c"]
    v: Float[Array, "l b k c h"]
    segments: Int[Array, "b c"]

    @property
    def length(self) -> int:
        return self.segments.shape[1]

    def constrain(self) -> KVCache:
        """The buffers constrained to the active layout (a no-op without one)."""
        return self.replace(k=shard(self.k, K_CACHE_AXES), v=shard(self.v, V_CACHE_AXES))

    def mark_written(self, write_index: Int[Array, "b t"]) -> KVCache:
        """The cache with `segments` 1 at each row's written indices (>= C: dropped)."""
        rows = jnp.arange(write_index.shape[0])[:, None]
        return self.replace(segments=self.segments.at[rows, write_index].set(1, mode="drop"))

    def rows(self, slots: Int[Array, " f"]) -> KVCache:
        """A copy of the rows `slots` (an id >= B reads the last row; `put_rows` drops it)."""
        i = jnp.minimum(slots, self.segments.shape[0] - 1)
        return KVCache(k=self.k[:, i], v=self.v[:, i], segments=self.segments[i])

    def put_rows(self, slots: Int[Array, " f"], rows: KVCache) -> KVCache:
        """These rows (`rows(slots)`, changed) written back; an id >= B is dropped."""
        return KVCache(
            k=self.k.at[:, slots].set(rows.k, mode="drop"),
            v=self.v.at[:, slots].set(rows.v, mode="drop"),
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
        t = segments.shape[1]
        pad = ((0, 0), (0, self.length - t))
        new_k = k.astype(self.k.dtype).transpose(0, 1, 3, 4, 2)  # [L, F, K, H, T]
        new_v = v.astype(self.v.dtype).transpose(0, 1, 3, 2, 4)  # [L, F, K, T, H]
        return KVCache(
            k=self.k.at[:, slots, :, :, :t].set(new_k, mode="drop"),
            v=self.v.at[:, slots, :, :t].set(new_v, mode="drop"),
            segments=self.segments.at[slots].set(jnp.pad(segments, pad), mode="drop"),
        )


def embed(config: DecoderConfig, params: Params, ids: Array) -> Array:
    """Token embeddings in the compute dtype (`transformer.embed_tokens`: scaled by sqrt(D)
    for Gemma)."""
    return embed_tokens(config, params, ids)


def init_cache(config: DecoderConfig, batch: int, length: int, dtype=None) -> KVCache:
    """An empty cache for `batch` rows of up to `length` tokens (in the compute dtype)."""
    dtype = config.compute_dtype if dtype is None else dtype
    kv, h, layers = config.num_kv_heads, config.head_dim, config.num_layers
    return KVCache(
        k=jnp.zeros((layers, batch, kv, h, length), dtype),
        v=jnp.zeros((layers, batch, kv, length, h), dtype),
        segments=jnp.zeros((batch, length), jnp.int32),
    ).constrain()


def _windowed(config: DecoderConfig) -> bool:
    return any(w is not None for w in config.sliding_windows)


def _rope_kind(config: DecoderConfig, i: int | Array) -> int | Array:
    """Layer i's index into `config.ropes` (`over_layers`' i: an int in its loop, traced in
    its scan)."""
    kinds = config.rope_per_layer
    return kinds[i] if isinstance(i, int) else jnp.asarray(kinds, jnp.int32)[i]


def prefill(
    config: DecoderConfig,
    params: Params,
    input_ids: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    segments: Int[Array, "b t"],
) -> tuple[Float[Array, "b t d"], Array, Array, Int[Array, "b t l k"] | None]:
    """Final-normed hidden states of left-padded prompts, every layer's keys and values, and
    a mixture of experts' routes.

    Args:
        config: The model.
        params: Its parameters.
        input_ids: [B, T] prompts (left-padded).
        positions: [B, T] their positions (verl's: count of real tokens before them).
        segments: [B, T] 1 for real tokens, 0 for padding (which no real token attends to).

    Returns:
        (hidden states [B, T, D], keys [L, B, T, K, H], values [L, B, T, K, H], routes
        [B, T, L, k] or None), keys after RoPE, in the compute dtype.
    """
    tables = rope_tables(config, positions)
    segments = segments.astype(jnp.int32)
    windowed = _windowed(config)

    def body(x_btd, p, window, i):
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
                softmax_scale=config.softmax_scale,
                logit_softcap=config.attn_logit_softcap,
            )

        cos, sin = layer_rope(tables, _rope_kind(config, i))
        x_btd, routing = _block(config, cos, sin, attend, x_btd, p, window)
        return x_btd, (kv["k"], kv["v"], routing.get("experts_tk"))

    x = embed(config, params, input_ids)
    x, (k, v, routes) = over_layers(config, params, body, x)
    h = norm(config, x, params["final_norm_d"])
    return h, k, v, _routes_btlk(routes, input_ids.shape)


def _routes_btlk(routes_ltk: Array | None, shape: tuple[int, int]) -> Array | None:
    """The layers' chosen experts [L, B*T, k] as [B, T, L, k] (None stays None)."""
    if routes_ltk is None:
        return None
    return jnp.moveaxis(routes_ltk.reshape(routes_ltk.shape[0], *shape, -1), 0, 2)


def unstack_layers(params: Params) -> Params:
    """`params` with the stacked layers [L, ...] as a tuple of L per-layer trees (the
    layout `over_layers` loops over; a copy)."""
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    return {**params, "layers": tuple(jax.tree.map(lambda a, i=i: a[i], stacked)
                                      for i in range(n))}  # fmt: skip


def over_layers(
    config: DecoderConfig,
    params: Params,
    body: Callable[[Any, Params, Array, Any], tuple[Any, Any]],
    carry: Any,
) -> tuple[Any, Any]:
    """`body(carry, layer_params, window, i) -> (carry, y)` over the layers: `lax.scan` over
    stacked parameters (i traced), a Python loop over a tuple of per-layer ones (i an int);
    the ys stacked [L, ...] either way (None: none)."""
    windows = jnp.asarray(config.window_per_layer, jnp.int32)
    layers = params["layers"]
    if not isinstance(layers, tuple):
        return jax.lax.scan(
            lambda c, xs: body(c, *xs), carry, (layers, windows, jnp.arange(config.num_layers))
        )
    ys = []
    for i, p in enumerate(layers):
        carry, y = body(carry, p, windows[i], i)
        ys.append(y)
    if ys[0] is None:
        return carry, None
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)


# attend(q [B, T, N, H], k_cache [L, B, K, H, C], v_cache [L, B, K, C, H], layer, window)
CacheAttention = Callable[[Array, Array, Array, Array, Array | None], Array]


def _cached_layers(
    config: DecoderConfig,
    params: Params,
    x_btd: Array,
    positions: Int[Array, "b t"],
    cache: KVCache,
    write_index: Int[Array, "b t"],
    attend: CacheAttention,
) -> tuple[Float[Array, "b t d"], KVCache, Int[Array, "b t l k"] | None]:
    """The layers over the cache (`decode_step`, `extend`), the stacked cache the carry
    (`over_layers`). Each layer writes its T new keys and values at
    their `write_index` (>= C: dropped) and `attend`s over its cache slice. Also returns a
    mixture of experts' routes."""
    b = x_btd.shape[0]
    rows = jnp.arange(b)[:, None]
    tables = rope_tables(config, positions)
    windowed = _windowed(config)

    def body(carry, p, window, i):
        x, k_all, v_all = carry
        out = {}

        def attend_cache(q, k, v, window):
            # [B, T, K, H] into row b's columns write_index[b, :] of layer i's buffers
            k_all_new = k_all.at[i, rows, :, :, write_index].set(k.astype(k_all.dtype), mode="drop")
            v_all_new = v_all.at[i, rows, :, write_index].set(v.astype(v_all.dtype), mode="drop")
            out["k"], out["v"] = k_all_new, v_all_new
            return attend(q, k_all_new, v_all_new, i, window if windowed else None)

        cos, sin = layer_rope(tables, _rope_kind(config, i))
        x, routing = _block(config, cos, sin, attend_cache, x, p, window)
        return (x, out["k"], out["v"]), routing.get("experts_tk")

    (x, k, v), routes = over_layers(config, params, body, (x_btd, cache.k, cache.v))
    h = norm(config, x, params["final_norm_d"])
    cache = KVCache(k=k, v=v, segments=cache.segments).constrain()
    return h, cache, _routes_btlk(routes, x_btd.shape[:2])


def decode_step(
    config: DecoderConfig,
    params: Params,
    tokens: Int[Array, " b"],
    positions: Int[Array, " b"],
    cache: KVCache,
    write_index: Int[Array, " b"],
    live: Int[Array, ""],
    block: int,
) -> tuple[Float[Array, "b d"], KVCache, Int[Array, "b l k"] | None]:
    """One token per row, each written at its own cache index, attending to the live prefix.

    Args:
        config: The model.
        params: Its parameters, as the parameter tree holds them (stacked layers).
        tokens: [B] the rows' newest tokens.
        positions: [B] their positions.
        cache: The cache; row b holds its keys below `write_index[b]` (`segments` marks them).
        write_index: [B] cache index for each row's token.
        live: Bound on `write_index + 1` over all rows: cache blocks at or past it are not read.
        block: Key block of the attention (the cache length is a multiple of it; equal to
            it: the whole cache is read at once).

    Returns:
        (final-normed hidden states [B, D], the updated cache, a mixture of experts' routes
        [B, L, k] or None).
    """
    cache = cache.mark_written(write_index[:, None])
    kv_valid = cache.segments > 0

    def attend(q, k_all, v_all, layer, window):
        return decode_attention(
            q,
            k_all,
            v_all,
            kv_valid,
            write_index,
            live=live,
            sliding_window=window,
            block=block,
            layer=layer,
            softmax_scale=config.softmax_scale,
            logit_softcap=config.attn_logit_softcap,
        )

    x = embed(config, params, tokens)[:, None]
    h, cache, routes = _cached_layers(
        config, params, x, positions[:, None], cache, write_index[:, None], attend
    )
    return h[:, 0], cache, None if routes is None else routes[:, 0]


def extend(
    config: DecoderConfig,
    params: Params,
    tokens: Int[Array, "b t"],
    positions: Int[Array, "b t"],
    cache: KVCache,
    write_index: Int[Array, "b t"],
) -> tuple[Float[Array, "b t d"], KVCache, Int[Array, "b t l k"] | None]:
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
        (final-normed hidden states [B, T, D], the updated cache, a mixture of experts'
        routes [B, T, L, k] or None).
    """
    cache = cache.mark_written(write_index)
    kv_valid: Bool[Array, "b c"] = cache.segments > 0

    def attend(q, k_all, v_all, layer, window):
        return extend_attention(
            q, k_all[layer], v_all[layer], kv_valid, write_index, sliding_window=window,
            softmax_scale=config.softmax_scale, logit_softcap=config.attn_logit_softcap,
        )  # fmt: skip

    return _cached_layers(
        config, params, embed(config, params, tokens), positions, cache, write_index, attend
    )
