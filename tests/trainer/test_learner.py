"""The PPO update: one optimizer step per mini-batch whose gradient does not depend on how the
mini-batch is cut into micro-batches (fixed counts, token budgets) or laid out on the mesh."""

import functools

import jax
import numpy as np
import optax
import pytest
from _batches import rl_batch

from jaxrl.config import load_config
from jaxrl.core_algos import global_batch_info
from jaxrl.models.params import param_shardings
from jaxrl.sharding import TRAIN_RULES, Layout, train_mesh
from jaxrl.trainer import losses
from jaxrl.trainer.batch import RLBatch, place_rows, whole
from jaxrl.trainer.learner import Learner, _membership, _mini_batches, mini_batch_counts
from jaxrl.trainer.microbatch import plan_micro_batches
from jaxrl.trainer.update import init_state


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen2_sliding_yarn")[1:]


def updated_params(model, layout, mode, balance=False, **split):
    config, params = model
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.path=unused",
            f"actor_rollout_ref.actor.loss_agg_mode={mode}",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
        ],
    ).actor_rollout_ref.actor
    params = jax.tree.map(lambda x: x.copy(), params)  # the update donates its state
    if layout is not None:
        params = jax.device_put(params, param_shardings(config, layout))
    optimizer = optax.sgd(1.0)  # the parameter change is the gradient itself
    shardings = jax.tree.map(lambda x: x.sharding, params)
    state = init_state(params, optimizer, layout, shardings)
    loss = functools.partial(losses.actor_loss, config=config, actor_cfg=cfg, temperature=0.9)
    learner = Learner(config, state, optimizer, loss, layout=layout, grad_clip=None)
    metrics = learner.update(
        RLBatch.from_host(rl_batch(), layout),
        mini_batch_rows=8,
        epochs=1,
        shuffle=False,
        seed=0,
        fields=("old_log_probs", "advantages", "ref_log_probs"),
        balance=balance,
        **split,
    )
    return jax.device_get(learner.params), metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_update_does_not_depend_on_micro_batches(model, mode):
    """With SGD(1) the parameter change is the gradient: equal for every split, to float32
    summation order (sums over 8 rows in other groupings: ~1e-6 of the largest gradient
    entry, checked at 1e-5 of it; the losses and the norm likewise, 1e-5 relative)."""
    before = jax.device_get(model[1])
    whole, m_whole = updated_params(model, None, mode, micro_rows=None, token_budget=None)
    grad_whole = jax.tree.map(lambda a, b: a - b, whole, before)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grad_whole))
    mesh = Layout.create(train_mesh({"dp": 2, "fsdp": 2, "tp": 2}), TRAIN_RULES)
    splits = [
        (None, dict(micro_rows=1, token_budget=None)),
        (None, dict(micro_rows=None, token_budget=24)),
        (mesh, dict(micro_rows=1, token_budget=None)),
        (mesh, dict(micro_rows=None, token_budget=20)),
        (mesh, dict(micro_rows=1, token_budget=None, balance=True)),
    ]
    if mode != "token-mean":  # the other normalisation: one split by rows, one by tokens
        splits = splits[:1] + splits[3:4]
    for layout, split in splits:
        params, metrics = updated_params(model, layout, mode, **split)
        grad = jax.tree.map(lambda a, b: a - b, params, before)
        for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_whole), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "grad_norm"):
            np.testing.assert_allclose(metrics[key], m_whole[key], rtol=1e-5, err_msg=key)


def test_mini_batch_counts_are_each_mini_batch_s():
    """The update's one counts program, over rows split on 4 devices, gives every mini-batch
    (shuffled, 2 epochs, the last of each epoch short) `global_batch_info` of its own rows,
    a row without tokens included: integer counts, so exactly."""
    mask = (np.random.default_rng(0).random((16, 6)) < 0.4).astype(np.float32)
    mask[3] = 0
    layout = Layout.create(train_mesh({"dp": 2, "fsdp": 2, "tp": 2}), TRAIN_RULES)
    mini_batches = _mini_batches(16, 5, epochs=2, shuffle=True, seed=3)
    assert [len(m) for m in mini_batches] == [5, 5, 5, 1] * 2
    members = whole(_membership(mini_batches, 16), layout)
    counts = jax.device_get(jax.jit(mini_batch_counts)(place_rows(mask, layout), members))
    for i, rows in enumerate(mini_batches):
        want = global_batch_info(mask[rows])
        assert counts["batch_num_tokens"][i] == want["batch_num_tokens"], i
        assert counts["global_batch_size"][i] == want["global_batch_size"], i


def test_micro_batch_plans():
    p_len = np.array([3, 1, 6, 2, 5, 4, 1, 2])
    r_len = np.array([7, 0, 2, 7, 1, 3, 2, 5])
    fixed = plan_micro_batches(np.arange(8), p_len, r_len, 6, 7, micro_rows=3, shards=2)
    assert [len(mb.row_ids) for mb in fixed] == [6, 2]
    assert sorted(r for mb in fixed for r in mb.row_ids if r >= 0) == list(range(8))
    assert all(mb.prompt_len <= 6 and mb.response_len <= 7 for mb in fixed)
    balanced = plan_micro_batches(np.arange(8), p_len, r_len, 6, 7, shards=2, balance=True)
    (only,) = balanced
    work = [(p_len + r_len)[half].sum() for half in np.split(only.row_ids, 2)]
    assert sorted(only.row_ids) == list(range(8)) and abs(work[0] - work[1]) <= 1, work
    budget = plan_micro_batches(np.arange(8), p_len, r_len, 6, 7, token_budget=12, shards=2)
    for mb in budget:
        assert len(mb.row_ids) % 2 == 0
        for shard in np.split(mb.row_ids, 2):
            shard = shard[shard >= 0]
            assert (p_len[shard] + r_len[shard]).sum() <= 12
    assert sorted(r for mb in budget for r in mb.row_ids if r >= 0) == list(range(8))
    with pytest.raises(ValueError, match="max_token_len"):
        plan_micro_batches(np.arange(8), p_len, r_len, 6, 7, token_budget=8, shards=2)
