"""DAPO's dynamic sampling (`algorithm.filter_groups`): train only on prompt groups whose
responses disagree.

A group whose n responses all get the same `metric` has GRPO advantage 0 everywhere: it costs
a whole update and teaches nothing. With `filter_groups.enable`, each generation batch
(`data.gen_batch_size` prompts, default `data.train_batch_size`) is generated and scored, and
only the groups kept by verl's DAPO recipe rule survive:

    keep group g  iff  std_i(v_i) > 0  or  |g| = 1      (population std over its responses)

with one exception: jaxrl takes the std in float64, the recipe `np.std` of float32 summed
scores, where a tied group of some non-dyadic scores has a std of a few ulps (six responses
all scoring 0.6: 6e-8) and is kept although its advantages are 0; jaxrl drops it (a group
that teaches nothing).

where v_i is the response's `metric`: `seq_reward` (or v1's name `reward`) the summed token
scores, `seq_final_reward` the summed token rewards (the same without KL in the reward), or
any key of the reward function's extra info (`acc`, `score`, ...). Kept groups accumulate over
generation batches, in order, until `train_batch_size` of them exist; the first
`train_batch_size` are trained on and the rest are dropped (as verl: not carried over). With
`max_num_gen_batches > 0`, a step that has generated that many batches without enough groups
stops the run with verl's message; 0 or less: no limit.

`GroupPool` holds the kept groups on the host (`KeptGroup`: the step's rows are host arrays
until the batch is built), and `assemble` makes the step's rows of them: the first
`train_batch_size` groups in order (generation batch, then prompt), padding prompts on the
left and responses on the right to a common width. With several processes each process
generates, scores and judges its own slice of every batch and keeps its own groups' rows;
only the counts (to decide when to stop) and, at the end, each kept group's key, size,
widths, row lengths and extra info cross the hosts. The batch is then placed on the devices
from each process's own rows (`jaxrl.trainer.batch.place_owned`: the rows move between the
devices, not the hosts), and the kept set, its order and its padding are one process's. As in
verl's recipe, a step's timings add up over its generation batches, while the reward
manager's and the agent loop's metrics are the last batch's.

A run takes `trainer.total_training_steps` steps (default: generation batches per epoch x
`total_epochs`), each drawing as many generation batches as it needs from the endless loader:
it may pass over the data more than `total_epochs` times, where verl's recipe stops when its
`total_epochs` passes end.

With `filter_groups.streaming` (jaxrl's, not verl's), the groups flow through the rollout
engine's slots instead of whole batches (`jaxrl.rollout.streaming`): each group is scored and
judged by the rule above as soon as its n responses end (the groups that end in one decode
chunk together), freed slots take the next prompts, and generation stops once the first
`train_batch_size` kept groups in prompt order are known (the cut: the groups still running
are aborted). From the same responses, verl's batches would keep those groups, in that
order; and they are the same whichever group finished first, on any number of processes
(each streams its own slice of every batch).
`GroupJudge` is the judge: it scores a group with the reward function and keeps its rows.
The same metrics come out: `train/num_gen_batches` counts the batches up to the cut (the
loader is left there: batches drawn past it go back), `evicted_samples` the groups before the
cut the rule dropped, `discarded_surplus_samples` the groups kept past the cut,
`aborted_groups` the groups cut at the stop; the reward manager's metrics are summed over
every judged group (they are counts), and `sampled_tokens_per_group` (every response token
sampled in the step over the groups trained on, in both modes) compares the two. The last
three measure the effort past the cut, which depends on the slots (and so on the process
count); the kept set does not.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl.data.batch import PromptBatch
from jaxrl.rollout.streaming import GroupRollout, StreamStats
from jaxrl.sharding.processes import allgather_objects, gather_rows
from jaxrl.trainer.batch import PROMPT_FIELDS, RowOwners

# the per-response values of `filter_groups.metric` computed from the batch, not read from the
# reward function's extra info
SEQUENCE_METRICS = ("seq_reward", "reward", "seq_final_reward")


def metric_values(
    metric: str, token_level_scores: np.ndarray, extra: Mapping[str, Sequence[Any]]
) -> np.ndarray:
    """float64 [N]: each response's `metric` (module doc). `seq_final_reward` is the summed
    scores: the trainer refuses it with KL in the reward, whose log-probs do not exist yet.

    Raises:
        DynamicSamplingError: `metric` is not a sequence metric nor a key of the extra info.
    """
    if metric in SEQUENCE_METRICS:
        return np.asarray(token_level_scores, np.float64).sum(-1)
    if metric not in extra:
        raise DynamicSamplingError(
            f"algorithm.filter_groups.metric={metric!r}: the reward function returned no "
            f"{metric!r} (its extra info has {sorted(extra)}); use seq_reward (the summed "
            "token scores) or one of those keys"
        )
    return np.asarray(extra[metric], np.float64)


def kept_rows(group_ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, int]:
    """(the rows of the kept groups in their order, how many groups were kept): a group is
    kept when its values' population std is > 0 or it has one response (a NaN std is not)."""
    group_ids = np.asarray(group_ids)
    values = np.asarray(values, np.float64)
    groups, first = np.unique(group_ids, return_index=True)
    keep = set()
    for g in groups[np.argsort(first)]:
        v = values[group_ids == g]
        if len(v) == 1 or np.std(v) > 0:
            keep.add(g)
    rows = np.flatnonzero(np.isin(group_ids, list(keep)))
    return rows, len(keep)


def select_rows(rows: Mapping[str, np.ndarray], index: np.ndarray) -> dict[str, np.ndarray]:
    """Every host array's rows `index`."""
    return {k: np.asarray(v)[index] for k, v in rows.items()}


def merged_extra(sizes: Sequence[int], extra: Sequence[Mapping[str, list]]) -> dict[str, list]:
    """The parts' extra info (`sizes[i]` rows each), row after row; a key one part's reward
    function did not return is None on its rows."""
    keys = sorted({k for part in extra for k in part})
    return {k: [v for size, part in zip(sizes, extra, strict=True)
                for v in part.get(k, [None] * size)] for k in keys}  # fmt: skip


NO_MORE_PROMPTS = (
    "algorithm.filter_groups needs more prompts than one batch: give PPOTrainer a "
    "prompt_source (fit passes its train loader)"
)


def concat_rows(
    parts: Sequence[Mapping[str, np.ndarray]], widths: Mapping[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Row-wise concatenation of host batches whose columns may differ in width, padded to
    the widest (at least `widths[key]`): prompt fields on the left, [N, R, ...] fields on the
    right (with 0)."""
    out = {}
    for key in parts[0]:
        arrays = [np.asarray(p[key]) for p in parts]
        if arrays[0].ndim >= 2:
            width = max([a.shape[1] for a in arrays] + [(widths or {}).get(key, 0)])
            left = key in PROMPT_FIELDS
            pads = [(width - a.shape[1], 0) if left else (0, width - a.shape[1]) for a in arrays]
            arrays = [np.pad(a, [(0, 0), pad] + [(0, 0)] * (a.ndim - 2))
                      for a, pad in zip(arrays, pads, strict=True)]  # fmt: skip
        out[key] = np.concatenate(arrays)
    return out


@dataclasses.dataclass
class KeptGroup:
    """One kept group, on the process that generated and judged it.

    Attributes:
        key: Its place in the step's order: (generation batch, its prompt's place in the
            global batch), or (its prompt's place in the stream's global order,).
        rows: Its rows' host arrays (one row per response, in order).
        extra: The reward function's extra info of its rows ({name: per-row list}).
        conversations: The agent loop's conversations of its rows (None: batch generation).
    """

    key: tuple[int, ...]
    rows: dict[str, np.ndarray]
    extra: dict[str, list]
    conversations: list | None = None


@dataclasses.dataclass
class KeptRows:
    """The step's kept groups (`assemble`), numbered 0, 1, ... in their order.

    Attributes:
        rows: This process's rows of them (one process: the batch), in order; `group_ids`
            the global numbers.
        owners: Several processes: where each row of the batch comes from (process, its
            row in `rows` there); None: `rows` are the batch.
        extra: Every row's extra info, in batch order (None where a group's reward function
            did not return the key).
        conversations: Every row's conversation in batch order (one process; several, when
            asked for), else None.
        lengths: Every row's (prompt, response) lengths, int32 [N] each.
        whole: Every row's values of the `whole_fields` asked for ({name: [N]}).
        metrics: The reward manager's metrics, summed over the processes.
    """

    rows: dict[str, np.ndarray]
    owners: RowOwners | None
    extra: dict[str, list]
    conversations: list | None
    lengths: tuple[np.ndarray, np.ndarray]
    whole: dict[str, np.ndarray]
    metrics: dict[str, float]

    def batch_rows(self) -> dict[str, np.ndarray]:
        """The whole batch's rows on every process (the processes' own rows gathered through
        the hosts, then put in order): where the batch cannot be placed from each process's
        own rows (`owned_placeable`)."""
        if self.owners is None:
            return self.rows
        every = gather_rows(self.rows)
        counts = np.bincount(self.owners.owner, minlength=jax.process_count())
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
        return select_rows(every, offsets[self.owners.owner] + self.owners.local)


class _Summary(NamedTuple):
    """What the other processes learn of a kept group (`assemble`)."""

    key: tuple[int, ...]
    size: int
    widths: dict[str, int]
    lengths: tuple[np.ndarray, np.ndarray]
    whole: dict[str, np.ndarray]
    extra: dict[str, list]
    conversations: list | None


def assemble(
    groups: Sequence[KeptGroup],
    limit: int | None = None,
    *,
    widths: Mapping[str, int] | None = None,
    conversations: bool = False,
    metrics: Mapping[str, float] | None = None,
    whole_fields: Sequence[str] = (),
) -> KeptRows:
    """The first `limit` (None: all) of every process's kept `groups` in key order, each
    process keeping its own rows (`KeptRows`). What crosses the hosts: per group its key,
    size, column widths, extra info and per row its lengths and `whole_fields`; the reward
    `metrics` (summed); the conversations only when `conversations` (one process has them
    all anyway). Columns are padded to the widest kept group's, at least `widths` (prompt
    fields on the left, others on the right). One collective with several processes."""
    single = jax.process_count() == 1
    mine = sorted(groups, key=lambda g: g.key)
    summaries = [_Summary(
        g.key, len(g.rows["response_mask"]), _widths(g.rows), _row_lengths(g.rows),
        {k: np.asarray(g.rows[k]) for k in whole_fields if k in g.rows}, g.extra,
        g.conversations if single or conversations else None,
    ) for g in mine]  # fmt: skip
    spec = {k: (np.asarray(v).dtype.str, np.asarray(v).shape[1:]) for k, v in
            (mine[0].rows.items() if mine else ())}  # fmt: skip
    every = allgather_objects((summaries, spec, dict(widths or {}), dict(metrics or {})))
    order = sorted(
        ((s.key, p, i) for p, part in enumerate(every) for i, s in enumerate(part[0])),
        key=lambda x: x[0],
    )[:limit]
    chosen = [every[p][0][i] for _, p, i in order]
    width: dict[str, int] = {}
    for w in [part[2] for part in every] + [s.widths for s in chosen]:
        for k, v in w.items():
            width[k] = max(width.get(k, 0), v)
    owner, local, counts = [], [], [0] * len(every)
    for (_, p, _), s in zip(order, chosen, strict=True):
        owner += [p] * s.size
        local += range(counts[p], counts[p] + s.size)
        counts[p] += s.size
    me = jax.process_index()
    own = [(rank, mine[i]) for rank, (_, p, i) in enumerate(order) if p == me]
    spec = next((part[1] for part in every if part[1]), {})
    talks = [s.conversations for s in chosen]
    names = sorted({k for part in every for k in part[3]})
    lengths = [np.concatenate([s.lengths[j] for s in chosen] + [np.zeros(0, np.int32)])
               for j in (0, 1)]  # fmt: skip
    whole = {k: np.concatenate([s.whole[k] for s in chosen])
             for k in whole_fields if chosen and k in chosen[0].whole}  # fmt: skip
    return KeptRows(
        rows=_own_rows(own, spec, width),
        owners=None if single else RowOwners(np.asarray(owner), np.asarray(local)),
        extra=merged_extra([s.size for s in chosen], [s.extra for s in chosen]),
        conversations=[c for t in talks for c in t] if talks and talks[0] is not None else None,
        lengths=(lengths[0], lengths[1]),
        whole=whole,
        metrics={k: float(sum(part[3].get(k, 0.0) for part in every)) for k in names},
    )


def _widths(rows: Mapping[str, np.ndarray]) -> dict[str, int]:
    return {k: np.asarray(v).shape[1] for k, v in rows.items() if np.asarray(v).ndim >= 2}


def _row_lengths(rows: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return tuple(np.asarray(rows[k]).sum(-1).astype(np.int32)
                 for k in ("prompt_mask", "response_mask"))  # fmt: skip


def _own_rows(
    own: list[tuple[int, KeptGroup]], spec: Mapping[str, tuple], width: Mapping[str, int]
) -> dict[str, np.ndarray]:
    """This process's kept groups' rows (`own`: (global rank, group) in order), group ids
    the ranks, each column padded to `width`; empty arrays of `spec`'s (dtype, trailing
    shape) when it has none."""
    if not own:
        return {k: np.zeros((0, width.get(k, 0), *shape[1:]) if len(shape) else (0,), dtype)
                for k, (dtype, shape) in spec.items()}  # fmt: skip
    parts = [{**g.rows, "group_ids": np.full(len(g.rows["response_mask"]), rank, np.int32)}
             for rank, g in own]  # fmt: skip
    return concat_rows(parts, width)


@dataclasses.dataclass
class GroupPool:
    """The kept groups of a step's generation batches (module doc). With several processes
    each pool holds its own process's groups; the counts are every process's.

    Attributes:
        kept: This process's kept groups (`KeptGroup`, keyed by (batch, group id)).
        widths: The widest columns of the batches so far ({field: width}).
        groups: Groups kept so far.
        generated: Groups generated so far.
        batches: Generation batches so far.
        tokens: Response tokens generated so far (kept or not).
    """

    kept: list[KeptGroup] = dataclasses.field(default_factory=list)
    widths: dict[str, int] = dataclasses.field(default_factory=dict)
    groups: int = 0
    generated: int = 0
    batches: int = 0
    tokens: int = 0

    def add(
        self,
        rows: dict[str, np.ndarray],
        extra: dict[str, list],
        conversations: list | None,
        values: np.ndarray,
    ) -> None:
        """Keep the groups of one generation batch (this process's rows: `group_ids`
        numbering the batch's prompts in order, `values` [N]) that pass the rule. With
        several processes, one small collective (the counts)."""
        group_ids = np.asarray(rows["group_ids"])
        index, kept = kept_rows(group_ids, values)
        for g in dict.fromkeys(group_ids[index].tolist()):  # kept groups, in order
            own = index[group_ids[index] == g]
            self.kept.append(KeptGroup(
                (self.batches, g), select_rows(rows, own),
                {k: [v[i] for i in own] for k, v in extra.items()},
                None if conversations is None else [conversations[i] for i in own],
            ))  # fmt: skip
        for k, w in _widths(rows).items():
            self.widths[k] = max(self.widths.get(k, 0), w)
        counts = (kept, len(np.unique(group_ids)), int(np.asarray(rows["response_mask"]).sum()))
        kept, generated, tokens = np.sum(allgather_objects(counts), axis=0)
        self.batches += 1
        self.groups, self.generated = self.groups + int(kept), self.generated + int(generated)
        self.tokens += int(tokens)

    def full(self, groups: int, max_num_gen_batches: int) -> bool:
        """Whether `groups` groups are kept (the step can train); raises
        `DynamicSamplingError` when not and `max_num_gen_batches` (> 0) batches are spent."""
        if self.groups >= groups:
            return True
        if 0 < max_num_gen_batches <= self.batches:
            raise DynamicSamplingError(too_many_batches_message(self.batches, max_num_gen_batches))
        return False

    def take(self, groups: int, **kwargs: Any) -> KeptRows:
        """The first `groups` kept groups (`assemble`, which takes `kwargs`)."""
        return assemble(self.kept, groups, widths=self.widths, **kwargs)

    def metrics(self, groups: int) -> dict[str, float]:
        """verl's `train/num_gen_batches` and v1's filter counts (in groups), and jaxrl's
        response tokens generated per trained group."""
        return {
            "train/num_gen_batches": float(self.batches),
            "training/filter_groups/evicted_samples": float(self.generated - self.groups),
            "training/filter_groups/discarded_surplus_samples": float(self.groups - groups),
            "training/filter_groups/sampled_tokens_per_group": self.tokens / groups,
        }


class GroupJudge:
    """Scores each finished group of the stream and keeps it by the rule (module doc).

    Args:
        reward_fn: The trainer's reward function (`RewardFn`).
        metric: `filter_groups.metric`.
        timing: The step's timings: the scoring adds to its `reward`.
        host_fields: More per-row host arrays of a kept group's rows, from its prompts
            (the trainer's: each row's distillation teacher); None: none.
    """

    def __init__(
        self,
        reward_fn: Callable,
        metric: str,
        timing: dict[str, float],
        host_fields: Callable[[PromptBatch], dict[str, np.ndarray]] | None = None,
    ):
        self.reward_fn, self.metric, self.timing = reward_fn, metric, timing
        self.host_fields = host_fields or (lambda prompts: {})
        self.sources: list[PromptBatch] = []
        self.kept: list[KeptGroup] = []  # keyed by their prompt's place in the global order
        self.reward_metrics: dict[str, float] = {}
        self._more: Iterator[PromptBatch] | None = None
        self._states: list[Any] = []  # the source's state before each batch drawn from it

    def batches(
        self, first: PromptBatch, more: Iterator[PromptBatch] | None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The stream's prompt arrays: `first`, then `more`'s batches (kept for scoring)."""
        self._more, batch = more, first
        while True:
            self.sources.append(batch)
            yield batch.input_ids, batch.attention_mask
            if more is None:
                raise ValueError(NO_MORE_PROMPTS)
            self._states.append(_state(more))
            batch = next(more)

    def settle(self, batches: int) -> None:
        """Leave the prompt source as if exactly `batches` batches (the first included) had
        been drawn: the stream's batches past its cut go back (a loader's saved state), and
        a process that did not reach its slice of a batch before the cut draws it now, so
        every process's loader is where one process's would be."""
        drawn = len(self.sources)
        if self._more is None:
            return
        if drawn > batches and self._states[batches - 1] is not None:
            self._more.load_state_dict(self._states[batches - 1])
        elif drawn > batches and jax.process_count() > 1:
            raise ValueError(
                "streamed dynamic sampling over several processes puts the batches drawn past "
                "its cut back into the prompt source, which needs state_dict / "
                "load_state_dict (the train loader's: fit passes it)"
            )
        for _ in range(batches - drawn):
            next(self._more)

    def __call__(self, groups: list[GroupRollout]) -> list[bool]:
        """Score the groups (one reward call per prompt batch they came from) and keep the
        rows of those whose `metric` varies (or that have one response), in their order."""
        start = time.perf_counter()
        verdicts: dict[int, bool] = {}
        scored: dict[int, tuple] = {}
        for batch in dict.fromkeys(g.batch for g in groups):  # batches in order of appearance
            mine = [k for k, g in enumerate(groups) if g.batch == batch]
            n = len(groups[mine[0]].responses)
            rows = np.repeat([groups[k].row for k in mine], n)
            prompts = self.sources[batch].select(rows)
            responses = np.concatenate([groups[k].responses for k in mine])
            mask = np.concatenate([groups[k].response_mask for k in mine])
            scores, reward_metrics, extra = self.reward_fn(prompts, responses, mask)
            for key, v in reward_metrics.items():
                self.reward_metrics[key] = self.reward_metrics.get(key, 0.0) + float(v)
            values = metric_values(self.metric, scores, extra)
            kept, _ = kept_rows(np.repeat(np.arange(len(mine)), n), values)
            for j, k in enumerate(mine):
                part = slice(j * n, (j + 1) * n)
                verdicts[k] = j * n in kept  # the rule of verl's recipe, as for batches
                scored[k] = (prompts.select(np.arange(part.start, part.stop)), scores[part],
                             {key: list(v[part]) for key, v in extra.items()})  # fmt: skip
        for k, group in enumerate(groups):
            if verdicts[k]:
                prompts, scores, extra = scored[k]
                self.kept.append(KeptGroup((group.sequence,), {
                    "prompts": prompts.input_ids, "prompt_mask": prompts.attention_mask,
                    "responses": group.responses, "response_mask": group.response_mask,
                    "token_level_scores": np.asarray(scores, np.float32),
                    "rollout_log_probs": group.log_probs,
                    **self.host_fields(prompts),
                }, extra))  # fmt: skip
        self.timing["reward"] = self.timing.get("reward", 0.0) + time.perf_counter() - start
        return [verdicts[k] for k in range(len(groups))]

    def take(self, cut: int | None, **kwargs: Any) -> KeptRows:
        """The kept groups before `cut` (None: all) in prompt order (`assemble`, which takes
        `kwargs`), with the reward manager's metrics summed over every process's judged
        groups (the surplus past the cut is dropped)."""
        before = [g for g in self.kept if cut is None or g.key[0] < cut]
        return assemble(before, metrics=self.reward_metrics, **kwargs)


def _state(source: Iterator) -> Any:
    """A prompt source's state (`state_dict`: the train loader's), so that batches drawn
    past the stream's cut can go back; None for a plain iterator (they cannot)."""
    return source.state_dict() if hasattr(source, "state_dict") else None


def stream_metrics(stats: StreamStats, groups: int) -> dict[str, float]:
    """The streamed step's filter metrics (module doc)."""
    return {
        "train/num_gen_batches": float(stats.batches),
        "training/filter_groups/evicted_samples": float(stats.dropped),
        "training/filter_groups/discarded_surplus_samples": float(stats.surplus),
        "training/filter_groups/aborted_groups": float(stats.aborted),
        "training/filter_groups/sampled_tokens_per_group": stats.sampled_tokens / groups,
    }


class DynamicSamplingError(RuntimeError):
    """`max_num_gen_batches` generation batches gave fewer than `train_batch_size` groups."""


def too_many_batches_message(batches: int, limit: int) -> str:
    """verl's error when `max_num_gen_batches` batches did not give enough groups."""
    return (
        f"num_gen_batches={batches} >= max_num_gen_batches={limit}. Generated too many. "
        "Please check if your data are too difficult. You could also try set "
        "max_num_gen_batches=0 to enable endless trials "
        "(algorithm.filter_groups.max_num_gen_batches)."
    )
