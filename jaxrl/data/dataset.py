"""`RLDataset`: verl-format parquet rows with their templated, truncated prompt token ids.

    tokenizer = load_tokenizer("path/to/model")
    train = RLDataset.from_config(cfg.data, tokenizer, split="train")
    batch = train.batch([0, 5, 7])            # a PromptBatch, left-padded to max_prompt_length

Building the dataset reads every file (all processes read the rows: parquet of prompts is small)
and applies `max_samples` and `filter_overlong_prompts`. Token ids are computed when a row is
first batched, so a process only tokenizes the rows it is given (see `PromptIterator`); the
overlong filter is the exception, as it must see every row and gives every process the same
surviving set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.data.batch import PromptBatch, object_array
from jaxrl.data.rows import DataError, ReadReport, Row, read_rows
from jaxrl.data.templates import TRUNCATIONS, encode_prompts, left_pad, truncate

log = logging.getLogger("jaxrl.data")


class RLDataset:
    """Rows of verl-format parquet files and their prompt token ids.

    Attributes:
        rows: The kept rows, in file order (after `max_samples` and the overlong filter).
        tokenizer: The HF tokenizer.
        max_prompt_length: P, the padded prompt length.
        truncation: `error`, `left`, `right` or `middle`.
        chat_template_kwargs: Extra `apply_chat_template` arguments.
        report: What reading the files did (`ReadReport`: rows per file, skipped bad rows).
        num_filtered: Rows dropped by `filter_overlong_prompts`.
    """

    def __init__(
        self,
        rows: Sequence[Row],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        truncation: str = "error",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        report: ReadReport | None = None,
    ):
        if truncation not in TRUNCATIONS:
            raise ValueError(
                f"data.truncation={truncation!r} is not one of {', '.join(TRUNCATIONS)}"
            )
        self.rows = list(rows)
        self.tokenizer = tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.truncation = truncation
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.report = report or ReadReport()
        self.num_filtered = 0
        self._ids: dict[int, list[int]] = {}  # row -> untruncated prompt ids

    @classmethod
    def from_files(
        cls,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_samples: int = -1,
        shuffle: bool = False,
        seed: int | None = 1,
        skip_bad_rows: bool = False,
    ) -> RLDataset:
        """Read `files` and build the dataset.

        Args:
            files: A parquet path or a list of them.
            tokenizer: The HF tokenizer (its chat template is applied).
            prompt_key: Column of the chat messages.
            max_prompt_length: P; longer prompts are filtered or truncated.
            truncation: What to do with a prompt longer than P (see `templates`).
            filter_overlong_prompts: Drop rows whose templated prompt is longer than P.
            chat_template_kwargs: Extra `apply_chat_template` arguments.
            max_samples: Keep at most this many rows (-1: all): a random subset drawn with
                `seed` when `shuffle`, else the first ones (verl's `train_max_samples`).
            shuffle: Whether `max_samples` draws a random subset.
            seed: Seed of that draw.
            skip_bad_rows: Skip malformed rows (counted in `report`) instead of raising.
        """
        rows, report = read_rows(files, prompt_key=prompt_key, skip_bad_rows=skip_bad_rows)
        return cls.from_rows(
            rows,
            report,
            tokenizer,
            max_prompt_length=max_prompt_length,
            truncation=truncation,
            filter_overlong_prompts=filter_overlong_prompts,
            chat_template_kwargs=chat_template_kwargs,
            max_samples=max_samples,
            shuffle=shuffle,
            seed=seed,
        )

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Row],
        report: ReadReport,
        tokenizer: Any,
        *,
        max_prompt_length: int = 512,
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_samples: int = -1,
        shuffle: bool = False,
        seed: int | None = 1,
    ) -> RLDataset:
        """The dataset of rows already read (`read_rows`): `max_samples` drawn, then the
        overlong filter; the arguments are `from_files`'."""
        if not rows:
            names = ", ".join(report.rows_per_file)
            why = (
                f"all {len(report.skipped)} rows are malformed (first: {report.skipped[0]})"
                if report.skipped
                else "the files hold no rows"
            )
            raise DataError(f"{names}: no usable rows: {why}")
        total = len(rows)
        if 0 < max_samples < total:
            if shuffle:
                keep = np.random.default_rng(seed).choice(total, size=max_samples, replace=False)
            else:
                keep = np.arange(max_samples)
            rows = [rows[i] for i in keep]
            log.info("kept %d of %d rows (max_samples)", max_samples, total)
        dataset = cls(
            rows,
            tokenizer,
            max_prompt_length=max_prompt_length,
            truncation=truncation,
            chat_template_kwargs=chat_template_kwargs,
            report=report,
        )
        if filter_overlong_prompts:
            dataset.filter_overlong()
        return dataset

    @classmethod
    def from_config(
        cls, data: Any, tokenizer: Any, split: str = "train", tools: list[dict] | None = None
    ) -> RLDataset:
        """The `train` or `val` dataset described by a `DataConfig` (`data.*`); `tools`: the
        OpenAI schemas a multi-turn run's prompts show, so that their lengths (filtering,
        truncation) are those the agent loop renders."""
        options = selection(data, split)
        if tools:
            options["chat_template_kwargs"] = {**options["chat_template_kwargs"], "tools": tools}
        files = data.train_files if split == "train" else data.val_files
        return cls.from_files(
            files,
            tokenizer,
            prompt_key=data.prompt_key,
            skip_bad_rows=getattr(data, "skip_bad_rows", False),
            **options,
        )

    def __len__(self) -> int:
        return len(self.rows)

    def _encode(self, indices: Sequence[int]) -> None:
        todo = [int(i) for i in indices if int(i) not in self._ids]
        encoded = encode_prompts(
            self.tokenizer, [self.rows[i].messages for i in todo], self.chat_template_kwargs
        )
        self._ids.update(zip(todo, encoded, strict=True))

    def prompt_lengths(self) -> np.ndarray:
        """int64 [N]: each row's templated prompt length in tokens, before truncation."""
        self._encode(range(len(self.rows)))
        return np.asarray([len(self._ids[i]) for i in range(len(self.rows))], np.int64)

    def filter_overlong(self) -> int:
        """Drop rows whose templated prompt is longer than P; returns (and logs) the count."""
        keep = np.flatnonzero(self.prompt_lengths() <= self.max_prompt_length).tolist()
        dropped = len(self.rows) - len(keep)
        self.rows = [self.rows[i] for i in keep]
        self._ids = {new: self._ids[old] for new, old in enumerate(keep)}
        self.num_filtered += dropped
        log.info(
            "filter_overlong_prompts: dropped %d of %d rows longer than %d tokens",
            dropped,
            dropped + len(keep),
            self.max_prompt_length,
        )
        if not self.rows:
            raise DataError(
                f"every row is longer than data.max_prompt_length={self.max_prompt_length} "
                "tokens after the chat template; raise it"
            )
        return dropped

    def prompt_ids(self, index: int) -> list[int]:
        """Token ids of row `index`'s templated prompt, truncated to P by `truncation`."""
        self._encode([index])
        path, i = self.rows[index].source
        return truncate(
            self._ids[index], self.max_prompt_length, self.truncation, where=f"{path}: row {i}"
        )

    def batch(
        self,
        indices: Sequence[int],
        *,
        group_offset: int = 0,
        uid_prefix: str = "",
        is_padding: Sequence[bool] | None = None,
    ) -> PromptBatch:
        """The rows `indices` as a left-padded `PromptBatch`.

        Args:
            indices: Dataset rows, in batch order.
            group_offset: `group_ids` are `group_offset + [0, 1, ...]` (the rows' positions in
                the global batch when a process holds a slice of it).
            uid_prefix: `uid` is `f"{uid_prefix}{group_id}"`.
            is_padding: Marks filler rows (see `PromptBatch.is_padding`).
        """
        indices = [int(i) for i in indices]
        self._encode(indices)
        ids = [self.prompt_ids(i) for i in indices]
        pad = self.tokenizer.pad_token_id
        input_ids, attention_mask = left_pad(ids, self.max_prompt_length, 0 if pad is None else pad)
        rows = [self.rows[i] for i in indices]
        group_ids = np.arange(group_offset, group_offset + len(indices), dtype=np.int32)
        return PromptBatch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            group_ids=group_ids,
            uid=object_array([f"{uid_prefix}{g}" for g in group_ids]),
            row_ids=np.asarray(indices, np.int64),
            data_source=object_array([r.data_source for r in rows]),
            ground_truth=object_array([r.ground_truth for r in rows]),
            ability=object_array([r.ability for r in rows]),
            extra_info=object_array([r.extra_info for r in rows]),
            raw_prompt=object_array([r.messages for r in rows]),
            agent_name=object_array([r.extra.get("agent_name") for r in rows])
            if any(r.extra.get("agent_name") is not None for r in rows)
            else None,
            row_fields=object_array([r.fields() for r in rows]),
            is_padding=np.zeros(len(indices), bool)
            if is_padding is None
            else np.asarray(is_padding, bool),
        )


def selection(data: Any, split: str) -> dict[str, Any]:
    """`from_rows`' arguments for the train or val split of a `DataConfig` (`data.*`)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return {
        "max_prompt_length": data.max_prompt_length,
        "truncation": data.truncation,
        "filter_overlong_prompts": data.filter_overlong_prompts,
        "chat_template_kwargs": data.apply_chat_template_kwargs,
        "max_samples": data.train_max_samples if split == "train" else data.val_max_samples,
        "shuffle": data.shuffle if split == "train" else data.validation_shuffle,
        "seed": 1 if data.seed is None else data.seed,
    }
