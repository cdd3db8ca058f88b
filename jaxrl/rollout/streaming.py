"""Groups streamed through the engine's slots until enough of them are kept.

    result = stream_groups(engine, batches, sampling, rng, judge, target=16, max_groups=320)
    # judge(groups: list[GroupRollout]) -> list[bool]: which to keep
    result.kept            # this process's kept groups, in prompt order
    result.cut             # the kept set: the kept groups of the prompts before it
    result.stats           # groups started / finished / kept / dropped / aborted, tokens

DAPO's dynamic sampling, as verl runs it, generates whole batches of prompts and filters them
afterwards: a batch's every group is decoded to its end, then the groups whose responses all
score alike are dropped, and when fewer than `target` remain another whole batch follows
(and the surplus of the last is thrown away). Here the groups flow through the
`RolloutEngine`'s conversation slots instead, as requests of a `Scheduler`:

    admit      the next prompts' groups (n copies of a prompt, prefilled once) into free
               slots, in prompt order, up to the `limit` below
    decode     every running slot `chunk` tokens
    finish     the groups whose n responses have all ended go to `judge` together (the
               caller's reward and filter, one call per decode chunk): each kept or dropped;
               their slots are free for the next groups
    stop       once the prompts up to some `cut` are all judged and hold `target` kept
               groups: those are the result; the groups still running are aborted, and
               kept groups past the cut are surplus

The kept set is thus the first `target` kept groups in prompt order, as verl's batches give
it, whichever groups finish first: a run is deterministic, and the same on any number of
processes. Prompts are numbered in the global order of the batches (`Share`: with several
processes, each streams its own slice of every batch on its own share of the engine,
`RolloutEngine.local`); after each decode chunk the processes exchange their new verdicts
(a few bytes each), so every one of them knows every verdict and decides the `cut` alike.
The `limit` is where the verdicts so far say the kept groups will suffice: scanning the
prompts in order, a judged group counts 1 if kept and 0 if dropped, an unjudged one the keep
rate so far (kept / judged; 1 before any verdict), and the limit is the first prompt where the
count reaches `target` (unbounded while nothing has been kept; `max_groups` bounds it). A
run whose groups are all kept generates exactly `target` groups; the tokens spent per kept
group shrink by what verl's batch boundary wastes (the slots idling while a batch's longest
response finishes), at the price of waiting for the slowest group before the cut.

Sampling is reproducible whatever the order in which groups finish: response j of prompt g
(its place in the global order, from 0 in the call) samples with `fold_in(fold_in(rng, g),
j)` (`Scheduler.submit`). Prompts are taken in order, batch after batch (`batches` yields
left-padded [B, P] arrays; a batch is drawn when the previous one is used up); `stats.batches`
counts the batches up to the cut (the caller may return the rest to its loader).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import jax
import numpy as np
from jaxtyping import Float, Int

from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.scheduler import Handle, Scheduler
from jaxrl.sharding.processes import allgather_objects


@dataclasses.dataclass
class GroupRollout:
    """One finished group: n responses to one prompt.

    Attributes:
        batch: Which batch of `batches` the prompt came from (0, 1, ...).
        row: Its row in that batch (this process's).
        sequence: The prompt's place in the global order (its sampling key, module doc).
        responses: int32 [n, R] right-padded response tokens (R = `sampling.max_tokens`).
        response_mask: int32 [n, R]: 1 on the response's tokens (its end token included).
        log_probs: float32 [n, R]: the sampled tokens' log-probs (0 on padding).
    """

    batch: int
    row: int
    sequence: int
    responses: Int[np.ndarray, "n r"]
    response_mask: Int[np.ndarray, "n r"]
    log_probs: Float[np.ndarray, "n r"]


@dataclasses.dataclass(frozen=True)
class Share:
    """Where this process's prompts sit in the global order: rows [first, first + B) of
    every batch of `total` rows, B its own batches' rows (several processes: process p's
    slice of each); `total` None: its batches are the whole (one process)."""

    first: int = 0
    total: int | None = None


@dataclasses.dataclass
class StreamStats:
    """What one `stream_groups` call did (over every process).

    Attributes:
        batches: Prompt batches up to the cut (all drawn when there was none).
        started: Groups admitted into slots.
        finished: Groups whose n responses ended (judged).
        kept: Groups kept before the cut (the target, or fewer when `max_groups` ran out).
        dropped: Groups before the cut the judge dropped.
        surplus: Groups the judge kept past the cut (dropped).
        aborted: Groups still running at the stop (their tokens are spent, not trained on).
        sampled_tokens: Every token sampled, aborted groups' included.
        kept_tokens: The kept groups' response tokens.
        decode_calls: Engine decode calls (summed over the processes).
    """

    batches: int = 0
    started: int = 0
    finished: int = 0
    kept: int = 0
    dropped: int = 0
    surplus: int = 0
    aborted: int = 0
    sampled_tokens: int = 0
    kept_tokens: int = 0
    decode_calls: int = 0


@dataclasses.dataclass
class StreamResult:
    """This process's kept groups (prompt order), the cut (the kept set is the kept groups
    of the prompts before it; None: `max_groups` ran out first) and the call's statistics."""

    kept: list[GroupRollout]
    cut: int | None
    stats: StreamStats


@dataclasses.dataclass
class _Group:
    """A running group: where its prompt came from and its n requests."""

    batch: int
    row: int
    sequence: int
    handles: list[Handle]


class _Prompts:
    """This process's prompts of `batches`, one at a time in order, drawing a batch when one
    is used up; each with its place in the global order (`Share`)."""

    def __init__(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], share: Share):
        self.batches, self.share, self.drawn = batches, share, 0
        self.ids: np.ndarray | None = None
        self.mask: np.ndarray | None = None
        self.next_row = 0
        self._draw()  # the first batch: its rows give one process's `total`
        self.total = share.total if share.total is not None else len(self.ids)

    def _draw(self) -> None:
        self.ids, self.mask = (np.asarray(a) for a in next(self.batches))
        self.drawn, self.next_row = self.drawn + 1, 0

    def next_sequence(self) -> int:
        """The next prompt's place in the global order (without drawing its batch)."""
        if self.next_row == len(self.ids):
            return self.drawn * self.total + self.share.first
        return (self.drawn - 1) * self.total + self.share.first + self.next_row

    def take(self) -> tuple[int, int, int, np.ndarray, np.ndarray]:
        """(batch, row, sequence, ids [P], mask [P]) of the next prompt."""
        sequence = self.next_sequence()
        if self.next_row == len(self.ids):
            self._draw()
        row, self.next_row = self.next_row, self.next_row + 1
        return self.drawn - 1, row, sequence, self.ids[row], self.mask[row]


class _Verdicts:
    """Every process's verdicts so far, and what they decide (the module doc's cut and
    limit); the same on every process."""

    def __init__(self, target: int, max_groups: int | None):
        self.target, self.max_groups = target, max_groups
        self.keep: dict[int, bool] = {}  # by sequence
        self.end = 0  # the first prompt not judged
        self.kept_before_end = 0
        self.cut: int | None = None

    def add(self, verdicts: list[tuple[int, bool]]) -> None:
        self.keep.update(verdicts)
        while self.cut is None and self.end in self.keep:
            self.kept_before_end += self.keep[self.end]
            self.end += 1
            if self.kept_before_end == self.target:
                self.cut = self.end

    @property
    def exhausted(self) -> bool:
        """Every prompt below `max_groups` judged, short of the target."""
        return self.cut is None and self.max_groups is not None and self.end >= self.max_groups

    def limit(self) -> int | None:
        """Admit prompts before this (None: no bound but `max_groups`)."""
        kept = sum(self.keep.values())
        rate = kept / len(self.keep) if self.keep else 1.0
        bound = self.max_groups
        if rate == 0.0:
            return bound
        # past `end`: each judged prompt counts its verdict, each other one the rate
        count, sequence = float(self.kept_before_end), self.end
        for judged in sorted(s for s in self.keep if s >= self.end):
            gap = judged - sequence  # unjudged prompts before this judged one
            if count + gap * rate >= self.target:
                break
            count += gap * rate + self.keep[judged]
            sequence = judged + 1
            if count >= self.target:
                return sequence if bound is None else min(sequence, bound)
        sequence += max(math.ceil((self.target - count) / rate - 1e-9), 0)
        return sequence if bound is None else min(sequence, bound)


def stream_groups(
    engine: RolloutEngine,
    batches: Iterator[tuple[np.ndarray, np.ndarray]],
    sampling: SamplingParams,
    rng: jax.Array,
    judge: Callable[[list[GroupRollout]], list[bool]],
    *,
    target: int,
    max_groups: int | None = None,
    chunk: int = 16,
    share: Share = Share(),
) -> StreamResult:
    """Stream groups of `sampling.n` responses through `engine`'s slots until the first
    `target` kept groups in prompt order are known (module doc), as requests of a
    `Scheduler` over it. Stops early, with fewer kept, when the first `max_groups` prompts
    are all judged (the caller decides whether that is an error). Several processes: every
    one calls it (on its `RolloutEngine.local()`, its own prompts, `share` saying where they
    sit) with the same rng, target and bound; they exchange verdicts after every decode
    chunk.

    Raises:
        ValueError: fewer slots than `sampling.n` (a group must fit at once), `target` < 1.
    """
    n = sampling.n
    if engine.slots < n:
        raise ValueError(
            f"streamed dynamic sampling holds a group's {n} responses in the engine's slots at "
            f"once, and it has {engine.slots} (with several processes, each process's share "
            "of max_num_seqs): raise actor_rollout_ref.rollout.max_num_seqs to at least "
            f"rollout.n={n} x the processes"
        )
    if target < 1:
        raise ValueError(f"stream_groups(target={target}): must be >= 1")
    one = dataclasses.replace(sampling, n=1)
    scheduler = Scheduler(engine, chunk=chunk)
    prompts, stats, verdicts = (
        _Prompts(batches, share),
        StreamStats(),
        _Verdicts(target, max_groups),
    )
    kept: dict[int, GroupRollout] = {}  # this process's, by sequence
    running: dict[int, _Group] = {}  # by sequence
    try:
        while verdicts.cut is None and not verdicts.exhausted:
            _admit(scheduler, prompts, running, stats, one, rng, n, verdicts.limit())
            if scheduler.busy:
                scheduler.step()
            ended = [s for s, g in running.items() if all(h.done for h in g.handles)]
            rollouts = [_finished(running.pop(s), sampling.max_tokens) for s in ended]
            stats.sampled_tokens += sum(int(r.response_mask.sum()) for r in rollouts)
            mine = judge(rollouts) if rollouts else []
            kept.update((r.sequence, r) for r, keep in zip(rollouts, mine, strict=True) if keep)
            # every process's verdicts: the one place the processes wait for each other
            for part in allgather_objects([(r.sequence, bool(k)) for r, k in
                                           zip(rollouts, mine, strict=True)]):  # fmt: skip
                verdicts.add(part)
    finally:  # the stop, or an error: the groups still running end now, their slots free
        stats.aborted = len(running)
        for group in running.values():
            for handle in group.handles:
                stats.sampled_tokens += len(handle.tokens)
                if handle.slot is None or engine.is_open(handle.slot):  # not ended by an error
                    scheduler.abort(handle)
        stats.decode_calls = scheduler.decode_calls
    cut = verdicts.cut
    mine = [kept[s] for s in sorted(kept) if cut is None or s < cut]
    stats.kept_tokens = sum(int(g.response_mask.sum()) for g in mine)
    stats.batches = prompts.drawn
    return StreamResult(mine, cut, _totals(stats, verdicts, prompts.total))


def _totals(stats: StreamStats, verdicts: _Verdicts, total: int) -> StreamStats:
    """The call's statistics over every process: sums of theirs, and what the verdicts say
    (the cut's batches; kept, dropped and surplus by the cut)."""
    every = allgather_objects(stats)
    out = StreamStats(**{f.name: sum(getattr(s, f.name) for s in every)
                         for f in dataclasses.fields(StreamStats)})  # fmt: skip
    cut = verdicts.cut
    before = [k for s, k in verdicts.keep.items() if cut is None or s < cut]
    out.finished = len(verdicts.keep)
    out.kept, out.dropped = sum(before), len(before) - sum(before)
    out.surplus = sum(verdicts.keep.values()) - out.kept
    out.batches = (cut - 1) // total + 1 if cut is not None else max(s.batches for s in every)
    return out


def _admit(scheduler, prompts, running, stats, sampling, rng, n, limit: int | None) -> None:
    """Submit this process's next groups, in prompt order, while the free slots hold them
    and they come before `limit`; the scheduler starts them together (each prompt prefilled
    once for its n slots, left-padded to its batch's width). Prompt g's response j samples
    with `fold_in(fold_in(rng, g), j)`."""
    while scheduler.free_slots >= n and (limit is None or prompts.next_sequence() < limit):
        batch, row, sequence, ids, mask = prompts.take()
        key = jax.random.fold_in(rng, sequence)
        handles = scheduler.submit(ids[mask > 0], sampling, key, copies=n, pad_to=len(ids))
        running[sequence] = _Group(batch, row, sequence, handles)
        stats.started += 1


def _finished(group: _Group, width: int) -> GroupRollout:
    """The group's responses, right-padded to `width`, in the order of its copies."""
    n = len(group.handles)
    responses = np.zeros((n, width), np.int32)
    mask = np.zeros((n, width), np.int32)
    log_probs = np.zeros((n, width), np.float32)
    for j, handle in enumerate(group.handles):
        k = len(handle.tokens)
        responses[j, :k], mask[j, :k] = handle.tokens, 1
        log_probs[j, :k] = handle.log_probs
    return GroupRollout(group.batch, group.row, group.sequence, responses, mask, log_probs)
