"""The device programs of conversations: KV-cache rows that live across calls.

    cache = open_cache(config, layout, slots=S, length=C)                   # once
    cache = start(config, layout, params, cache, slot_f, ids_fp, mask_fp)    # prompts in
    cache, decoded = decode(config, layout, steps, block, backend, params, cache,
                            pending, budget_s, keys_s, offsets_s, rows_s)    # sample
    cache, decoded = decode_rows(..., cache, active_b, pending, ...)  # only B slots' rows
    cache = append(config, layout, params, cache, slot_f, ids_ft, index_ft, positions_ft)

A slot's sequence is in the cache up to its last token, which is *pending*: known, but its
keys and values not yet computed. `start` prefills a prompt's tokens but the last (which
becomes the pending one); each decode step feeds a slot's pending token (writes its keys and
values at the slot's `index`, attends to the slot's prefix) and samples the next, which is
pending in turn; `append` feeds the pending token and all but the last of the given tokens in
one prefill (`jaxrl.models.cached.extend`), the last given token becoming pending. So a
conversation's cache is the same whether its tokens were sampled or given, and one more
`decode` after an `append` continues from the appended text with no token sampled in between.

Slots not being decoded are left alone: a decode step writes every slot at its `write_index`,
and for an idle slot that is the cell of its pending token, which it writes itself before it
is next read (so a slot's `index` must stay below the cache length: `decode` stops a slot one
cell before the end). Only the host (`jaxrl.rollout.engine.RolloutEngine`) keeps each slot's
pending token, index and position (`Pending`); the programs take them as arguments, and the
host moves them on by what `decode` returns.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrl.models.cached import KVCache, extend, init_cache, prefill
from jaxrl.models.config import DecoderConfig
from jaxrl.models.transformer import positions_from_mask
from jaxrl.rollout.backends import DecodeBackend
from jaxrl.rollout.sampling import RowSampling, is_end_row, sample_rows
from jaxrl.sharding.layouts import Layout, use_layout


@flax.struct.dataclass
class Pending:
    """Each slot's pending token and where it goes (kept by the host, passed in).

    Attributes:
        last: [S] the pending token.
        index: [S] the cache index its keys and values go to.
        position: [S] its position id.
    """

    last: Int[Array, " s"]
    index: Int[Array, " s"]
    position: Int[Array, " s"]


@flax.struct.dataclass
class Decoded:
    """What one `decode` call sampled, per slot.

    Attributes:
        tokens: [S, R] the sampled tokens (the first `counts[s]` of row s).
        log_probs: [S, R] their log-probs under the processed distribution.
        counts: [S] tokens sampled (0 for a slot not decoded).
        ended: [S] whether the slot's last token is an end token (EOS or a stop token).
    """

    tokens: Int[Array, "s r"]
    log_probs: Float[Array, "s r"]
    counts: Int[Array, " s"]
    ended: Bool[Array, " s"]


def open_cache(config: DecoderConfig, layout: Layout | None, slots: int, length: int) -> KVCache:
    """An empty cache of `slots` rows of `length` cells, in the layout's cache sharding."""
    with use_layout(layout):
        return init_cache(config, slots, length)


def start(
    config: DecoderConfig,
    layout: Layout | None,
    copies: int,
    params: Any,
    cache: KVCache,
    slot_ids: Int[Array, " fc"],
    input_ids: Int[Array, "f p"],
    attention_mask: Int[Array, "f p"],
) -> KVCache:
    """Prefill left-padded prompts [F, P] but their last token, once each, into `copies`
    slots each (prompt i's keys and values into slots `slot_ids[i * copies : (i + 1) *
    copies]`, cells [0, P - 1)); a slot id >= S (padding rows) is not written."""
    with use_layout(layout):
        ids, mask = input_ids[:, :-1], attention_mask[:, :-1]
        _, k, v, _ = prefill(config, params, ids, positions_from_mask(mask), mask)
        if copies > 1:
            k, v = jnp.repeat(k, copies, axis=1), jnp.repeat(v, copies, axis=1)
            mask = jnp.repeat(mask, copies, axis=0)
        return cache.write(slot_ids, k, v, mask).constrain()


@flax.struct.dataclass
class _Loop:
    cache: KVCache
    last: Int[Array, " s"]
    counts: Int[Array, " s"]
    ended: Bool[Array, " s"]
    tokens: Int[Array, "s1 r"]  # [S + 1, R]: row S takes the writes of idle slots
    log_probs: Float[Array, "s1 r"]


def decode(
    config: DecoderConfig,
    layout: Layout | None,
    steps: int,
    block: int,
    backend: DecodeBackend,
    params: Any,
    cache: KVCache,
    pending: Pending,
    budget: Int[Array, " s"],
    keys: jax.Array,
    offsets: Int[Array, " s"],
    settings: RowSampling,
) -> tuple[KVCache, Decoded]:
    """Sample up to `budget[s]` (<= `steps`) tokens for each slot with the slot's own
    `settings` (temperature, top-k, top-p, greedy: data, so one program serves every mix), a
    slot stopping early at one of its end tokens; slots with budget 0 are not decoded. The
    caller keeps `index + budget` below the cache length (see the module doc).

    `keys` [S] (typed): slot s samples its k-th token of this call with
    `fold_in(keys[s], offsets[s] + k)` (the engine passes each turn's key and the tokens
    it has so far), so its draws depend on its own key only, not on which other slots
    decode alongside it, or in which chunks."""
    s = budget.shape[0]
    rows = jnp.arange(s)

    def running(st: _Loop) -> Bool[Array, " s"]:
        return (st.counts < budget) & ~st.ended

    def body(st: _Loop) -> _Loop:
        run = running(st)
        write_index = pending.index + st.counts
        sub = jax.vmap(jax.random.fold_in)(keys, offsets + st.counts)
        positions = pending.position + st.counts
        live = jnp.max(write_index) + 1
        logits, cache, _ = backend.step(
            config, params, prepared, st.last, positions, st.cache, write_index, live, block
        )
        tok, lp = sample_rows(logits, settings, sub)
        out_row = jnp.where(run, rows, s)
        column = jnp.minimum(st.counts, steps - 1)
        return st.replace(
            cache=cache,
            last=jnp.where(run, tok, st.last),
            counts=st.counts + run,
            ended=st.ended | (run & is_end_row(tok, settings.end_ids)),
            tokens=st.tokens.at[out_row, column].set(tok),
            log_probs=st.log_probs.at[out_row, column].set(lp),
        )

    with use_layout(layout):
        prepared = backend.prepare(config, params)
        init = _Loop(
            cache=cache,
            last=pending.last,
            counts=jnp.zeros((s,), jnp.int32),
            ended=jnp.zeros((s,), bool),
            tokens=jnp.zeros((s + 1, steps), jnp.int32),
            log_probs=jnp.zeros((s + 1, steps), jnp.float32),
        )
        st = jax.lax.while_loop(lambda st: jnp.any(running(st)), body, init)
    return st.cache, Decoded(st.tokens[:s], st.log_probs[:s], st.counts, st.ended)


def decode_rows(
    config: DecoderConfig,
    layout: Layout | None,
    steps: int,
    block: int,
    backend: DecodeBackend,
    params: Any,
    cache: KVCache,
    active: Int[Array, " b"],
    pending: Pending,
    budget: Int[Array, " s"],
    keys: jax.Array,
    offsets: Int[Array, " s"],
    settings: RowSampling,
) -> tuple[KVCache, Decoded]:
    """`decode` of the slots `active` [B] (B < S) only, as a batch of B rows: their cache
    rows gathered into a cache of B rows, decoded, and put back (an id >= S pads: not
    decoded, not written). A decode step's cost is its rows': B of them instead of every
    slot when few run (vLLM's running batch). `Decoded` is per slot [S], as `decode`'s."""
    s = budget.shape[0]
    i = jnp.minimum(active, s - 1)

    def take(tree):
        return jax.tree.map(lambda x: x[i], tree)

    def per_slot(x, fill):
        whole = jnp.full((s, *x.shape[1:]), fill, x.dtype)
        return whole.at[active].set(x, mode="drop")

    with use_layout(layout):
        rows = cache.rows(active)
    budget_b = jnp.where(active < s, budget[i], 0)
    rows, out = decode(config, layout, steps, block, backend, params, rows, take(pending),
                       budget_b, keys[i], offsets[i], take(settings))  # fmt: skip
    with use_layout(layout):
        cache = cache.put_rows(active, rows).constrain()
    return cache, Decoded(
        per_slot(out.tokens, 0), per_slot(out.log_probs, 0.0), per_slot(out.counts, 0),
        per_slot(out.ended, False),
    )  # fmt: skip


def append(
    config: DecoderConfig,
    layout: Layout | None,
    params: Any,
    cache: KVCache,
    slot_ids: Int[Array, " f"],
    tokens: Int[Array, "f t"],
    write_index: Int[Array, "f t"],
    positions: Int[Array, "f t"],
) -> KVCache:
    """Feed [F, T] tokens to the given slots (`extend` on those rows: each token's keys and
    values to its `write_index`, which is >= the cache length for padding); a slot id >= S
    (padding rows) is not written."""
    with use_layout(layout):
        rows = cache.rows(slot_ids)
        _, rows, _ = extend(config, params, tokens, positions, rows, write_index)
        return cache.put_rows(slot_ids, rows).constrain()
