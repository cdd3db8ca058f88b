"""The cluster (the run's roles on the mesh) and the `Trainer` protocol `fit` drives: which
roles a config loads and in which dtypes, the rollout's weight sync, the checkpointable state,
and PPO trained through the protocol alone (with a checkpoint and a resume) equal to `fit`."""

import dataclasses

import jax
import numpy as np
import pytest
from _quickstart import assert_same_metrics, quickstart_config

from jaxrl.models.cached import unstack_layers
from jaxrl.trainer.cluster import Cluster
from jaxrl.trainer.fit import build_run, fit, train_run
from jaxrl.trainer.loggers import read_metrics
from jaxrl.trainer.ppo_trainer import ppo_training
from jaxrl.trainer.protocol import Trainer
from jaxrl.trainer.roles import role_specs

MESH = ["mesh.dp=2", "mesh.fsdp=4", "mesh.tp=1", "mesh.sp=1"]


SMALL = [
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "trainer.logger=[]",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]


def config(root, run_dir, *extra):
    return quickstart_config(root, run_dir, *SMALL, *MESH, *extra)


def test_role_specs_follow_verls_rules(assets, tmp_path):
    """GRPO loads actor and rollout; a KL loss adds the reference, GAE the critic (with its
    value head), `reward_model.enable` the reward model; each role gets its own dtypes."""
    grpo = role_specs(config(assets, tmp_path))
    assert list(grpo) == ["actor", "rollout"]
    assert grpo["actor"].trainable and not grpo["rollout"].trainable
    everything = role_specs(
        config(
            assets,
            tmp_path,
            "actor_rollout_ref.actor.use_kl_loss=true",
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.ref.dtype=fp32",
            "critic.model_dtype=bf16",
            "reward_model.enable=true",
            f"reward_model.model.path={assets}/model",
        )
    )
    assert list(everything) == ["actor", "rollout", "ref", "critic", "reward"]
    assert everything["ref"].compute_dtype == "float32" and not everything["ref"].trainable
    critic = everything["critic"]
    assert (critic.head, critic.param_dtype, critic.trainable) == ("value", "bfloat16", True)
    assert everything["reward"].head == "reward"


def test_sync_weights_and_state_round_trip(assets, tmp_path):
    """`sync_weights` copies the actor into the rollout layout (the rollout's devices and
    shardings, same values), `release` frees it; `state_items` / `restore` move the trainable
    roles' parameters, optimizer states and update counts into a fresh cluster."""
    cfg = config(assets, tmp_path, "algorithm.adv_estimator=gae")
    a = Cluster.load(cfg, ppo_training(cfg, total_steps=2))
    assert sorted(a.learners) == ["actor", "critic"] and a.ref is None
    # the quickstart's dtypes: fp32 weights and compute; the critic computes in verl's bf16
    assert {x.dtype for x in jax.tree.leaves(a.actor.params)} == {np.dtype("float32")}
    assert a.actor.config.dtype == a.rollout.config.dtype == "float32"
    assert a.critic.config.dtype == "bfloat16"
    assert a.critic.config.head == "token_classification" and a.rollout.config.remat == "none"
    a.sync_weights()
    rollout = a.rollout.params
    expected = a.rollout.copy_of(a.actor.params)  # per layer with the xla decode step
    assert jax.tree.map(lambda x: x.sharding, rollout) == jax.tree.map(
        lambda x: x.sharding, expected
    )
    source = a.actor.params
    if isinstance(rollout["layers"], tuple):
        source = unstack_layers(source)
    for x, y in zip(jax.tree.leaves(rollout), jax.tree.leaves(source), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    a.rollout.release()
    assert a.rollout.params is None and all(x.is_deleted() for x in jax.tree.leaves(rollout))

    a.actor.state = a.actor.state.replace(
        params=jax.tree.map(lambda x: x + 1, a.actor.params), step=a.actor.state.step + 3
    )
    items, meta = a.state_items()
    assert sorted(items) == ["actor_opt", "actor_params", "critic_opt", "critic_params"]
    assert (meta["actor_steps"], meta["critic_steps"]) == (3, 0)
    b = Cluster.load(cfg, ppo_training(cfg, total_steps=2))
    b.restore(items, meta)
    assert int(b.actor.state.step) == 3
    for x, y in zip(jax.tree.leaves(b.actor.params), jax.tree.leaves(a.actor.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_trainable_role_needs_its_training(assets, tmp_path):
    cfg = config(assets, tmp_path, "algorithm.adv_estimator=gae")
    training = ppo_training(cfg, total_steps=2)
    del training["critic"]
    with pytest.raises(ValueError, match="critic role is trainable"):
        Cluster.load(cfg, training, abstract=True)


class OnlyTheProtocol:
    """A trainer that is nothing but the `Trainer` protocol, forwarding to a real one."""

    def __init__(self, inner: Trainer):
        self._inner = inner

    def step(self, batch, global_step):
        return self._inner.step(batch, global_step)

    def validate(self, loader, global_step):
        return self._inner.validate(loader, global_step)

    def state_items(self):
        return self._inner.state_items()

    def restore(self, items, meta):
        self._inner.restore(items, meta)


@pytest.mark.entry
def test_ppo_trains_through_the_protocol_alone(assets, tmp_path):
    """`train_run` needs nothing of a trainer but the protocol: PPO (with a critic and KL in
    the reward, so every piece of state is checkpointed) behind a wrapper that has only the
    four methods trains 1 step, checkpoints, and resumes to step 3, with every metric equal
    to `fit`'s uninterrupted run (timings aside)."""
    extra = [
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "trainer.save_freq=1",
    ]
    straight = tmp_path / "straight"
    fit(config(assets, straight, *extra, "trainer.total_training_steps=3"))
    wrapped = tmp_path / "wrapped"
    for steps in (1, 3):
        cfg = config(assets, wrapped, *extra, f"trainer.total_training_steps={steps}")
        run = build_run(cfg)
        assert isinstance(run.trainer, Trainer)
        train_run(cfg, dataclasses.replace(run, trainer=OnlyTheProtocol(run.trainer)))
    assert_same_metrics(read_metrics(straight), read_metrics(wrapped), steps=[1, 2, 3])


def test_train_run_refuses_what_is_not_a_trainer(assets, tmp_path):
    cfg = config(assets, tmp_path)
    run = dataclasses.replace(build_run(cfg, abstract=True), trainer=object())
    with pytest.raises(TypeError, match="does not implement the Trainer protocol"):
        train_run(cfg, run)
