"""The step's batch on the devices (`RLBatch`): micro-batches gathered and per-token results
scattered with no host copy, every advantage estimator jitted equal to its eager run, and a
loss mask apart from the attention mask."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _batches import rl_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxrl.config import load_config
from jaxrl.core_algos import AdvantageEstimator
from jaxrl.models.params import param_shardings
from jaxrl.sharding import TRAIN_RULES, Layout, train_mesh
from jaxrl.sharding.processes import global_array
from jaxrl.testing.numerics import LOG_PROB_ATOL
from jaxrl.trainer import losses
from jaxrl.trainer.advantage import compute_advantage, gdpo_components
from jaxrl.trainer.batch import SEQUENCE_FIELDS, RLBatch, _take, place_rows, take
from jaxrl.trainer.learner import Learner, infer, plan
from jaxrl.trainer.roles import log_prob_fn
from jaxrl.trainer.update import init_state

COLLECTIVE = re.compile(
    r"= \w+\[([\d,]*)\]\S* (?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
)


def collective_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The result shapes of a compiled program's collectives (what crosses the devices)."""
    return [tuple(int(d) for d in m.split(",") if d) for m in COLLECTIVE.findall(hlo)]


@pytest.fixture(scope="module")
def layout():
    return Layout.create(train_mesh({"dp": 2, "fsdp": 4}), TRAIN_RULES)


@pytest.fixture(scope="module")
def model(tiny_model, layout):
    _, config, params = tiny_model("qwen2_sliding_yarn")
    params = jax.tree.map(jnp.copy, params)  # the session's: an update here donates its copy
    return config, jax.device_put(params, param_shardings(config, layout))


def test_micro_batches_and_passes_stay_on_the_devices(model, layout):
    """The batch's rows are split over the data axes; gathering micro-batches out of it and
    scattering a pass's results back move nothing through the host, and between the devices
    only a micro-batch's rows (never an all-gather of the batch); the pass equals the same
    rows run on one device."""
    config, params = model
    host = rl_batch()
    batch = RLBatch.from_host(host, layout)
    fn = log_prob_fn(config, layout, temperature=1.0, chunk_size=None)
    with jax.transfer_guard_device_to_host("disallow"):
        whole = infer(fn, params, batch, layout=layout, micro_rows=1, token_budget=None)
        first = plan(batch, np.arange(8), layout, 1, None)[0]
        mb = take(batch.fields(SEQUENCE_FIELDS), first, layout)
    assert batch.responses.sharding.spec == P(("dp", "fsdp", "ep"), None)  # 1 row per device
    assert whole.sharding == batch.responses.sharding and whole.shape == (8, 20)
    assert mb["prompts"].sharding.spec[0] == ("dp", "fsdp", "ep")  # split over the batch shards
    # 8 of 64 rows: what crosses the devices is the 8 rows' kept columns
    arrays = {"responses": place_rows(np.zeros((64, 32), np.int32), layout)}
    rows = global_array(np.arange(8, dtype=np.int32) * 7, layout.replicated())
    moved = collective_shapes(_take.lower(arrays, rows, 8, 16, layout).compile().as_text())
    assert moved and all(shape[0] <= 8 and shape[1:] <= (16,) for shape in moved), moved
    single = RLBatch.from_host(host, None)
    expected = infer(fn, params, single, layout=None, micro_rows=None, token_budget=None)
    mask = host["response_mask"] > 0
    # one forward on a mesh against one device (jaxrl.testing.numerics.LOG_PROB_ATOL)
    np.testing.assert_allclose(np.asarray(whole)[mask], np.asarray(expected)[mask],
                               atol=LOG_PROB_ATOL)  # fmt: skip


@functools.cache
def _advantage_fn(estimator: AdvantageEstimator):
    """(the estimator's config, compute_advantage under it, unjitted)."""
    overrides = ["actor_rollout_ref.model.path=unused", f"algorithm.adv_estimator={estimator}"]
    overrides += ["algorithm.gdpo_reward_keys=[acc,format]"]
    overrides += ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"]
    algorithm = load_config(None, overrides).algorithm
    return algorithm, functools.partial(compute_advantage, algorithm=algorithm)


@functools.cache
def _jitted_advantage(estimator: AdvantageEstimator):
    return jax.jit(_advantage_fn(estimator)[1])


def _advantage_inputs(estimator, group_ids: np.ndarray, seed: int, r: int = 7):
    """Random inputs of an estimator for rows in groups `group_ids` (host arrays) and its
    scorer's extra info."""
    algorithm, _ = _advantage_fn(estimator)
    rng = np.random.RandomState(seed)
    n = len(group_ids)
    mask = (np.arange(r)[None] < rng.randint(1, r + 1, n)[:, None]).astype(np.int32)
    batch = {
        "token_level_rewards": rng.randn(n, r).astype(np.float32) * mask,
        "loss_mask": mask,
        "response_mask": mask,
        "prompt_mask": np.ones((n, 3), np.int32),
        "group_ids": np.asarray(group_ids, np.int32),
        "values": rng.randn(n, r).astype(np.float32),
        "old_log_probs": -rng.rand(n, r).astype(np.float32),
        "sum_pi_squared": rng.rand(n, r).astype(np.float32),
    }
    if estimator == AdvantageEstimator.REMAX:  # the trainer's greedy-response rewards
        batch["reward_baselines"] = rng.randn(n).astype(np.float32)
    extra = {"acc": list(rng.rand(n)), "format": list(rng.rand(n))}
    return batch, gdpo_components(algorithm, extra)


@pytest.mark.parametrize("estimator", list(AdvantageEstimator))
def test_every_estimator_runs_jitted_as_it_runs_eagerly(estimator):
    batch, extra = _advantage_inputs(estimator, np.repeat(np.arange(3), 4), seed=0)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    eager_adv, eager_ret = _advantage_fn(estimator)[1](batch, extra)
    adv, ret = _jitted_advantage(estimator)(batch, extra)
    # the same float32 ops, fused by jit (reassociated, FMA): ~1e-7 relative on O(1) values,
    # 1e-6 absolute for those that cancel to ~0
    np.testing.assert_allclose(np.asarray(adv), np.asarray(eager_adv), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), np.asarray(eager_ret), rtol=1e-5, atol=1e-6)


@functools.cache
def _data_layout(dp: int, fsdp: int) -> Layout:
    return Layout.create(train_mesh({"dp": dp, "fsdp": fsdp}), TRAIN_RULES)


@settings(max_examples=5, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=48),
    shuffled=st.booleans(),
    mesh=st.sampled_from([(8, 1), (2, 4), (1, 8)]),
    seed=st.integers(0, 2**16),
)
def test_group_statistics_on_sharded_rows_equal_one_device(sizes, shuffled, mesh, seed):
    """Every estimator over a batch whose rows are split over the data axes (groups of random
    sizes, a group's rows in one shard or across several, consecutive or scattered) equals
    it over the whole batch on one device: the group statistics (GRPO's mean and std, RLOO's
    leave-one-out means, ...) are segment sums over the sharded rows, gathered by XLA."""
    n = 48  # one shape: every estimator compiles once per layout
    group_ids = np.repeat(np.arange(len(sizes)), sizes)[:n]
    group_ids = np.concatenate([group_ids, np.arange(n - len(group_ids)) + len(sizes)])
    if shuffled:
        group_ids = np.random.RandomState(seed).permutation(group_ids)
    layout = _data_layout(*mesh)
    for estimator in AdvantageEstimator:
        batch, extra = _advantage_inputs(estimator, group_ids, seed)
        one = _jitted_advantage(estimator)({k: jnp.asarray(v) for k, v in batch.items()}, extra)
        sharded = {k: place_rows(v, layout) for k, v in batch.items()}
        adv, ret = _jitted_advantage(estimator)(sharded, extra)
        assert sharded["group_ids"].sharding.spec[0] == ("dp", "fsdp", "ep")
        # a group split over shards sums its float32 terms in another order (partial sums per
        # device, then across): ~1e-7 relative, 1e-6 absolute where they cancel to ~0
        for got, want in ((adv, one[0]), (ret, one[1])):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{estimator} on {mesh}")  # fmt: skip


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
