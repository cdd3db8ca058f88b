"""PromptIterator: shuffling, exact resume from saved state, per-process sharding; group ids."""

import json

import numpy as np
import pytest

from jaxrl.data import PromptIterator, RLDataset, group_ids_from_uids, repeated_group_ids


@pytest.fixture
def dataset(write, tokenizer, digit_records):
    rng = np.random.default_rng(0)
    return RLDataset.from_files(
        write(digit_records(rng.integers(1, 11, size=26).tolist())), tokenizer,
        max_prompt_length=17,
    )  # fmt: skip


def _rows(batches):
    return [b.row_ids.tolist() for b in batches]


def test_epochs_shuffle_with_seed_and_drop_last(dataset):
    it = PromptIterator(dataset, 8, seed=5, process_index=0, process_count=1)
    assert it.batches_per_epoch == 3  # 26 rows: the last 2 of each epoch's order are unused
    epoch0 = _rows(next(it) for _ in range(3))
    epoch1 = _rows(next(it) for _ in range(3))
    assert it.epoch == 1
    assert len({r for b in epoch0 for r in b}) == 24 and epoch0 != epoch1
    again = PromptIterator(dataset, 8, seed=5, process_index=0, process_count=1)
    assert _rows(next(again) for _ in range(3)) == epoch0
    other = PromptIterator(dataset, 8, seed=6, process_index=0, process_count=1)
    assert _rows(next(other) for _ in range(3)) != epoch0
    plain = PromptIterator(dataset, 8, shuffle=False, process_index=0, process_count=1)
    assert _rows([next(plain)]) == [list(range(8))]


@pytest.mark.parametrize("stop_after", [0, 2, 3, 5])
def test_resume_reproduces_the_next_batches_exactly(dataset, stop_after):
    run = PromptIterator(dataset, 8, seed=2, process_index=0, process_count=1)
    for _ in range(stop_after):
        next(run)
    state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint stores it
    assert set(state) == {"epoch", "position", "seed", "num_rows"}
    expected = [next(run) for _ in range(5)]
    resumed = PromptIterator(dataset, 8, seed=2, process_index=0, process_count=1)
    resumed.load_state_dict(state)
    for want, got in zip(expected, (next(resumed) for _ in range(5)), strict=True):
        np.testing.assert_array_equal(got.input_ids, want.input_ids)
        assert got.row_ids.tolist() == want.row_ids.tolist()
        assert got.uid.tolist() == want.uid.tolist()


def test_resume_rejects_another_dataset_or_seed(dataset):
    state = PromptIterator(dataset, 8, seed=2, process_index=0, process_count=1).state_dict()
    with pytest.raises(ValueError, match="does not match"):
        PromptIterator(dataset, 8, seed=3, process_index=0, process_count=1).load_state_dict(state)
    with pytest.raises(ValueError, match="does not match"):
        PromptIterator(dataset, 8, seed=2, process_index=0, process_count=1).load_state_dict(
            {**state, "num_rows": 99}
        )


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_processes_cover_every_row_once(write, tokenizer, digit_records, processes):
    ds = RLDataset.from_files(write(digit_records([2] * 24)), tokenizer, max_prompt_length=9)
    its = [PromptIterator(ds, 8, seed=1, process_index=p, process_count=processes)
           for p in range(processes)]  # fmt: skip
    seen, groups = [], []
    for _ in range(3):  # one epoch
        parts = [next(it) for it in its]
        assert {len(b) for b in parts} == {8 // processes}
        seen += [r for b in parts for r in b.row_ids.tolist()]
        groups.append(np.concatenate([b.group_ids for b in parts]).tolist())
    assert sorted(seen) == list(range(24))
    assert all(g == list(range(8)) for g in groups)  # group ids: positions in the global batch


def test_a_process_tokenizes_only_its_rows(write, tokenizer, digit_records):
    path = write(digit_records([2] * 24))
    ds = RLDataset.from_files(path, tokenizer, max_prompt_length=9)
    it = PromptIterator(ds, 8, seed=1, process_index=1, process_count=4)
    batch = next(it)
    assert sorted(ds._ids) == sorted(batch.row_ids.tolist())


def test_validation_pads_the_last_batch(write, tokenizer, digit_records):
    ds = RLDataset.from_files(write(digit_records([2] * 7)), tokenizer, max_prompt_length=9)
    its = [PromptIterator(ds, 4, shuffle=False, drop_last=False, process_index=p,
                          process_count=2) for p in range(2)]  # fmt: skip
    assert its[0].batches_per_epoch == 2
    batches = [list(it.one_epoch()) for it in its]
    last = [b[1] for b in batches]
    assert [b.row_ids.tolist() for b in last] == [[4, 5], [6, 6]]
    assert [b.is_padding.tolist() for b in last] == [[False, False], [False, True]]
    assert sum(len(b) for p in batches for b in p) - sum(b.is_padding.sum() for b in last) == 7


def test_batch_size_checks(dataset):
    default = PromptIterator(dataset, 8)  # jax.process_index() / process_count()
    assert (default.process_index, default.process_count) == (0, 1)
    with pytest.raises(ValueError, match="multiple of the 3 JAX processes"):
        PromptIterator(dataset, 8, process_index=0, process_count=3)
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptIterator(dataset, 32, process_index=0, process_count=1)


def test_repeat_and_group_ids(dataset):
    batch = next(PromptIterator(dataset, 4, seed=1, process_index=1, process_count=2))
    assert batch.group_ids.tolist() == [2, 3]
    rep = batch.repeat(3)
    assert len(rep) == 6 and rep.input_ids.shape == (6, 17)
    assert rep.group_ids.tolist() == [2, 2, 2, 3, 3, 3]
    assert rep.group_ids.tolist() == repeated_group_ids(2, 3, offset=2).tolist()
    np.testing.assert_array_equal(rep.input_ids[:3], np.repeat(batch.input_ids[:1], 3, 0))
    assert rep.uid.tolist() == [batch.uid[0]] * 3 + [batch.uid[1]] * 3
    assert group_ids_from_uids(rep.uid).tolist() == [0, 0, 0, 1, 1, 1]
    assert group_ids_from_uids(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]
    assert group_ids_from_uids(np.array(["x", "y"], dtype=object)).dtype == np.int32


def test_for_validation_takes_the_whole_set(write, tokenizer, digit_records):
    ds = RLDataset.from_files(write(digit_records([2] * 7)), tokenizer, max_prompt_length=9)
    its = [PromptIterator.for_validation(ds, None, process_index=p, process_count=2)
           for p in range(2)]  # fmt: skip
    assert its[0].batch_size == 8 and its[0].batches_per_epoch == 1
    (a,), (b,) = (list(it.one_epoch()) for it in its)
    assert a.row_ids.tolist() + b.row_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 6]
    assert b.is_padding.tolist() == [False, False, False, True]
