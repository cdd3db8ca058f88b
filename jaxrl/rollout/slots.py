"""`ConversationSlots`: the engine's conversations, over KV-cache slots that live across calls.

    slots = engine.start(ids, mask)               # conversations: prompts into KV-cache slots
    slots = engine.start(ids, mask, copies=4)     # (each prompt prefilled once, in 4 slots)
    turn = engine.decode(slots, sampling, rng)    # sample until EOS / stop / max_tokens
    turn = engine.decode(slots, sampling, keys, max_steps=16)   # or a chunk of it (None:
                                                  # not over; the next decode continues it)
    engine.append(slots[:1], [tool_output_ids])   # a tool's output, prefilled (not sampled)
    turn = engine.decode(slots[:1], sampling, rng2)
    turn = engine.decode(slots, [greedy, hot, short])  # or each slot its own settings
    record = engine.conversation(slots[0])        # prompt, response, log-probs, sampled mask
    engine.end(slots)                             # the slots are free again
    engine.release()                              # free weights and cache (verl's sleep)

A slot's sampling settings (temperature, top-k, top-p, greedy, end tokens) are arrays the
decode program takes (`sampling.RowSampling`, one row per slot), not constants compiled into
it: one program decodes slots whose requests asked for different settings; `max_tokens` and
stop strings are the host's (the slot's budget per call, the text checked between chunks).

Unlike batch generation's cache (which lives in its program), the conversations' lives
across calls: one cache of `max_num_seqs` slots of `max_model_len` tokens each, allocated on
the first `start` and donated into and out of every conversation program
(`jaxrl.rollout.conversation`), so a conversation's keys and values stay on the devices
between turns while the host runs tools. A decode chunk computes the rows of the slots it
decodes only (`conversation.decode_rows`: their cache rows gathered into a batch of a `bucket`
size of at least 16, a multiple of the mesh's dp, and put back), unless that is all of them.
The host keeps each slot's record (its tokens, their log-probs, and which were sampled) and
its pending token (see `conversation`'s module doc).

A stop string needs the text: with `sampling.stop`, `decode` samples in chunks of
`stop_check_tokens`, detokenizes each still running slot's turn after every chunk, and cuts
the turn after the token that completes a stop string (the slot continues from there: its
pending token is that one; the cache cells written past it are never read, as the next token
overwrites them before any query reaches them).

`ConversationSlots` is the conversation half of `RolloutEngine` (`jaxrl.rollout.engine`),
which subclasses it: it reads the engine's model config, layout, decode backend, weights
(`RolloutWeights`) and limits, and keeps the slots' state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.data.batch import bucket
from jaxrl.models.config import DecoderConfig
from jaxrl.rollout import conversation
from jaxrl.rollout.backends import DecodeBackend
from jaxrl.rollout.generation import cache_geometry
from jaxrl.rollout.sampling import RowSampling, SamplingParams, typed_key
from jaxrl.rollout.weights import RolloutWeights
from jaxrl.sharding.layouts import Layout
from jaxrl.sharding.processes import spans_processes
from jaxrl.sharding.reshard import free

log = logging.getLogger("jaxrl.rollout")


@dataclasses.dataclass
class Conversation:
    """A sequence's host record: one slot's tokens so far (the engine's `end` returns it, a
    scheduler handle's `record`), and the token part of the agent's `Trajectory`.

    Attributes:
        prompt: The prompt's token ids (no padding).
        response: Every token after the prompt, sampled or appended.
        log_probs: Per response token, its log-prob when sampled (processed distribution),
            0.0 when appended.
        sampled: Per response token, 1 if the engine sampled it, 0 if it was appended (a
            tool's output: attended to, not generated; verl's multi-turn response mask).
        versions: Per response token, the version of the weights that sampled it
            (`load_weights(version=)`; a turn that runs over a weight push has two), None
            when appended or sampled with unversioned weights.
    """

    prompt: list[int]
    response: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    sampled: list[int] = dataclasses.field(default_factory=list)
    versions: list[int | None] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Turn:
    """What one `decode` call produced, one entry per requested slot (in their order).

    Attributes:
        tokens: The sampled tokens of the turn.
        log_probs: Their log-probs.
        finish_reasons: "stop" (EOS, a stop token or a stop string), "length"
            (`max_tokens`, or the slot's cache is full), or None: not over yet (`decode`'s
            `max_steps`).
        versions: Per token, the version of the weights that sampled it (a turn decoded in
            chunks with a `load_weights` in between has the earlier, then the later).
    """

    tokens: list[np.ndarray]
    log_probs: list[np.ndarray]
    finish_reasons: list[str]
    versions: list[list[int | None]]


class ConversationSlots:
    """The engine's conversations (module doc): `RolloutEngine` subclasses it and sets what
    it reads (below); this class keeps the slots' cache, host records and turn state.

    Attributes read (the engine's):
        config: The model. layout: The rollout layout. backend: The decode backend.
        weights: The loaded weights (`RolloutWeights`).
        max_prompt_length: Refuse longer prompts (None: no limit).
        max_num_seqs: Slots (None: no conversations).
        max_model_len: Tokens a conversation holds.
        tokenizer, stop_check_tokens: Stop strings' text, checked every that many tokens.
    """

    config: DecoderConfig
    layout: Layout
    backend: DecodeBackend
    weights: RolloutWeights
    max_prompt_length: int | None
    max_num_seqs: int | None
    max_model_len: int
    tokenizer: Any
    stop_check_tokens: int

    def __init__(self) -> None:
        self._cache: Any = None
        self._pending: dict[str, np.ndarray] = {}
        self._records: dict[int, Conversation] = {}
        self._turns: dict[int, _TurnSoFar] = {}  # turns a decode(max_steps=) left running
        self._key_impl = jax.random.key_impl(jax.random.key(0))
        self._keys: np.ndarray | None = None  # each slot's turn key (key data [S, ...])
        self._rows: RowSampling | None = None  # each slot's turn's sampling settings [S]
        self._idle_row: RowSampling | None = None  # what a slot holds between turns

    def _drop_slots(self) -> None:
        """Free the cache's device memory and end every conversation."""
        if self._cache is not None:
            free(self._cache)
            self._cache = None
        self._records.clear()
        self._turns.clear()

    @property
    def slots(self) -> int:
        """Conversation slots: `max_num_seqs`, rounded down to a multiple of the mesh's dp."""
        if self.max_num_seqs is None:
            raise ValueError(
                "conversations need KV-cache slots: set max_num_seqs "
                "(actor_rollout_ref.rollout.max_num_seqs)"
            )
        dp = int(self.layout.mesh.shape.get("dp", 1))
        return max(self.max_num_seqs // dp, 1) * dp

    @property
    def free_slots(self) -> int:
        """Slots not holding a conversation."""
        return self.slots - len(self._records)

    def _geometry(self) -> tuple[int, int]:
        """(cache cells, attention block) of the conversation cache: `max_model_len` cells
        rounded up as `cache_geometry` needs (the cells past `max_model_len` stay unused)."""
        return cache_geometry(self.max_model_len, 0)

    def room_after_prompt(self, columns: int) -> int:
        """`room` of a conversation just started from prompts `columns` wide (left-padded
        to their bucket, as `start` lays them out)."""
        return self.max_model_len - max(bucket(columns), 2)

    def room(self, slot: int) -> int:
        """Tokens the conversation in `slot` can still take: each needs a cell, and the
        pending one keeps its own (so a slot's index stays below `max_model_len`)."""
        return self.max_model_len - 1 - int(self._pending["index"][slot])

    def _ensure_cache(self) -> None:
        if spans_processes(self.layout.mesh):
            raise ValueError(
                "conversations run on one process's devices, and this engine's mesh spans "
                f"{jax.process_count()} processes: open them on engine.local() (this "
                "process's share), whose requests arrive and end at this process's pace"
            )
        if self._cache is None:
            s, (length, _) = self.slots, self._geometry()
            log.info("conversation cache: %d slots x %d cells", s, length)
            self._cache = _open_cache(self.config, self.layout, s, length)
            data = np.asarray(jax.random.key_data(jax.random.key(0)))
            self._keys = np.zeros((s, *data.shape), data.dtype)
            self._idle_row = RowSampling.of([SamplingParams()], self.config.eos_token_id)
            self._rows = RowSampling.of([SamplingParams()] * s, self.config.eos_token_id)
            self._pending = {
                "last": np.zeros(s, np.int32),
                "index": np.zeros(s, np.int32),
                "position": np.zeros(s, np.int32),
            }

    @contextlib.contextmanager
    def _ending_on_error(self, slots: Sequence[int]) -> Iterator[None]:
        """Within the block, an error ends the conversations in `slots` (their host records
        and cache rows may disagree), and every conversation if the cache itself was lost (a
        program that failed after its cache was donated)."""
        try:
            yield
        except BaseException:
            for slot in slots:
                self._records.pop(int(slot), None)
                self._turns.pop(int(slot), None)
            if self._cache is not None and self._cache.segments.is_deleted():
                self._cache = None
                self._records.clear()
                self._turns.clear()
            raise

    def check_ids(self, ids: np.ndarray, what: str) -> None:
        """Refuse token ids outside the vocabulary, naming `what` was given them."""
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            raise ValueError(
                f"{what}: token id {int(ids[bad][0])} is outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )

    def start(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, copies: int = 1
    ) -> np.ndarray:
        """Open `copies` conversations per left-padded prompt [F, P] (prompt i's copies
        consecutive: rows i * copies ...), each prompt prefilled once and its keys and
        values copied into its slots; returns their slot ids [F * copies]."""
        params = self.weights.get()
        ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
        if ids.ndim != 2 or mask.shape != ids.shape or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                "start() takes left-padded integer prompts [F, P] and a mask of that shape; "
                f"got {ids.dtype} {ids.shape} and {mask.shape}"
            )
        ids, mask = ids.astype(np.int32), (mask > 0).astype(np.int32)
        self.check_ids(ids[mask > 0], "start()")
        counts = mask.sum(axis=-1)
        if (counts == 0).any() or (mask[:, -1] == 0).any():
            row = int(np.flatnonzero((counts == 0) | (mask[:, -1] == 0))[0])
            raise ValueError(
                f"prompt row {row} is empty or not left-padded (its last column is padding)"
            )
        if self.max_prompt_length is not None and counts.max() > self.max_prompt_length:
            raise ValueError(
                f"a prompt has {counts.max()} tokens, more than "
                f"max_prompt_length={self.max_prompt_length}"
            )
        width = max(bucket(ids.shape[1]), 2)
        if self.room_after_prompt(ids.shape[1]) < 1:
            raise ValueError(
                f"prompts of {ids.shape[1]} tokens (padded to {width}) leave no room in a "
                f"conversation of max_model_len={self.max_model_len} cells: raise max_model_len"
            )
        if copies < 1:
            raise ValueError(f"start(copies={copies}): must be >= 1")
        self._ensure_cache()
        f = ids.shape[0]
        free_ids = [s for s in range(self.slots) if s not in self._records]
        if f * copies > len(free_ids):
            raise ValueError(
                f"start(): {f} prompts x {copies} copies but {len(free_ids)} free slots of "
                f"{self.slots} (max_num_seqs): end() finished conversations first"
            )
        slot_ids = np.asarray(free_ids[: f * copies], np.int32)
        rows = bucket(f, 1)
        pad = ((0, rows - f), (width - ids.shape[1], 0))
        program = _start_program(self.config, self.layout, copies)
        with self._ending_on_error([]):
            self._cache = program(
                params,
                self._cache,
                np.pad(slot_ids, (0, (rows - f) * copies), constant_values=self.slots),
                np.pad(ids, pad),
                np.pad(mask, pad),
            )
        ids, mask, counts = (np.repeat(a, copies, axis=0) for a in (ids, mask, counts))
        self._pending["last"][slot_ids] = ids[:, -1]
        self._pending["index"][slot_ids] = width - 1
        self._pending["position"][slot_ids] = counts - 1
        for slot, row_ids, row_mask in zip(slot_ids, ids, mask, strict=True):
            self._records[int(slot)] = Conversation(prompt=row_ids[row_mask > 0].tolist())
        return slot_ids

    def _check_open(self, slots: Sequence[int]) -> list[int]:
        slots = [int(s) for s in np.atleast_1d(np.asarray(slots))]
        closed = [s for s in slots if s not in self._records]
        if closed:
            raise ValueError(f"slots {closed} hold no conversation (start() opens them)")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} repeat a slot")
        return slots

    def decode(
        self,
        slots: Sequence[int],
        sampling: SamplingParams | Sequence[SamplingParams],
        rng: jax.Array | None = None,
        *,
        max_steps: int | None = None,
    ) -> Turn:
        """Sample each slot's next turn: until an end token (EOS, `stop_token_ids`), a stop
        string, `max_tokens`, or its cache is full. The slots' records grow by the turn.

        `sampling`: one `SamplingParams` for every slot, or one per slot (in `slots`' order):
        the settings are data of the one compiled decode program, so slots with different
        temperatures, top-k / top-p, max_tokens, end tokens or stop strings decode together.

        `rng`: one key (slot `slots[i]`'s turn samples with `fold_in(rng, i)`) or a key per
        slot [len(slots)], typed or legacy (`sampling.typed_key`); None: each slot's
        `sampling.seed`'s (folded with i too). A
        turn's k-th token is drawn with `fold_in(turn key, k)`: the same tokens whichever
        slots decode alongside it.

        `max_steps`: return after at most this many decode steps (about: stop-string
        chunks round it up); a turn not over by then has finish reason None and its tokens
        so far, and continues (with its own key and sampling settings; the call's `rng` is
        not used for it) when its slot is next decoded. Its record grows when it is over.
        """
        slots = self._check_open(slots)
        params, version = self.weights.get(), self.weights.version
        per_slot = self._per_slot(sampling, len(slots))
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"decode(max_steps={max_steps}): must be >= 1 (or None)")
        other = [
            s
            for s, sp in zip(slots, per_slot, strict=True)
            if s in self._turns and self._turns[s].sampling != sp
        ]
        if other:
            raise ValueError(
                f"slots {other}: their turns started with other sampling parameters; continue "
                "them with the same SamplingParams"
            )
        new = [i for i, s in enumerate(slots) if s not in self._turns]
        if new:  # continuing turns keep their keys: no key work (a host copy) per chunk
            keys = _turn_keys(rng, [sp.seed for sp in per_slot], len(slots), self._key_impl)
            for i in new:
                sp = per_slot[i]
                self._turns[slots[i]] = _TurnSoFar(sampling=sp)
                self._keys[slots[i]] = keys[i]
                self._rows.set_row(slots[i], RowSampling.of([sp], self.config.eos_token_id))
        turns = {s: self._turns[s] for s in slots}
        # the program's token columns: one width per chunk size (a slot stops at its budget)
        if max_steps is None:
            steps = bucket(max(t.sampling.max_tokens for t in turns.values()), 1)
        else:
            steps = max_steps
        if any(t.sampling.stop for t in turns.values()):  # chunks, the text checked between
            steps = min(steps, self.stop_check_tokens)
        block = self._geometry()[1]
        whole = _decode_program(self.config, self.layout, steps, block, self.backend)
        rows_only = _decode_rows_program(self.config, self.layout, steps, block, self.backend)
        dp = int(self.layout.mesh.shape.get("dp", 1))
        taken = 0
        with self._ending_on_error(slots):
            while not all(t.reason for t in turns.values()):
                if max_steps is not None and taken >= max_steps:
                    break
                budget = np.zeros(self.slots, np.int32)
                offsets = np.zeros(self.slots, np.int32)
                for s, turn in turns.items():
                    if not turn.reason:
                        left = turn.sampling.max_tokens - len(turn.tokens)
                        budget[s] = max(min(steps, left, self.room(s)), 0)
                        offsets[s] = len(turn.tokens)
                pending = conversation.Pending(**self._pending)
                keys = jax.random.wrap_key_data(self._keys, impl=self._key_impl)
                args = (pending, budget, keys, offsets, self._rows)
                active = np.flatnonzero(budget)
                width = _running_rows(len(active), dp)
                if width < self.slots:  # the running slots' rows only
                    ids = np.full(width, self.slots, np.int32)
                    ids[: len(active)] = active
                    self._cache, out = rows_only(params, self._cache, ids, *args)
                else:
                    self._cache, out = whole(params, self._cache, *args)
                taken += steps
                out = jax.tree.map(np.asarray, out)
                for s, turn in turns.items():
                    if turn.reason:
                        continue
                    n = int(out.counts[s])
                    turn.tokens += out.tokens[s, :n].tolist()
                    turn.log_probs += out.log_probs[s, :n].tolist()
                    turn.versions += [version] * n
                    self._move_pending(s, n, turn.tokens[-1] if n else None)
                    turn.reason = self._finished(s, turn, bool(out.ended[s]))
        for s, turn in turns.items():
            if turn.reason:
                del self._turns[s]
                self._rows.set_row(s, self._idle_row)  # no filter left to sort for
                record = self._records[s]
                record.response += turn.tokens
                record.log_probs += turn.log_probs
                record.sampled += [1] * len(turn.tokens)
                record.versions += turn.versions
        return Turn(
            tokens=[np.asarray(turns[s].tokens, np.int32) for s in slots],
            log_probs=[np.asarray(turns[s].log_probs, np.float32) for s in slots],
            finish_reasons=[turns[s].reason for s in slots],
            versions=[list(turns[s].versions) for s in slots],
        )

    def _per_slot(
        self, sampling: SamplingParams | Sequence[SamplingParams], count: int
    ) -> list[SamplingParams]:
        """`decode`'s sampling as one `SamplingParams` per slot, checked."""
        per_slot = [sampling] * count if isinstance(sampling, SamplingParams) else list(sampling)
        if len(per_slot) != count:
            raise ValueError(f"decode(): {count} slots but {len(per_slot)} SamplingParams")
        for sp in per_slot:
            self.check_sampling(sp)
        return per_slot

    def check_sampling(self, sp: SamplingParams) -> None:
        """Refuse settings a slot cannot decode: `n` > 1 (one continuation per slot), or
        stop strings without the engine's tokenizer."""
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling settings are a SamplingParams, not {type(sp)}")
        if sp.n != 1:
            raise ValueError(
                f"a slot samples one continuation (n={sp.n}): for n samples of a prompt, "
                "start() it n times (or Scheduler.submit(copies=n))"
            )
        if sp.stop and self.tokenizer is None:
            raise ValueError(
                "sampling.stop needs the engine's tokenizer (RolloutEngine(tokenizer=...))"
            )

    def _move_pending(self, slot: int, n: int, last: int | None) -> None:
        """The slot's pending token moves `n` tokens (back, for n < 0) to `last`."""
        if n:
            self._pending["last"][slot] = last
            self._pending["index"][slot] += n
            self._pending["position"][slot] += n

    def _finished(self, slot: int, turn: _TurnSoFar, ended: bool) -> str | None:
        """The finish reason if the slot's turn is over, else None; a stop string cuts the
        turn (its tokens and log-probs) and moves the slot's pending token back with it."""
        sampling = turn.sampling
        if sampling.stop:
            cut = _stop_string_end(self.tokenizer, turn.tokens, sampling.stop)
            if cut is not None:
                back = len(turn.tokens) - cut
                del turn.tokens[cut:], turn.log_probs[cut:], turn.versions[cut:]
                self._move_pending(slot, -back, turn.tokens[-1])
                return "stop"
        if ended:
            return "stop"
        if len(turn.tokens) >= sampling.max_tokens or self.room(slot) <= 0:
            return "length"
        return None

    def append(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """Append tokens (a tool's output, the next user message) to each slot's sequence,
        prefilled into its cache without sampling; they enter the records unsampled
        (log-prob 0, `sampled` 0)."""
        slots = self._check_open(slots)
        params = self.weights.get()
        running = [s for s in slots if s in self._turns]
        if running:
            raise ValueError(
                f"append(): slots {running} are in the middle of a turn (decode(max_steps=)); "
                "decode them until it is over first"
            )
        if len(tokens) != len(slots):
            raise ValueError(f"append(): {len(slots)} slots but {len(tokens)} token lists")
        seqs = [np.asarray(t) for t in tokens]
        for s, seq in zip(slots, seqs, strict=True):
            if seq.ndim != 1 or not (seq.size == 0 or np.issubdtype(seq.dtype, np.integer)):
                raise ValueError(
                    f"append(): slot {s} was given {seq.dtype} {seq.shape}; give a flat list "
                    "of token ids per slot"
                )
            self.check_ids(seq, f"append() to slot {s}")
            if len(seq) > self.room(s):
                raise ValueError(
                    f"append(): slot {s} has room for {self.room(s)} more tokens, "
                    f"{len(seq)} given: raise max_model_len ({self.max_model_len})"
                )
        length = self._geometry()[0]
        f, t = bucket(len(slots), 1), bucket(max(len(q) for q in seqs), 1)
        fed = np.zeros((f, t), np.int32)  # the pending token, then all but the last given
        index = np.full((f, t), length, np.int32)  # >= the cache's cells: not written
        positions = np.zeros((f, t), np.int32)
        slot_ids = np.full(f, self.slots, np.int32)
        for row, (s, seq) in enumerate(zip(slots, seqs, strict=True)):
            if len(seq):
                n = len(seq)
                slot_ids[row] = s
                fed[row, :n] = np.concatenate([[self._pending["last"][s]], seq[:-1]])
                index[row, :n] = self._pending["index"][s] + np.arange(n)
                positions[row, :n] = self._pending["position"][s] + np.arange(n)
        program = _append_program(self.config, self.layout)
        with self._ending_on_error(slots):
            self._cache = program(params, self._cache, slot_ids, fed, index, positions)
        for s, seq in zip(slots, seqs, strict=True):
            if len(seq):
                self._move_pending(s, len(seq), int(seq[-1]))
                record = self._records[s]
                record.response += seq.astype(int).tolist()
                record.log_probs += [0.0] * len(seq)
                record.sampled += [0] * len(seq)
                record.versions += [None] * len(seq)

    def is_open(self, slot: int) -> bool:
        """Whether `slot` holds a conversation (an error in a call ends those it touched)."""
        return int(slot) in self._records

    def conversation(self, slot: int) -> Conversation:
        """The record of the conversation in `slot`."""
        return self._records[self._check_open([slot])[0]]

    def end(self, slots: Sequence[int]) -> list[Conversation]:
        """End the conversations in `slots` (their slots are free again); returns their
        records."""
        slots = self._check_open(slots)
        for s in slots:
            if self._turns.pop(s, None) is not None:
                self._rows.set_row(s, self._idle_row)
        return [self._records.pop(s) for s in slots]


@dataclasses.dataclass
class _TurnSoFar:
    """One slot's turn while `decode` samples it (reason: None until it is over)."""

    sampling: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int | None] = dataclasses.field(default_factory=list)
    reason: str | None = None


def _turn_keys(rng: jax.Array | None, seeds: list[int | None], count: int, impl: Any) -> np.ndarray:
    """Each decoded slot's turn key, as key data [count, ...] (see `RolloutEngine.decode`'s
    `rng`; `seeds`: each slot's `SamplingParams.seed`, used when `rng` is None)."""
    if rng is None and len(set(seeds)) > 1:
        keys = [jax.random.fold_in(jax.random.key(s or 0), i) for i, s in enumerate(seeds)]
        return np.asarray(jax.random.key_data(jnp.stack(keys)))
    if rng is None:
        rng = jax.random.key(seeds[0] or 0)  # as generate()
    rng = typed_key(rng, "decode(rng=...)")
    if jax.random.key_impl(rng) != impl:
        raise ValueError(
            f"decode(rng=...): keys of {jax.random.key_impl(rng)}; the engine uses {impl}"
        )
    if rng.ndim == 0:
        rng = jax.vmap(jax.random.fold_in, (None, 0))(rng, np.arange(count, dtype=np.uint32))
    elif rng.shape != (count,):
        raise ValueError(f"decode(): {count} slots but rng holds {rng.shape} keys")
    return np.asarray(jax.random.key_data(rng))


def _stop_string_end(tokenizer: Any, tokens: list[int], stop: tuple[str, ...]) -> int | None:
    """The shortest prefix of `tokens` whose text contains a stop string (its length), or
    None when the whole text contains none."""
    if not any(s in tokenizer.decode(tokens) for s in stop):
        return None
    for k in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:k])
        if any(s in text for s in stop):
            return k
    return len(tokens)


_open_cache = jax.jit(conversation.open_cache, static_argnums=(0, 1, 2, 3))


@functools.lru_cache(maxsize=8)
def _start_program(config: DecoderConfig, layout: Layout | None, copies: int = 1):
    fn = functools.partial(conversation.start, config, layout, copies)
    return jax.jit(fn, donate_argnums=(1,))


@functools.lru_cache(maxsize=32)
def _decode_program(
    config: DecoderConfig, layout: Layout | None, steps: int, block: int, backend: DecodeBackend
):
    fn = functools.partial(conversation.decode, config, layout, steps, block, backend)
    return jax.jit(fn, donate_argnums=(1,))


@functools.lru_cache(maxsize=32)
def _decode_rows_program(
    config: DecoderConfig, layout: Layout | None, steps: int, block: int, backend: DecodeBackend
):
    fn = functools.partial(conversation.decode_rows, config, layout, steps, block, backend)
    return jax.jit(fn, donate_argnums=(1,))


_MIN_ROWS = 16  # the CPU kernels' vector lanes: narrower batches are padded to them anyway


def _running_rows(running: int, dp: int) -> int:
    """The rows a decode chunk of `running` slots computes: a `bucket` size of at least 16
    rows (a handful of compiled widths; fewer rows save nothing), a multiple of the mesh's
    dp (each device its share)."""
    width = bucket(max(running, 1), _MIN_ROWS)
    return -(-width // dp) * dp


@functools.lru_cache(maxsize=8)
def _append_program(config: DecoderConfig, layout: Layout | None):
    return jax.jit(functools.partial(conversation.append, config, layout), donate_argnums=(1,))
