"""Groups streamed through the engine's slots until enough of them are kept.

    result = stream_groups(engine, batches, sampling, rng, judge, target=16, max_groups=320)
    # judge(groups: list[GroupRollout]) -> list[bool]: which to keep
    result.kept            # the kept groups' rollouts, in the order they were kept
    result.stats           # groups started / finished / kept / aborted, tokens sampled

DAPO's dynamic sampling, as verl runs it, generates whole batches of prompts and filters them
afterwards: a batch's every group is decoded to its end, then the groups whose responses all
score alike are dropped, and when fewer than `target` remain another whole batch follows
(and the surplus of the last is thrown away). Here the groups flow through the
`RolloutEngine`'s conversation slots instead, as requests of a `Scheduler`:

    admit      a group's n copies of its prompt into free slots (prefilled once) while
               kept + running x keep_rate < target   (keep_rate: kept / finished so far, 1
               before any group has finished), and at most `max_groups` groups in all
    decode     every running slot `chunk` tokens
    finish     the groups whose n responses have all ended go to `judge` together (the
               caller's reward and filter, one call per decode chunk): each kept or dropped;
               their slots are free for the next groups
    stop       once `target` groups are kept: the groups still running are aborted (and
               kept groups judged in the same round past the target are surplus)

so the tokens spent per kept group shrink by what verl's batch boundary wastes: the groups
decoded after the target was reached, and the slots idling while a batch's longest response
finishes. The admission rule never starts more groups than the kept ones so far predict are
needed; a run whose groups are all kept generates exactly `target` groups.

Sampling is reproducible whatever the order in which groups finish: response j of the g-th
group started in the call samples with `fold_in(fold_in(rng, g), j)` (`Scheduler.submit`),
and prompts are taken in order, batch after batch (`batches` yields left-padded
[B, P] arrays; a batch is drawn when the previous one is used up, and the rest of the last
one is not used).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import jax
import numpy as np
from jaxtyping import Float, Int

from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.scheduler import Handle, Scheduler


@dataclasses.dataclass
class GroupRollout:
    """One finished group: n responses to one prompt.

    Attributes:
        batch: Which batch of `batches` the prompt came from (0, 1, ...).
        row: Its row in that batch.
        sequence: The group's start order in the call (its sampling key, module doc).
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


@dataclasses.dataclass
class StreamStats:
    """What one `stream_groups` call did.

    Attributes:
        batches: Prompt batches drawn.
        started: Groups admitted into slots.
        finished: Groups whose n responses ended (judged).
        kept: Groups the judge kept, up to the target.
        surplus: Groups the judge kept past the target (judged in the same round as the
            last kept ones; dropped).
        aborted: Groups still running at the stop (their tokens are spent, not trained on).
        sampled_tokens: Every token sampled, aborted groups' included.
        kept_tokens: The kept groups' response tokens.
        decode_calls: Engine decode calls.
    """

    batches: int = 0
    started: int = 0
    finished: int = 0
    kept: int = 0
    surplus: int = 0
    aborted: int = 0
    sampled_tokens: int = 0
    kept_tokens: int = 0
    decode_calls: int = 0


@dataclasses.dataclass
class StreamResult:
    """The kept groups (in the order they were kept) and the call's statistics."""

    kept: list[GroupRollout]
    stats: StreamStats


@dataclasses.dataclass
class _Group:
    """A running group: where its prompt came from and its n requests."""

    batch: int
    row: int
    sequence: int
    handles: list[Handle]


class _Prompts:
    """The prompts of `batches`, one at a time, drawing a batch when one is used up."""

    def __init__(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]):
        self.batches, self.drawn = batches, 0
        self.ids: np.ndarray | None = None
        self.mask: np.ndarray | None = None
        self.next_row = 0

    def take(self) -> tuple[int, int, np.ndarray, np.ndarray]:
        """(batch, row, ids [P], mask [P]) of the next prompt."""
        if self.ids is None or self.next_row == len(self.ids):
            self.ids, self.mask = (np.asarray(a) for a in next(self.batches))
            self.drawn, self.next_row = self.drawn + 1, 0
        row, self.next_row = self.next_row, self.next_row + 1
        return self.drawn - 1, row, self.ids[row], self.mask[row]


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
) -> StreamResult:
    """Stream groups of `sampling.n` responses through `engine`'s slots until `target` are
    kept (module doc), as requests of a `Scheduler` over it. Stops early, with fewer kept,
    when `max_groups` groups have been started and judged (the caller decides whether that
    is an error).

    Raises:
        ValueError: fewer slots than `sampling.n` (a group must fit at once), `target` < 1.
    """
    n = sampling.n
    if engine.slots < n:
        raise ValueError(
            f"streamed dynamic sampling holds a group's {n} responses in the engine's slots at "
            f"once, and it has {engine.slots}: raise actor_rollout_ref.rollout.max_num_seqs "
            f"to at least rollout.n={n}"
        )
    if target < 1:
        raise ValueError(f"stream_groups(target={target}): must be >= 1")
    one = dataclasses.replace(sampling, n=1)
    scheduler = Scheduler(engine, chunk=chunk)
    prompts, stats, kept = _Prompts(batches), StreamStats(), []
    running: dict[int, _Group] = {}  # by sequence
    try:
        while stats.kept < target:
            _admit(scheduler, prompts, running, stats, one, rng, n, target, max_groups)
            if not running:
                break  # max_groups started and judged
            scheduler.step()
            ended = [s for s, g in running.items() if all(h.done for h in g.handles)]
            rollouts = [_finished(running.pop(s), sampling.max_tokens) for s in ended]
            stats.sampled_tokens += sum(int(r.response_mask.sum()) for r in rollouts)
            if not rollouts:
                continue
            stats.finished += len(rollouts)
            verdicts = judge(rollouts)
            for rollout, keep in zip(rollouts, verdicts, strict=True):
                if keep and stats.kept == target:
                    stats.surplus += 1
                elif keep:
                    kept.append(rollout)
                    stats.kept += 1
                    stats.kept_tokens += int(rollout.response_mask.sum())
    finally:  # the stop, or an error: the groups still running end now, their slots free
        stats.aborted = len(running)
        for group in running.values():
            for handle in group.handles:
                stats.sampled_tokens += len(handle.tokens)
                if handle.slot is None or engine.is_open(handle.slot):  # not ended by an error
                    scheduler.abort(handle)
        stats.decode_calls = scheduler.decode_calls
    stats.batches = prompts.drawn
    return StreamResult(kept, stats)


def _admit(scheduler, prompts, running, stats, sampling, rng, n, target, max_groups) -> None:
    """Submit groups while the free slots hold them and the kept ones so far say more are
    needed; the scheduler starts them together (each prompt prefilled once for its n slots,
    left-padded to its batch's width). Group g's response j samples with
    `fold_in(fold_in(rng, g), j)`."""
    keep_rate = stats.kept / stats.finished if stats.finished else 1.0
    count = 0
    while (
        scheduler.free_slots >= (count + 1) * n
        and (max_groups is None or stats.started + count < max_groups)
        and stats.kept + (len(running) + count) * keep_rate < target
    ):
        count += 1
    for _ in range(count):
        batch, row, ids, mask = prompts.take()
        key = jax.random.fold_in(rng, stats.started)
        handles = scheduler.submit(ids[mask > 0], sampling, key, copies=n, pad_to=len(ids))
        running[stats.started] = _Group(batch, row, stats.started, handles)
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
