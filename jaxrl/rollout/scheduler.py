"""`Scheduler`: requests over the engine's conversation slots.

    scheduler = Scheduler(engine, chunk=16)
    [h] = scheduler.submit(prompt_ids, sampling, key)          # one request, queued
    group = scheduler.submit(prompt_ids, sampling, key, copies=4)   # 4 samples of one prompt
    finished = scheduler.step()        # admit what fits, decode every running turn a chunk
    h.tokens, h.log_probs              # the turn so far (streamed, chunk by chunk)
    h.finish_reason                    # "stop" | "length" | "abort"; None while it runs
    scheduler.run(group)               # step until these are over
    scheduler.abort(h)                 # queued or running: it ends now

    [h] = scheduler.submit(prompt_ids, sampling, key, keep_open=True)   # a conversation
    scheduler.run([h])
    h2 = scheduler.resume(h, tool_output_ids, sampling, key2)   # its next turn, after them
    record = scheduler.close(h2)       # prompt, response, log-probs, sampled mask; slot free

    out = scheduler.generate(input_ids, attention_mask, sampling, key)   # a batch request
    out.responses, out.response_mask, out.log_probs, out.version, out.fixed_batch

A request is one turn: the first of a new conversation (`submit`) or the next of an open one
(`resume`: the given tokens, a tool's output or the next user message, are appended first).
Requests carry their own sampling settings: the engine decodes slots with different
temperatures, top-k / top-p, max_tokens, end tokens and stop strings in one compiled program
(`RolloutEngine.decode`), so requests of any settings share the engine.

`step`:
    admit    queued new requests in order, as long as the free slots hold the next one's
             copies (one `engine.start` per distinct copy count; prompts of different lengths
             left-padded to one width, each prompt prefilled once for its copies)
    append   the queued resumes' tokens, in one `engine.append`; a resume with no room left
             ends with "length", nothing sampled
    decode   every running turn, `chunk` tokens at most (None: until every turn is over)
    finish   a turn over: its handle is done; its conversation's slot is freed unless
             `keep_open` (then `resume` or `close` it)

A batch (`generate`: every prompt `sampling.n` times, rows in the order prompt i, copy j)
takes the fixed-batch path when no request is queued, running or open: the engine's
`generate`, prefill and decode in one on-device program over all processes (the fast path:
on W1 1.1x the slots' tokens/s at chunks of 64 steps, 1.7x at 16; `benchmarks/scheduler.py`).
Otherwise (or `fast=False`) its prompts are requests like any other: prompt i submitted with
`copies=n` and `fold_in(key, i)`, run to their end beside the others. The two paths sample
the same distributions, not the same tokens (each its own key layout).

A submitted request's copy j takes `fold_in(key, j)` as its key (one copy too), a resumed
turn `key` itself; a turn samples its k-th token with `fold_in(its key, k)`: the same tokens
whichever requests decode alongside it, in whatever chunks. A handle's `version` is the
engine's `version` (`load_weights(..., version=)`) when the turn sampled its first token, and
`versions` that of each token: weights pushed between two `step`s leave the running turns
to continue on the new weights with the caches they have (a partial rollout, PipelineRL's
in-flight update: the tokens before the push keep the keys and values the old weights
computed), so a turn over a push has both.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.generation import GenerationOutput, own_rows
from jaxrl.rollout.sampling import SamplingParams, typed_key
from jaxrl.rollout.slots import Conversation
from jaxrl.sharding.processes import spans_processes

Array = Any  # a device array (the fixed-batch path) or numpy (the slots')


@dataclasses.dataclass(eq=False)
class Handle:
    """One request: a turn of a conversation, as far as it has got.

    Attributes:
        id: The request's number in its scheduler (submission order).
        sampling: Its settings (`n` must be 1: `copies` makes groups).
        tokens: The turn's sampled tokens so far.
        log_probs: Their log-probs (the processed distribution).
        finish_reason: "stop", "length" or "abort" once over; None before.
        version: The engine's weights version the turn's first token was sampled with
            (None: unversioned weights, or nothing sampled yet).
        versions: Per token of the turn, the weights version that sampled it: a turn that
            runs over a `load_weights` (a push between two `step`s) continues on the new
            weights with its cache (a partial rollout) and has both.
        slot: The engine slot of its conversation (None while queued, and once freed).
        record: The conversation's record, once its slot is freed (the turn's end without
            `keep_open`, `abort` or `close`).
    """

    id: int
    sampling: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    version: int | None = None
    versions: list[int | None] = dataclasses.field(default_factory=list)
    slot: int | None = None
    record: Conversation | None = None
    keep_open: bool = False
    _key: np.ndarray | None = dataclasses.field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class BatchOutput:
    """A batch request's rows (prompt i's copy j at row i * n + j), right-padded to
    `max_tokens` columns with the model's pad id.

    Attributes:
        responses: Token ids [B*n, R].
        response_mask: 1 on response tokens (an end token included), 0 after.
        log_probs: The tokens' log-probs under the processed distribution (0 on padding).
        version: The engine's weights version it was sampled with.
        fixed_batch: Which path ran: the engine's fixed-batch loop (device arrays, every
            process's rows), or requests on the slots (numpy, this process's).
        deferred: The fixed-batch path over several processes: the whole output, on the
            rollout's devices, with where this process's rows are (`rows()` reads them);
            else None.
        prompt_routes: `SamplingParams.record_routes` (the fixed-batch path, one process):
            the experts of every prompt token in every layer [B*n, P, L, k], else None.
        response_routes: The same for the response tokens [B*n, R, L, k].
    """

    responses: Array
    response_mask: Array
    log_probs: Array
    version: int | None
    fixed_batch: bool
    deferred: GenerationOutput | None = None
    prompt_routes: Array | None = None
    response_routes: Array | None = None

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(responses, response_mask, log_probs) of this process's rows on the host: the
        arrays read, or, from the fixed-batch path over several processes, this process's
        rows of them (`generation.own_rows`; every process calls it at once)."""
        if self.deferred is not None:
            out = own_rows(self.deferred)
            return out.responses, out.response_mask, out.log_probs
        return tuple(np.asarray(x) for x in (self.responses, self.response_mask, self.log_probs))


@dataclasses.dataclass
class _NewGroup:
    """A queued `submit`: one prompt for `len(handles)` copies, left-padded to at least
    `width` columns when prefilled."""

    prompt: np.ndarray
    handles: list[Handle]
    width: int = 0


@dataclasses.dataclass
class _Resume:
    """A queued `resume`: tokens to append before the handle's turn."""

    handle: Handle
    tokens: np.ndarray


class Scheduler:
    """Requests over one `RolloutEngine`'s slots (module doc).

    Args:
        engine: The engine (its weights loaded before the first `step`).
        chunk: Decode steps per `step` (None: each `step` decodes until every running turn is
            over).
    """

    def __init__(self, engine: RolloutEngine, chunk: int | None = 16):
        if chunk is not None and chunk < 1:
            raise ValueError(f"Scheduler(chunk={chunk}): must be >= 1 (or None)")
        self.engine, self.chunk = engine, chunk
        self._queue: collections.deque[_NewGroup] = collections.deque()
        self._resumes: list[_Resume] = []
        self._running: dict[int, Handle] = {}  # slot -> the handle decoding in it
        self._open: dict[int, Handle] = {}  # slot -> the kept-open conversation's last handle
        self._count = 0
        self.decode_calls = 0  # engine.decode calls made

    # ---- requests ------------------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int] | np.ndarray,
        sampling: SamplingParams,
        key: jax.Array,
        *,
        copies: int = 1,
        keep_open: bool = False,
        pad_to: int = 0,
        first_copy: int = 0,
    ) -> list[Handle]:
        """Queue a new conversation's first turn, `copies` times (copy j samples with
        `fold_in(key, first_copy + j)`: a client numbering its requests under one key, as
        an external agent's episode numbers its calls); returns its handles. `keep_open`:
        the conversation stays in its slot after the turn (for `resume` or `close`).
        `pad_to`: prefill the prompt left-padded to at least this many columns (a client
        that must lay prompts out as its batches were: the padding changes no token, but
        the cache cells they land in)."""
        ids = np.asarray(prompt)
        if ids.ndim != 1 or not ids.size or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"submit() takes one prompt as a flat, non-empty list of token ids; got "
                f"{ids.dtype} {ids.shape}"
            )
        if copies < 1:
            raise ValueError(f"submit(copies={copies}): must be >= 1")
        if copies > self.engine.slots:
            raise ValueError(
                f"submit(copies={copies}): more than the engine's {self.engine.slots} slots "
                "(max_num_seqs) can ever hold at once"
            )
        self.engine.check_sampling(sampling)
        self.engine.check_ids(ids, "submit()")
        keys = _key_data(key, copies, first_copy)
        handles = [self._handle(sampling, k, keep_open) for k in keys]
        self._queue.append(_NewGroup(ids.astype(np.int32), handles, pad_to))
        return handles

    def resume(
        self,
        handle: Handle,
        tokens: Sequence[int],
        sampling: SamplingParams,
        key: jax.Array,
        *,
        keep_open: bool = True,
    ) -> Handle:
        """Queue the next turn of `handle`'s open conversation, after `tokens` (a tool's
        output, the next user message; may be empty) are appended; returns its handle. The
        turn samples with `key` itself."""
        if not handle.done or handle.slot is None or self._open.get(handle.slot) is not handle:
            raise ValueError(
                f"resume(): request {handle.id} is not the finished last turn of an open "
                "conversation (submit it with keep_open=True and run it to its end first)"
            )
        self.engine.check_sampling(sampling)
        ids = np.asarray(tokens, np.int64).reshape(-1)
        # here, not in step's batched append, whose error ends every conversation in it
        self.engine.check_ids(ids, f"resume() of request {handle.id}")
        key = _one_key(key, f"resume() of request {handle.id}")
        new = self._handle(sampling, np.asarray(jax.random.key_data(key)), keep_open)
        new.slot = handle.slot
        del self._open[handle.slot]
        self._resumes.append(_Resume(new, ids))
        return new

    def close(self, handle: Handle) -> Conversation:
        """End the open conversation whose last turn is `handle` (its slot is free again);
        returns its record."""
        if handle.slot is None or self._open.get(handle.slot) is not handle:
            raise ValueError(f"close(): request {handle.id} holds no open conversation")
        del self._open[handle.slot]
        return self._free(handle)

    def abort(self, handle: Handle) -> None:
        """End a queued or running request now (finish reason "abort"), and its
        conversation; an open conversation is closed. A finished one is left as it is."""
        if handle.slot is not None and self._open.get(handle.slot) is handle:
            self.close(handle)
            return
        if handle.done:
            return
        handle.finish_reason = "abort"
        for group in self._queue:
            if handle in group.handles:
                group.handles.remove(handle)
        self._queue = collections.deque(g for g in self._queue if g.handles)
        self._resumes = [r for r in self._resumes if r.handle is not handle]
        if handle.slot is not None:
            self._running.pop(handle.slot, None)
            self._free(handle)

    def generate(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        sampling: SamplingParams,
        key: jax.Array | None,
        *,
        fast: bool | None = None,
    ) -> BatchOutput:
        """A batch request: the left-padded prompts [B, P], each `sampling.n` times (module
        doc). `fast`: None takes the fixed-batch path when the scheduler is idle (its rows
        come back as device arrays, dispatched, not waited for; over several processes the
        whole batch's on the rollout's devices, `BatchOutput.rows` reading this process's);
        True insists on it (an error while requests hold slots); False runs the rows as
        requests on the slots, returning when every row is over. `key` None:
        `sampling.seed`'s, as `generate`."""
        if key is None:
            key = jax.random.key(0 if sampling.seed is None else sampling.seed)
        key = _one_key(key, "generate()")
        idle = not self.busy and not self._open
        if fast and not idle:
            raise ValueError(
                "generate(fast=True): the fixed-batch path needs the whole engine, and "
                f"requests hold {self.engine.slots - self.engine.free_slots} of its slots; "
                "run them to their end first, or pass fast=None"
            )
        version = self.engine.version
        if fast or (fast is None and idle):
            out = self.engine.generate(input_ids, attention_mask, sampling, key, defer=True)
            deferred = out if out.local is not None else None
            return BatchOutput(out.responses, out.response_mask, out.log_probs, version, True,
                               deferred, out.prompt_routes, out.response_routes)  # fmt: skip
        if spans_processes(self.engine.layout.mesh):
            raise ValueError(
                "generate(fast=False): slots are one process's, and this engine's mesh spans "
                "processes: a multi-process batch takes the fixed-batch path (an idle "
                "scheduler, fast=None), or each process runs its rows on Scheduler(engine."
                "local())"
            )
        if sampling.record_routes:
            raise ValueError(
                "generate(): recording a mixture of experts' routes (routing replay) runs on "
                "the fixed-batch path only: run the batch on an idle scheduler"
            )
        if sampling.over_sample_rate:
            raise ValueError(
                f"generate(): over_sample_rate={sampling.over_sample_rate} aborts the batch's "
                "slowest rows on the fixed-batch path only; on the slots it is not applied: "
                "set it to 0, or run the batch on an idle scheduler"
            )
        one = dataclasses.replace(sampling, n=1)
        width = input_ids.shape[1]
        handles: list[Handle] = []
        try:
            for i, (ids, mask) in enumerate(zip(input_ids, attention_mask, strict=True)):
                prompt = np.asarray(ids)[np.asarray(mask) > 0]
                handles += self.submit(
                    prompt, one, jax.random.fold_in(key, i), copies=sampling.n, pad_to=width
                )
        except BaseException:
            for handle in handles:  # a bad prompt: none of the batch's rows stays queued
                self.abort(handle)
            raise
        self.run(handles)
        pad_id = self.engine.config.pad_token_id
        return _padded(handles, sampling.max_tokens, pad_id or 0, version)

    # ---- progress ------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        """The engine's free slots less the copies of the queued requests."""
        return self.engine.free_slots - sum(len(g.handles) for g in self._queue)

    @property
    def busy(self) -> bool:
        """Whether a request is queued or running."""
        return bool(self._queue or self._resumes or self._running)

    def step(self) -> list[Handle]:
        """Admit, append, decode one chunk, finish (module doc); returns the handles whose
        turns ended in this step."""
        self._admit()
        ended = self._append()
        if self._running:
            ended += self._decode()
        return ended

    def run(self, handles: Sequence[Handle] | None = None) -> list[Handle]:
        """`step` until `handles` (None: every request) are over; returns them."""
        wanted = list(handles) if handles is not None else None
        while (not all(h.done for h in wanted)) if wanted is not None else self.busy:
            if not self.busy:
                raise RuntimeError(
                    "run(): the requests waited for are neither queued nor running (handles "
                    "of another scheduler?)"
                )
            self.step()
        return wanted if wanted is not None else []

    # ---- the four phases -----------------------------------------------------------------

    def _admit(self) -> None:
        """Start queued groups in order while the free slots hold the next."""
        taken, free = [], self.engine.free_slots
        while self._queue and len(self._queue[0].handles) <= free:
            group = self._queue.popleft()
            free -= len(group.handles)
            taken.append(group)
        by_copies: dict[int, list[_NewGroup]] = collections.defaultdict(list)
        for group in taken:
            by_copies[len(group.handles)].append(group)
        for copies, groups in by_copies.items():
            width = max(max(len(g.prompt), g.width) for g in groups)
            ids = np.stack([np.pad(g.prompt, (width - len(g.prompt), 0)) for g in groups])
            mask = np.stack(
                [np.pad(np.ones_like(g.prompt), (width - len(g.prompt), 0)) for g in groups]
            )
            slots = self.engine.start(ids, mask, copies=copies)
            handles = [h for g in groups for h in g.handles]
            for slot, handle in zip(slots, handles, strict=True):
                handle.slot = int(slot)
                self._running[int(slot)] = handle

    def _append(self) -> list[Handle]:
        """Append the queued resumes' tokens (one `engine.append`); a resume without room
        ends with "length"."""
        resumes, self._resumes = self._resumes, []
        ended, fed = [], []
        for r in resumes:
            if len(r.tokens) >= self.engine.room(r.handle.slot):  # no token left to sample
                r.handle.finish_reason = "length"
                self._finish(r.handle)
                ended.append(r.handle)
            else:
                fed.append(r)
        if nonempty := [r for r in fed if len(r.tokens)]:
            self.engine.append([r.handle.slot for r in nonempty], [r.tokens for r in nonempty])
        for r in fed:
            self._running[r.handle.slot] = r.handle
        return ended

    def _decode(self) -> list[Handle]:
        """One chunk of every running turn."""
        handles = list(self._running.values())
        slots = [h.slot for h in handles]
        keys = jax.random.wrap_key_data(np.stack([h._key for h in handles]))
        for h in handles:
            if not h.tokens:  # the weights its first token is sampled with
                h.version = self.engine.version
        turn = self.engine.decode(slots, [h.sampling for h in handles], keys, max_steps=self.chunk)
        self.decode_calls += 1
        ended = []
        for h, tokens, log_probs, versions, reason in zip(
            handles, turn.tokens, turn.log_probs, turn.versions, turn.finish_reasons, strict=True
        ):
            h.tokens, h.log_probs, h.versions = tokens.tolist(), log_probs.tolist(), versions
            if reason is not None:
                h.finish_reason = reason
                del self._running[h.slot]
                self._finish(h)
                ended.append(h)
        return ended

    def _finish(self, handle: Handle) -> None:
        """A turn is over: keep its conversation open, or free its slot."""
        if handle.keep_open:
            self._open[handle.slot] = handle
        else:
            self._free(handle)

    def _free(self, handle: Handle) -> Conversation:
        [handle.record] = self.engine.end([handle.slot])
        handle.slot = None
        return handle.record

    def _handle(self, sampling: SamplingParams, key: np.ndarray, keep_open: bool) -> Handle:
        self._count += 1
        return Handle(id=self._count - 1, sampling=sampling, keep_open=keep_open, _key=key)


def _padded(handles: list[Handle], width: int, pad_id: int, version: int | None) -> BatchOutput:
    """The handles' turns as right-padded rows [len(handles), width]."""
    responses = np.full((len(handles), width), pad_id, np.int32)
    log_probs = np.zeros((len(handles), width), np.float32)
    mask = np.zeros((len(handles), width), np.int32)
    for row, h in enumerate(handles):
        n = len(h.tokens)
        responses[row, :n], log_probs[row, :n], mask[row, :n] = h.tokens, h.log_probs, 1
    return BatchOutput(responses, mask, log_probs, version, False)


def _key_data(key: jax.Array, copies: int, first: int = 0) -> np.ndarray:
    """Key data [copies, ...]: `fold_in(key, first + j)` for copy j (one copy too: a
    request's samples do not depend on how many were asked for with it)."""
    key = _one_key(key, "submit()")
    return np.asarray(_copy_keys(key, np.arange(first, first + copies, dtype=np.uint32)))


def _one_key(key: jax.Array, what: str) -> jax.Array:
    """A request's key: one key, typed or legacy (`typed_key`)."""
    key = typed_key(key, what)
    if key.ndim != 0:
        raise ValueError(f"{what}: a request takes one key, not {key.shape} of them")
    return key


@jax.jit
def _copy_keys(key: jax.Array, copies: jax.Array) -> jax.Array:
    """Key data of `fold_in(key, j)` for each j in `copies` (one program per copy count)."""
    return jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(key, copies))
