"""RLDataset: batches, overlong filtering and truncation, max_samples, the config entry."""

import dataclasses
import logging

import numpy as np
import pytest

from jaxrl.config.schema import DataConfig
from jaxrl.data import DataError, RLDataset


def test_batch_is_left_padded_with_row_fields(write, tokenizer, digit_records):
    path = write(digit_records([3, 1, 5]))
    ds = RLDataset.from_files(path, tokenizer, max_prompt_length=12)
    batch = ds.batch([2, 0], group_offset=4, uid_prefix="s-")
    assert batch.input_ids.shape == batch.attention_mask.shape == (2, 12)
    np.testing.assert_array_equal(batch.prompt_lengths, [12, 10])
    np.testing.assert_array_equal(batch.attention_mask[1], [0, 0] + [1] * 10)
    assert (batch.input_ids[1, :2] == tokenizer.pad_token_id).all()
    assert tokenizer.decode(batch.input_ids[1, 2:]).startswith("<|im_start|> user copy : 0 1 2")
    assert batch.group_ids.tolist() == [4, 5] and batch.uid.tolist() == ["s-4", "s-5"]
    assert batch.row_ids.tolist() == [2, 0]
    assert batch.ground_truth.tolist() == ["2", "0"]
    assert batch.raw_prompt[0] == ({"role": "user", "content": "copy: 0 1 2 3 4"},)
    assert batch.extra_info[1] == {"split": "train", "index": 0}
    assert batch.reward_inputs()[0]["ground_truth"] == "2"
    assert not batch.is_padding.any()


def test_filter_overlong_prompts_counts_and_logs(write, tokenizer, digit_records, caplog):
    # Prompt lengths 7 + n: 8, 17, 10, 15, 9 tokens; max 10 keeps rows 0, 2, 4.
    path = write(digit_records([1, 10, 3, 8, 2]))
    with caplog.at_level(logging.INFO, logger="jaxrl.data"):
        ds = RLDataset.from_files(
            path, tokenizer, max_prompt_length=10, filter_overlong_prompts=True
        )
    assert len(ds) == 3 and ds.num_filtered == 2
    assert [r.ground_truth for r in ds.rows] == ["0", "2", "4"]
    assert "dropped 2 of 5 rows longer than 10 tokens" in caplog.text
    assert ds.batch([0, 1, 2]).prompt_lengths.tolist() == [8, 10, 9]


@pytest.mark.parametrize("truncation", ["left", "right", "middle"])
def test_truncation_in_batches(write, tokenizer, digit_records, truncation):
    path = write(digit_records([10]))
    ds = RLDataset.from_files(path, tokenizer, max_prompt_length=6, truncation=truncation)
    full = RLDataset.from_files(path, tokenizer, max_prompt_length=17).batch([0]).input_ids[0]
    got = ds.batch([0]).input_ids[0].tolist()
    want = {"left": full[-6:], "right": full[:6], "middle": np.r_[full[:3], full[-3:]]}
    assert got == want[truncation].tolist()


def test_truncation_error_names_file_and_row(write, tokenizer, digit_records):
    path = write(digit_records([1, 10]))
    ds = RLDataset.from_files(path, tokenizer, max_prompt_length=10)
    ds.batch([0])  # fits
    with pytest.raises(DataError, match=rf"{path}: row 1: the templated prompt has 17 tokens"):
        ds.batch([1])


def test_max_samples(write, tokenizer, digit_records):
    path = write(digit_records([1] * 10))
    first = RLDataset.from_files(path, tokenizer, max_samples=4, shuffle=False)
    assert [r.ground_truth for r in first.rows] == ["0", "1", "2", "3"]
    drawn = RLDataset.from_files(path, tokenizer, max_samples=4, shuffle=True, seed=3)
    again = RLDataset.from_files(path, tokenizer, max_samples=4, shuffle=True, seed=3)
    assert [r.source for r in drawn.rows] == [r.source for r in again.rows]
    expected = np.random.default_rng(3).choice(10, size=4, replace=False)  # verl's draw
    assert [r.source[1] for r in drawn.rows] == expected.tolist()


def test_from_config(write, tokenizer, digit_records):
    train = write(digit_records([1, 2, 3]), "train.parquet")
    val = write(digit_records([1, 10]), "val.parquet")
    cfg = dataclasses.replace(
        DataConfig(),
        train_files=(train,),
        val_files=val,
        max_prompt_length=10,
        filter_overlong_prompts=True,
        train_max_samples=2,
    )
    assert len(RLDataset.from_config(cfg, tokenizer, "train")) == 2
    assert len(RLDataset.from_config(cfg, tokenizer, "val")) == 1
    assert DataConfig().skip_bad_rows is False
