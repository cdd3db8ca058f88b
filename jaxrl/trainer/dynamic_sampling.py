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

`GroupPool` holds the kept rows on the host (the step's rows are host arrays until the batch is
built), padding prompts on the left and responses on the right to a common width. As in verl's
recipe, a step's timings add up over its generation batches, while the reward manager's and
the agent loop's metrics are the last batch's.

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
from typing import Any

import jax
import numpy as np

from jaxrl.data.batch import PromptBatch
from jaxrl.rollout.streaming import GroupRollout, StreamStats
from jaxrl.sharding.processes import allgather_objects
from jaxrl.trainer.batch import PROMPT_FIELDS

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


def _by_appearance(group_ids: np.ndarray) -> np.ndarray:
    """Group ids renumbered 0, 1, ... in the order the groups first appear."""
    _, first, inverse = np.unique(group_ids, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))
    return rank[inverse]


def select_rows(rows: Mapping[str, np.ndarray], index: np.ndarray) -> dict[str, np.ndarray]:
    """Every host array's rows `index`."""
    return {k: np.asarray(v)[index] for k, v in rows.items()}


def merged_extra(
    rows: Sequence[Mapping[str, np.ndarray]], extra: Sequence[Mapping[str, list]]
) -> dict[str, list]:
    """The parts' extra info, row after row; a key one part's reward function did not return
    is None on its rows."""
    keys = sorted({k for part in extra for k in part})
    sizes = [len(part["group_ids"]) for part in rows]
    return {k: [v for size, part in zip(sizes, extra, strict=True)
                for v in part.get(k, [None] * size)] for k in keys}  # fmt: skip


NO_MORE_PROMPTS = (
    "algorithm.filter_groups needs more prompts than one batch: give PPOTrainer a "
    "prompt_source (fit passes its train loader)"
)


def concat_rows(parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Row-wise concatenation of host batches whose columns may differ in width: prompt
    fields are padded on the left, [N, R] fields on the right (with 0)."""
    out = {}
    for key in parts[0]:
        arrays = [np.asarray(p[key]) for p in parts]
        if arrays[0].ndim == 2:
            width = max(a.shape[1] for a in arrays)
            left = key in PROMPT_FIELDS
            arrays = [
                np.pad(a, ((0, 0), (width - a.shape[1], 0) if left else (0, width - a.shape[1])))
                for a in arrays
            ]
        out[key] = np.concatenate(arrays)
    return out


@dataclasses.dataclass
class GroupPool:
    """The kept groups of a step's generation batches (module doc).

    Attributes:
        rows: Host arrays per part (prompts, masks, responses, scores, group ids, ...).
        extra: The reward function's extra info per part ({name: per-row list}).
        conversations: The agent loop's conversations per part (None: batch generation).
        groups: Groups kept so far.
        generated: Groups generated so far.
        batches: Generation batches so far.
        tokens: Response tokens generated so far (kept or not).
    """

    rows: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    extra: list[dict[str, list]] = dataclasses.field(default_factory=list)
    conversations: list[list | None] = dataclasses.field(default_factory=list)
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
        """Keep the groups of one generation batch (`rows["group_ids"]`, `values` [N]) that
        pass the rule; their group ids are renumbered after the pool's."""
        self.batches += 1
        self.tokens += int(np.asarray(rows["response_mask"]).sum())
        group_ids = np.asarray(rows["group_ids"])
        self.generated += len(np.unique(group_ids))
        index, kept = kept_rows(group_ids, values)
        part = select_rows(rows, index)
        part["group_ids"] = (_by_appearance(part["group_ids"]) + self.groups).astype(np.int32)
        self.rows.append(part)
        self.extra.append({k: [v[i] for i in index] for k, v in extra.items()})
        self.conversations.append(None if conversations is None else
                                  [conversations[i] for i in index])  # fmt: skip
        self.groups += kept

    def full(self, groups: int, max_num_gen_batches: int) -> bool:
        """Whether `groups` groups are kept (the step can train); raises
        `DynamicSamplingError` when not and `max_num_gen_batches` (> 0) batches are spent."""
        if self.groups >= groups:
            return True
        if 0 < max_num_gen_batches <= self.batches:
            raise DynamicSamplingError(too_many_batches_message(self.batches, max_num_gen_batches))
        return False

    def take(self, groups: int) -> tuple[dict[str, np.ndarray], dict[str, list], list | None]:
        """The first `groups` kept groups: (rows, extra info, conversations or None)."""
        rows = concat_rows(self.rows)
        keep = np.flatnonzero(rows["group_ids"] < groups)
        extra = merged_extra(self.rows, self.extra)
        conversations = None
        if self.conversations[0] is not None:
            everything = [c for part in self.conversations for c in part]
            conversations = [everything[i] for i in keep]
        return (
            select_rows(rows, keep),
            {k: [v[i] for i in keep] for k, v in extra.items()},
            (conversations),
        )

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
        self.kept: list[tuple[int, dict[str, np.ndarray], dict[str, list]]] = []  # by group:
        # (its prompt's place in the global order, its rows, its extra info)
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
                self.kept.append((group.sequence, {
                    "prompts": prompts.input_ids, "prompt_mask": prompts.attention_mask,
                    "responses": group.responses, "response_mask": group.response_mask,
                    "token_level_scores": np.asarray(scores, np.float32),
                    "rollout_log_probs": group.log_probs,
                    **self.host_fields(prompts),
                }, extra))  # fmt: skip
        self.timing["reward"] = self.timing.get("reward", 0.0) + time.perf_counter() - start
        return [verdicts[k] for k in range(len(groups))]

    def take(self, cut: int | None) -> tuple[dict[str, np.ndarray], dict[str, list], dict]:
        """The kept groups' rows before `cut` (None: all), of every process, in prompt order
        (group ids numbering them), their extra info, and the reward manager's metrics summed
        over every process (the surplus past the cut is dropped)."""
        every = allgather_objects(([g for g in self.kept if cut is None or g[0] < cut],
                                   self.reward_metrics))  # fmt: skip
        groups = sorted((g for part, _ in every for g in part), key=lambda g: g[0])
        rows = [{**r, "group_ids": np.full(len(r["responses"]), i, np.int32)}
                for i, (_, r, _) in enumerate(groups)]  # fmt: skip
        names = sorted({k for _, m in every for k in m})
        metrics = {k: float(sum(m.get(k, 0.0) for _, m in every)) for k in names}
        if not rows:
            return {}, {}, metrics
        return concat_rows(rows), merged_extra(rows, [e for _, _, e in groups]), metrics


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
