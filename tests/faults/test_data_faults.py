"""Data files as they arrive damaged or malformed: each problem names the file and the row,
and `data.skip_bad_rows` decides between refusing and skipping (counted)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl.data import RLDataset, load_tokenizer, synthetic
from jaxrl.data.rows import DataError, read_rows, write_parquet

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(synthetic.write_tokenizer(tmp_path_factory.mktemp("tok"))))


def records(n: int) -> list[dict]:
    return synthetic.make_records(n, task="repeat", length=4, seed=0, split="train")


def row_contents(path) -> list[tuple]:
    rows, _ = read_rows(path)
    return [(r.messages, r.data_source, r.ground_truth, r.extra_info, r.reward_model) for r in rows]


@pytest.mark.fault(
    fault="A parquet file with a corrupt row group (one byte flipped in any of its pages)",
    outcome=(
        "jaxrl writes parquet with page checksums and verifies them on read: a flip that would "
        "change a row is refused, naming the file (the footer has no checksum in parquet: "
        "about 2% of flips there load changed rows)"
    ),
    lost="Nothing (the run does not start)",
)
def test_corrupt_row_group_is_refused_not_misread(tmp_path):
    path = tmp_path / "rows.parquet"
    write_parquet(records(200), path)
    good, raw = row_contents(path), path.read_bytes()
    footer = len(raw) - 8 - int.from_bytes(raw[-8:-4], "little")  # where the pages end
    refused = 0
    for offset in range(4, footer, 7):
        damaged = bytearray(raw)
        damaged[offset] ^= 0x5A
        path.write_bytes(bytes(damaged))
        try:
            assert row_contents(path) == good, f"byte {offset} flipped: rows changed silently"
        except DataError as e:
            assert str(path) in str(e)
            refused += 1
    assert refused > footer // 7 // 2


@pytest.mark.fault(
    fault="Rows with a missing or wrong-typed field, an empty prompt, a null ground truth",
    outcome=(
        "Refused naming the file, the row and the column; with data.skip_bad_rows=true those "
        "rows are skipped, counted and logged, and the run goes on with the rest"
    ),
    lost="The malformed rows (with skip_bad_rows)",
)
def test_malformed_rows_named_or_skipped(tmp_path):
    rows = records(6)
    rows[1]["data_source"] = ""
    rows[2]["prompt"] = [{"role": "user", "content": "   "}]
    rows[4]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = write_parquet(rows, tmp_path / "rows.parquet")
    with pytest.raises(
        DataError, match=rf"{path}: row 1: column 'data_source': expected a non-empty"
    ):
        read_rows(path)
    kept, report = read_rows(path, skip_bad_rows=True)
    assert len(kept) == 3 and len(report.skipped) == 3
    assert [m.split(": ")[1] for m in report.skipped] == ["row 1", "row 2", "row 4"]


@pytest.mark.fault(
    fault="A file whose every row is malformed, with data.skip_bad_rows=true",
    outcome="Refused: the files, the count and the first row's problem (not a Python tuple)",
    lost="Nothing (the run does not start)",
)
def test_no_usable_rows_says_why(tmp_path, tokenizer):
    rows = records(3)
    for row in rows:
        row["prompt"] = []
    path = write_parquet(rows, tmp_path / "rows.parquet")
    with pytest.raises(DataError) as err:
        RLDataset.from_files([path], tokenizer, skip_bad_rows=True)
    assert str(err.value).startswith(f"{path}: no usable rows: all 3 rows are malformed (first: ")
    assert "row 0: column 'prompt'" in str(err.value)


@pytest.mark.fault(
    fault="A file without a required column",
    outcome="Refused as a whole, naming every missing column and the columns a verl file has",
    lost="Nothing (the run does not start)",
)
def test_missing_columns_name_each(tmp_path):
    path = tmp_path / "rows.parquet"
    write_parquet(records(3), path)
    pq.write_table(pq.read_table(path).drop_columns(["reward_model", "data_source"]), path)
    with pytest.raises(DataError, match=r"no column 'data_source', 'reward_model' \("):
        read_rows(path, skip_bad_rows=True)


@pytest.mark.fault(
    fault="A prompt longer than data.max_prompt_length, with each data.truncation mode",
    outcome=(
        "`error` names the file, the row and the lengths; `left` / `right` / `middle` cut it "
        "to the limit"
    ),
    lost="The cut tokens (by request)",
)
@pytest.mark.parametrize("truncation", ["error", "left", "right", "middle"])
def test_overlong_prompts_by_truncation_mode(tmp_path, tokenizer, truncation):
    path = write_parquet(records(2), tmp_path / "rows.parquet")
    ds = RLDataset.from_files(path, tokenizer, max_prompt_length=5, truncation=truncation)
    if truncation == "error":
        with pytest.raises(DataError, match=rf"{path}: row 0: the templated prompt has \d+"):
            ds.batch([0])
    else:
        assert ds.batch([0, 1]).input_ids.shape == (2, 5)


def with_raw_bytes(table, column: str, row: int, raw: bytes):
    """`table` with row `row` of string column `column` replaced by bytes that may not be UTF-8.

    pyarrow checks UTF-8 when it builds a string array from Python, not when it reads a file:
    the array is built as binary and its buffers reinterpreted as a string column.
    """
    values = table.column(column).to_pylist()
    values[row] = raw
    binary = pa.array([v if isinstance(v, bytes) else v.encode() for v in values], pa.binary())
    strings = pa.Array.from_buffers(pa.string(), len(binary), binary.buffers())
    return table.set_column(table.column_names.index(column), column, strings)


@pytest.mark.fault(
    fault="A string that is not valid UTF-8 (bytes 0xff 0xfe in a row's data_source)",
    outcome=(
        "That row is refused naming the file, the row and the column; with "
        "data.skip_bad_rows=true it is skipped and counted like any malformed row"
    ),
    lost="The undecodable row (with skip_bad_rows)",
)
def test_non_utf8_string_named_or_skipped(tmp_path):
    path = tmp_path / "rows.parquet"
    write_parquet(records(4), path)
    table = with_raw_bytes(pq.read_table(path), "data_source", 2, b"\xff\xfebad")
    pq.write_table(table, path)
    with pytest.raises(
        DataError, match=rf"{path}: row 2: column 'data_source': a string that is not valid UTF-8"
    ):
        read_rows(path)
    kept, report = read_rows(path, skip_bad_rows=True)
    assert [r.source[1] for r in kept] == [0, 1, 3] and len(report.skipped) == 1
