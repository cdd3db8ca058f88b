"""Property tests of the row parser: any record, in memory or read back from parquet, is a
`Row` or a problem naming its column; a file never fails with anything but a `DataError`
naming the file."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import assume, given
from hypothesis import strategies as st

from jaxrl.data.rows import DataError, check_row, read_rows, to_row, write_parquet

LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.binary(max_size=4)
)
FIELDS = ["role", "content", "ground_truth", "style", "index", "x"]
VALUE = st.recursive(
    LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=3)
    ),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.one_of(st.text(max_size=5), VALUE),
        "content": st.one_of(st.text(max_size=10), VALUE),
    }
)
RECORD = st.fixed_dictionaries(
    {},
    optional={
        "data_source": st.one_of(st.text(max_size=5), VALUE),
        "prompt": st.one_of(st.lists(MESSAGE, max_size=3), VALUE),
        "reward_model": st.one_of(st.fixed_dictionaries({"ground_truth": VALUE}), VALUE),
        "ability": VALUE,
        "extra_info": VALUE,
        "other": VALUE,
    },
)


@given(RECORD)
def test_any_record_is_a_row_or_a_named_problem(raw):
    problem = check_row(raw, "prompt")
    if problem is None:
        row = to_row(raw, "prompt", ("f.parquet", 0))
        assert row.data_source and row.messages and row.ground_truth is not None
    else:
        assert problem.startswith("column ")


@given(st.lists(RECORD, min_size=1, max_size=4), st.booleans())
def test_any_parquet_file_reads_or_names_file_and_row(tmp_path_factory, records, skip_bad_rows):
    path = str(tmp_path_factory.mktemp("rows") / "rows.parquet")
    try:
        write_parquet(records, path)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        assume(False)  # records parquet cannot store (mixed types in a column, empty structs)
    try:
        rows, report = read_rows(path, skip_bad_rows=skip_bad_rows)
    except DataError as e:
        assert str(e).startswith(f"{path}: ")
    else:
        assert len(rows) + len(report.skipped) == len(records)
