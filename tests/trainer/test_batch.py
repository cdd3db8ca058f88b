"""The step's batch on the devices (`RLBatch`): micro-batches gathered and per-token results
scattered with no host copy, every advantage estimator jitted equal to its eager run, and a
loss mask apart from the attention mask."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _batches import rl_batch

from jaxrl.config import load_config
from jaxrl.core_algos import AdvantageEstimator
from jaxrl.models.params import param_shardings
from jaxrl.sharding import TRAIN_RULES, Layout, train_mesh
from jaxrl.testing.numerics import LOG_PROB_ATOL
from jaxrl.trainer import losses
from jaxrl.trainer.advantage import compute_advantage, gdpo_components
from jaxrl.trainer.batch import SEQUENCE_FIELDS, RLBatch, take
from jaxrl.trainer.learner import Learner, infer, plan
from jaxrl.trainer.roles import log_prob_fn
from jaxrl.trainer.update import init_state


@pytest.fixture(scope="module")
def layout():
    return Layout.create(train_mesh({"dp": 2, "fsdp": 4}), TRAIN_RULES)


@pytest.fixture(scope="module")
def model(tiny_model, layout):
    _, config, params = tiny_model("qwen2_sliding_yarn")
    params = jax.tree.map(jnp.copy, params)  # the session's: an update here donates its copy
    return config, jax.device_put(params, param_shardings(config, layout))


def test_micro_batches_and_passes_stay_on_the_devices(model, layout):
    """Gathering micro-batches out of the replicated batch and scattering a pass's results
    back move nothing through the host; the pass equals the same rows run one by one."""
    config, params = model
    host = rl_batch()
    batch = RLBatch.from_host(host, layout)
    fn = log_prob_fn(config, layout, temperature=1.0, chunk_size=None)
    with jax.transfer_guard_device_to_host("disallow"):
        whole = infer(fn, params, batch, layout=layout, micro_rows=1, token_budget=None)
        first = plan(batch, np.arange(8), layout, 1, None)[0]
        mb = take(batch.fields(SEQUENCE_FIELDS), first, layout)
    assert whole.sharding == layout.replicated() and whole.shape == (8, 20)
    assert mb["prompts"].sharding.spec[0] == ("dp", "fsdp")  # split over the batch shards
    single = RLBatch.from_host(host, None)
    expected = infer(fn, params, single, layout=None, micro_rows=None, token_budget=None)
    mask = host["response_mask"] > 0
    # one forward on a mesh against one device (jaxrl.testing.numerics.LOG_PROB_ATOL)
    np.testing.assert_allclose(np.asarray(whole)[mask], np.asarray(expected)[mask],
                               atol=LOG_PROB_ATOL)  # fmt: skip


@pytest.mark.parametrize("estimator", list(AdvantageEstimator))
def test_every_estimator_runs_jitted_as_it_runs_eagerly(estimator):
    overrides = ["actor_rollout_ref.model.path=unused", f"algorithm.adv_estimator={estimator}"]
    overrides += ["algorithm.gdpo_reward_keys=[acc,format]"]
    overrides += ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"]
    algorithm = load_config(None, overrides).algorithm
    rng = np.random.RandomState(0)
    n, r = 12, 7
    mask = (np.arange(r)[None] < rng.randint(1, r + 1, n)[:, None]).astype(np.int32)
    batch = {
        "token_level_rewards": jnp.asarray(rng.randn(n, r).astype(np.float32) * mask),
        "loss_mask": jnp.asarray(mask),
        "response_mask": jnp.asarray(mask),
        "prompt_mask": jnp.ones((n, 3), jnp.int32),
        "group_ids": jnp.asarray(np.repeat(np.arange(n // 4), 4), jnp.int32),
        "values": jnp.asarray(rng.randn(n, r).astype(np.float32)),
        "old_log_probs": jnp.asarray(-rng.rand(n, r).astype(np.float32)),
        "sum_pi_squared": jnp.asarray(rng.rand(n, r).astype(np.float32)),
    }
    if estimator == AdvantageEstimator.REMAX:  # the trainer's greedy-response rewards
        batch["reward_baselines"] = jnp.asarray(rng.randn(n).astype(np.float32))
    extra = gdpo_components(algorithm, {"acc": list(rng.rand(n)), "format": list(rng.rand(n))})
    fn = functools.partial(compute_advantage, algorithm=algorithm)
    eager_adv, eager_ret = fn(batch, extra)
    adv, ret = jax.jit(fn)(batch, extra)
    # the same float32 ops, fused by jit (reassociated, FMA): ~1e-7 relative on O(1) values,
    # 1e-6 absolute for those that cancel to ~0
    np.testing.assert_allclose(np.asarray(adv), np.asarray(eager_adv), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), np.asarray(eager_ret), rtol=1e-5, atol=1e-6)


def test_the_loss_counts_only_the_loss_mask(model, layout):
    """Tokens the model attends to but does not train on (a tool's output) carry no loss: on
    the first update (ratio 1) the token-mean policy loss is -mean(A) over the loss mask."""
    config, params = model
    host = rl_batch()
    loss_mask = host["response_mask"].copy()
    loss_mask[:, 2:5] = 0  # attended, not trained on
    batch = RLBatch.from_host({**host, "loss_mask": loss_mask}, layout)
    actor_cfg = load_config(None, ["actor_rollout_ref.model.path=unused"]).actor_rollout_ref.actor
    optimizer = optax.sgd(0.0)
    state = init_state(params, optimizer, layout, jax.tree.map(lambda x: x.sharding, params))
    loss = functools.partial(losses.actor_loss, config=config, actor_cfg=actor_cfg, temperature=1.0)
    learner = Learner(config, state, optimizer, loss, layout=layout, grad_clip=None)
    metrics = learner.update(
        batch,
        mini_batch_rows=8,
        epochs=1,
        shuffle=False,
        seed=0,
        micro_rows=None,
        token_budget=None,
        fields=("advantages",),
    )
    expected = -(host["advantages"] * loss_mask).sum() / loss_mask.sum()
    # one masked mean of 8 x 20 float32 terms, in the update's order: ~1e-7 relative
    np.testing.assert_allclose(metrics["actor/pg_loss"], expected, rtol=1e-5)
