"""Logits, values and reward scores equal to `transformers` in torch (float32).

Tolerance policy (DESIGN §6): `COMPOSITE_RTOL` (1e-4) relative to the scale of the reference
output, over the positions that hold real tokens: a forward pass (composite float32 ops) in
another framework; measured <= 1e-6 of the scale under both XLA CPU configurations, a 100x
margin.
"""

import numpy as np
import pytest
import torch

import jaxrl.models as M
from jaxrl.testing.hf_reference import (
    hf_model,
    hf_run,
    left_padded,
    random_batch,
    right_padded,
)
from jaxrl.testing.numerics import assert_close_to_scale
from jaxrl.testing.tiny import TINY_CONFIGS, save_tiny

B, T = 3, 12


def batch(seed=0):
    return random_batch(B, T, vocab=97, seed=seed)


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    folder = save_tiny(request.param, tmp_path_factory.mktemp(request.param))
    config, params = M.from_pretrained(folder)
    return request.param, folder, config, params


def test_families_covered():
    families = {c["model_type"] for c in TINY_CONFIGS.values()}
    assert families == {"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text"}
    for family in families:
        assert sum(c["model_type"] == family for c in TINY_CONFIGS.values()) >= 2


@pytest.mark.parametrize("padding", ["right", "left"])
def test_logits_match_padded(tiny, padding):
    _, folder, config, params = tiny
    ids, lengths = batch()
    ids, mask = (right_padded if padding == "right" else left_padded)(ids, lengths)
    ref = hf_run(folder, ids, mask)
    ours = M.forward(config, params, ids, mask)
    assert_close_to_scale(ours, ref, mask.astype(bool))


def test_logits_match_packed(tiny):
    """Packed row [seq0 | seq1 | seq2 | pad] equals the sequences run one by one."""
    _, folder, config, params = tiny
    rng = np.random.RandomState(1)
    lengths = [5, 4, 2]
    seqs = [rng.randint(2, 97, n) for n in lengths]
    row = np.concatenate([*seqs, np.zeros(T - sum(lengths), np.int64)])
    segment_ids = np.concatenate(
        [np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(T - sum(lengths), int)]
    )
    ours = np.asarray(M.forward(config, params, row[None], segment_ids=segment_ids[None]))[0]
    start = 0
    for seq in seqs:
        ref = hf_run(folder, seq[None], np.ones((1, len(seq)), np.int64))[0]
        assert_close_to_scale(ours[start : start + len(seq)], ref)
        start += len(seq)


def test_positions_follow_verl():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(M.positions_from_mask(mask), [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]])
    seg = np.array([[1, 1, 2, 2, 2, 3, 0, 0]])
    np.testing.assert_array_equal(M.positions_from_segments(seg), [[0, 1, 0, 1, 2, 0, 0, 1]])


@pytest.mark.parametrize("name", ["qwen2_gqa_tied", "llama_gqa_bias_llama3"])
def test_value_head_matches_token_classification(name, tmp_path):
    folder = save_tiny(name, tmp_path, head="token_classification")
    config, params = M.from_pretrained(folder)
    assert config.head == "token_classification" and config.score_bias
    ids, mask = left_padded(*batch(2))
    ref = hf_run(folder, ids, mask, head="token_classification")[..., 0]
    assert_close_to_scale(M.values(config, params, ids, mask), ref, mask.astype(bool))


@pytest.mark.parametrize("name", ["qwen2_gqa_tied", "mistral_sliding"])
def test_reward_score_matches_sequence_classification(name, tmp_path):
    folder = save_tiny(name, tmp_path, head="sequence_classification")
    config, params = M.from_pretrained(folder)
    ids, lengths = batch(3)
    ids, mask = right_padded(ids, lengths)  # pads are pad_token_id, as HF's pooling expects
    with torch.no_grad():
        ref = hf_model(folder, "sequence_classification")(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)
        ).logits.numpy()
    assert_close_to_scale(M.sequence_scores(config, params, ids, mask), ref)
    np.testing.assert_array_equal(M.last_token_index(mask), lengths - 1)
    _, lmask = left_padded(*batch(3))
    np.testing.assert_array_equal(M.last_token_index(lmask), [T - 1] * B)
