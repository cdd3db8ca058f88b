"""`PromptBatch`: a batch of prompts as numpy arrays, and its `rollout.n` repetition.

Token arrays are int32 [B, P] with P = `data.max_prompt_length`, left-padded. The per-row
fields that the reward step needs (data source, ground truth, ...) are object arrays [B], so
one index array selects or repeats every field at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Prompts of one step on this process.

    Attributes:
        input_ids: int32 [B, P], left-padded token ids.
        attention_mask: int32 [B, P], 1 on prompt tokens, 0 on padding.
        group_ids: int32 [B], the prompt's integer group id (its position in the global batch;
            after `repeat` the n responses to one prompt share it). This is core_algos'
            `index`.
        uid: object [B], a string id of the prompt unique within the step (verl's `uid`).
        row_ids: int64 [B], the prompt's row in its dataset.
        data_source: object [B], the scorer selector.
        ground_truth: object [B], `reward_model.ground_truth`.
        ability: object [B].
        extra_info: object [B] of dicts.
        raw_prompt: object [B] of message tuples (verl's `raw_prompt`).
        is_padding: bool [B], true on rows added to fill the last, short batch of an epoch
            when `drop_last=False` (validation); their scores should be ignored.
        agent_name: object [B], the row's agent loop (verl's `agent_name` column; None where
            the row has none); None: no row has one.
        row_fields: object [B] of dicts, each row's fields by name (`Row.fields`: what
            `field` reads); None: not kept (a batch built by hand).
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    group_ids: np.ndarray
    uid: np.ndarray
    row_ids: np.ndarray
    data_source: np.ndarray
    ground_truth: np.ndarray
    ability: np.ndarray
    extra_info: np.ndarray
    raw_prompt: np.ndarray
    is_padding: np.ndarray
    agent_name: np.ndarray | None = None
    row_fields: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_lengths(self) -> np.ndarray:
        """int32 [B], tokens in each prompt."""
        return self.attention_mask.sum(-1).astype(np.int32)

    def field(self, name: str) -> np.ndarray:
        """object [B], each row's field `name` (`Row.fields`; None where a row lacks it)."""
        if self.row_fields is None:
            raise ValueError(f"this PromptBatch keeps no row fields, so none named {name!r}")
        return object_array([f.get(name) for f in self.row_fields])

    def select(self, idx: Any) -> PromptBatch:
        """The rows `idx` (an index array or slice) of every field."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v[idx] for k, v in fields.items() if v is not None})

    def repeat(self, n: int) -> PromptBatch:
        """Each prompt `n` times in a row (verl's `repeat(n, interleave=True)`): rows
        [p0, p0, ..., p1, p1, ...], so `group_ids` is `repeat(group_ids, n)` [B * n]."""
        if n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {n}")
        return self.select(np.repeat(np.arange(len(self)), n))

    def reward_inputs(self) -> list[dict[str, Any]]:
        """Per row, the keyword arguments of a verl scorer besides the response text:
        `data_source`, `ground_truth`, `extra_info`."""
        return [
            dict(data_source=s, ground_truth=g, extra_info=e)
            for s, g, e in zip(self.data_source, self.ground_truth, self.extra_info, strict=True)
        ]


def object_array(values: list[Any]) -> np.ndarray:
    """A 1-D object array holding `values` as they are (lists and dicts are not expanded)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def group_ids_from_uids(uids: Any) -> np.ndarray:
    """Map arbitrary uid values to int32 group ids [N], numbered by first appearance.

    `["b", "a", "b", "c"]` gives `[0, 1, 0, 2]`. Equal uids share an id, whatever the order.
    """
    table: dict[Any, int] = {}
    return np.asarray([table.setdefault(u, len(table)) for u in uids], dtype=np.int32)


def repeated_group_ids(num_prompts: int, n: int, offset: int = 0) -> np.ndarray:
    """int32 [num_prompts * n] group ids of `n` interleaved responses per prompt:
    `offset + [0]*n + [1]*n + ...`."""
    return np.repeat(np.arange(offset, offset + num_prompts, dtype=np.int32), n)


def bucket(n: int, minimum: int = 8) -> int:
    """The smallest size >= n among minimum * {1, 1.5, 2, 3, 4, 6, ...} (at most 1.5x padding,
    a handful of distinct sizes, so a handful of compiled programs)."""
    size = minimum
    while size < n:
        if size * 3 // 2 >= n and size * 3 // 2 > size:
            return size * 3 // 2
        size *= 2
    return size
