"""Balanced partitions and dynamic micro-batches, against verl 0.9.1's seqlen_balancing."""

import numpy as np
import pytest

from jaxrl.data import (
    balance_batch,
    calculate_workload,
    dynamic_micro_batches,
    get_seqlen_balanced_partitions,
    greedy_partition,
    inverse_permutation,
    karmarkar_karp,
    restore_order,
)
from jaxrl.testing import import_reference


@pytest.fixture(scope="module")
def verl():
    return import_reference("verl.utils.seqlen_balancing")


def _cases():
    rng = np.random.default_rng(0)
    cases = [([5, 5, 5, 5, 5, 5], 3), ([1, 2, 3, 4, 5, 6, 7, 8], 2), ([9, 1, 1, 1], 2)]
    for n, k in [(8, 2), (12, 4), (16, 8), (30, 3), (64, 8)]:
        cases.append((rng.integers(1, 200, size=n).tolist(), k))
        cases.append((rng.integers(1, 4, size=n).tolist(), k))  # many ties
    return cases


@pytest.mark.parametrize("equal_size", [True, False])
def test_partitions_equal_verls(verl, equal_size):
    for values, k in _cases():
        if equal_size and len(values) % k:
            continue
        assert karmarkar_karp(values, k, equal_size) == verl.karmarkar_karp(values, k, equal_size)
        assert get_seqlen_balanced_partitions(
            values, k, equal_size
        ) == verl.get_seqlen_balanced_partitions(values, k, equal_size)
        assert greedy_partition(values, k, equal_size) == verl.greedy_partition(
            values, k, equal_size
        )


def test_partitions_are_balanced():
    rng = np.random.default_rng(1)
    for _ in range(20):
        values = rng.integers(1, 1000, size=32).tolist()
        parts = get_seqlen_balanced_partitions(values, 4, equal_size=True)
        assert sorted(i for p in parts for i in p) == list(range(32))
        assert {len(p) for p in parts} == {8}
        sums = [sum(values[i] for i in p) for p in parts]
        # Largest differencing leaves a spread below the largest item (and far below a
        # contiguous split's typical spread).
        assert max(sums) - min(sums) <= max(values)


def test_balance_batch_equals_verls_trainer_step(verl):
    """RayPPOTrainer._balance_batch (default path), written out with verl's own functions."""
    import torch

    rng = np.random.default_rng(2)
    seqlens = rng.integers(10, 500, size=32)
    order, metrics = balance_batch(seqlens, dp_size=4)
    workload = verl.calculate_workload(torch.tensor(seqlens)).tolist()
    parts = verl.get_seqlen_balanced_partitions(workload, k_partitions=4, equal_size=True)
    for i, p in enumerate(parts):
        p.sort(key=lambda x: (workload[x], x))
        parts[i] = p[::2] + p[1::2][::-1]
    assert order.tolist() == [j for p in parts for j in p]
    assert metrics == verl.log_seqlen_unbalance(seqlens.tolist(), parts, "global_seqlen")
    assert calculate_workload(seqlens).tolist() == workload
    shards = seqlens[order].reshape(4, 8).sum(-1)
    assert shards.max() - shards.min() <= metrics["global_seqlen/minmax_diff"]
    np.testing.assert_array_equal(seqlens[order][inverse_permutation(order)], seqlens)


def test_balance_batch_keeps_minibatches():
    seqlens = np.random.default_rng(3).integers(10, 500, size=32)
    order, _ = balance_batch(seqlens, dp_size=2, minibatch_size=16)
    shard0, shard1 = order[:16], order[16:]
    # Each shard holds half of each mini-batch: mini-batch m is rows [16m, 16m + 16).
    for shard in (shard0, shard1):
        assert sorted((shard // 16).tolist()) == [0] * 8 + [1] * 8


def _verl_micro_batches(verl, seqlens, max_token_len):
    import torch
    from tensordict import TensorDict

    t = 600
    mask = torch.zeros(len(seqlens), t, dtype=torch.long)
    for i, n in enumerate(seqlens):
        mask[i, :n] = 1
    batch = TensorDict({"input_ids": mask.clone(), "attention_mask": mask}, batch_size=[len(mask)])
    _, idx = verl.rearrange_micro_batches(batch, max_token_len=max_token_len)
    return idx


@pytest.mark.parametrize("max_token_len", [600, 1000, 2500])
def test_dynamic_micro_batches_respect_budget_and_equal_verls(verl, max_token_len):
    rng = np.random.default_rng(4)
    seqlens = rng.integers(20, 600, size=24)
    (parts,) = dynamic_micro_batches([seqlens], max_token_len)
    assert all(seqlens[p].sum() <= max_token_len for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(24))
    assert parts == _verl_micro_batches(verl, seqlens.tolist(), max_token_len)
    # Results computed in micro-batch order come back in batch order.
    x = np.concatenate([seqlens[p] for p in parts])
    np.testing.assert_array_equal(restore_order(x, parts), seqlens)


def test_dynamic_micro_batches_same_count_on_every_shard():
    rng = np.random.default_rng(5)
    shards = [rng.integers(20, 100, size=8), rng.integers(300, 600, size=8)]
    parts = dynamic_micro_batches(shards, 700)
    assert len(parts[0]) == len(parts[1]) >= 5  # the long shard sets the count
    for p, s in zip(parts, shards, strict=True):
        assert all(0 < s[m].sum() <= 700 for m in p)
    with pytest.raises(ValueError, match="exceeds the micro-batch token budget 500"):
        dynamic_micro_batches(shards, 500)
