"""`generate`: jitted prefill and a `lax.while_loop` decode over an explicit KV cache.

    out = generate(config, params, input_ids, attention_mask, SamplingParams(...), rng)
    out.responses [B*n, R], out.response_mask, out.log_probs, out.lengths

Prompts come left-padded (verl's layout). Each prompt is repeated `n` times (interleaved), the
batch and prompt length are padded up to buckets (so a run compiles a bounded number of
programs; every new program is logged), and one jitted program does the rest: the rows are a
queue and the KV cache has `max_num_seqs` slots; the first prompts are prefilled into the
slots (with n > 1, each prompt once, its keys and values copied into its n slots: prefix
sharing), then a `lax.while_loop` decodes one token for every busy slot per step (each slot
at its own cache index; a long cache is read only up to its live prefix), and a slot whose
row produced an end token (EOS, `stop_token_ids`) or `max_tokens` tokens is refilled with the
next queued prompt (continuous batching), until the queue is empty (with
`over_sample_rate`, verl's early abort: until int(rows x (1 - rate)) rows have finished).
`response_mask` covers the tokens up to and including the end token (with `ignore_eos`, all
`max_tokens`).

The decode step is a backend's (`jaxrl.rollout.backends`): the model's own step, scanned over
the stacked parameters as they are (`xla`, every platform), or the C++ CPU kernels
(`cpu_kernels`: float32 on one CPU device, which cut the weights into panels once per call);
`decode_backend="auto"` takes the kernels where they apply.

With a `layout` (the rollout layout), parameters are expected in it, the batch is split over
its `dp` axis and the KV cache over batch and kv heads.
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import logging
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxrl.data.batch import bucket
from jaxrl.models.cached import KVCache, init_cache, prefill
from jaxrl.models.config import DecoderConfig
from jaxrl.models.transformer import lm_logits, positions_from_mask
from jaxrl.rollout.backends import DecodeBackend, choose_backend
from jaxrl.rollout.sampling import SamplingParams, sample, typed_key
from jaxrl.sharding.layouts import Layout, use_layout
from jaxrl.sharding.processes import (
    allgather_objects,
    global_array,
    one_device_each,
    process_rows,
    spans_processes,
)
from jaxrl.sharding.reshard import moved

log = logging.getLogger("jaxrl.rollout")


@flax.struct.dataclass
class GenerationOutput:
    """Right-padded responses of a `generate` call (rows in the order prompt_i, copy_j).

    Attributes:
        responses: Token ids [B*n, R]; padding after the response.
        response_mask: 1 on response tokens (EOS included), 0 after.
        log_probs: Log-probs of the tokens under the processed distribution (0 on padding).
        lengths: Response lengths [B*n].
        decode_steps: Iterations of the decode loop (one token for every busy slot each).
        slots: Rows decoded at once (KV-cache slots).
        local: Several processes, `generate(..., defer=True)`: where this process's rows are
            (the arrays are the whole batch's, on the rollout's devices); else None.
        prompt_routes: `SamplingParams.record_routes`: the experts each prompt token used in
            each layer [B*n, P, L, k] (int16; -1 on padding), else None.
        response_routes: The same for the response tokens [B*n, R, L, k]: -1 on padding and
            on each response's last token (sampled, never fed to the model).
    """

    responses: Int[Array, "b r"]
    response_mask: Int[Array, "b r"]
    log_probs: Float[Array, "b r"]
    lengths: Int[Array, " b"]
    decode_steps: Int[Array, ""]
    slots: int = flax.struct.field(pytree_node=False, default=0)
    local: LocalRows | None = flax.struct.field(pytree_node=False, default=None)
    prompt_routes: Int[Array, "b p l k"] | None = None
    response_routes: Int[Array, "b r l k"] | None = None


@dataclasses.dataclass(frozen=True)
class LocalRows:
    """Where this process's rows are in a deferred multi-process output (`own_rows`).

    Attributes:
        start: Its first row in the output's rows.
        stop: One past its last.
        move: The rollout's devices are some processes' only: a copy moves onto one device
            of each process before the read.
    """

    start: int
    stop: int
    move: bool


@flax.struct.dataclass
class _Slots:
    """The decode batch: which queued row each slot holds and how far it has got.

    Attributes:
        row: [S] queue row in the slot; Q (one past the last row) marks a free slot.
        step: [S] tokens generated so far.
        last: [S] the newest token (fed to the next decode step).
        start: [S] position of the first response token (the prompt's real tokens).
    """

    row: Int[Array, " s"]
    step: Int[Array, " s"]
    last: Int[Array, " s"]
    start: Int[Array, " s"]


@flax.struct.dataclass
class _LoopState:
    slots: _Slots
    next_row: Int[Array, ""]  # the first queued row not yet in a slot
    tokens: Int[Array, "q1 r"]  # [Q + 1, R]: row Q takes the writes of free slots
    log_probs: Float[Array, "q1 r"]
    lengths: Int[Array, " q1"]
    cache: KVCache
    key: jax.Array
    decode_steps: Int[Array, ""]
    prompt_routes: Int[Array, "q1 p l k"] | None = None  # record_routes: row Q the free slots'
    response_routes: Int[Array, "q1 r l k"] | None = None


ROUTE_DTYPE = jnp.int16  # expert ids (up to 32767 experts); -1: no route


def cache_geometry(
    prompt_len: int, max_tokens: int, block: int = 128, whole: int = 256
) -> tuple[int, int]:
    """(cache length, attention block): the length is prompt + response rounded up to a
    multiple of 16 (the vector width of the CPU decode kernels). A cache of up to `whole`
    entries is one block, read whole every step; a longer one is rounded up to a multiple of
    `block` and read block by block up to the live prefix. (Measured on 2 CPU cores, M's
    shapes: for 192 entries the whole read was faster than 64- or 96-key blocks at every live
    length; at 256 the two break even over a generation; from 512 on, blocks win, as the
    unwritten tail is skipped.)"""
    length = -(-(prompt_len + max_tokens) // 16) * 16
    if length <= whole:
        return length, length
    return -(-length // block) * block, block


def refill_sizes(slots: int, queued: int) -> tuple[int, ...]:
    """Static batch sizes of the refill prefills: powers of 4 below `slots`, and `slots`
    (a refill of k free slots runs the smallest size >= k, so at most 4x padded rows)."""
    if queued <= slots:
        return (slots,)
    sizes, size = [], 1
    while size < slots:
        sizes.append(size)
        size *= 4
    return (*sizes, slots)


def is_end(tokens: Array, end_ids: tuple[int, ...]) -> Array:
    """Whether each token ends its response (is in `end_ids`: `SamplingParams.end_ids`)."""
    if not end_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(end_ids, jnp.int32))


def _generate(
    config: DecoderConfig,
    sp: SamplingParams,
    layout: Layout | None,
    num_slots: int,
    backend: DecodeBackend,
    prefix_sharing: bool,
    params: Any,
    input_ids: Int[Array, "q p"],
    attention_mask: Int[Array, "q p"],
    key: jax.Array,
    num_rows: Int[Array, ""],
    order: Int[Array, " q"],
) -> GenerationOutput:
    """Continuous batching: `num_slots` rows decode at once; a slot whose row finishes (EOS or
    `max_tokens`) is refilled with the next queued prompt (prefilled into the slot's cache),
    until the queue is empty and every slot is free. With as many slots as rows this is plain
    static batching: one prefill, then decode until the last row finishes. The queue is
    `order` (row indices); its entries from `num_rows` on (padding rows) are never decoded."""
    q, p = input_ids.shape
    r, s = sp.max_tokens, num_slots
    length, block = cache_geometry(p, r)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    eos_ids = sp.end_ids(config.eos_token_id)

    def retire(st: _LoopState) -> _LoopState:
        """Free the slots whose row just ended (EOS or max_tokens), recording its length."""
        sl = st.slots
        ended = (sl.row < q) & ((sl.step >= r) | is_end(sl.last, eos_ids))
        lengths = st.lengths.at[jnp.where(ended, sl.row, q)].set(sl.step)
        return st.replace(slots=sl.replace(row=jnp.where(ended, q, sl.row)), lengths=lengths)

    def prefill_rows(
        next_row: Array, rows: Array, f: int, aligned: bool
    ) -> tuple[Array, Array, Array, Array | None]:
        """Logits of the first response token [f, V] and keys and values [L, f, T, K, H] of
        the queue's rows next_row + [0, f) (row ids `rows`). With n > 1 the queue holds each
        prompt's n copies consecutively (real rows in groups of n), so the f rows hold at most
        (f - 1) // n + 2 distinct prompts (ceil(f / n) when `aligned`: next_row % n == 0);
        when that is fewer than f, each is prefilled once and its outputs copied to its rows
        (prefix sharing: a prompt's n samples pay one prefill). Also the prompts' routes
        [f, P, L, k] (a mixture of experts), else None."""
        n = sp.n
        groups = -(-f // n) if aligned else (f - 1) // n + 2
        if not (prefix_sharing and n > 1 and groups < f):
            mask = attention_mask[rows]
            h, k, v, routes = prefill(config, params, input_ids[rows], positions_from_mask(mask),
                                      mask)  # fmt: skip
            return lm_logits(config, params, h[:, -1:])[:, 0], k, v, routes
        first = next_row // n
        rep = order[jnp.minimum((first + jnp.arange(groups)) * n, q - 1)]
        mask = attention_mask[rep]
        h, k, v, routes = prefill(config, params, input_ids[rep], positions_from_mask(mask), mask)
        group = jnp.minimum((next_row + jnp.arange(f)) // n - first, groups - 1)
        logits = lm_logits(config, params, h[:, -1:])[:, 0]
        return logits[group], k[:, group], v[:, group], None if routes is None else routes[group]

    def refill(st: _LoopState, f: int, aligned: bool = False) -> _LoopState:
        """Prefill up to `f` queued prompts into the first free slots."""
        sl = st.slots
        free = sl.row == q
        slot_ids = jnp.argsort(~free, stable=True)[:f]  # free slots first, in order
        queued = st.next_row + jnp.arange(f)
        take = free[slot_ids] & (queued < num_rows)
        rows = order[jnp.minimum(queued, q - 1)]
        mask = attention_mask[rows] * take[:, None]
        logits, k, v, routes = prefill_rows(st.next_row, rows, f, aligned)
        key, sub = jax.random.split(st.key)
        tok, lp = sample(logits, sp, sub)
        into = jnp.where(take, slot_ids, s)  # s: out of range, dropped
        out_row = jnp.where(take, rows, q)
        cache = st.cache.write(into, k, v, mask)
        slots = _Slots(
            row=sl.row.at[into].set(rows, mode="drop"),
            step=sl.step.at[into].set(1, mode="drop"),
            last=sl.last.at[into].set(tok, mode="drop"),
            start=sl.start.at[into].set(jnp.sum(mask, axis=-1), mode="drop"),
        )
        st = st.replace(
            slots=slots,
            next_row=st.next_row + jnp.sum(take),
            tokens=st.tokens.at[out_row, 0].set(tok),
            log_probs=st.log_probs.at[out_row, 0].set(lp),
            cache=cache.constrain(),
            key=key,
        )
        if st.prompt_routes is not None:  # -1 on the prompts' padding
            real = (mask > 0)[:, :, None, None]
            routes_fplk = jnp.where(real, routes.astype(ROUTE_DTYPE), -1)
            st = st.replace(prompt_routes=st.prompt_routes.at[out_row].set(routes_fplk))
        return retire(st)

    def decode(st: _LoopState, prepared: Any) -> _LoopState:
        sl = st.slots
        busy = sl.row < q
        out_row = jnp.where(busy, sl.row, q)
        write_index = jnp.minimum(p + sl.step - 1, length - 1)
        live = jnp.max(jnp.where(busy, write_index + 1, 1))
        positions = sl.start + sl.step - 1
        key, sub = jax.random.split(st.key)
        logits, cache, routes = backend.step(
            config, params, prepared, sl.last, positions, st.cache, write_index, live, block
        )
        if st.response_routes is not None:  # the fed token: response column step - 1
            fed = st.response_routes.at[out_row, sl.step - 1].set(routes.astype(ROUTE_DTYPE))
            st = st.replace(response_routes=fed)
        tok, lp = sample(logits, sp, sub)
        column = jnp.minimum(sl.step, r - 1)
        st = st.replace(
            slots=sl.replace(step=sl.step + busy, last=jnp.where(busy, tok, pad_id)),
            tokens=st.tokens.at[out_row, column].set(tok),
            log_probs=st.log_probs.at[out_row, column].set(lp),
            cache=cache,
            key=key,
            decode_steps=st.decode_steps + 1,
        )
        return retire(st)

    with use_layout(layout):
        prepared = backend.prepare(config, params)
        state = _LoopState(
            slots=_Slots(
                row=jnp.full((s,), q, jnp.int32),
                step=jnp.zeros((s,), jnp.int32),
                last=jnp.full((s,), pad_id, jnp.int32),
                start=jnp.zeros((s,), jnp.int32),
            ),
            next_row=jnp.int32(0),
            tokens=jnp.full((q + 1, r), pad_id, jnp.int32),
            log_probs=jnp.zeros((q + 1, r), jnp.float32),
            lengths=jnp.zeros((q + 1,), jnp.int32),
            cache=init_cache(config, s, length),
            key=key,
            decode_steps=jnp.int32(0),
        )
        if sp.record_routes:
            if config.moe is None:
                raise ValueError("SamplingParams.record_routes: the model has no experts to route")
            routes = (config.num_layers, config.moe.top_k)
            state = state.replace(
                prompt_routes=jnp.full((q + 1, p, *routes), -1, ROUTE_DTYPE),
                response_routes=jnp.full((q + 1, r, *routes), -1, ROUTE_DTYPE),
            )
        state = refill(state, s, aligned=True)
        sizes = refill_sizes(s, q)

        target = finish_target(num_rows, sp.over_sample_rate)

        def cond(st: _LoopState):
            done = jnp.sum(st.lengths[:q] > 0)
            return (jnp.any(st.slots.row < q) | (st.next_row < num_rows)) & (done < target)

        def body(st: _LoopState):
            if q > s:
                wanted = jnp.minimum(jnp.sum(st.slots.row == q), num_rows - st.next_row)
                branch = jnp.searchsorted(jnp.asarray(sizes), wanted)
                st = jax.lax.cond(
                    wanted > 0,
                    lambda x: jax.lax.switch(
                        branch, [functools.partial(refill, f=f) for f in sizes], x
                    ),
                    lambda x: x,
                    st,
                )
            return decode(st, prepared)

        state = jax.lax.while_loop(cond, body, state)
    lengths = state.lengths[:q]
    mask = (jnp.arange(r)[None, :] < lengths[:, None]).astype(jnp.int32)
    routes = {}
    if state.prompt_routes is not None:
        routes = {"prompt_routes": state.prompt_routes[:q],
                  "response_routes": state.response_routes[:q]}  # fmt: skip
    return GenerationOutput(
        responses=jnp.where(mask > 0, state.tokens[:q], pad_id),
        response_mask=mask,
        log_probs=state.log_probs[:q] * mask,
        lengths=lengths,
        decode_steps=state.decode_steps,
        slots=s,
        **routes,
    )


def finish_target(num_rows: Int[Array, ""], over_sample_rate: float) -> Int[Array, ""]:
    """Rows that must finish before `generate` stops: verl's int(rows x (1 - rate)), in
    exact integer arithmetic (the rate as a fraction a / b: rows - ceil(rows x a / b))."""
    if over_sample_rate <= 0:
        return num_rows
    rate = fractions.Fraction(over_sample_rate).limit_denominator(10_000)
    a, b = rate.numerator, rate.denominator
    return num_rows - (num_rows * a + b - 1) // b


def idle_fraction(out: GenerationOutput) -> float:
    """Share of the decode loop's slot-steps that produced no token (slots whose row had
    finished with nothing left to refill them: RL's long tail):
    1 - sum_i (length_i - 1) / (decode_steps * slots), the first token coming from prefill."""
    produced = float(np.maximum(np.asarray(out.lengths) - 1, 0).sum())
    capacity = int(out.decode_steps) * out.slots
    return 1.0 - produced / capacity if capacity else 0.0


@functools.lru_cache(maxsize=64)
def _compiled(
    config: DecoderConfig,
    sp: SamplingParams,
    layout: Layout | None,
    b: int,
    p: int,
    slots: int,
    backend: DecodeBackend,
    replicated_out: bool = False,
    prefix_sharing: bool = True,
):
    log.info(
        "compiling generate: batch %d, prompt %d, max_tokens %d, %d slots (%s)%s",
        b,
        p,
        sp.max_tokens,
        slots,
        "greedy" if not sp.do_sample else f"T={sp.temperature} k={sp.top_k} p={sp.top_p}",
        f", {backend.name} decode backend",
    )
    fn = functools.partial(_generate, config, sp, layout, slots, backend, prefix_sharing)
    if layout is None:
        return jax.jit(fn)
    tokens = layout.tokens((b, p))
    out = layout.replicated() if replicated_out else None
    return jax.jit(fn, in_shardings=(None, tokens, tokens, None, None, None), out_shardings=out)


def generate(
    config: DecoderConfig,
    params: Any,
    input_ids: Int[Array, "b p"] | np.ndarray,
    attention_mask: Int[Array, "b p"] | np.ndarray,
    sampling_params: SamplingParams,
    rng: jax.Array | None = None,
    *,
    layout: Layout | None = None,
    max_prompt_length: int | None = None,
    max_num_seqs: int | None = None,
    prefix_sharing: bool = True,
    decode_backend: str = "auto",
    every_process: bool | None = None,
    defer: bool = False,
) -> GenerationOutput:
    """Generate responses for left-padded prompts.

    Args:
        config: The model.
        params: Its parameters (in `layout` when given).
        input_ids: Left-padded prompt ids [B, P].
        attention_mask: 1 on prompt tokens, 0 on padding [B, P].
        sampling_params: What to generate.
        rng: A fresh PRNG key per call (the caller's responsibility: never reuse one):
            `jax.random.key(s)` or the legacy `jax.random.PRNGKey(s)` (the same samples);
            None derives it from `sampling_params.seed`.
        layout: The rollout layout (mesh dp x tp) to generate on; None: one device.
        max_prompt_length: Refuse prompts longer than this (the configured maximum).
        max_num_seqs: Rows decoded at once (KV-cache slots; verl's `rollout.max_num_seqs`).
            With fewer slots than rows, a finished row's slot is refilled with the next
            prompt (continuous batching); None: one slot per row.
        prefix_sharing: With n > 1, prefill each prompt once and copy its keys and values
            into its n slots (False: prefill every copy; the same outputs up to rounding).
        decode_backend: How the decode step runs: "xla", "cpu_kernels" or "auto"
            (`jaxrl.rollout.backends`).

    Several processes: every process calls `generate` with its own prompts (numpy, the same
    number on each), the same rng and the rollout `layout`; one program generates for all of
    them, and each process gets back the rows of its own prompts as numpy arrays. The mesh
    may be on some processes' devices only (the rollout placed there): the others' prompts
    reach it and their rows come back device to device (`reshard.moved`). On one process's
    share of the mesh (`RolloutEngine.local`) it runs as in one process.

    `every_process`: whether every process calls it (the mesh's owners and the others);
    None: when the mesh has devices of other processes than this one. `defer` (several
    processes): return the output on the rollout's devices, dispatched and not read, its
    `local` saying where this process's rows are; `own_rows` reads them (every process
    at once). Without it the call waits for the whole generation (a caller generating ahead
    of the trainer defers).

    Raises:
        ValueError: for a prompt longer than `max_prompt_length`, or `max_tokens` beyond the
            model's context, naming the parameter and the allowed range; with several
            processes, for unequal prompt counts or a mesh whose `dp` axis does not split
            evenly over the processes.
        TypeError: with several processes, for prompts given as jax arrays.
    """
    sp = sampling_params
    if sp.stop:
        raise ValueError(
            f"generate() takes no stop strings (stop={sp.stop!r}): they need the text, which "
            "the conversation API of RolloutEngine (rollout/engine.py) decodes; give "
            "stop_token_ids here"
        )
    if jax.process_count() > 1 and layout is None:
        raise ValueError(
            f"generate() in a run of {jax.process_count()} processes needs the rollout "
            "layout (layout=...): the whole rollout mesh's, or one process's share of it"
        )
    spanning = layout is not None and (
        spans_processes(layout.mesh) if every_process is None else every_process
    )  # one program, every process calling
    if spanning and (isinstance(input_ids, jax.Array) or isinstance(attention_mask, jax.Array)):
        raise TypeError(
            "generate() over several processes' devices takes this process's prompts as host "
            "(numpy) arrays"
        )
    input_ids = np.asarray(input_ids) if not isinstance(input_ids, jax.Array) else input_ids
    attention_mask = (
        np.asarray(attention_mask) if not isinstance(attention_mask, jax.Array) else attention_mask
    )
    b, p = input_ids.shape
    if attention_mask.shape != (b, p):
        raise ValueError(f"attention_mask {attention_mask.shape} does not match input_ids {(b, p)}")
    longest = int(np.asarray(attention_mask).sum(axis=-1).max()) if b else 0
    if max_prompt_length is not None and longest > max_prompt_length:
        raise ValueError(
            f"a prompt has {longest} tokens, more than max_prompt_length={max_prompt_length}"
        )
    context = config.rope.max_position_embeddings
    if longest + sp.max_tokens > context:
        raise ValueError(
            f"max_tokens={sp.max_tokens} with a {longest}-token prompt exceeds the model's context "
            f"of {context}; max_tokens must be <= {max(context - longest, 0)}"
        )
    if max_num_seqs is not None and max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs}: must be >= 1 (or None: one per row)")
    if rng is None:
        rng = jax.random.key(0 if sp.seed is None else sp.seed)
    rng = typed_key(rng, "generate(rng=...)")
    plan = _Plan(
        layout, max_num_seqs, prefix_sharing, choose_backend(decode_backend, config, layout)
    )
    if spanning and sp.record_routes:
        raise ValueError(
            "recording a mixture of experts' routes (routing replay) over several processes' "
            "rollout is not implemented; use one process"
        )
    if spanning:
        return _generate_processes(config, params, input_ids, attention_mask, sp, rng, plan,
                                   defer)  # fmt: skip
    fn, args = _program(config, params, input_ids, attention_mask, sp, rng, plan)
    out = _rows(fn(*args), slice(0, b * sp.n))
    if out.prompt_routes is not None:  # the prompts' own columns (padded on the left)
        out = out.replace(prompt_routes=out.prompt_routes[:, out.prompt_routes.shape[1] - p :])
    return out


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How `generate` runs, beyond the prompts and sampling (see its arguments)."""

    layout: Layout | None
    max_num_seqs: int | None
    prefix_sharing: bool
    backend: DecodeBackend


def _program(config, params, input_ids, attention_mask, sp, rng, plan: _Plan):
    """The jitted generation program for these prompts and its arguments (rows repeated `n`
    times and padded to the bucketed shapes the program is compiled for)."""
    b, p = input_ids.shape
    ids = jnp.repeat(jnp.asarray(input_ids, jnp.int32), sp.n, axis=0)
    mask = jnp.repeat(jnp.asarray(attention_mask, jnp.int32), sp.n, axis=0)
    rows, layout = b * sp.n, plan.layout
    dp = 1 if layout is None else int(layout.mesh.shape.get("dp", 1))
    padded_rows = -(-bucket(rows, 1) // dp) * dp
    padded_len = bucket(p)
    ids = jnp.pad(ids, ((0, padded_rows - rows), (padded_len - p, 0)))
    mask = jnp.pad(mask, ((0, padded_rows - rows), (padded_len - p, 0)))
    slots = _num_slots(plan.max_num_seqs, padded_rows, dp)
    fn = _compiled(
        config,
        sp,
        layout,
        padded_rows,
        padded_len,
        slots,
        plan.backend,
        prefix_sharing=plan.prefix_sharing,
    )
    order = jnp.arange(padded_rows, dtype=jnp.int32)
    return fn, (params, ids, mask, rng, jnp.int32(rows), order)


def compile_generate(
    config: DecoderConfig,
    params: Any,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    sampling_params: SamplingParams,
    *,
    layout: Layout | None = None,
    max_num_seqs: int | None = None,
    prefix_sharing: bool = True,
    decode_backend: str = "auto",
) -> jax.stages.Compiled:
    """The compiled program `generate` runs for prompts of these shapes, without running it
    (`params` may be `jax.ShapeDtypeStruct`s with shardings): for its memory and cost
    analyses."""
    backend = choose_backend(decode_backend, config, layout)
    plan = _Plan(layout, max_num_seqs, prefix_sharing, backend)
    rng = jax.random.key(0)
    fn, args = _program(config, params, input_ids, attention_mask, sampling_params, rng, plan)
    return fn.lower(*args).compile()


def _num_slots(max_num_seqs: int | None, rows: int, dp: int) -> int:
    """KV-cache slots: one per row, or `max_num_seqs` (a multiple of dp) when fewer."""
    if max_num_seqs is None or max_num_seqs >= rows:
        return rows
    return max(max_num_seqs // dp, 1) * dp


def _rows(out: GenerationOutput, index: slice) -> GenerationOutput:
    """The output's rows `index` (dropping padding rows, or other processes' rows)."""
    routes = {}
    if out.prompt_routes is not None:
        routes = {"prompt_routes": out.prompt_routes[index],
                  "response_routes": out.response_routes[index]}  # fmt: skip
    return out.replace(
        responses=out.responses[index],
        response_mask=out.response_mask[index],
        log_probs=out.log_probs[index],
        lengths=out.lengths[index],
        **routes,
    )


def _block_per_process(mesh: jax.sharding.Mesh, processes: int) -> bool:
    """Whether the mesh's `dp` rows (each a tensor-parallel group) are each on one process,
    process p holding the p-th of `processes` equal blocks of them: then each process places
    its prompts on its own rows of the mesh."""
    rows = mesh.devices.reshape(mesh.devices.shape[0], -1)
    owners = [{d.process_index for d in row} for row in rows]
    if any(len(o) != 1 for o in owners) or len(rows) % processes:
        return False
    per = len(rows) // processes
    return [o.pop() for o in owners] == [p for p in range(processes) for _ in range(per)]


def _generate_processes(
    config: DecoderConfig,
    params: Any,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    sp: SamplingParams,
    rng: jax.Array,
    plan: _Plan,
    defer: bool,
) -> GenerationOutput:
    """`generate` in a multi-process run: every process passes its own prompts (the same
    number on each), one program generates for all of them over the whole rollout mesh, and
    each process gets back the rows of its own prompts (numpy; `defer`: the output on the
    rollout's devices, dispatched, for `own_rows`).

    Process p's rows (its prompts repeated n times, padded to a multiple of its share of `dp`)
    are block p of the global batch (`make_array_from_process_local_data`); the queue takes
    the real rows of every block before any padding row, so padding is never decoded; the
    outputs come back replicated. The rng must be the same on every process (it is one
    program). A mesh whose `dp` rows are not an equal block of each process's (on some
    processes' devices only, or in unequal shares): each process puts its block on its first
    device, `reshard.moved` takes the batch to the mesh's devices, and the replicated outputs
    come back the same way onto one device of each process.
    """
    processes = jax.process_count()
    b, p = input_ids.shape
    shapes = allgather_objects((b, p))
    if len({rows for rows, _ in shapes}) > 1:
        raise ValueError(
            "generate(): every process must pass the same number of prompts; got "
            + ", ".join(f"process {i}: {rows}" for i, (rows, _) in enumerate(shapes))
        )
    layout = plan.layout
    dp = int(layout.mesh.shape.get("dp", 1))
    everywhere = _block_per_process(layout.mesh, processes)
    rows = b * sp.n
    unit = dp // processes if everywhere else dp // math.gcd(dp, processes)
    local_rows = -(-bucket(rows, 1) // unit) * unit
    padded_len = bucket(max(width for _, width in shapes))
    pad = ((0, local_rows - rows), (padded_len - p, 0))
    ids = np.pad(np.repeat(input_ids.astype(np.int32), sp.n, axis=0), pad)
    mask = np.pad(np.repeat(attention_mask.astype(np.int32), sp.n, axis=0), pad)
    global_rows = local_rows * processes
    shape = (global_rows, padded_len)
    sharding = layout.tokens(shape)
    start = jax.process_index() * local_rows  # its block (on one of its devices, staged)
    if everywhere:  # each process's block on its own rollout devices
        start, stop = process_rows(sharding, shape)
        if stop - start != local_rows:
            raise ValueError(
                f"the rollout mesh gives this process rows [{start}, {stop}) of {global_rows}, "
                f"not one block of {local_rows}: its devices are not one contiguous part of the "
                "dp axis"
            )
        ids = jax.make_array_from_process_local_data(sharding, ids, shape)
        mask = jax.make_array_from_process_local_data(sharding, mask, shape)
    else:  # on one device of each process, then device to device onto the rollout's
        staging = one_device_each(split=True)
        ids = moved(jax.make_array_from_process_local_data(staging, ids, shape), sharding)
        mask = moved(jax.make_array_from_process_local_data(staging, mask, shape), sharding)
    slots = _num_slots(plan.max_num_seqs, global_rows, dp)
    fn = _compiled(
        config, sp, layout, global_rows, padded_len, slots, plan.backend, True, plan.prefix_sharing
    )
    # The queue: every process's real rows in process order, then the padding rows (which sit
    # at the end of each process's block and are never decoded).
    blocks = np.arange(global_rows).reshape(processes, local_rows)
    order = np.concatenate([blocks[:, :rows].ravel(), blocks[:, rows:].ravel()]).astype(np.int32)
    order = global_array(order, layout.replicated())
    count = np.int32(rows * processes)
    if not everywhere:  # the key and count placed too: a process may hold none of the devices
        data = global_array(np.asarray(jax.random.key_data(rng)), layout.replicated())
        rng = jax.random.wrap_key_data(data, impl=jax.random.key_impl(rng))
        count = global_array(count, layout.replicated())
    out = fn(params, ids, mask, rng, count, order)
    out = out.replace(local=LocalRows(start, start + rows, move=not everywhere))
    return out if defer else own_rows(out)


def own_rows(out: GenerationOutput) -> GenerationOutput:
    """This process's rows (numpy) of a multi-process `generate(..., defer=True)` output (every
    process calls it at once: where the rollout's devices are some processes' only, a whole
    copy moves onto one device of each process first, device to device); any other output
    as it is."""
    where = out.local
    if where is None:
        return out
    if where.move:
        out = jax.tree.map(lambda x: moved(x, one_device_each()), out)
    host = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), out)
    return _rows(host, slice(where.start, where.stop)).replace(local=None)
