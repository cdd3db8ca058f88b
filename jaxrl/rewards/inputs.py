"""What a reward manager reads and writes: `RewardInputs` (one batch of rollouts, on the host)
and `RewardOutput` (the [B, R] reward tensor, extra info, metrics), and the score placement.

    reward_tensor[b, r] = score_b  if r == the last valid response position of row b,  else 0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jaxtyping import Float, Int


@dataclass
class RewardInputs:
    """One batch of rollouts to score, on the host.

    Attributes:
        response_mask: [B, R] 1 on the response's valid tokens (the response part of the
            attention mask, right-padded); its row sum is the response length.
        data_sources: [B] the `data.reward_fn_key` column, which picks the scorer.
        ground_truths: [B] each row's `reward_model.ground_truth`.
        responses: [B] decoded responses; None: decode `response_ids` with the manager's
            tokenizer (`skip_special_tokens=True`, as verl does).
        response_ids: [B, R] response token ids (needed when `responses` is None).
        extra_infos: [B] each row's `extra_info` mapping (or None).
        prompts: [B] decoded prompts, only printed for the first `num_examine` rows.
    """

    response_mask: Int[np.ndarray, "b r"]
    data_sources: Sequence[str]
    ground_truths: Sequence[Any]
    responses: Sequence[str] | None = None
    response_ids: Int[np.ndarray, "b r"] | None = None
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None
    prompts: Sequence[str] | None = None

    def __post_init__(self) -> None:
        self.response_mask = np.asarray(self.response_mask)
        if self.response_mask.ndim != 2:
            raise ValueError(f"response_mask must be [B, R], got shape {self.response_mask.shape}")
        b = self.response_mask.shape[0]
        named = {
            "data_sources": self.data_sources,
            "ground_truths": self.ground_truths,
            "responses": self.responses,
            "response_ids": self.response_ids,
            "extra_infos": self.extra_infos,
            "prompts": self.prompts,
        }
        for name, value in named.items():
            if value is not None and len(value) != b:
                raise ValueError(f"{name} has {len(value)} rows, response_mask has {b}")
        if self.responses is None and self.response_ids is None:
            raise ValueError("give the decoded `responses` or the `response_ids` to decode")

    def __len__(self) -> int:
        return self.response_mask.shape[0]

    @classmethod
    def from_columns(
        cls,
        columns: Mapping[str, Sequence[Any]],
        response_mask: Int[np.ndarray, "b r"],
        *,
        responses: Sequence[str] | None = None,
        response_ids: Int[np.ndarray, "b r"] | None = None,
        reward_fn_key: str = "data_source",
        prompts: Sequence[str] | None = None,
    ) -> RewardInputs:
        """From verl's per-row columns: `columns[reward_fn_key]` (the data source),
        `columns["reward_model"][b]["ground_truth"]` and the optional `columns["extra_info"]`."""
        missing = [k for k in (reward_fn_key, "reward_model") if k not in columns]
        if missing:
            raise KeyError(
                f"reward inputs need the columns {missing} (have {sorted(columns)}); check "
                "data.reward_fn_key and that the dataset has verl's reward_model column"
            )
        return cls(
            response_mask=response_mask,
            data_sources=list(columns[reward_fn_key]),
            ground_truths=[dict(r).get("ground_truth") for r in columns["reward_model"]],
            responses=responses,
            response_ids=response_ids,
            extra_infos=list(columns["extra_info"]) if "extra_info" in columns else None,
            prompts=prompts,
        )

    @property
    def response_lengths(self) -> Int[np.ndarray, " b"]:
        """[B] valid response tokens per row (verl's `valid_response_length`)."""
        return self.response_mask.sum(-1).astype(np.int64)

    def extra_info(self, i: int) -> dict[str, Any]:
        """A fresh copy of row i's extra info (scorers may modify it)."""
        info = None if self.extra_infos is None else self.extra_infos[i]
        return dict(info or {})


@dataclass
class RewardOutput:
    """Scores of one batch.

    Attributes:
        reward_tensor: [B, R] float32, each row's score at its last valid response token.
        reward_extra_info: key -> [B] values (the scorer's dict entries, `acc`, overlong info).
        metrics: `reward/errors` and `reward/timeouts` counts.
    """

    reward_tensor: Float[np.ndarray, "b r"]
    reward_extra_info: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def last_valid_index(response_mask: Int[np.ndarray, "b r"]) -> Int[np.ndarray, " b"]:
    """[B] position of the last 1 in each row (0 for an empty row)."""
    mask = np.asarray(response_mask) > 0
    r = mask.shape[-1]
    return np.where(mask.any(-1), r - 1 - np.argmax(mask[:, ::-1], axis=-1), 0)


def place_scores(
    scores_b: Float[np.ndarray, " b"], response_mask: Int[np.ndarray, "b r"]
) -> Float[np.ndarray, "b r"]:
    """[B, R] float32 zeros with `scores_b[b]` at row b's last valid response token.

    verl writes at `valid_response_length - 1`, which is the same position for right-padded
    masks; an empty response (length 0) gets its score at position 0 here, where verl's index
    -1 would wrap to the last position.
    """
    mask = np.asarray(response_mask)
    out = np.zeros(mask.shape, np.float32)
    out[np.arange(mask.shape[0]), last_valid_index(mask)] = np.asarray(scores_b, np.float32)
    return out
