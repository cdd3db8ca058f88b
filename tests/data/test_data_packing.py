"""Packing: layout, round trips, and packed forward passes equal to unpacked ones."""

import jax
import numpy as np
import pytest

import jaxrl.models as M
from jaxrl.data import (
    pack,
    pack_padded,
    pack_prompt_response,
    row_length,
    unpack,
    unpack_to_padded,
)
from jaxrl.data.packing import plan_packing
from jaxrl.testing.tiny import tiny_decoder
from jaxrl.trainer.sequences import response_log_probs

LENGTHS = [5, 3, 7, 1, 4, 6]


def _seqs(lengths, vocab=16, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=n).astype(np.int32) for n in lengths]


def test_layout_and_round_trip():
    seqs = _seqs(LENGTHS)
    packed = pack(seqs, row_len=10, pad_token_id=0)
    # First-fit decreasing: 7+3, 6+4, 5+1 -> 3 rows, no sequence split across rows.
    assert packed.input_ids.shape == (3, 10)
    assert packed.num_tokens == sum(LENGTHS)
    for seq, back, (row, start, n) in zip(seqs, unpack(packed.input_ids, packed.placement),
                                          packed.placement, strict=True):  # fmt: skip
        np.testing.assert_array_equal(back, seq)
        np.testing.assert_array_equal(packed.positions[row, start : start + n], np.arange(n))
        assert len(set(packed.segment_ids[row, start : start + n].tolist())) == 1
    # Segments are numbered 1, 2, ... from the left of each row; padding is 0.
    for row in packed.segment_ids:
        ids = row[row > 0]
        assert ids.tolist() == sorted(ids.tolist()) and ids[0] == 1
    assert (packed.input_ids[packed.segment_ids == 0] == 0).all()


def test_fixed_row_count_and_errors():
    packed = pack(_seqs([2, 2]), row_len=8, num_rows=3)
    assert packed.input_ids.shape == (3, 8) and (packed.segment_ids[1:] == 0).all()
    with pytest.raises(ValueError, match="does not fit in a row of 4"):
        plan_packing([5], 4)
    with pytest.raises(ValueError, match="need 2 rows of 4 tokens, more than the 1 given"):
        plan_packing([3, 3], 4, num_rows=1)


def test_row_length_needs_the_fewest_padded_tokens():
    # a short batch: rows of its longest sequence's bucket, not of max_len
    assert row_length([5, 3], 384) == 8
    # about equal lengths: two per 32-token row (2 x 32) beat one per 16-token row (4 x 16)
    # on rows at equal padded tokens, and beat 24-token rows (4 x 24)
    assert row_length([14, 14, 14, 14], 32) == 32
    # 30 + 30 + 20 fits in 96 tokens as one row of 96, or 3 rows of 32 (also 96): fewer rows win
    assert row_length([30, 30, 20], 96) == 96
    # max_len need not be a bucket size
    assert row_length([40, 40], 90) == 90
    assert row_length([], 64) == 8
    with pytest.raises(ValueError, match="does not fit in a row of 16"):
        row_length([17], 16)


@pytest.fixture(scope="module")
def model():
    config = tiny_decoder(num_layers=2, hidden_size=16, intermediate_size=16, head_dim=8)
    # numpy draws: jax.random's first use costs seconds of compilation on this CPU.
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: rng.normal(0, 0.3, s.shape).astype(np.float32), M.abstract_params(config)
    )
    return config, params


def _forward(config, params, ids, mask=None, segment_ids=None):
    fn = jax.jit(M.forward, static_argnums=0)
    return np.asarray(fn(config, params, ids, mask, segment_ids=segment_ids))


def test_packed_forward_equals_one_pass_per_sequence(model):
    config, params = model
    seqs = _seqs(LENGTHS, vocab=config.vocab_size)
    packed = pack(seqs, row_len=12)
    logits_rlv = _forward(config, params, packed.input_ids, segment_ids=packed.segment_ids)
    # Each sequence in its own row, right-padded (causal: its logits never see the padding).
    alone_ids = np.zeros((len(seqs), max(LENGTHS)), np.int32)
    alone_mask = np.zeros_like(alone_ids)
    for i, seq in enumerate(seqs):
        alone_ids[i, : len(seq)], alone_mask[i, : len(seq)] = seq, 1
    alone = _forward(config, params, alone_ids, alone_mask)
    for i, got in enumerate(unpack(logits_rlv, packed.placement)):
        # The same model on the same tokens in other rows and shapes: XLA may tile the products
        # otherwise, a few float32 roundings of logits of scale ~1 (DESIGN §6's 1e-5 for simple
        # ops; measured 2.4e-7, 0.02 of the tolerance)
        np.testing.assert_allclose(got, alone[i, : len(got)], rtol=1e-5, atol=1e-5)


def test_packed_forward_equals_padded_batch(model):
    """Left-padded prompt + right-padded response rows, packed and scattered back."""
    config, params = model
    rng = np.random.default_rng(1)
    b, p, r = 4, 6, 5
    ids = rng.integers(2, config.vocab_size, size=(b, p + r)).astype(np.int32)
    prompt_len, resp_len = [6, 2, 4, 1], [5, 3, 1, 2]
    mask = np.zeros((b, p + r), np.int32)
    for i in range(b):
        mask[i, p - prompt_len[i] : p + resp_len[i]] = 1
    padded = _forward(config, params, ids, mask)
    packed = pack_padded(ids, mask, row_len=12, num_rows=3)
    logits_rlv = _forward(config, params, packed.input_ids, segment_ids=packed.segment_ids)
    back = unpack_to_padded(logits_rlv, packed.placement, mask)
    assert back.shape == padded.shape
    keep = mask.astype(bool)
    np.testing.assert_allclose(back[keep], padded[keep], rtol=1e-5, atol=1e-5)  # idem (exact here)
    assert (back[~keep] == 0).all()


def test_prompt_response_packing_keeps_every_trained_log_prob(model):
    """A batch in the RL layout, packed by `pack_prompt_response`: the trained tokens'
    log-probs (`response_log_probs` over the packed rows and their segment ids) are those of
    the padded rows, so the masked sum and count are unchanged; a row without trained tokens
    (filler) is left out."""
    config, params = model
    rng = np.random.default_rng(2)
    prompt_len, resp_len = [3, 1, 5, 2, 4], [4, 6, 2, 3, 5]
    n, p, r = len(prompt_len), max(prompt_len), max(resp_len)
    batch = {k: np.zeros((n, w), np.int32) for k, w in
             (("prompts", p), ("prompt_mask", p), ("responses", r), ("response_mask", r),
              ("loss_mask", r))}  # fmt: skip
    for i, (a, b) in enumerate(zip(prompt_len, resp_len, strict=True)):
        batch["prompts"][i, p - a :] = rng.integers(2, config.vocab_size, a)
        batch["prompt_mask"][i, p - a :] = 1
        batch["responses"][i, :b] = rng.integers(2, config.vocab_size, b)
        batch["response_mask"][i, :b] = 1
        batch["loss_mask"][i, :b] = rng.integers(0, 2, b) | (np.arange(b) == 0)
    batch["loss_mask"][3] = 0  # a filler row
    packed = pack_prompt_response(batch, row_len=16)
    assert packed["prompts"].shape[1] == 1 and packed["responses"].shape[1] == 15
    assert len(packed["prompts"]) == 2  # sequences of 7, 7, 7, 9 tokens (filler out): 9+7, 7+7
    assert packed["loss_mask"].sum() == batch["loss_mask"].sum()

    def log_probs(mb):
        fn = jax.jit(lambda params, mb: response_log_probs(config, params, mb, temperature=1.0)[0])
        return np.asarray(fn(params, mb))

    padded = log_probs(batch)
    got = log_probs(packed)
    mask, packed_mask = batch["loss_mask"].astype(bool), packed["loss_mask"].astype(bool)
    # as above: other shapes, the same values up to rounding (measured exact; the masked sum of
    # ~20 log-probs in another order: 0.012 of the tolerance)
    np.testing.assert_allclose(np.sort(got[packed_mask]), np.sort(padded[mask]), rtol=1e-5)
    np.testing.assert_allclose((got * packed_mask).sum(), (padded * mask).sum(), rtol=1e-5)


def test_a_sequences_first_token_is_never_trained():
    """A row without prompt tokens whose first response token is trained: packed, that token
    would be predicted by the previous sequence's last token, so it is not trained on."""
    batch = {"prompts": np.array([[5, 6], [0, 0]]), "prompt_mask": np.array([[1, 1], [0, 0]]),
             "responses": np.array([[7, 8], [9, 10]]), "response_mask": np.ones((2, 2), int),
             "loss_mask": np.ones((2, 2), int)}  # fmt: skip
    packed = pack_prompt_response(batch, row_len=8)
    seg = np.concatenate([packed["prompt_segment_ids"], packed["response_segment_ids"]], 1)
    ids = np.concatenate([packed["prompts"], packed["responses"]], 1)
    assert len(ids) == 1 and ids[0, :6].tolist() == [5, 6, 7, 8, 9, 10]
    assert seg[0, :6].tolist() == [1, 1, 1, 1, 2, 2]
    assert packed["loss_mask"][0, :5].tolist() == [0, 1, 1, 0, 1]  # token 9 (column 4) is out
