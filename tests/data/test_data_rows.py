"""Reading verl-format parquet: round trip, malformed rows, bad files."""

import pyarrow.parquet as pq
import pytest

from jaxrl.data import DataError, read_rows
from jaxrl.data.rows import row_to_record


def test_round_trip_through_parquet(write, digit_records):
    records = digit_records([3, 1, 10])
    records[1]["extra_info"] = {"split": "train", "index": 1, "answer": "x"}
    records[2]["extra_info"] = None  # verl allows a null extra_info
    records[0]["level"] = "Level 1"  # extra columns pass through
    path = write(records)
    rows, report = read_rows(path)
    assert report.rows_per_file == {path: 3} and report.skipped == []
    assert [r.source for r in rows] == [(path, 0), (path, 1), (path, 2)]
    assert rows[0].messages == tuple(records[0]["prompt"])
    assert [r.ground_truth for r in rows] == ["0", "1", "2"]
    assert [r.data_source for r in rows] == ["jaxrl/synthetic_copy"] * 3
    assert rows[0].extra == {"level": "Level 1"} and rows[1].extra == {"level": None}
    assert rows[1].extra_info["answer"] == "x" and rows[1].index == 1
    assert rows[2].extra_info == {} and rows[2].index == 0
    # Written back and read again: the same rows.
    again, _ = read_rows(write([row_to_record(r) for r in rows], "again.parquet"))
    assert [(r.messages, r.ground_truth, r.extra_info) for r in again] == [
        (r.messages, r.ground_truth, r.extra_info) for r in rows
    ]


def test_several_files_and_prompt_key(write, digit_records):
    a = write(digit_records([1, 2]), "a.parquet")
    records = digit_records([3])
    records[0]["question"] = records[0].pop("prompt")
    b = write(records, "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet: no column 'prompt' \(a verl-format"):
        read_rows([a, b])
    rows, _ = read_rows([b], prompt_key="question")
    assert rows[0].messages[0]["content"] == "copy: 0 1 2"


def _break(records, i, how):
    r = records[i]
    if how == "no_ground_truth":
        r["reward_model"] = {"style": "rule", "ground_truth": None}
    elif how == "empty_prompt":
        r["prompt"] = []
    elif how == "blank_prompt":
        r["prompt"] = [{"role": "user", "content": "  "}]
    elif how == "null_source":
        r["data_source"] = None
    return records


@pytest.mark.parametrize(
    ("how", "column"),
    [
        ("no_ground_truth", "'reward_model': 'ground_truth'"),
        ("empty_prompt", "'prompt'"),
        ("blank_prompt", "'prompt'"),
        ("null_source", "'data_source'"),
    ],
)
def test_bad_row_names_file_row_and_column(write, digit_records, how, column):
    path = write(_break(digit_records([2, 2, 2]), 1, how))
    with pytest.raises(DataError) as e:
        read_rows(path)
    assert f"{path}: row 1: column {column}" in str(e.value)
    assert "data.skip_bad_rows=true" in str(e.value)
    rows, report = read_rows(path, skip_bad_rows=True)
    assert [r.source[1] for r in rows] == [0, 2] and len(report.skipped) == 1


def test_wrong_column_type(write, digit_records):
    records = digit_records([1, 2])
    for i, r in enumerate(records):
        r["ability"] = i  # an int column where verl has strings
    path = write(records)
    with pytest.raises(DataError, match=r"row 0: column 'ability': expected a string"):
        read_rows(path)


def test_missing_columns_are_a_file_error_naming_each(write, digit_records):
    """A file without a required column is refused as a whole, skip_bad_rows or not (skipping
    every row would only end in 'no usable rows')."""
    records = digit_records([1, 2, 3])
    path = write(records)
    table = pq.read_table(path).drop_columns(["reward_model", "data_source"])
    pq.write_table(table, path)
    for skip in (False, True):
        with pytest.raises(DataError, match=r"no column 'data_source', 'reward_model' \("):
            read_rows(path, skip_bad_rows=skip)


def test_missing_and_non_parquet_files(tmp_path):
    missing = tmp_path / "nope.parquet"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        read_rows(str(missing))
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(DataError, match=f"{junk}: not a readable parquet file"):
        read_rows(str(junk))
