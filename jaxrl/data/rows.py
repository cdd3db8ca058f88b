"""Reading verl-format parquet files into checked rows.

A verl RL row has the columns

    data_source   str                       selects the rule-based scorer
    prompt        list[{role, content}]     the chat messages (column name: `data.prompt_key`)
    ability       str                       a free-form tag (e.g. "math"); optional
    reward_model  {style, ground_truth}     `ground_truth` is what the scorer compares with
    extra_info    dict | null               anything else (verl reads `extra_info.index`)

Other columns are kept and passed through. A row that breaks these rules is an error naming the
file, the row index in that file and the column; with `skip_bad_rows=True` it is dropped and
counted instead (`ReadReport.skipped`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("jaxrl.data")

REQUIRED_COLUMNS = ("data_source", "reward_model")


class DataError(ValueError):
    """A dataset file or row that cannot be used; the message names the file, row and column."""


@dataclass(frozen=True)
class Row:
    """One prompt of the dataset.

    Attributes:
        messages: The chat messages, `[{"role": ..., "content": ...}, ...]`.
        data_source: Selects the scorer.
        ground_truth: `reward_model.ground_truth` (any JSON-like value, never None).
        ability: The `ability` column ("" when absent).
        reward_model: The whole `reward_model` column.
        extra_info: The `extra_info` column ({} when absent or null).
        source: `(file, row index in that file)`, for error messages.
        extra: Every other column, passed through untouched.
    """

    messages: tuple[dict[str, Any], ...]
    data_source: str
    ground_truth: Any
    ability: str
    reward_model: dict[str, Any]
    extra_info: dict[str, Any]
    source: tuple[str, int]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def index(self) -> Any:
        """verl's per-row `index`: `extra_info["index"]`, else 0."""
        return self.extra_info.get("index", 0)

    def fields(self) -> dict[str, Any]:
        """The row's fields by name, as verl hands them to its agent loop (`sample_kwargs`):
        `data_source`, `ability`, `reward_model`, `extra_info`, `index`, and every other
        column (`distillation.teacher_key` names one of them)."""
        return {
            **self.extra,
            "data_source": self.data_source,
            "ability": self.ability or None,  # verl's row has no `ability` when it is absent
            "reward_model": self.reward_model,
            "extra_info": self.extra_info,
            "index": self.index,  # verl's, from extra_info, over an `index` column
        }


@dataclass
class ReadReport:
    """What `read_rows` did: rows read per file and bad rows skipped (with their reasons)."""

    rows_per_file: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def as_file_list(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """A path or a list of paths as a list of expanded path strings."""
    if isinstance(files, str | os.PathLike):
        files = [files]
    return [os.path.expanduser(os.fspath(f)) for f in files]


@dataclass(frozen=True)
class BadRow:
    """A row `read_table` could not turn into Python values; `problem` names the column."""

    problem: str


def _decode_row(table: Any, i: int) -> dict[str, Any] | BadRow:
    """Row `i` of a pyarrow table as a dict, or a `BadRow` naming a column that is not UTF-8."""
    row = table.slice(i, 1)
    values = {}
    for name in row.column_names:
        try:
            (values[name],) = row.column(name).to_pylist()
        except UnicodeDecodeError as e:
            return BadRow(f"column {name!r}: a string that is not valid UTF-8 ({e.reason})")
    return values


def read_table(path: str) -> list[dict[str, Any] | BadRow]:
    """All rows of one parquet file as Python dicts; a missing or non-parquet file names `path`.

    A row holding a string column whose bytes are not UTF-8 (parquet does not enforce it on
    write) comes back as a `BadRow`, so callers can name it or skip it like any malformed row.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path}: no such dataset file; check data.train_files / data.val_files "
            "(make the files with `python -m jaxrl.data.preprocess ...`)"
        )
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory; give the parquet files inside it")
    try:
        # Pages written with checksums (jaxrl's own files) are verified: without them a flipped
        # byte in a data page can load as silently different rows.
        table = pq.read_table(path, page_checksum_verification=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
        if "page integrity" in str(e) or "checksum" in str(e).lower():
            raise DataError(f"{path}: corrupted: a page checksum does not match ({e})") from e
        raise DataError(f"{path}: not a readable parquet file ({e})") from e
    try:
        return table.to_pylist()
    except UnicodeDecodeError:  # rare: find the rows, one at a time
        return [_decode_row(table, i) for i in range(table.num_rows)]


def missing_columns(path: str, prompt_key: str) -> list[str]:
    """The required columns that the parquet file's schema lacks."""
    import pyarrow.parquet as pq

    names = set(pq.read_schema(path).names)
    return [c for c in (*REQUIRED_COLUMNS, prompt_key) if c not in names]


def check_row(raw: dict[str, Any] | BadRow, prompt_key: str) -> str | None:
    """Why `raw` is not a valid verl row (naming the column), or None when it is."""
    if isinstance(raw, BadRow):
        return raw.problem
    if not isinstance(raw, dict):
        return f"expected a record of columns, got {raw!r}"
    for column in (*REQUIRED_COLUMNS, prompt_key):
        if column not in raw:
            return f"column {column!r} is missing"
    if not isinstance(raw["data_source"], str) or not raw["data_source"]:
        return f"column 'data_source': expected a non-empty string, got {raw['data_source']!r}"
    messages = raw[prompt_key]
    if not isinstance(messages, list | tuple) or not messages:
        return (
            f"column {prompt_key!r}: expected a non-empty list of chat messages, got {messages!r}"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"column {prompt_key!r}: message {i} needs a string 'role', got {m!r}"
        if not isinstance(m.get("content"), str):
            return f"column {prompt_key!r}: message {i} needs a string 'content', got {m!r}"
    if not any(m["content"].strip() for m in messages):
        return f"column {prompt_key!r}: every message is empty"
    rm = raw["reward_model"]
    if not isinstance(rm, dict):
        return f"column 'reward_model': expected a struct {{style, ground_truth}}, got {rm!r}"
    if rm.get("ground_truth") is None:
        return "column 'reward_model': 'ground_truth' is missing or null"
    ability = raw.get("ability")
    if ability is not None and not isinstance(ability, str):
        return f"column 'ability': expected a string, got {ability!r}"
    extra_info = raw.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        return f"column 'extra_info': expected a struct or null, got {extra_info!r}"
    return None


def to_row(raw: dict[str, Any], prompt_key: str, source: tuple[str, int]) -> Row:
    """A checked raw dict as a `Row` (call `check_row` first)."""
    # Parquet structs come back with every field of the column's schema; drop the nulls that
    # pyarrow filled in for messages that lacked a field.
    messages = tuple({k: v for k, v in m.items() if v is not None} for m in raw[prompt_key])
    known = {*REQUIRED_COLUMNS, prompt_key, "ability", "extra_info"}
    return Row(
        messages=messages,
        data_source=raw["data_source"],
        ground_truth=raw["reward_model"]["ground_truth"],
        ability=raw.get("ability") or "",
        reward_model=dict(raw["reward_model"]),
        extra_info=dict(raw.get("extra_info") or {}),
        source=source,
        extra={k: v for k, v in raw.items() if k not in known},
    )


def read_rows(
    files: str | os.PathLike | Sequence[str | os.PathLike],
    prompt_key: str = "prompt",
    skip_bad_rows: bool = False,
) -> tuple[list[Row], ReadReport]:
    """Read and check every row of `files`, in file order.

    Args:
        files: One parquet path or a list of them (`~` is expanded).
        prompt_key: The column holding the chat messages (`data.prompt_key`).
        skip_bad_rows: Drop malformed rows (counted in the report and logged) instead of raising.

    Returns:
        The rows and a `ReadReport`.

    Raises:
        FileNotFoundError: A file does not exist (the message names it).
        DataError: A file is not parquet, or a row is malformed and `skip_bad_rows` is false
            (the message names the file, the row index and the column).
    """
    rows: list[Row] = []
    report = ReadReport()
    for path in as_file_list(files):
        table = read_table(path)
        missing = missing_columns(path, prompt_key)
        if missing:  # a file-level problem: skipping every row would hide it
            raise DataError(
                f"{path}: no column {', '.join(map(repr, missing))} (a verl-format file has "
                f"{', '.join(map(repr, (*REQUIRED_COLUMNS, prompt_key)))}; the prompt column is "
                "data.prompt_key); convert it with python -m jaxrl.data.preprocess"
            )
        report.rows_per_file[path] = len(table)
        for i, raw in enumerate(table):
            problem = check_row(raw, prompt_key)
            if problem is None:
                rows.append(to_row(raw, prompt_key, (path, i)))
                continue
            message = f"{path}: row {i}: {problem}"
            if not skip_bad_rows:
                raise DataError(
                    message + "; fix the file, or set data.skip_bad_rows=true to skip such rows"
                )
            report.skipped.append(message)
    if report.skipped:
        log.warning(
            "skipped %d malformed rows (data.skip_bad_rows=true); first: %s",
            len(report.skipped),
            report.skipped[0],
        )
    return rows, report


def row_to_record(row: Row, prompt_key: str = "prompt") -> dict[str, Any]:
    """The verl parquet record of a `Row` (inverse of `to_row`)."""
    return {
        "data_source": row.data_source,
        prompt_key: [dict(m) for m in row.messages],
        "ability": row.ability,
        "reward_model": dict(row.reward_model),
        "extra_info": dict(row.extra_info),
        **row.extra,
    }


def write_parquet(records: Sequence[dict[str, Any]], path: str | os.PathLike) -> str:
    """Write verl-format records (dicts with verl's columns) to one parquet file.

    Nested values become parquet structs and lists, as `datasets.Dataset.to_parquet` writes
    them, so verl's own loader reads the file too. Returns the path written.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.expanduser(os.fspath(path))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    # Parquet cannot store a struct without fields: an empty dict is written as null.
    records = [{k: (None if v == {} else v) for k, v in r.items()} for r in records]
    pq.write_table(pa.Table.from_pylist(records), path, write_page_checksum=True)
    return path
