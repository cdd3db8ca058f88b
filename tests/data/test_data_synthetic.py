"""The synthetic digit task: rows, scorer, tokenizer, and the whole data path on it."""

import numpy as np
import pytest

from jaxrl.data import PromptIterator, RLDataset, load_tokenizer, synthetic
from jaxrl.rewards.scorers.synthetic import compute_score, is_synthetic


def test_scorer_partial_credit():
    score = compute_score
    assert score("7 7 7 7", "7 7 7 7") == 1.0
    assert score("<|im_start|> 7 7 7 7", "7 7 7 7") == 1.0  # non-digits ignored
    assert score("7 7 1 1", "7 7 7 7") == 0.5
    assert score("7 7", "7 7 7 7") == 0.5
    assert score("7 7 7 7 7 7 7 7", "7 7 7 7") == 0.5  # extra digits cost
    assert score("assistant", "7 7 7 7") == 0.0
    assert score("", "1") == 0.0


@pytest.mark.parametrize(
    ("task", "content", "truth"),
    [("repeat", "repeat: 7", "7 7 7 7"), ("copy", "copy: 3 1 4 1", "3 1 4 1"),
     ("reverse", "reverse: 3 1 4 1", "1 4 1 3")],
)  # fmt: skip
def test_answers(task, content, truth):
    digits = [int(d) for d in content.split(": ")[1].split()]
    assert synthetic.answer(task, digits, 4) == truth


def test_records_are_seeded_and_splits_differ():
    a = synthetic.make_records(50, task="copy", seed=1)
    assert a == synthetic.make_records(50, task="copy", seed=1)
    assert a != synthetic.make_records(50, task="copy", seed=1, split="test")
    r = a[0]
    assert r["data_source"] == "jaxrl/synthetic_copy" and is_synthetic(r["data_source"])
    digits = r["prompt"][0]["content"].split(": ")[1]
    assert r["reward_model"]["ground_truth"] == digits
    assert compute_score(digits, r["reward_model"]["ground_truth"]) == 1.0
    with pytest.raises(ValueError, match="unknown synthetic task"):
        synthetic.make_records(1, task="sort")


def test_end_to_end_data_path(tmp_path, tokenizer_dir):
    paths = synthetic.write_dataset(tmp_path, train_size=32, test_size=8, task="repeat")
    tok = load_tokenizer(str(tokenizer_dir))
    assert len(tok) == len(synthetic.TOKENIZER_WORDS) and tok.pad_token_id == 0
    ds = RLDataset.from_files(paths["train"], tok, max_prompt_length=10)
    batch = next(PromptIterator(ds, 8, seed=1, process_index=0, process_count=1)).repeat(2)
    assert batch.input_ids.shape == (16, 10)
    assert (batch.input_ids < len(tok)).all() and tok.unk_token_id not in batch.input_ids
    assert batch.group_ids.tolist() == np.repeat(np.arange(8), 2).tolist()
    # The tokenizer's decoded response is what the scorer reads.
    truth = batch.ground_truth[0]
    response_ids = tok(truth, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    text = tok.decode(response_ids, skip_special_tokens=True)
    assert compute_score(text, truth) == 1.0
