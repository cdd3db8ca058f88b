"""`OfflineDataset`: the rows of an SFT or preference parquet file, tokenized (`supervised`),
and their batches.

    train = OfflineDataset.sft(cfg.data, tokenizer, "train")        # or .preference(...)
    loader = PromptIterator(train, batch_size, seed=1)                # the RL data's iterator
    batch = next(loader)                                              # an OfflineBatch

Every row is read, checked and tokenized when the dataset is built, so a bad row is named
(file and row index in that file) before training starts; with `skip_bad_rows` it is counted
and dropped instead (`report.skipped`). An example has one sequence (SFT, KTO) or two (DPO:
chosen, then rejected); a batch lays its examples' sequences out as consecutive rows, so the
chosen and rejected of pair i are rows 2i and 2i + 1.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.data.batch import bucket
from jaxrl.data.rows import BadRow, DataError, ReadReport, as_file_list, read_table
from jaxrl.data.supervised import (
    PreferenceLimits,
    TokenSeq,
    cut_sequence,
    multiturn_sequence,
    prompt_and_bodies,
    sft_sequence,
)

log = logging.getLogger("jaxrl.data")


@dataclasses.dataclass(frozen=True)
class Example:
    """One row of the dataset.

    Attributes:
        sequences: Its sequences (DPO: chosen, rejected).
        label: KTO's label (1.0 desirable, 0.0 undesirable); None elsewhere.
        source: (file, row index in that file).
        body: KTO: the completion's ids before the `max_length` cut (another example's KL
            sequence appends them to its prompt, then cuts).
    """

    sequences: tuple[TokenSeq, ...]
    label: float | None
    source: tuple[str, int]
    body: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class OfflineBatch:
    """Sequences of a batch as host arrays (N = examples x sequences per example).

    Attributes:
        prompts: int32 [N, P], left-padded.
        prompt_mask: int32 [N, P].
        responses: int32 [N, R], the completions, right-padded.
        response_mask: int32 [N, R].
        loss_mask: int32 [N, R], 1 on the completion tokens trained on (0 on padding rows).
        row_ids: int64 [N], each sequence's example (its row in the dataset).
        is_padding: bool [N], sequences of rows added to fill a last, short batch.
        labels: float32 [N] (KTO's labels), else None.
        kl: KTO's mismatched pairs (prompt i with the completion of example i - 1), else None.
    """

    prompts: np.ndarray
    prompt_mask: np.ndarray
    responses: np.ndarray
    response_mask: np.ndarray
    loss_mask: np.ndarray
    row_ids: np.ndarray
    is_padding: np.ndarray
    labels: np.ndarray | None = None
    kl: OfflineBatch | None = None

    def __len__(self) -> int:
        return int(self.responses.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        """The token arrays (`RLBatch.from_host`'s input)."""
        names = ("prompts", "prompt_mask", "responses", "response_mask", "loss_mask")
        return {k: getattr(self, k) for k in names}


def pad_sequences(
    seqs: Sequence[TokenSeq], pad_token_id: int, padding: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Left-padded prompts and right-padded completions, each to the bucket of its longest."""
    p = bucket(max(len(s.prompt) for s in seqs))
    r = bucket(max(len(s.completion) for s in seqs))
    n = len(seqs)
    out = {
        "prompts": np.full((n, p), pad_token_id, np.int32),
        "prompt_mask": np.zeros((n, p), np.int32),
        "responses": np.full((n, r), pad_token_id, np.int32),
        "response_mask": np.zeros((n, r), np.int32),
        "loss_mask": np.zeros((n, r), np.int32),
    }
    for i, s in enumerate(seqs):
        out["prompts"][i, p - len(s.prompt) :] = s.prompt
        out["prompt_mask"][i, p - len(s.prompt) :] = 1
        out["responses"][i, : len(s.completion)] = s.completion
        out["response_mask"][i, : len(s.completion)] = 1
        if padding is None or not padding[i]:
            out["loss_mask"][i, : len(s.completion)] = s.loss_mask
    return out


def _value(raw: Mapping[str, Any], key: str, dict_keys: Sequence[str] | None, name: str) -> Any:
    if raw.get(key) is None:
        raise DataError(f"no value in column {key!r} ({name})")
    value = raw[key]
    for k in dict_keys or ():
        if not isinstance(value, Mapping) or k not in value:
            raise DataError(f"column {key!r} has no key {k!r} ({name} dict keys)")
        value = value[k]
    return value


def _text_or_messages(value: Any, what: str) -> Any:
    """A string or a list of {role, content} messages (numpy arrays from parquet as lists)."""
    if isinstance(value, str):
        if not value:
            raise DataError(f"empty {what}")
        return value
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    ):
        return [dict(m) for m in value]
    raise DataError(f"the {what} is neither a non-empty string nor a list of chat messages")


class OfflineDataset:
    """Tokenized examples; `batch(rows)` lays them out as an `OfflineBatch`.

    Attributes:
        examples: The kept rows, in file order.
        pad_token_id: The padding token.
        report: Rows read per file and bad rows skipped.
        num_dropped: Examples TRL's truncation drops (a prompt that fills `max_length`).
        kl_limits: KTO: the length limits its KL sequences are cut by (None: not KTO).
    """

    def __init__(
        self,
        examples: Sequence[Example],
        pad_token_id: int,
        report: ReadReport | None = None,
        *,
        num_dropped: int = 0,
        kl_limits: PreferenceLimits | None = None,
    ):
        self.examples = list(examples)
        self.pad_token_id = int(pad_token_id)
        self.report = report or ReadReport()
        self.num_dropped = num_dropped
        self.kl_limits = kl_limits

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def sequences_per_example(self) -> int:
        return len(self.examples[0].sequences) if self.examples else 1

    # ------------------------------------------------------------------------- building

    @classmethod
    def read(
        cls,
        files: Any,
        make: Callable[[Mapping[str, Any], str], Example | None],
        pad_token_id: int,
        columns: dict[str, str],
        *,
        skip_bad_rows: bool = False,
        max_samples: int = -1,
        kl_limits: PreferenceLimits | None = None,
    ) -> OfflineDataset:
        """Every row of `files` through `make(raw_row, where)` (None: dropped by truncation;
        `DataError`: a bad row, raised or, with `skip_bad_rows`, counted). A file without
        one of `columns` ({column: its config key}) is an error whatever `skip_bad_rows`
        says (skipping every row would hide it). Reading stops once `max_samples` rows
        (>= 0) are kept."""
        import pyarrow.parquet as pq

        examples, report, dropped = [], ReadReport(), 0
        limit = None if max_samples is None or max_samples < 0 else max_samples
        for path in as_file_list(files):
            if limit is not None and len(examples) >= limit:
                break
            table = read_table(path)
            names = set(pq.read_schema(path).names)
            if missing := [f"{c!r} ({key})" for c, key in columns.items() if c not in names]:
                raise DataError(f"{path}: no column {', '.join(missing)}; set the key to the "
                                "file's column name")  # fmt: skip
            report.rows_per_file[path] = len(table)
            for i, raw in enumerate(table):
                if limit is not None and len(examples) >= limit:
                    break
                where = f"{path}: row {i}"
                try:
                    if isinstance(raw, BadRow):
                        raise DataError(raw.problem)
                    example = make(raw, where)
                except DataError as e:
                    message = str(e) if str(e).startswith(where) else f"{where}: {e}"
                    if not skip_bad_rows:
                        raise DataError(
                            f"{message}; fix the file, or set data.skip_bad_rows=true to skip "
                            "such rows"
                        ) from None
                    report.skipped.append(message)
                    continue
                if example is None:
                    dropped += 1
                else:
                    examples.append(dataclasses.replace(example, source=(path, i)))
        if report.skipped:
            log.warning("skipped %d malformed rows (data.skip_bad_rows=true); first: %s",
                        len(report.skipped), report.skipped[0])  # fmt: skip
        if dropped:
            log.warning("dropped %d rows whose prompt alone fills dpo.max_length "
                        "(truncation_mode keep_start, as TRL)", dropped)  # fmt: skip
        if not examples:
            raise DataError(f"{', '.join(as_file_list(files))}: no usable rows")
        return cls(examples, pad_token_id, report, num_dropped=dropped, kl_limits=kl_limits)

    @classmethod
    def sft(cls, data: Any, tokenizer: Any, split: str) -> OfflineDataset:
        """verl's SFT rows of `data.{split}_files` (`jaxrl.config.offline.SFTDataConfig`)."""
        files = data.train_files if split == "train" else data.val_files
        kw = dict(max_length=data.max_length, truncation=data.truncation,
                  template_kwargs=dict(data.apply_chat_template_kwargs))  # fmt: skip
        mt = data.multiturn

        def make(raw, where):
            if mt.enable:
                messages = _text_or_messages(
                    _value(raw, mt.messages_key, None, "messages"), "messages"
                )
                if isinstance(messages, str):
                    raise DataError(f"column {mt.messages_key!r} is not a list of chat messages")
                tools = raw.get(mt.tools_key)
                extra = dict(kw["template_kwargs"])
                thinking = raw.get(mt.enable_thinking_key, mt.enable_thinking_default)
                if thinking is not None:
                    extra["enable_thinking"] = bool(thinking)
                seq = multiturn_sequence(
                    tokenizer, messages, max_length=kw["max_length"],
                    truncation=kw["truncation"], tools=tools, template_kwargs=extra,
                    header_kwargs=kw["template_kwargs"], where=where,
                    allow_mismatch=mt.ignore_input_ids_mismatch,
                )  # fmt: skip
            else:
                prompt = _text_or_messages(
                    _value(raw, data.prompt_key, data.prompt_dict_keys, "data.prompt_key"), "prompt"
                )
                response = _value(raw, data.response_key, data.response_dict_keys,
                                  "data.response_key")  # fmt: skip
                if not isinstance(response, str) or not response:
                    raise DataError(f"column {data.response_key!r}: empty or not a string")
                seq = sft_sequence(tokenizer, prompt, response, where=where, **kw)
            return Example((seq,), None, ("", 0))

        limit = data.train_max_samples if split == "train" else data.val_max_samples
        if mt.enable:
            columns = {mt.messages_key: "data.multiturn.messages_key"}
        else:
            columns = {data.prompt_key: "data.prompt_key", data.response_key: "data.response_key"}
        return cls.read(files, make, tokenizer.pad_token_id, columns,
                        skip_bad_rows=data.skip_bad_rows, max_samples=limit)  # fmt: skip

    @classmethod
    def preference(
        cls, data: Any, limits: PreferenceLimits, tokenizer: Any, split: str, *, kto: bool
    ) -> OfflineDataset:
        """TRL's preference rows: `prompt`, `chosen`, `rejected` (DPO) or `prompt`,
        `completion`, `label` (KTO) (`jaxrl.config.offline.PreferenceDataConfig`)."""
        files = data.train_files if split == "train" else data.val_files
        keys = (data.completion_key,) if kto else (data.chosen_key, data.rejected_key)
        template_kwargs = dict(data.apply_chat_template_kwargs)

        def make(raw, where):
            prompt = _text_or_messages(
                _value(raw, data.prompt_key, None, "data.prompt_key"), "prompt"
            )
            completions = [
                _text_or_messages(_value(raw, k, None, f"data.{name}_key"), f"{name} completion")
                for k, name in zip(keys, ("completion",) if kto else ("chosen", "rejected"),
                                   strict=True)
            ]  # fmt: skip
            label = None
            if kto:
                value = _value(raw, data.label_key, None, "data.label_key")
                if not isinstance(value, bool | np.bool_ | int) or value not in (0, 1):
                    raise DataError(f"column {data.label_key!r}: {value!r} is not a boolean")
                label = float(bool(value))
            prompt_ids, bodies = prompt_and_bodies(tokenizer, prompt, completions, limits,
                                                   template_kwargs=template_kwargs,
                                                   where=where)  # fmt: skip
            seqs = [cut_sequence(prompt_ids, body, limits, where) for body in bodies]
            if any(s is None for s in seqs):
                return None
            return Example(tuple(seqs), label, ("", 0), tuple(bodies[0]) if kto else ())

        limit = data.train_max_samples if split == "train" else data.val_max_samples
        names = ("completion", "label") if kto else ("chosen", "rejected")
        key_of = {data.prompt_key: "data.prompt_key"}
        for name in names:
            key_of[getattr(data, f"{name}_key")] = f"data.{name}_key"
        return cls.read(files, make, tokenizer.pad_token_id, key_of,
                        skip_bad_rows=data.skip_bad_rows, max_samples=limit,
                        kl_limits=limits if kto else None)  # fmt: skip

    # --------------------------------------------------------------------------- batches

    def batch(
        self,
        rows: Sequence[int],
        *,
        group_offset: int = 0,
        uid_prefix: str = "",
        is_padding: np.ndarray | None = None,
    ) -> OfflineBatch:
        """The examples `rows` as an `OfflineBatch` (`PromptIterator`'s call; `group_offset`
        and `uid_prefix` have no use here). `is_padding` rows carry no loss."""
        del group_offset, uid_prefix
        rows = np.asarray(rows, np.int64)
        padding = np.zeros(len(rows), bool) if is_padding is None else np.asarray(is_padding)
        k = self.sequences_per_example
        examples = [self.examples[r] for r in rows]
        seqs = [s for e in examples for s in e.sequences]
        seq_padding = np.repeat(padding, k)
        arrays = pad_sequences(seqs, self.pad_token_id, seq_padding)
        labels = None
        if examples[0].label is not None:
            labels = np.asarray([e.label for e in examples], np.float32)
        kl = None
        if self.kl_limits is not None:
            kl = self._kl_batch(examples, padding)
        return OfflineBatch(
            **arrays,
            row_ids=np.repeat(rows, k),
            is_padding=seq_padding,
            labels=labels,
            kl=kl,
        )

    def _kl_batch(self, examples: Sequence[Example], padding: np.ndarray) -> OfflineBatch:
        """KTO's mismatched pairs: example i's prompt with example i - 1's completion (the
        first with the last's) before its own cut, then cut to `max_length` (TRL's KL
        dataset). A batch of one example has no mismatched pair: its KL row carries no
        loss mask (the estimate is then 0)."""
        seqs = []
        for i, e in enumerate(examples):
            prompt = e.sequences[0].prompt
            seq = cut_sequence(prompt, examples[i - 1].body, self.kl_limits)
            if seq is None or not seq.completion:  # the prompt fills max_length: no KL tokens
                seq = TokenSeq(prompt[:-1], prompt[-1:], (0,))
            seqs.append(seq)
        no_pair = padding | (len(examples) < 2)
        arrays = pad_sequences(seqs, self.pad_token_id, no_pair)
        return OfflineBatch(**arrays, row_ids=np.zeros(len(seqs), np.int64), is_padding=padding)
