"""Fixtures of the data tests: the synthetic task's word-level tokenizer and parquet writers."""

from __future__ import annotations

import pytest

from jaxrl.data import synthetic
from jaxrl.data.rows import write_parquet


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return synthetic.write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from jaxrl.data import load_tokenizer

    return load_tokenizer(str(tokenizer_dir))


def _digit_records(num_digits, source="jaxrl/synthetic_copy"):
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": "copy: " + " ".join("0123456789"[:n])}],
            "ability": "synthetic",
            "reward_model": {"style": "rule", "ground_truth": str(index)},
            "extra_info": {"split": "train", "index": index},
        }
        for index, n in enumerate(num_digits)
    ]


@pytest.fixture(scope="session")
def digit_records():
    """`digit_records([n0, n1, ...])`: row i is a `copy:` prompt of the first n_i digits (7 + n_i
    tokens under the synthetic tokenizer's template, so 1 <= n_i <= 10) with ground truth
    `str(i)` and `extra_info.index = i`."""
    return _digit_records


@pytest.fixture
def write(tmp_path):
    """`write(records, name="rows.parquet") -> path` in the test's tmp folder."""

    def _write(records, name="rows.parquet"):
        return write_parquet(records, tmp_path / name)

    return _write
