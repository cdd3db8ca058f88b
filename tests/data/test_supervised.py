"""Token sequences of the offline trainers (`jaxrl.data.supervised`): truncation edges, TRL's
length keys, and KTO's KL rows, on the synthetic word-level tokenizer (one token per word)."""

import numpy as np
import pytest

from jaxrl.data import load_tokenizer, synthetic
from jaxrl.data.offline import Example, OfflineDataset
from jaxrl.data.rows import DataError
from jaxrl.data.supervised import (
    PreferenceLimits,
    TokenSeq,
    cut_sequence,
    prompt_and_bodies,
    sft_sequence,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(str(synthetic.write_tokenizer(tmp_path_factory.mktemp("tok"))))


def test_left_cut_inside_the_response_keeps_the_row(tok):
    """A left cut that lands in the response: the first kept token becomes the prompt (nothing
    before it predicts it); the rest stays trained."""
    seq = sft_sequence(tok, "copy: 1", "1 2 3 4 5 6 7 8", max_length=6, truncation="left")
    assert len(seq) == 6 and seq.prompt == (tok.convert_tokens_to_ids("4"),)
    assert seq.loss_mask == (1,) * 5  # 5 6 7 8 <|im_end|>
    with pytest.raises(DataError, match=r"truncation to data\.max_length left no token"):
        sft_sequence(tok, "copy: 1 2 3 4 5 6 7 8", "1", max_length=4, truncation="right")


def test_max_prompt_length_keeps_the_prompts_end(tok):
    """TRL < 0.29 kept the prompt's last `max_prompt_length` tokens in every mode."""
    ids = lambda text: tok(text)["input_ids"]  # noqa: E731
    for mode in ("keep_start", "keep_end"):
        limits = PreferenceLimits(max_length=None, max_prompt_length=3, truncation_mode=mode)
        prompt, (body,) = prompt_and_bodies(tok, "copy : 1 2 3 4", [" 5"], limits)
        assert prompt == ids("2 3 4")
        assert body == [*ids("5"), tok.eos_token_id]
    with pytest.raises(DataError, match=r"dpo\.max_prompt_length=3"):
        prompt_and_bodies(tok, "copy : 1 2 3 4", [" 5"],
                          PreferenceLimits(None, 3, None, "error"))  # fmt: skip


def test_keep_end_with_a_long_completion_keeps_the_row(tok):
    """keep_end: a completion that fills max_length keeps its last tokens; the first of them
    is the prompt (TRL never predicts a sequence's first token either)."""
    seq = cut_sequence(
        [1, 2], [10, 11, 12, 13, 14, 15, 16, 17, 18], PreferenceLimits(6, None, None, "keep_end")
    )
    assert seq == TokenSeq((13,), (14, 15, 16, 17, 18), (1,) * 5)
    assert cut_sequence([1, 2, 3, 4, 5, 6], [7], PreferenceLimits(6)) is None  # TRL drops it
    start = cut_sequence([1, 2], [10, 11, 12, 13, 14], PreferenceLimits(4))
    assert start == TokenSeq((1, 2), (10, 11), (1, 1))


def test_kto_kl_rows_use_the_uncut_completion(tok):
    """Example i's KL row is its prompt + example i - 1's completion before that example's
    own cut, then cut to max_length (TRL's KL dataset); one example alone has no pair."""
    limits = PreferenceLimits(8)
    a = Example(
        (cut_sequence(range(6), range(10, 15), limits),), 1.0, ("f", 0), tuple(range(10, 15))
    )
    b = Example((cut_sequence([1, 2], [20, 21], limits),), 0.0, ("f", 1), (20, 21))
    assert a.sequences[0].completion == (10, 11)  # a's own sequence was cut
    data = OfflineDataset([a, b], pad_token_id=0, kl_limits=limits)
    kl = data.batch([0, 1]).kl
    # b's KL row: b's prompt (1, 2) + a's whole completion (5 tokens): 7 <= 8
    b_row = kl.responses[1][kl.response_mask[1] > 0].tolist()
    assert b_row == [10, 11, 12, 13, 14]
    alone = data.batch([1]).kl
    assert alone.loss_mask.sum() == 0
    np.testing.assert_array_equal(data.batch([0, 1]).labels, [1.0, 0.0])
